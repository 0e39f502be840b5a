"""Deployment profile of the Hopper target for Kimi K3 with MXFP4 routed experts (Moonshot's own checkpoint, compressed-
tensors; everything else bf16): what it claims of the engine's ModelingContext (its quant criterion: the checkpoint's
storage, routing.ModelingContext.weight_format)."""

from kestrel.catalog._targets import fp4_experts_claim

CLAIM = fp4_experts_claim("kimi_k3", "mxfp4")
