"""Quantize new tokens' MLA latent to FP8 and write it, with k_pe, into one layer's FP8 pages, in place."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, overlaps, tiny
from kestrel.catalog.attention._mla_common import check_paging, context_lengths, device_generator, latent_rows
from kestrel.catalog.attention._mla_quant import check_pages, encoded_cache, page_format
from kestrel.kernels.attention.mla_cache_write import mla_cache_write_fp8

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_REAL = dict(kv_lora_rank=512, rope_dim=64, page_size=64, dtype=torch.bfloat16)
_TINY = dict(kv_lora_rank=32, rope_dim=16, page_size=16, dtype=torch.float32)


class MlaCacheWriteFp8(OpWrapper):
    """MlaCacheWrite into FP8 byte pages (`--kv-cache-dtype fp8`): the row of token t becomes
    `KvPageFormat("fp8").encode(latent[t], k_pe[t])` (fp32 scale = amax / 448 per 128 channels, e4m3 values,
    bf16 k_pe); positions < 0 are padding and write nothing; pad bytes at a row's end are never written or read.
    Returns kv_cache."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("bitwise: IEEE division (div_rn) and ties-to-even e4m3 / bf16 rounding, as the plain-torch "
                 "quantize; every byte of the cache, written or not, must match")
    WIDTHS = ("kv_lora_rank", "rope_dim", "page_size", "dtype")
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

    @staticmethod
    def raw_call(latent, k_pe, kv_cache, block_tables, req_idx, positions):
        fmt = page_format("fp8", latent.shape[1], k_pe.shape[1])
        return mla_cache_write_fp8(latent, k_pe, kv_cache, block_tables, req_idx, positions, fmt)

    @staticmethod
    def reference(latent, k_pe, kv_cache, block_tables, req_idx, positions):
        fmt = page_format("fp8", latent.shape[1], k_pe.shape[1])
        ps = kv_cache.shape[1]
        live = positions >= 0
        pos = positions[live]
        pages = block_tables.long()[req_idx[live].long(), pos // ps]
        kv_cache[pages, pos % ps] = fmt.encode(latent[live], k_pe[live])
        return kv_cache

    @staticmethod
    def widths(latent, k_pe, kv_cache, block_tables, req_idx, positions):
        return {"kv_lora_rank": latent.shape[1], "rope_dim": k_pe.shape[1], "page_size": kv_cache.shape[1],
                "dtype": latent.dtype}

    @staticmethod
    def is_valid(latent, k_pe, kv_cache, block_tables, req_idx, positions):
        if latent.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != latent.shape[0]:
            return "latent [T, L], k_pe [T, R]"
        T, L = latent.shape
        why = check_pages("fp8", kv_cache, L, k_pe.shape[1])
        if why:
            return why
        if latent.dtype not in _DTYPES or k_pe.dtype not in _DTYPES:
            return f"latent and k_pe must be one of {_DTYPES}"
        if latent.stride(1) != 1 or k_pe.stride(1) != 1:
            return "latent and k_pe need a unit stride along the feature dim"
        if len({t.device for t in (latent, k_pe, kv_cache, block_tables, req_idx, positions)}) != 1:
            return "inputs on several devices"
        if positions.dtype != torch.int64 or tuple(positions.shape) != (T,) or tuple(req_idx.shape) != (T,):
            return f"positions must be int64 [{T}] and req_idx [{T}]"
        if overlaps(latent, kv_cache) or overlaps(k_pe, kv_cache):
            return "latent / k_pe alias the cache"
        why = check_paging(kv_cache, block_tables, req_idx, positions)
        if why:
            return why
        live = positions.cpu() >= 0
        if bool(live.any()):
            ps = kv_cache.shape[1]
            pos = positions.cpu()[live]
            slots = block_tables.cpu().long()[req_idx.cpu()[live].long(), pos // ps] * ps + pos % ps
            if slots.unique().numel() != slots.numel():
                return "two tokens write the same cache slot (the result would depend on scheduling)"
        return None

    @staticmethod
    def compare(out, ref):
        diff = out.cpu() != ref.cpu()
        if diff.any():
            where = diff.nonzero()[0].tolist()
            raise AssertionError(f"MlaCacheWriteFp8: {int(diff.sum())}/{out.numel()} cache bytes differ, first at "
                                 f"(page, slot, byte) {tuple(where)}")

    @staticmethod
    def make_inputs(spec, device, generator):
        device = torch.device(device)
        L, R, ps, dtype = spec["kv_lora_rank"], spec["rope_dim"], spec["page_size"], spec["dtype"]
        ctx = context_lengths(spec, generator)
        new = spec["new"]
        new = [int(new)] * len(ctx) if isinstance(new, int) else list(new)
        kv_cache, block_tables = encoded_cache("fp8", [c + n for c, n in zip(ctx, new)], ps, L, R, device,
                                               generator)
        req_idx = [b for b, n in enumerate(new) for _ in range(n)] + [0] * int(spec.get("pad", 0))
        positions = [ctx[b] + j for b, n in enumerate(new) for j in range(n)] + [-1] * int(spec.get("pad", 0))
        order = torch.randperm(len(req_idx), generator=generator)
        c, pe = latent_rows((len(req_idx),), L, R, device_generator(generator, device), device)
        return dict(latent=c.to(dtype), k_pe=pe.to(dtype), kv_cache=kv_cache, block_tables=block_tables,
                    req_idx=torch.tensor(req_idx, dtype=torch.int32)[order].to(device),
                    positions=torch.tensor(positions, dtype=torch.int64)[order].to(device))
