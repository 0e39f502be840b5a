"""MoE permutation of a decode- or verify-sized batch in one launch, optionally with the shared expert as one more
expert that every token visits.

The same stable sort as `permute.py` (its four launches pay off for prefill-sized batches), written as a rank by
counting: slot i of expert e_i has the key e_i * S + i (distinct keys, so the order is the stable order by expert),
and its sorted row is the number of keys below its own. The expert offsets are counts of the same kind:
expert_offsets[b] = keys below b * S (= slots routed to experts < b). So the kernel answers S + E' + 1 queries
"how many keys lie below q", BQ queries a program, each program scanning all S keys in blocks of BJ:
  queries 0 .. S-1:    q = key of slot i        -> row r; sorted_*[r] = slot i, slot_to_sorted[i] = r
  queries S .. S+E':   q = b * S (b = 0 .. E')  -> expert_offsets[b]
Every program is independent (no scratch, no barrier, no atomics): the work is (S + E' + 1) * S compares spread
over (S + E' + 1) / BQ programs, where the one-program walk it replaced ran S / 128 blocks in series (H200, Kimi
Linear batch 64, S = 576: 37 us a layer). With `shared`, token t gets a virtual slot t*(k+1)+k routed to expert E
(E' = E + 1), and the routed slot j of token t becomes t*(k+1)+j, so MoeCombine can read the [T, k+1] weights this
kernel writes (the routed weights, then 1.0 for the shared expert). Outputs are exactly `permute.py`'s Permutation
over E' experts and S = T*(k+1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.moe._common import pow2, warps_for
from kestrel.kernels.moe.permute import Permutation

MAX_SLOTS = 8192        # beyond this MoePermute's four launches take over: the compares here grow as S^2
BQ = 16                 # queries a program: S = 576 gives 53 programs, S = 2304 gives 161 (the H200 has 132 SMs)
BJ = 1024               # keys compared a step at most; fewer slots take the next power of two from 16 (block_for)


def block_for(slots: int) -> int:
    """Keys a step: a [BQ, BJ] compare tile, so a batch-1 step (9 slots) scans one 16-key block. Seven values
    (16 .. 1024), each compiled by the decode buckets' capture. A step's loads are its latency (one key load a
    thread, L2 hits), so a wide step keeps several in flight: S = 2304 takes three steps, not nine."""
    return min(BJ, pow2(slots, lo=16))


def warps_for_block(bj: int) -> int:
    """num_warps of a [BQ, bj] step: 2 .. 8 (16 warps would only copy the queries into more threads)."""
    return min(8, warps_for(BQ * bj))


@triton.jit
def _slot_experts(ids_ptr, offs, m, E, K: tl.constexpr, KS: tl.constexpr, SHARED: tl.constexpr):
    """Expert of each slot (padding slots give 0: their keys are masked by the caller)."""
    if SHARED:
        t = offs // KS
        j = offs - t * KS
        e = tl.load(ids_ptr + offs - t, mask=m & (j < K), other=0)        # t*K + j = slot - t
        e = tl.where(j == K, E, e)
    else:
        e = tl.load(ids_ptr + offs, mask=m, other=0)
    return e


@triton.jit
def _permute_small_kernel(ids_ptr, w_ptr, wext_ptr, offsets_ptr, sorted_tok_ptr, sorted_slot_ptr,
                          slot_to_sorted_ptr, S, E,
                          K: tl.constexpr, KS: tl.constexpr, SHARED: tl.constexpr, E_TOT: tl.constexpr,
                          BQ: tl.constexpr, BJ: tl.constexpr):
    qi = tl.program_id(0) * BQ + tl.arange(0, BQ)
    is_slot = qi < S
    is_bin = (qi >= S) & (qi <= S + E_TOT)
    e_q = _slot_experts(ids_ptr, qi, is_slot, E, K, KS, SHARED)
    q = tl.where(is_slot, e_q * S + qi, (qi - S) * S)
    lj = tl.arange(0, BJ)
    below = tl.zeros([BQ, BJ], dtype=tl.int32)
    for j0 in range(0, S, BJ):
        offs = j0 + lj
        m = offs < S
        key = tl.where(m, _slot_experts(ids_ptr, offs, m, E, K, KS, SHARED) * S + offs, 2147483647)
        # key < q is the sign bit of key - q (both in [0, 2^31): no overflow); sm_90 adds it with one LEA.HI, so a
        # compare costs two instructions, not three (compare, select, add)
        d = (key[None, :] - q[:, None]).to(tl.uint32, bitcast=True)
        below += (d >> 31).to(tl.int32)
    pos = tl.sum(below, axis=1)
    tl.store(offsets_ptr + (qi - S), pos, mask=is_bin)
    tl.store(sorted_tok_ptr + pos, qi // KS, mask=is_slot)
    tl.store(sorted_slot_ptr + pos, qi, mask=is_slot)
    tl.store(slot_to_sorted_ptr + qi, pos, mask=is_slot)
    if SHARED:
        t = qi // KS
        j = qi - t * KS
        w = tl.load(w_ptr + qi - t, mask=is_slot & (j < K), other=0.0)
        tl.store(wext_ptr + qi, tl.where(j == K, 1.0, w), mask=is_slot)


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
    offsets = torch.empty(e_tot + 1, dtype=torch.int32, device=dev)
    sorted_tok = torch.empty(S, dtype=torch.int32, device=dev)
    sorted_slot = torch.empty(S, dtype=torch.int32, device=dev)
    slot_to_sorted = torch.empty(S, dtype=torch.int32, device=dev)
    wext = torch.empty((T, ks), dtype=torch.float32, device=dev) if shared else topk_weights
    bj = block_for(S)
    _permute_small_kernel[(triton.cdiv(S + e_tot + 1, BQ),)](
        topk_ids, topk_weights if shared else topk_ids, wext if shared else topk_ids, offsets, sorted_tok,
        sorted_slot, slot_to_sorted, S, num_experts,
        K=k, KS=ks, SHARED=bool(shared), E_TOT=e_tot, BQ=BQ, BJ=bj, num_warps=warps_for_block(bj))
    return Permutation(offsets, sorted_tok, slot_to_sorted, sorted_slot), wext
