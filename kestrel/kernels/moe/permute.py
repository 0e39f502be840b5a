"""MoE permutation: group the T*k (token, slot) pairs by expert, stably, on the device with no host sync.

A counting sort in four small launches over S = T*k slots cut into blocks of BLOCK slots:
  1. _hist:    counts[b, e] = slots of block b routed to expert e            (tl.histogram)
  2. _scan:    counts[b, e] <- slots routed to e in blocks before b; totals[e]  (cumsum over blocks, per expert tile)
  3. _offsets: expert_offsets[e] = sum of totals before e, [E + 1]             (one program)
  4. _scatter: slot i of block b, expert e, goes to
               expert_offsets[e] + counts[b, e] + (slots of block b before i routed to e)
Outputs (all int32): expert_offsets [E+1], sorted_slot_ids [S] (slot t*k+j at each sorted position),
sorted_token_ids [S] (= sorted_slot_ids // k), slot_to_sorted [S] (the inverse: sorted position of slot t*k+j).
Every buffer is sized by S, the worst case; nothing depends on the routing's values on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kestrel.kernels.moe._common import pow2

BLOCK = 128


class Permutation(NamedTuple):
    expert_offsets: torch.Tensor     # int32 [E + 1]
    sorted_token_ids: torch.Tensor   # int32 [S]: token index of each sorted row
    slot_to_sorted: torch.Tensor     # int32 [S]: sorted row of slot t*k+j (inverse map)
    sorted_slot_ids: torch.Tensor    # int32 [S]: slot t*k+j of each sorted row


@triton.jit
def _hist_kernel(ids_ptr, counts_ptr, S, E, BLOCK: tl.constexpr, E_BINS: tl.constexpr):
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < S, other=E)       # padding lands in the spare bin E
    h = tl.histogram(ids, E_BINS)
    bins = tl.arange(0, E_BINS)
    tl.store(counts_ptr + b.to(tl.int64) * E + bins, h, mask=bins < E)


@triton.jit
def _scan_kernel(counts_ptr, totals_ptr, NBLK, E, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    ecols = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = ecols < E
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b0 in range(0, NBLK, BLOCK_B):
        brows = b0 + tl.arange(0, BLOCK_B)
        m = (brows < NBLK)[:, None] & emask[None, :]
        ptrs = counts_ptr + brows.to(tl.int64)[:, None] * E + ecols[None, :]
        c = tl.load(ptrs, mask=m, other=0)
        incl = tl.cumsum(c, axis=0)
        tl.store(ptrs, incl - c + carry[None, :], mask=m)
        carry = carry + tl.sum(c, axis=0)
    tl.store(totals_ptr + ecols, carry, mask=emask)


@triton.jit
def _offsets_kernel(totals_ptr, offsets_ptr, E, E_PAD: tl.constexpr):
    ev = tl.arange(0, E_PAD)
    c = tl.load(totals_ptr + ev, mask=ev < E, other=0)
    incl = tl.cumsum(c, axis=0)
    tl.store(offsets_ptr + ev + 1, incl, mask=ev < E)
    tl.store(offsets_ptr + ev, incl - c, mask=ev == 0)


@triton.jit
def _scatter_kernel(ids_ptr, counts_ptr, offsets_ptr, sorted_tok_ptr, sorted_slot_ptr, slot_to_sorted_ptr,
                    S, E, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    li = tl.arange(0, BLOCK)
    offs = b * BLOCK + li
    smask = offs < S
    ids = tl.load(ids_ptr + offs, mask=smask, other=E)
    # rank of each slot among the earlier slots of this block routed to the same expert (stable order)
    same = (ids[:, None] == ids[None, :]) & (li[None, :] < li[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    base = tl.load(counts_ptr + b.to(tl.int64) * E + ids, mask=smask, other=0)
    start = tl.load(offsets_ptr + ids, mask=smask, other=0)
    pos = start + base + rank
    tl.store(sorted_tok_ptr + pos, offs // TOP_K, mask=smask)
    tl.store(sorted_slot_ptr + pos, offs, mask=smask)
    tl.store(slot_to_sorted_ptr + offs, pos, mask=smask)


def moe_permute(topk_ids: torch.Tensor, num_experts: int) -> Permutation:
    """topk_ids int32 [T, k] (contiguous, values in [0, E)) -> Permutation."""
    T, k = topk_ids.shape
    S, E = T * k, num_experts
    dev = topk_ids.device
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    sorted_tok = torch.empty(S, dtype=torch.int32, device=dev)
    sorted_slot = torch.empty(S, dtype=torch.int32, device=dev)
    slot_to_sorted = torch.empty(S, dtype=torch.int32, device=dev)
    nblk = max(1, triton.cdiv(S, BLOCK))
    counts = torch.empty((nblk, E), dtype=torch.int32, device=dev)
    totals = torch.empty(E, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)
    _hist_kernel[(nblk,)](ids, counts, S, E, BLOCK=BLOCK, E_BINS=pow2(E + 1), num_warps=4)
    block_e = min(64, pow2(E))
    _scan_kernel[(triton.cdiv(E, block_e),)](counts, totals, nblk, E, BLOCK_B=32, BLOCK_E=block_e, num_warps=4)
    _offsets_kernel[(1,)](totals, offsets, E, E_PAD=pow2(E), num_warps=4)
    if S > 0:
        _scatter_kernel[(nblk,)](ids, counts, offsets, sorted_tok, sorted_slot, slot_to_sorted, S, E,
                                 TOP_K=k, BLOCK=BLOCK, num_warps=4)
    return Permutation(offsets, sorted_tok, slot_to_sorted, sorted_slot)
