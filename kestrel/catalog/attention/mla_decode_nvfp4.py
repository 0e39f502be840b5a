"""MLA absorbed-form decode / speculative verify reading NVFP4 pages directly (`--kv-cache-dtype nvfp4`)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import gpu, tiny
from kestrel.catalog.attention._mla_quant import QuantPagedDecode

_REAL = dict(kv_lora_rank=512, rope_dim=64, page_size=64, d_qk=192, dtype=torch.bfloat16)
_TINY = dict(kv_lora_rank=32, rope_dim=16, page_size=16, d_qk=32, dtype=torch.float32)


class MlaDecodeNvfp4(QuantPagedDecode):
    """MlaDecode with kv_cache = NVFP4 byte pages [P, page_size, row_bytes] (packed e2m1 c_kv, e4m3 scale per 16,
    fp32 scale per token, bf16 k_pe), dequantized in the load path (e2m1 * (block scale * token scale) in fp32,
    rounded to q's dtype). Hopper has no FP4 math: the dots run in q's dtype, as over bf16 rows."""

    KIND = "nvfp4"
    TOLERANCE = ("the kernel's dequantized tile equals KvPageFormat.decode(pages, q.dtype) bit for bit (integer "
                 "e2m1 / e4m3 decode, the same fp32 products), so MlaDecode's bound over those rows applies: bf16 "
                 "out atol/rtol 1e-2, lse atol 2e-3; fp32 rtol 1e-4, atol 1e-5. Against the unquantized cache a "
                 "channel moves by up to 2^-2 of itself plus the e4m3 block-scale rounding (kv_cache.py)")
    CELLS = (
        tiny("tiny widths, NVFP4 decode: lengths 1, one full page, one past a page edge, 2.5 pages (page 16)",
             heads=4, ctx=(1, 16, 17, 40), num_splits=1, **_TINY),
        tiny("tiny widths, NVFP4 split-K decode (2 splits) in the GPU model dtype (bf16 query), verify 2 tokens",
             heads=3, ctx=(9, 45), tokens_per_req=2, num_splits=2, **{**_TINY, "dtype": torch.bfloat16}),
        tiny("NVFP4 pages with a latent that does not fill a power-of-two tile (kv_lora 48): the per-channel scale "
             "gather path", heads=2, ctx=(3, 21), num_splits=1, **{**_TINY, "kv_lora_rank": 48}),
        gpu("Kimi Linear 48B tp1 NVFP4-KV decode (32 heads): batch 32, 8k context", heads=32, batch=32, ctx=8192,
            num_splits=1, **_REAL),
        gpu("K3 tp1 NVFP4-KV decode (96 heads): batch 32, 8k context", heads=96, batch=32, ctx=8192, num_splits=1,
            **_REAL),
        gpu("K3 tp1 NVFP4-KV decode (96 heads): batch 4 x 32k, split-K 8", heads=96, batch=4, ctx=32768,
            num_splits=8, **_REAL),
    )
