"""Stand-ins, on the H200 only, for what SGLang 0.5.10 and 0.5.23 import on CUDA and their model classes never
call while they are built and loaded (bench/sglang_gpu_classes.py: no forward pass runs).

On PYTHONPATH (bench/colocated_device.sh sglang-classes puts it there), so every process imports it at start.
Each stubbed top-level name imports, with every submodule (a meta-path finder) and every attribute (module
`__getattr__`); calling anything of it raises, so a stub can never compute a wrong number silently. Why each
(WHY, which the script writes into every result line; ../shared/research/sglang-gpu.md has the study):
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types

WHY = {
    "sgl_kernel": "SGLang's CUDA kernel package cannot load on the device's torch 2.11 cu130: 0.5.10's "
    "sglang-kernel 0.4.1 is a CUDA 12 build for torch 2.9, 0.5.23's 0.4.10 misses 5 torch 2.11 symbols; "
    "SGLang imports its ops at import time on CUDA (activation, layernorm, fused_moe, ...) but building and "
    "loading the model classes calls none",
    "flashinfer": "imported on CUDA where not used (fp8 utils, the sampler); the wheel needs 88 MB of CUDA "
    "packages and JIT-compiles with nvcc; no forward pass runs here",
    "IPython": "imported by a debugging helper only",
}
# And with the kernel stubbed, no `sgl_kernel::*` torch op exists: 0.5.10 registers fake (meta) kernels for
# some at import (`torch.library.register_fake("sgl_kernel::moe_fused_gate")`, moe/topk.py), which torch
# refuses for an op that does not exist; those registrations are skipped (`_skip_missing_fakes`).
# One module stood in for by a faithful small one (`_dual_gemm_standin`): 0.5.23's dense MLP (qwen2.py
# Qwen2MLP, which Qwen3 uses) builds a `DualGemm`, whose constructor imports
# sglang.kernels.ops.gemm.cutedsl_dual_gemm to ask `can_use_dual_gemm`; that module imports nvidia-cutlass-dsl
# and cuda-python at import (not on the device), and the kernel is Blackwell-only: on the H200 the real
# `can_use_dual_gemm` answers False (`is_sm100_supported()`), so the layer keeps its plain path either way.
STANDIN = {"sglang.kernels.ops.gemm.cutedsl_dual_gemm"}
WHY["sglang.kernels.ops.gemm.cutedsl_dual_gemm"] = (
    "SGLang 0.5.23's Blackwell-only CuTe DSL dual GEMM: imports nvidia-cutlass-dsl and cuda-python (not on "
    "the device); stand-in with the same constants and enum whose can_use_dual_gemm answers as the real one "
    "does on Hopper (False: not sm100), and raises on an sm100 GPU"
)
WHY["torch.library.register_fake(sgl_kernel::*)"] = (
    "skipped for ops that do not exist (the kernel is stubbed); only torch.compile tracing uses them"
)
STUBBED = tuple(WHY) + tuple(n for n in os.environ.get("COLOCATE_EXTRA_STUBS", "").split(",") if n)


class _Missing:
    def __init__(self, name):
        self._name = name

    def __call__(self, *a, **k):
        raise RuntimeError(
            f"stub: {self._name} is not available in this run (classes_stubs/sitecustomize.py)"
        )

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self._name}.{item}")

    def __repr__(self):
        return f"<stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self.__name__}.{item}")


def _skip_missing_fakes():
    import torch

    original = torch.library.register_fake
    if getattr(original, "_colocate_stub", False):
        return

    def register_fake(op, *args, **kwargs):
        if isinstance(op, str) and op.startswith("sgl_kernel::"):
            name = op.split("::", 1)[1].split(".")[0]
            if not hasattr(torch.ops.sgl_kernel, name):
                return (lambda fn: fn) if not args and "func" not in kwargs else None
        return original(op, *args, **kwargs)

    register_fake._colocate_stub = True
    torch.library.register_fake = register_fake


def _dual_gemm_standin(module):
    import enum

    class DualGemmQuantMode(enum.IntEnum):  # as in the real module
        STATIC_PER_TENSOR = 0
        STATIC_PER_TOKEN = 1
        DYNAMIC_PER_TENSOR = 2
        DYNAMIC_PER_TOKEN = 3
        UNQUANT = 4

        @property
        def is_quantized(self):
            return self != DualGemmQuantMode.UNQUANT

        @property
        def is_dynamic(self):
            return self in (DualGemmQuantMode.DYNAMIC_PER_TENSOR, DualGemmQuantMode.DYNAMIC_PER_TOKEN)

    def can_use_dual_gemm(num_tokens, hidden_size, intermediate_size, quant_mode):
        from sglang.srt.utils.common import is_sm100_supported

        if is_sm100_supported():
            raise RuntimeError("stub: the dual GEMM stand-in cannot answer for an sm100 GPU")
        return False  # the real predicate's answer off sm100

    module.MAX_DUAL_GEMM_DECODE_TOKENS = 16
    module.DualGemmQuantMode = DualGemmQuantMode
    module.can_use_dual_gemm = can_use_dual_gemm


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED or fullname in STANDIN:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0+stub"
        return m

    def exec_module(self, module):
        if module.__name__ == "sgl_kernel":
            _skip_missing_fakes()
        if module.__name__ in STANDIN:
            _dual_gemm_standin(module)


sys.meta_path.insert(0, _Finder())
