"""Shared input builders and reference helpers for the MLA entries (not an entry: the leading `_` keeps the catalog
walker out)."""

from __future__ import annotations

import torch


def device_generator(gen: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on `device` seeded from the cell's CPU generator: large GPU inputs are drawn on the GPU."""
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape, gen: torch.Generator, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def context_lengths(spec: dict, gen: torch.Generator) -> list[int]:
    """`ctx` is either the tuple of per-request lengths, or (with `batch`) the longest length of a batch whose other
    requests are drawn in [ctx/2, ctx] (a serving batch is never uniform)."""
    ctx = spec["ctx"]
    if isinstance(ctx, (tuple, list)):
        return [int(c) for c in ctx]
    batch = int(spec.get("batch", 1))
    rest = torch.randint(max(ctx // 2, 1), ctx + 1, (batch - 1,), generator=gen).tolist()
    return [int(ctx)] + rest


def latent_rows(shape_prefix: tuple, kv_lora_rank: int, rope_dim: int, gen: torch.Generator,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_kv, k_pe) in fp32 at the scales the model writes: c_kv is RMS-normalized and multiplied by a per-channel
    norm weight (kv_a_layernorm), k_pe is the raw projection (NoPE: never rotated)."""
    c = randn((*shape_prefix, kv_lora_rank), gen, device)
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
    w = torch.rand((kv_lora_rank,), generator=gen, device=device) + 0.3
    pe = randn((*shape_prefix, rope_dim), gen, device)
    return c * w, pe


def build_paged_cache(lens: list[int], page_size: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                      device: torch.device, gen: torch.Generator, spare_pages: int = 3
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled cache whose pages are handed out in a shuffled order (requests' pages scattered, some pages unused);
    block-table entries past a request's last page are -1 (never read)."""
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + spare_pages
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    block_tables = torch.full((len(lens), max(max(need), 1)), -1, dtype=torch.int32)
    at = 0
    for b, k in enumerate(need):
        block_tables[b, :k] = perm[at:at + k]
        at += k
    dgen = device_generator(gen, device)
    c, pe = latent_rows((num_pages, page_size), kv_lora_rank, rope_dim, dgen, device)
    kv_cache = torch.cat([c, pe], dim=-1).to(dtype)
    return kv_cache, block_tables.to(device)


def gather_rows(kv_cache: torch.Tensor, block_tables: torch.Tensor, req: int, n: int) -> torch.Tensor:
    """Request `req`'s cache rows for positions 0..n-1, [n, W] (reference path: plain indexing)."""
    page_size = kv_cache.shape[1]
    pos = torch.arange(n, device=kv_cache.device)
    pages = block_tables[req].to(kv_cache.device).long()[pos // page_size]
    return kv_cache[pages, pos % page_size]


def check_paging(kv_cache: torch.Tensor, block_tables: torch.Tensor, req_idx: torch.Tensor,
                 last_pos: torch.Tensor) -> str | None:
    """Every (request, position <= last_pos) the kernel reads or writes maps to a real page. Host-side, tests only."""
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        return f"block_tables must be int32 [B, max_pages], got {block_tables.dtype} {tuple(block_tables.shape)}"
    if block_tables.stride(1) != 1:
        return "block_tables rows must be contiguous"
    if req_idx.dtype != torch.int32 or req_idx.dim() != 1:
        return f"req_idx must be int32 [T], got {req_idx.dtype} {tuple(req_idx.shape)}"
    B, max_pages = block_tables.shape
    if req_idx.numel() == 0:
        return None
    req = req_idx.cpu().long()
    if int(req.min()) < 0 or int(req.max()) >= B:
        return f"req_idx outside [0, {B})"
    page_size = kv_cache.shape[1]
    last = last_pos.cpu().long()
    if int(last.max()) >= max_pages * page_size:
        return f"a position past the block table's {max_pages} pages x {page_size}"
    bt = block_tables.cpu().long()
    for r, p in zip(req.tolist(), last.tolist()):
        if p < 0:
            continue
        used = bt[r, : p // page_size + 1]
        if int(used.min()) < 0 or int(used.max()) >= kv_cache.shape[0]:
            return f"request {r}: block table names a page outside [0, {kv_cache.shape[0]})"
    return None


def check_distinct_slots(kv_cache: torch.Tensor, block_tables: torch.Tensor, req_idx: torch.Tensor,
                         positions: torch.Tensor) -> str | None:
    """A cache write's live tokens (position >= 0) land in distinct page slots. Host-side, tests only."""
    live = positions.cpu() >= 0
    if bool(live.any()):
        ps = kv_cache.shape[1]
        pos = positions.cpu()[live]
        slots = block_tables.cpu().long()[req_idx.cpu()[live].long(), pos // ps] * ps + pos % ps
        if slots.unique().numel() != slots.numel():
            return "two tokens write the same cache slot (the result would depend on scheduling)"
    return None
