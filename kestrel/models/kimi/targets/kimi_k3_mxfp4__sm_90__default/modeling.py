"""Kimi K3 with MXFP4 routed experts (Moonshot's own checkpoint, compressed-tensors; everything else bf16), Hopper, one
GPU.

The model's sm_90 forward with `_layers.W4A16Experts`: the FP4 stacks run weight-only (catalog/_targets.py).
"""

from kestrel.catalog._targets import build_fp4_experts

build = build_fp4_experts("kimi_k3")
