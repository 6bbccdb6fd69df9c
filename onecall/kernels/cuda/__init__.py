"""CUDA kernels in Triton (loaded only with the triton backend on a CUDA device)."""
