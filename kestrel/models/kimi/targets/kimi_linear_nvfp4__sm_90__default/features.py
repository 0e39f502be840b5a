"""Deployment profile of the Hopper target for Kimi Linear 48B with NVFP4 routed experts (`kestrel quantize --format
nvfp4 --modules experts`; everything else bf16): what it claims of the engine's ModelingContext (its quant criterion:
the checkpoint's storage, routing.ModelingContext.weight_format)."""

from kestrel.catalog._targets import fp4_experts_claim

CLAIM = fp4_experts_claim("kimi_linear", "nvfp4")
