"""What the entries over quantized MLA pages share (not an entry: the leading `_` keeps the catalog walker out).

A quantized layer's pages are bytes `[num_pages, page_size, row_bytes]` in the layout of
`kestrel.quant.kv_cache.KvPageFormat` (fp8: e4m3 c_kv + an fp32 scale per 128 channels; nvfp4: e2m1 c_kv + an e4m3
scale per 16 + an fp32 scale per token; k_pe bf16 in both). The entries take the same arguments as their bf16
counterparts and read the format from their class (`KIND`) and the latent widths, so a target swaps one entry for
the other by the layer's `CachePools.page_format(i).kind`.
"""

from __future__ import annotations

import functools

import torch

from kestrel.catalog._op import Arch, OpWrapper, overlaps
from kestrel.catalog.attention._mla_common import (build_paged_cache, check_distinct_slots, check_paging,
                                                   context_lengths, device_generator, latent_rows, randn)
from kestrel.catalog.attention.mla_decode import MlaDecode
from kestrel.kernels.attention.mla_cache_write import mla_cache_write_quant
from kestrel.kernels.attention.mla_decode import mla_decode
from kestrel.quant.kv_cache import KvPageFormat

Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DTYPES = Q_DTYPES


@functools.lru_cache(maxsize=None)
def page_format(kind: str, kv_lora_rank: int, rope_dim: int) -> KvPageFormat:
    return KvPageFormat(kind, kv_lora_rank, rope_dim)


