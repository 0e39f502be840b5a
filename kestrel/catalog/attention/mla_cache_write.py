"""Write new tokens' MLA latent (c_kv) and k_pe into one layer's paged latent cache, in place."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.attention._mla_common import (build_paged_cache, check_distinct_slots, check_paging,
                                                   context_lengths, device_generator, latent_rows)
from kestrel.kernels.attention.mla_cache_write import mla_cache_write

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_REAL = dict(kv_lora_rank=512, rope_dim=64, page_size=64, dtype=torch.bfloat16)
_TINY = dict(kv_lora_rank=32, rope_dim=16, page_size=16, dtype=torch.float32)


class MlaCacheWrite(OpWrapper):
    """kv_cache[block_tables[req_idx[t], positions[t] // ps], positions[t] % ps] = [latent[t] | k_pe[t]];
    positions < 0 are padding and write nothing. Returns kv_cache."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "exact: a copy between tensors of one dtype (every byte of the cache, written or not, must match)"

    WIDTHS = ("kv_lora_rank", "rope_dim", "page_size", "dtype")
    CELLS = (
        tiny("tiny widths, decode step: 1 new token per request after 0, 15, 16 and 40 cached tokens (page 16), "
             "one padding slot",
             ctx=(0, 15, 16, 40), new=1, pad=1, **_TINY),
        tiny("tiny widths, prefill chunk: 20 tokens after 30, 5 after 0, 3 speculative tokens after 60 (page 64)",
             ctx=(30, 0, 60), new=(20, 5, 3), pad=0, **{**_TINY, "page_size": 64}),
        tiny("tiny widths, decode step in the GPU model dtype (bf16)", ctx=(3, 33), new=2, pad=2,
             **{**_TINY, "dtype": torch.bfloat16}),
        gpu("Kimi Linear / K3 decode step: batch 128 x 1 token, up to 8k context, 8 CUDA-graph padding slots",
            batch=128, ctx=8192, new=1, pad=8, **_REAL),
        gpu("K3 DSpark verify: batch 32 x 8 draft tokens, up to 8k context", batch=32, ctx=8192, new=8, pad=0,
            **_REAL),
        gpu("Kimi Linear / K3 prefill: 1 x 4096-token prompt", ctx=(0,), new=4096, pad=0, **_REAL),
        gpu("Kimi Linear / K3 chunked prefill: 2048-token chunk after 6144 cached", ctx=(6144,), new=2048, pad=0,
            **_REAL),
    )

    @staticmethod
    def raw_call(latent, k_pe, kv_cache, block_tables, req_idx, positions):
        """In place; -> kv_cache."""
        return mla_cache_write(latent, k_pe, kv_cache, block_tables, req_idx, positions)

    @staticmethod
    def reference(latent, k_pe, kv_cache, block_tables, req_idx, positions):
        L = latent.shape[1]
        ps = kv_cache.shape[1]
        live = positions >= 0
        pos = positions[live]
        pages = block_tables.long()[req_idx[live].long(), pos // ps]
        kv_cache[pages, pos % ps, :L] = latent[live].to(kv_cache.dtype)
        kv_cache[pages, pos % ps, L:] = k_pe[live].to(kv_cache.dtype)
        return kv_cache

    @staticmethod
    def widths(latent, k_pe, kv_cache, block_tables, req_idx, positions):
        return {"kv_lora_rank": latent.shape[1], "rope_dim": k_pe.shape[1], "page_size": kv_cache.shape[1],
                "dtype": kv_cache.dtype}

    @staticmethod
    def is_valid(latent, k_pe, kv_cache, block_tables, req_idx, positions):
        if latent.dim() != 2 or k_pe.dim() != 2 or kv_cache.dim() != 3:
            return "latent [T, L], k_pe [T, R], kv_cache [pages, page_size, L + R]"
        T, L = latent.shape
        if k_pe.shape[0] != T or L + k_pe.shape[1] != kv_cache.shape[2]:
            return f"latent {tuple(latent.shape)} + k_pe {tuple(k_pe.shape)} do not fill cache rows of " \
                   f"{kv_cache.shape[2]}"
        if not (latent.dtype == k_pe.dtype == kv_cache.dtype) or latent.dtype not in _DTYPES:
            return f"latent, k_pe and kv_cache must share one of {_DTYPES} (quantized caches are other entries)"
        if latent.stride(1) != 1 or k_pe.stride(1) != 1 or kv_cache.stride(2) != 1:
            return "latent, k_pe and kv_cache need a unit stride along the feature dim"
        if len({t.device for t in (latent, k_pe, kv_cache, block_tables, req_idx, positions)}) != 1:
            return "inputs on several devices"
        if positions.dtype != torch.int64 or tuple(positions.shape) != (T,):
            return f"positions must be int64 [{T}]"
        if tuple(req_idx.shape) != (T,):
            return f"req_idx must be [{T}]"
        if overlaps(latent, kv_cache) or overlaps(k_pe, kv_cache):
            return "latent / k_pe alias the cache"
        return check_paging(kv_cache, block_tables, req_idx, positions) or \
            check_distinct_slots(kv_cache, block_tables, req_idx, positions)

    @staticmethod
    def compare(out, ref):
        assert_close(out, ref, rtol=0.0, atol=0.0, what="mla_cache_write kv_cache")

    @staticmethod
    def make_inputs(spec, device, generator):
        device = torch.device(device)
        L, R, ps, dtype = spec["kv_lora_rank"], spec["rope_dim"], spec["page_size"], spec["dtype"]
        ctx = context_lengths(spec, generator)
        new = spec["new"]
        new = [int(new)] * len(ctx) if isinstance(new, int) else list(new)
        lens = [c + n for c, n in zip(ctx, new)]
        kv_cache, block_tables = build_paged_cache(lens, ps, L, R, dtype, device, generator)
        req_idx = [b for b, n in enumerate(new) for _ in range(n)]
        positions = [ctx[b] + j for b, n in enumerate(new) for j in range(n)]
        pad = int(spec.get("pad", 0))
        req_idx += [0] * pad
        positions += [-1] * pad
        order = torch.randperm(len(req_idx), generator=generator)    # tokens need not come grouped or sorted
        req = torch.tensor(req_idx, dtype=torch.int32)[order].to(device)
        pos = torch.tensor(positions, dtype=torch.int64)[order].to(device)
        c, pe = latent_rows((len(req_idx),), L, R, device_generator(generator, device), device)
        return dict(latent=c.to(dtype), k_pe=pe.to(dtype), kv_cache=kv_cache, block_tables=block_tables,
                    req_idx=req, positions=pos)
