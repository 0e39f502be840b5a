"""Triton kernels: norm family."""
