"""Triton kernels: quantized-weight GEMMs (W4A16 FP4, W8A8 FP8) and activation quantization."""
