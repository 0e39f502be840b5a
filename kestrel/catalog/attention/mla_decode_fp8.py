"""MLA absorbed-form decode / speculative verify reading FP8 pages directly (`--kv-cache-dtype fp8`)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import gpu, tiny
from kestrel.catalog.attention._mla_quant import QuantPagedDecode

_REAL = dict(kv_lora_rank=512, rope_dim=64, page_size=64, d_qk=192, dtype=torch.bfloat16)
_TINY = dict(kv_lora_rank=32, rope_dim=16, page_size=16, d_qk=32, dtype=torch.float32)


class MlaDecodeFp8(QuantPagedDecode):
    """MlaDecode with kv_cache = FP8 byte pages [P, page_size, row_bytes] (e4m3 c_kv, fp32 scale per 128
    channels, bf16 k_pe): each tile is dequantized in the load path (e4m3 * scale in fp32, rounded to q's dtype) and
    attended as MlaDecode attends bf16 rows."""

    KIND = "fp8"
    TOLERANCE = ("the kernel's dequantized tile equals KvPageFormat.decode(pages, q.dtype) bit for bit (integer "
                 "e4m3 decode, the same fp32 product), so MlaDecode's bound over those rows applies unchanged: "
                 "bf16 out atol/rtol 1e-2, lse atol 2e-3; fp32 rtol 1e-4, atol 1e-5. Against the unquantized "
                 "cache the rows themselves differ by <= max(2^-4 |x|, 2^-10 amax/448) per channel "
                 "(kestrel/quant/kv_cache.py)")
    CELLS = (
        tiny("tiny widths, FP8 decode: lengths 1, one full page, one past a page edge, 2.5 pages (page 16)",
             heads=4, ctx=(1, 16, 17, 40), num_splits=1, **_TINY),
        tiny("tiny widths, FP8 split-K decode (3 splits) in the GPU model dtype (bf16 query)",
             heads=4, ctx=(1, 50, 37), num_splits=3, **{**_TINY, "dtype": torch.bfloat16}),
        tiny("tiny widths, FP8 DSpark-style verify: 4 tokens/request", heads=2, ctx=(4, 19), tokens_per_req=4,
             num_splits=1, **_TINY),
        tiny("FP8 pages with two 128-channel scale groups (kv_lora 256), 64-token pages", heads=2, ctx=(70, 5),
             num_splits=2, **{**_TINY, "kv_lora_rank": 256, "page_size": 64}),
        tiny("FP8 pages with a latent that does not fill a power-of-two tile (kv_lora 48): the per-channel scale "
             "gather path", heads=2, ctx=(3, 21), num_splits=1, **{**_TINY, "kv_lora_rank": 48}),
        gpu("Kimi Linear 48B tp1 FP8-KV decode (32 heads): batch 32, 8k context", heads=32, batch=32, ctx=8192,
            num_splits=1, **_REAL),
        gpu("Kimi Linear 48B tp1 FP8-KV decode (32 heads): batch 128, 1k context", heads=32, batch=128, ctx=1024,
            num_splits=1, **_REAL),
        gpu("K3 tp1 FP8-KV decode (96 heads): batch 32, 8k context", heads=96, batch=32, ctx=8192, num_splits=1,
            **_REAL),
        gpu("K3 tp1 FP8-KV decode (96 heads): batch 4 x 32k, split-K 8 (the targets' choice past 8192 tokens)",
            heads=96, batch=4, ctx=32768, num_splits=8, **_REAL),
        gpu("K3 tp1 FP8-KV DSpark verify (96 heads): batch 32 x 8 draft tokens, 8k context", heads=96, batch=32,
            ctx=8192, tokens_per_req=8, num_splits=1, **_REAL),
        gpu("Kimi Linear 48B tp1 FP8-KV decode (32 heads): batch 16 x 16k, split-K 8", heads=32, batch=16,
            ctx=16384, num_splits=8, **_REAL),
    )
