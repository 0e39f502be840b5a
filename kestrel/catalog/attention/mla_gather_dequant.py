"""Reading requests' cached latents out of quantized (FP8 / NVFP4) pages, dequantized, for the expanded (prefill)
form of MLA: the context attention's read of a quantized cache."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, tiny
from kestrel.catalog.attention._mla_quant import check_pages, encoded_cache, page_format
from kestrel.catalog.attention.mla_gather import MlaGather

_OUT = (torch.bfloat16, torch.float16, torch.float32)


class MlaGatherDequant(OpWrapper):
    """MlaGather over byte pages of format `kind` ("fp8" | "nvfp4"): ctx [len(row_index), L + R] in `dtype`,
    each row `KvPageFormat(kind).decode` of its page row. Plain torch (an index_select of whole byte rows, then
    the dequantize: values * scale in fp32, rounded once): the expanded form multiplies these rows by kv_b_proj
    right after, so this is the one extra pass over the chunk's context a quantized cache costs in prefill.
    NVFP4 decode can run MlaDecodeNvfp4 instead; this entry is how prefill reads both formats."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "exact: the same plain-torch decode as the reference, row by row"
    WIDTHS = ("page", "kv_lora_rank", "rope_dim", "kind", "dtype")
    CELLS = (
        tiny("unit: 3 requests crossing FP8 pages of 4, L=32 + 8, bf16 out", lens=(5, 1, 9), page=4,
             kv_lora_rank=32, rope_dim=8, kind="fp8", dtype=torch.bfloat16),
        tiny("unit: 2 requests over NVFP4 pages of 16, L=32 + 16, fp32 out", lens=(20, 3), page=16,
             kv_lora_rank=32, rope_dim=16, kind="nvfp4", dtype=torch.float32),
        gpu("Kimi Linear / K3 FP8-KV prefill chunk over 8k context: 2 requests, 512 + 64, page 64", lens=(8192, 2048),
            page=64, kv_lora_rank=512, rope_dim=64, kind="fp8", dtype=torch.bfloat16),
        gpu("Kimi Linear / K3 NVFP4-KV prefill chunk over 8k context: 2 requests, 512 + 64, page 64",
            lens=(8192, 2048), page=64, kv_lora_rank=512, rope_dim=64, kind="nvfp4", dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(kv_cache, row_index, kind, kv_lora_rank, rope_dim, dtype):
        rows = kv_cache.view(-1, kv_cache.shape[-1]).index_select(0, row_index)
        return page_format(kind, kv_lora_rank, rope_dim).decode(rows, dtype)

    @staticmethod
    def reference(kv_cache, row_index, kind, kv_lora_rank, rope_dim, dtype):
        fmt = page_format(kind, kv_lora_rank, rope_dim)
        ps = kv_cache.shape[1]
        out = torch.empty(len(row_index), kv_lora_rank + rope_dim, dtype=dtype, device=kv_cache.device)
        for i, r in enumerate(row_index.tolist()):
            out[i] = fmt.decode(kv_cache[r // ps, r % ps], dtype)
        return out

    @staticmethod
    def widths(kv_cache, row_index, kind, kv_lora_rank, rope_dim, dtype):
        return {"page": kv_cache.shape[1], "kv_lora_rank": kv_lora_rank, "rope_dim": rope_dim, "kind": kind,
                "dtype": dtype}

    @staticmethod
    def is_valid(kv_cache, row_index, kind, kv_lora_rank, rope_dim, dtype):
        why = check_pages(kind, kv_cache, kv_lora_rank, rope_dim)
        if why:
            return why
        if dtype not in _OUT:
            return f"dtype must be one of {_OUT}"
        return MlaGather.is_valid(kv_cache, row_index)

    @staticmethod
    def compare(out, ref):
        assert_close(out, ref, rtol=0, atol=0, what="MlaGatherDequant")

    @staticmethod
    def make_inputs(spec, device, generator):
        lens, ps, L, R = list(spec["lens"]), spec["page"], spec["kv_lora_rank"], spec["rope_dim"]
        kv, bt = encoded_cache(spec["kind"], lens, ps, L, R, torch.device(device), generator)
        return dict(kv_cache=kv, row_index=MlaGather.row_index_for(bt, lens, ps, device), kind=spec["kind"],
                    kv_lora_rank=L, rope_dim=R, dtype=spec["dtype"])
