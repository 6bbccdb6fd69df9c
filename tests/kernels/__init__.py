"""Tests of native CPU and Triton kernels against their references."""
