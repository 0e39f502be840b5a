"""Triton kernels: sampling family."""
