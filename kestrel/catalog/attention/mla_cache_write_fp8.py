"""Quantize new tokens' MLA latent to FP8 and write it, with k_pe, into one layer's FP8 pages, in place."""

from __future__ import annotations

import torch

from kestrel.catalog._op import gpu, tiny
from kestrel.catalog.attention._mla_quant import QuantCacheWrite

_REAL = dict(kv_lora_rank=512, rope_dim=64, page_size=64, dtype=torch.bfloat16)
_TINY = dict(kv_lora_rank=32, rope_dim=16, page_size=16, dtype=torch.float32)


class MlaCacheWriteFp8(QuantCacheWrite):
    """MlaCacheWrite into FP8 byte pages (`--kv-cache-dtype fp8`): fp32 scale = amax / 448 per 128 channels, e4m3
    values, bf16 k_pe."""

    KIND = "fp8"
    CELLS = (
        tiny("tiny widths, FP8 decode step: 1 new token per request after 0, 15, 16 and 40 cached tokens (page 16), "
             "one padding slot", ctx=(0, 15, 16, 40), new=1, pad=1, **_TINY),
        tiny("tiny widths, FP8 prefill chunk from the GPU model dtype (bf16): 20 tokens after 30, 3 after 60",
             ctx=(30, 60), new=(20, 3), pad=0, **{**_TINY, "dtype": torch.bfloat16, "page_size": 64}),
        tiny("FP8 pages with two 128-channel scale groups (kv_lora 256)", ctx=(3, 17), new=2, pad=1,
             **{**_TINY, "kv_lora_rank": 256}),
        gpu("Kimi Linear / K3 FP8-KV decode step: batch 128 x 1 token, up to 8k context, 8 padding slots",
            batch=128, ctx=8192, new=1, pad=8, **_REAL),
        gpu("K3 FP8-KV DSpark verify: batch 32 x 8 draft tokens, up to 8k context", batch=32, ctx=8192, new=8,
            pad=0, **_REAL),
        gpu("Kimi Linear / K3 FP8-KV prefill: 1 x 4096-token prompt", ctx=(0,), new=4096, pad=0, **_REAL),
    )
