"""MoE permutation of a decode-sized batch in one launch (one program), optionally with the shared expert as one
more expert that every token visits.

The same stable counting sort as `permute.py` (its four launches pay off for prefill-sized batches), walked by a
single program over the S slots in blocks of BLOCK:
  pass 1: histogram of all slots -> expert_offsets (exclusive cumsum, [E'+1])
  pass 2: per block, in slot order: row = running[e] + (earlier slots of the block routed to e), then
          running += the block's histogram (running lives in registers and is published to a small scratch
          vector for the gather, with barriers around it)
With `shared`, token t gets a virtual slot t*(k+1)+k routed to expert E (E' = E + 1), and the routed slot j of
token t becomes t*(k+1)+j, so MoeCombine can read the [T, k+1] weights this kernel writes (the routed weights,
then 1.0 for the shared expert). Outputs are exactly `permute.py`'s Permutation over E' experts and S = T*(k+1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.moe._common import pow2
from kestrel.kernels.moe.permute import Permutation

BLOCK = 128             # slots per pass at most; fewer slots take the next power of two from 16 (block_for)
MAX_SLOTS = 8192        # beyond this the four-launch permute's parallel blocks win


def block_for(slots: int) -> int:
    """Slots per pass: tl.histogram over the expert bins and the pairwise rank are [BLOCK, bins] and [BLOCK, BLOCK]
    register tiles, so a batch-1 step (9 slots) on 128-slot blocks spent 10 us of one SM on padding (H200 profile,
    kl8). Four values (16 .. 128), each compiled by the decode buckets' capture."""
    return min(BLOCK, max(16, triton.next_power_of_2(max(slots, 1))))


@triton.jit
def _slot_experts(ids_ptr, offs, m, E, K: tl.constexpr, KS: tl.constexpr, SHARED: tl.constexpr,
                  PAD: tl.constexpr):
    """Expert of each slot (padding slots land in the spare bin PAD)."""
    if SHARED:
        t = offs // KS
        j = offs - t * KS
        e = tl.load(ids_ptr + t * K + j, mask=m & (j < K), other=PAD)
        e = tl.where(j == K, E, e)
    else:
        e = tl.load(ids_ptr + offs, mask=m, other=PAD)
    return tl.where(m, e, PAD)


@triton.jit
def _permute_small_kernel(ids_ptr, w_ptr, wext_ptr, cnt_ptr, offsets_ptr, sorted_tok_ptr, sorted_slot_ptr,
                          slot_to_sorted_ptr, S, E,
                          K: tl.constexpr, KS: tl.constexpr, SHARED: tl.constexpr, E_TOT: tl.constexpr,
                          E_BINS: tl.constexpr, BLOCK: tl.constexpr):
    li = tl.arange(0, BLOCK)
    bins = tl.arange(0, E_BINS)
    hist = tl.zeros([E_BINS], dtype=tl.int32)
    for s0 in range(0, S, BLOCK):
        offs = s0 + li
        m = offs < S
        e = _slot_experts(ids_ptr, offs, m, E, K, KS, SHARED, E_TOT)
        hist += tl.histogram(e, E_BINS)
        if SHARED:
            t = offs // KS
            j = offs - t * KS
            w = tl.load(w_ptr + t * K + j, mask=m & (j < K), other=0.0)
            tl.store(wext_ptr + offs, tl.where(j == K, 1.0, w), mask=m)
    incl = tl.cumsum(hist, axis=0)
    running = incl - hist                                   # exclusive: first row of each expert
    tl.store(offsets_ptr + bins, running, mask=bins <= E_TOT)   # offsets[E_TOT] = S (padding sits in bin E_TOT)
    for s0 in range(0, S, BLOCK):
        offs = s0 + li
        m = offs < S
        e = _slot_experts(ids_ptr, offs, m, E, K, KS, SHARED, E_TOT)
        tl.store(cnt_ptr + bins, running)
        tl.debug_barrier()                                  # published before any thread gathers from it
        base = tl.load(cnt_ptr + e, mask=m, other=0)
        same = (e[:, None] == e[None, :]) & (li[None, :] < li[:, None])
        pos = base + tl.sum(same.to(tl.int32), axis=1)
        tl.store(sorted_tok_ptr + pos, offs // KS, mask=m)
        tl.store(sorted_slot_ptr + pos, offs, mask=m)
        tl.store(slot_to_sorted_ptr + offs, pos, mask=m)
        running += tl.histogram(e, E_BINS)
        tl.debug_barrier()                                  # every gather done before the next publish


def moe_permute_small(topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor | None = None,
                      shared: bool = False) -> tuple[Permutation, torch.Tensor | None]:
    """topk_ids int32 [T, k] (contiguous, values in [0, E)); with `shared`, topk_weights fp32 [T, k] (contiguous).
    Returns (Permutation over E (+1) experts, weights): weights is [T, k+1] (routed, then 1.0) with `shared`,
    else topk_weights unchanged."""
    T, k = topk_ids.shape
    ks = k + int(shared)
    S = T * ks
    e_tot = num_experts + int(shared)
    dev = topk_ids.device
    e_bins = pow2(e_tot + 1)
    offsets = torch.empty(e_tot + 1, dtype=torch.int32, device=dev)
    sorted_tok = torch.empty(S, dtype=torch.int32, device=dev)
    sorted_slot = torch.empty(S, dtype=torch.int32, device=dev)
    slot_to_sorted = torch.empty(S, dtype=torch.int32, device=dev)
    cnt = torch.empty(e_bins, dtype=torch.int32, device=dev)
    wext = torch.empty((T, ks), dtype=torch.float32, device=dev) if shared else topk_weights
    _permute_small_kernel[(1,)](
        topk_ids, topk_weights if shared else topk_ids, wext if shared else topk_ids, cnt, offsets, sorted_tok,
        sorted_slot, slot_to_sorted, S, num_experts,
        K=k, KS=ks, SHARED=bool(shared), E_TOT=e_tot, E_BINS=e_bins, BLOCK=block_for(S),
        num_warps=8 if S > 64 else 4)
    return Permutation(offsets, sorted_tok, slot_to_sorted, sorted_slot), wext
