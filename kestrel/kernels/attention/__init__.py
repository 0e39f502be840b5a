"""Attention kernels (Triton): MLA absorbed decode over the paged latent cache, MLA non-absorbed varlen prefill,
and the paged latent-cache write."""
