"""`python -m tests.sglang_real.cpu_launch ARGS`: `python -m sglang.launch_server ARGS` without a GPU.

The project's torch is a CUDA build, so `torch.get_device_module()` is `torch.cuda` even with no GPU, and
`/release_memory_occupation` ends in `torch.get_device_module().synchronize()` (0.5.10
managers/scheduler_update_weights_mixin.py:153, 0.5.23 managers/scheduler_components/weight_updater.py:379),
which raises "Found no NVIDIA driver" and kills the scheduler. Without a GPU there is nothing to wait for, so
`torch.cuda.synchronize` becomes a no-op here (torch, not SGLang, is adjusted). SGLang starts its schedulers
with the `spawn` start method, which re-imports this module (as `__mp_main__`) in every child, so the same
adjustment applies there.
"""

import runpy

import torch

if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda device=None: None

if __name__ == "__main__":
    # alter_sys=False keeps this module as sys.modules["__main__"], so spawn children import it (not
    # sglang.launch_server) as __mp_main__ and get the adjustment above.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
