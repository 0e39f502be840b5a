"""Triton kernels: moe family."""
