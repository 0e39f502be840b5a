"""Triton kernels: activation family."""
