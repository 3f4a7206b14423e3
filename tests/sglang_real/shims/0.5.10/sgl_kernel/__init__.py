# Stand-in for sgl_kernel (CUDA-only wheel): 0.5.10 imports it off NPU/XPU; no ops, so CPU runs native torch.