def check_pages(kind: str, kv_cache: torch.Tensor, kv_lora_rank: int, rope_dim: int) -> str | None:
    """Byte pages of format `kind` for these widths, rows addressable as fp32 / bf16 words."""
    why = KvPageFormat.unsupported(kind, kv_lora_rank)
    if why:
        return why
    fmt = page_format(kind, kv_lora_rank, rope_dim)
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3 or kv_cache.shape[2] != fmt.row_bytes:
        return (f"{kind} pages must be uint8 [pages, page_size, {fmt.row_bytes}], got {kv_cache.dtype} "
                f"{tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        return "quantized pages must be contiguous (rows are read as fp32 and bf16 words of the same bytes)"
    return None


def encoded_cache(kind: str, lens: list[int], page_size: int, L: int, R: int, device: torch.device,
                  gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled paged cache (shuffled pages, as `build_paged_cache`) stored in format `kind`."""
    plain, block_tables = build_paged_cache(lens, page_size, L, R, torch.float32, device, gen)
    fmt = page_format(kind, L, R)
    rows = fmt.encode(plain[..., :L].reshape(-1, L), plain[..., L:].reshape(-1, R))
    return rows.view(plain.shape[0], page_size, fmt.row_bytes), block_tables


def _decode_raw(kind, q, kv_cache, block_tables, req_idx, kv_lens, scale, kv_lora_rank, num_splits=1, out=None,
                lse=None):
    fmt = page_format(kind, kv_lora_rank, q.shape[2] - kv_lora_rank)
    return mla_decode(q, kv_cache, block_tables, req_idx, kv_lens, scale, kv_lora_rank, num_splits, out, lse,
                      fmt=fmt)


def _decode_reference(kind, q, kv_cache, block_tables, req_idx, kv_lens, scale, kv_lora_rank, num_splits=1,
                      out=None, lse=None):
    plain = page_format(kind, kv_lora_rank, q.shape[2] - kv_lora_rank).decode(kv_cache, q.dtype)
    return MlaDecode.reference(q, plain, block_tables, req_idx, kv_lens, scale, kv_lora_rank, num_splits)


def _decode_compare(out, ref):
    MlaDecode.compare(out, ref)


class QuantPagedDecode(OpWrapper):
    """MlaDecode over quantized pages: the same arguments and results, kv_cache being `KIND` byte pages that the
    kernel dequantizes as it loads them. Reference: the pages dequantized to q's dtype (`KvPageFormat.decode`),
    then MlaDecode's reference. Subclasses set KIND and CELLS; raw_call, reference and compare are bound to
    KIND in each subclass's own namespace (where the contract's test hooks look for them)."""

    KIND = ""
    ARCHS = MlaDecode.ARCHS
    WIDTHS = MlaDecode.WIDTHS

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.raw_call = staticmethod(functools.partial(_decode_raw, cls.KIND))
        cls.reference = staticmethod(functools.partial(_decode_reference, cls.KIND))
        cls.compare = staticmethod(_decode_compare)

    @staticmethod
    def widths(q, kv_cache, block_tables, req_idx, kv_lens, scale, kv_lora_rank, num_splits=1, out=None,
               lse=None):
        return {"heads": q.shape[1], "kv_lora_rank": kv_lora_rank, "rope_dim": q.shape[2] - kv_lora_rank,
                "page_size": kv_cache.shape[1], "d_qk": round(scale ** -2), "dtype": q.dtype}

    @classmethod
    def is_valid(cls, q, kv_cache, block_tables, req_idx, kv_lens, scale, kv_lora_rank, num_splits=1, out=None,
                 lse=None):
        if q.dim() != 3 or q.dtype not in Q_DTYPES or q.stride(2) != 1:
            return f"q must be [T, H, W] in one of {Q_DTYPES} with a unit last stride"
        T, H, W = q.shape
        if not 16 <= kv_lora_rank < W:
            return f"kv_lora_rank {kv_lora_rank} must be in [16, W={W})"
        why = check_pages(cls.KIND, kv_cache, kv_lora_rank, W - kv_lora_rank)
        if why:
            return why
        if len({t.device for t in (q, kv_cache, block_tables, req_idx, kv_lens)}) != 1:
            return "inputs on several devices"
        if not isinstance(num_splits, int) or num_splits < 1:
            return f"num_splits must be a positive int, got {num_splits!r}"
        if kv_lens.dtype != torch.int32 or tuple(kv_lens.shape) != (T,) or tuple(req_idx.shape) != (T,):
            return f"kv_lens must be int32 [{T}] and req_idx [{T}]"
        if T and int(kv_lens.min()) < 1:
            return "every token sees at least itself: kv_lens >= 1"
        why = check_paging(kv_cache, block_tables, req_idx, kv_lens.long() - 1)
        if why:
            return why
        for name, t, shape, dt in (("out", out, (T, H, kv_lora_rank), q.dtype), ("lse", lse, (T, H), torch.float32)):
            if t is not None and (tuple(t.shape) != shape or t.dtype != dt or t.stride(-1) != 1
                                  or overlaps(t, q) or overlaps(t, kv_cache)):
                return f"{name} must be {dt} {shape} with unit last stride, aliasing no input"
        return None

    @classmethod
    def make_inputs(cls, spec, device, generator):
        device = torch.device(device)
        L, R, H, dtype = spec["kv_lora_rank"], spec["rope_dim"], spec["heads"], spec["dtype"]
        k = int(spec.get("tokens_per_req", 1))
        lens = context_lengths(spec, generator)
        kv_cache, block_tables = encoded_cache(cls.KIND, lens, spec["page_size"], L, R, device, generator)
        order = torch.randperm(len(lens), generator=generator).tolist()
        req_idx = [b for b in order for _ in range(k)]
        kv_lens = [lens[b] - k + 1 + j for b in order for j in range(k)]
        q = randn((len(req_idx), H, L + R), device_generator(generator, device), device, dtype)
        return dict(q=q, kv_cache=kv_cache, block_tables=block_tables,
                    req_idx=torch.tensor(req_idx, dtype=torch.int32, device=device),
                    kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
                    scale=spec["d_qk"] ** -0.5, kv_lora_rank=L, num_splits=int(spec["num_splits"]))


def _write_raw(kind, latent, k_pe, kv_cache, block_tables, req_idx, positions):
    fmt = page_format(kind, latent.shape[1], k_pe.shape[1])
    return mla_cache_write_quant(latent, k_pe, kv_cache, block_tables, req_idx, positions, fmt)


def _write_reference(kind, latent, k_pe, kv_cache, block_tables, req_idx, positions):
    fmt = page_format(kind, latent.shape[1], k_pe.shape[1])
    ps = kv_cache.shape[1]
    live = positions >= 0
    pos = positions[live]
    pages = block_tables.long()[req_idx[live].long(), pos // ps]
    kv_cache[pages, pos % ps] = fmt.encode(latent[live], k_pe[live])
    return kv_cache


def _write_compare(out, ref):
    diff = out.cpu() != ref.cpu()
    if diff.any():
        where = diff.nonzero()[0].tolist()
        raise AssertionError(f"quantized cache write: {int(diff.sum())}/{out.numel()} cache bytes differ, first at "
                             f"(page, slot, byte) {tuple(where)}")


class QuantCacheWrite(OpWrapper):
    """MlaCacheWrite into `KIND` byte pages: the row of token t becomes `KvPageFormat(KIND).encode(latent[t],
    k_pe[t])`; positions < 0 are padding and write nothing; pad bytes at a row's end are never written or read.
    Returns kv_cache. Subclasses set KIND and CELLS (raw_call, reference and compare bound as QuantPagedDecode's)."""

    KIND = ""
    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("bitwise: IEEE divisions (div_rn) and ties-to-even e4m3 / e2m1 / bf16 rounding, as the "
                 "plain-torch quantize; every byte of the cache, written or not, must match")
    WIDTHS = ("kv_lora_rank", "rope_dim", "page_size", "dtype")

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.raw_call = staticmethod(functools.partial(_write_raw, cls.KIND))
        cls.reference = staticmethod(functools.partial(_write_reference, cls.KIND))
        cls.compare = staticmethod(_write_compare)

    @staticmethod
    def widths(latent, k_pe, kv_cache, block_tables, req_idx, positions):
        return {"kv_lora_rank": latent.shape[1], "rope_dim": k_pe.shape[1], "page_size": kv_cache.shape[1],
                "dtype": latent.dtype}

    @classmethod
    def is_valid(cls, latent, k_pe, kv_cache, block_tables, req_idx, positions):
        if latent.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != latent.shape[0]:
            return "latent [T, L], k_pe [T, R]"
        T, L = latent.shape
        why = check_pages(cls.KIND, kv_cache, L, k_pe.shape[1])
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
        return check_paging(kv_cache, block_tables, req_idx, positions) or \
            check_distinct_slots(kv_cache, block_tables, req_idx, positions)

    @classmethod
    def make_inputs(cls, spec, device, generator):
        device = torch.device(device)
        L, R, ps, dtype = spec["kv_lora_rank"], spec["rope_dim"], spec["page_size"], spec["dtype"]
        ctx = context_lengths(spec, generator)
        new = spec["new"]
        new = [int(new)] * len(ctx) if isinstance(new, int) else list(new)
        kv_cache, block_tables = encoded_cache(cls.KIND, [c + n for c, n in zip(ctx, new)], ps, L, R, device,
                                               generator)
        req_idx = [b for b, n in enumerate(new) for _ in range(n)] + [0] * int(spec.get("pad", 0))
        positions = [ctx[b] + j for b, n in enumerate(new) for j in range(n)] + [-1] * int(spec.get("pad", 0))
        order = torch.randperm(len(req_idx), generator=generator)
        c, pe = latent_rows((len(req_idx),), L, R, device_generator(generator, device), device)
        return dict(latent=c.to(dtype), k_pe=pe.to(dtype), kv_cache=kv_cache, block_tables=block_tables,
                    req_idx=torch.tensor(req_idx, dtype=torch.int32)[order].to(device),
                    positions=torch.tensor(positions, dtype=torch.int64)[order].to(device))
