"""Stand-ins, on the H200 only, for imports real SGLang 0.5.17 makes on CUDA that our runs never call.

On PYTHONPATH (bench/colocated_device.sh sglang-gpu puts it there), so every process, SGLang's scheduler
processes included, imports it at start. From the smoke run of 2026-12-03 (../shared/research/sglang-gpu.md):
- `flashinfer`: SGLang 0.5.17 imports it on CUDA even where it is not used (`fp8_utils` imports `bmm_fp8`,
  the sampler `flashinfer.sampling`); the wheel needs 88 MB of CUDA packages more and JIT-compiles with nvcc.
  We run `--attention-backend triton --sampling-backend pytorch` and `SGLANG_IS_FLASHINFER_AVAILABLE=false`,
  so a stub package answers the imports; calling anything of it raises.
- `flashinfer.norm` and `flashinfer.activation` stay absent on purpose: sgl_kernel 0.4.5 then uses its own
  RMSNorm and SiLU-and-mul kernels (with them importable it calls the stub at the first forward).
- `IPython`: imported by a debugging helper only.
"""

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("flashinfer", "IPython")
ABSENT = ("flashinfer.norm", "flashinfer.activation")


class _Missing:
    def __init__(self, name):
        self._name = name

    def __call__(self, *a, **k):
        raise RuntimeError(f"stub: {self._name} is not available in this run")

    def __getattr__(self, item):
        return _Missing(f"{self._name}.{item}")


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in ABSENT:
            raise ImportError(f"stub: {fullname} is absent in this run")
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0"
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
