"""MoePermuteSmall beyond the generic cell driver: heavy ties (many tokens on the same experts), the empty batch,
the MAX_SLOTS edge, the outputs' own invariants, and the kernel compiling for the H200."""

from __future__ import annotations

import pytest
import torch

from kestrel.catalog._op import validating
from kestrel.catalog.moe.permute_small import MoePermuteSmall
from kestrel.kernels.moe.permute_small import MAX_SLOTS
from helpers import compile_for_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tied_ids(T: int, E: int, k: int, pool: int, seed: int) -> torch.Tensor:
    """k distinct experts a token, drawn from the first `pool` experts only: each of them takes ~T*k/pool slots."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(T, pool, generator=g).argsort(-1)[:, :k].to(torch.int32)


def _run(ids: torch.Tensor, E: int, shared: bool, seed: int = 0):
    T, k = ids.shape
    w = torch.rand(T, k, generator=torch.Generator().manual_seed(seed + 1)) + 0.05
    inp = dict(topk_ids=ids.to(DEVICE), num_experts=E, topk_weights=w.to(DEVICE), shared=shared)
    with validating(MoePermuteSmall):
        out = MoePermuteSmall.raw_call(**inp)
    MoePermuteSmall.compare(out, MoePermuteSmall.reference(**inp))
    return out


def _check_invariants(perm, ids: torch.Tensor, E: int, shared: bool):
    """Rows grouped by expert in slot order, the inverse map inverts, offsets end at S."""
    T, k = ids.shape
    ks = k + int(shared)
    flat = torch.cat([ids, torch.full((T, 1), E, dtype=ids.dtype)], 1) if shared else ids
    flat = flat.reshape(-1).long()
    S = flat.numel()
    pos, slots = perm.slot_to_sorted.long().cpu(), perm.sorted_slot_ids.long().cpu()
    assert torch.equal(slots[pos], torch.arange(S)) and torch.equal(pos[slots], torch.arange(S))
    assert torch.equal(perm.sorted_token_ids.long().cpu(), slots // ks)
    offs = perm.expert_offsets.long().cpu()
    assert offs.numel() == E + int(shared) + 1 and offs[0] == 0 and offs[-1] == S
    for e in range(E + int(shared)):
        rows = slots[offs[e]:offs[e + 1]]
        assert (flat[rows] == e).all() and (rows[1:] > rows[:-1]).all()


@pytest.mark.parametrize("T,E,k,pool,shared", [
    (64, 256, 8, 9, True),          # Kimi Linear bs64 (576 slots): 9 experts share every routed slot
    (72, 256, 8, 8, False),         # every token on the same 8 experts: 72-way ties in each
    (1, 256, 8, 256, True),         # batch 1 (9 slots)
])
def test_ties_keep_slot_order(T, E, k, pool, shared):
    ids = _tied_ids(T, E, k, pool, seed=T + pool)
    perm, w = _run(ids, E, shared, seed=T)
    _check_invariants(perm, ids, E, shared)
    if shared:
        assert w.shape == (T, k + 1) and torch.equal(w[:, k].cpu(), torch.ones(T))


def test_slots_past_max_are_refused():
    """910 tokens x (8 + shared) = 8190 slots is the largest batch it takes (a GPU cell runs it: under the
    interpreter its 69M compares take minutes); one token more goes to MoePermute."""
    T = MAX_SLOTS // 9
    w = torch.rand(T + 1, 8)
    assert not MoePermuteSmall.is_valid(torch.zeros((T, 8), dtype=torch.int32), 256, w[:T], True)
    why = MoePermuteSmall.is_valid(torch.zeros((T + 1, 8), dtype=torch.int32), 256, w, True)
    assert why and "MoePermute" in why


def test_empty_batch():
    ids = torch.empty((0, 8), dtype=torch.int32)
    perm, w = _run(ids, 256, True)
    assert torch.equal(perm.expert_offsets.cpu(), torch.zeros(258, dtype=torch.int32)) and w.shape == (0, 9)


_COMPILE = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kestrel.kernels.moe import permute_small as P

n = 0
for K, E, shared in ((8, 256, True), (8, 256, False), (16, 896, False)):     # Kimi Linear (+ shared), K3
    for slots in (9, 27, 40, 72, 576, 1024, 2304):                            # every key-step width, 16 .. 1024
        bj = P.block_for(slots)
        const = dict(K=K, KS=K + shared, SHARED=shared, E_TOT=E + shared, BQ=P.BQ, BJ=bj)
        sig = {name: "constexpr" if name in const else "*fp32" if name in ("w_ptr", "wext_ptr")
               else "*i32" if name.endswith("_ptr") else "i32"
               for name in inspect.signature(P._permute_small_kernel.fn).parameters}
        src = ASTSource(fn=P._permute_small_kernel, signature=sig, constexprs=const)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": P.warps_for_block(bj)}).asm["cubin"]
        n += 1
print("cubins", n)
"""


def test_permute_small_kernel_compiles_for_the_h200():
    """The interpreter runs the kernel as Python; this compiles it for sm_90 at every key-step width the decode and
    verify buckets launch (no GPU needed; a process without TRITON_INTERPRET)."""
    assert "cubins 21" in compile_for_sm90(_COMPILE)
