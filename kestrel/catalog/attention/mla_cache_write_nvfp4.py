"""Quantize new tokens' MLA latent to NVFP4 and write it, with k_pe, into one layer's NVFP4 pages, in place."""

from __future__ import annotations

import torch

from kestrel.catalog._op import gpu, tiny
from kestrel.catalog.attention._mla_quant import QuantCacheWrite

_REAL = dict(kv_lora_rank=512, rope_dim=64, page_size=64, dtype=torch.bfloat16)
_TINY = dict(kv_lora_rank=32, rope_dim=16, page_size=16, dtype=torch.float32)


class MlaCacheWriteNvfp4(QuantCacheWrite):
    """MlaCacheWrite into NVFP4 byte pages (`--kv-cache-dtype nvfp4`): fp32 s2 = amax / (448 * 6) per token, e4m3
    scale per 16 channels, packed e2m1 values, bf16 k_pe."""

    KIND = "nvfp4"
    CELLS = (
        tiny("tiny widths, NVFP4 decode step: 1 new token per request after 0, 15, 16 and 40 cached tokens (page 16), "
             "one padding slot", ctx=(0, 15, 16, 40), new=1, pad=1, **_TINY),
        tiny("tiny widths, NVFP4 prefill chunk from the GPU model dtype (bf16): 20 tokens after 30, 3 after 60",
             ctx=(30, 60), new=(20, 3), pad=0, **{**_TINY, "dtype": torch.bfloat16, "page_size": 64}),
        gpu("Kimi Linear / K3 NVFP4-KV decode step: batch 128 x 1 token, up to 8k context, 8 padding slots",
            batch=128, ctx=8192, new=1, pad=8, **_REAL),
        gpu("Kimi Linear / K3 NVFP4-KV prefill: 1 x 4096-token prompt", ctx=(0,), new=4096, pad=0, **_REAL),
    )
