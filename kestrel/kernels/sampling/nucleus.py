"""Top-p / min-p sampling of one row per program, without sorting the vocabulary.

For row b with scaled logits v = x / T and weights w = exp(v - max v) (the max token has weight 1):
- top-p keeps the first tokens of the canonical order (v descending, id ascending) while the mass before them is
  below P = top_p * sum(w); the first token is always kept;
- min-p keeps, of those, w >= min_p.
Order keys: a logit's fp32 bits as int32 with the magnitude bits of negatives flipped order like the logit (v is
loaded as x / T + 0.0, which turns -0.0 into +0.0, so equal logits share one key). A token j is in the top-p set
iff A(key_j) + r_j * w_j < P, where A(t) is the mass of the keys above t and r_j its rank among the tokens tied with
it (by id).

The draw is rejection sampling, exact: draw j from the whole row (inverse CDF in vocabulary order, float64 running
sums), accept it if it passes both filters (one pass), else draw again with the next round's uniform. A round is
accepted with probability (kept mass) / (row mass), at least top_p without min-p, so top_p = 0.95 takes about two
passes more than the row's max and sum. After `ROUNDS` rejections (strong min-p, small top_p) the row falls back to
finding the top-p boundary itself, by bisection over the order keys (about 32 passes), and draws over the kept
set. Uniforms are counter-based (request keys, token position, round), every pass walks the row in the same order,
so a row's token never depends on the other rows. A row with top_p = 1 and min_p = 0 (temperature only) takes
its first draw: three passes in all. `runtime/sampler.py`'s sort path defines the same kept set; the
tests compare them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _elementwise_min, _sum_combine


# Under the interpreter every call of a jit helper re-patches the language (milliseconds), so the row's loads and
# order keys are written out in each pass, and sums use the builtin reductions (see kernels/kda/_common.py).
# A logit is loaded as v = x / T + 0.0 (+ 0.0 turns -0.0 into +0.0: equal logits share one order key); its key
# is its fp32 bits as int32 with the magnitude bits of negatives flipped, which orders like v.

@triton.jit
def _nucleus_kernel(x_ptr, stride, V, ints_ptr, ints_stride, temp_ptr, top_p_ptr, min_p_ptr, out_ptr, thr_ptr,
                    PATH_A: tl.constexpr, PATH_B: tl.constexpr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    path = tl.load(ints_ptr + 4 * ints_stride + row)
    if (path == PATH_A) | (path == PATH_B):
        _nucleus_row(x_ptr + row.to(tl.int64) * stride, V, row, ints_ptr, ints_stride, temp_ptr, top_p_ptr,
                     min_p_ptr, out_ptr, thr_ptr, ROUNDS, BLOCK)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _uniform(a):
    """u in [0, 1) from a 32-bit hash a and one more mix of it: 53 bits."""
    return ((a >> 5) * 67108864 + (_mix32(a ^ 0x1B873593) >> 6)).to(tl.float64) * (1.0 / 9007199254740992.0)


@triton.jit
def _cdf_step(w, offs, V, target, run, pick, last):
    """One chunk of an inverse-CDF draw over weights w (float64): the first index whose running sum passes
    `target`, and the last positive one (taken when rounding leaves the target past the whole sum)."""
    cs = run + tl.associative_scan(w, 0, _sum_combine)
    pick = tl.minimum(pick, tl.reduce(tl.where((w > 0) & (cs > target), offs, V), 0, _elementwise_min))
    last = tl.maximum(last, tl.reduce(tl.where(w > 0, offs, 0), 0, _elementwise_max))
    return run + tl.reduce(w, 0, _sum_combine), pick, last


@triton.jit
def _draw_full(x_row, V, temp, m, z, u, BLOCK: tl.constexpr):
    """Inverse CDF over the whole row's weights, in vocabulary order."""
    run = tl.zeros((), tl.float64)
    pick = tl.zeros((), tl.int32) + V
    last = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp + 0.0
        w = tl.where(offs < V, tl.exp(v - m), 0.0).to(tl.float64)
        run, pick, last = _cdf_step(w, offs, V, u * z, run, pick, last)
    return tl.where(pick < V, pick, last)


@triton.jit
def _kept_chunk(x_row, offs, V, temp, m, hi, c, minp, seen):
    """Weights (float64, 0 where dropped) of one chunk of the fallback's kept set: keys above the boundary `hi`,
    the first `c` ties at it by id (`seen` ties came before this chunk), min-p; and the chunk's tie count."""
    v = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp + 0.0
    b = v.to(tl.int32, bitcast=True)
    k = tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)
    tie = (k == hi) & (offs < V)
    rank = seen + tl.associative_scan(tie.to(tl.int32), 0, _sum_combine) - 1
    w = tl.exp(v - m)
    kept = ((k > hi) | (tie & (rank < c))) & (w >= minp) & (offs < V)
    return tl.where(kept, w, 0.0).to(tl.float64), tl.reduce(tie.to(tl.int32), 0, _sum_combine)


@triton.jit
def _mass_ahead(x_row, V, temp, m, key, j, BLOCK: tl.constexpr):
    """Mass ahead of (key, id j) in the canonical order: the keys above `key`, and the ids below j tied at it
    (j = 0: the mass above `key`; (key_j, j): the mass before token j)."""
    acc = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp + 0.0
        b = v.to(tl.int32, bitcast=True)
        k = tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)
        ahead = ((k > key) | ((k == key) & (offs < j))) & (offs < V)
        acc += tl.reduce(tl.where(ahead, tl.exp(v - m), 0.0), 0, _sum_combine)
    return acc


@triton.jit
def _nucleus_row(x_row, V, row, ints_ptr, ints_stride, temp_ptr, top_p_ptr, min_p_ptr, out_ptr, thr_ptr,
                 ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    key0 = tl.load(ints_ptr + row)
    key1 = tl.load(ints_ptr + ints_stride + row)
    pos = tl.load(ints_ptr + 2 * ints_stride + row) & 0xFFFFFFFF
    temp = tl.load(temp_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    minp = tl.load(min_p_ptr + row)
    # max and min of v (the bisection range), then the whole mass z
    m = tl.full((), float("-inf"), tl.float32)
    lo_v = tl.full((), float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp + 0.0
        m = tl.maximum(m, tl.reduce(v, 0, _elementwise_max))
        lo_v = tl.minimum(lo_v, tl.reduce(tl.where(offs < V, v, float("inf")), 0, _elementwise_min))
    m = tl.where(m == float("-inf"), 0.0, m)
    lo_v = tl.where(lo_v == float("-inf"), -3.0e38, lo_v)
    z = tl.zeros((), tl.float64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp + 0.0
        z += tl.reduce(tl.where(offs < V, tl.exp(v - m), 0.0).to(tl.float64), 0, _sum_combine)
    # top-p's mass is the whole row's (min-p filters the top-p set afterwards, relative to the max)
    P = top_p * z.to(tl.float32)
    # rejection rounds: a draw from the whole row, kept if both filters keep it
    h = _mix32(_mix32(pos ^ key0) ^ key1)
    tok = tl.zeros((), tl.int32)
    done = tl.zeros((), tl.int32)
    r = tl.zeros((), tl.int32)
    if ROUNDS == 0:
        # straight to the boundary (tests force it): a loop with no trip, folded away, left `done` a constant
        # that Triton 3.6's sm_90 pipeline asserted on (make_ttgir: SmallVector idx < size)
        tl.store(thr_ptr + 2 * row, -1)
        tl.store(thr_ptr + 2 * row + 1, 0)
        _bisect_and_draw(x_row, V, row, temp, m, lo_v, P, minp, h, out_ptr, thr_ptr, BLOCK)
        return
    while (done == 0) & (r < ROUNDS):
        u = _uniform(_mix32(((h ^ 0x68E31DA4) + r * 40503) & 0xFFFFFFFF))      # small steps: no int32 overflow
        j = _draw_full(x_row, V, temp, m, z, u, BLOCK)
        vj = tl.load(x_row + j).to(tl.float32) / temp + 0.0
        bj = vj.to(tl.int32, bitcast=True)
        wj = tl.exp(vj - m)
        ok = wj >= minp
        if top_p < 1.0:
            key_j = tl.where(bj >= 0, bj, bj ^ 0x7FFFFFFF).to(tl.int64)
            ok = ok & (_mass_ahead(x_row, V, temp, m, key_j, j, BLOCK) < P)
        tok = tl.where(ok, j, tok)
        done = ok.to(tl.int32)
        r += 1
    tl.store(thr_ptr + 2 * row, -1)
    tl.store(thr_ptr + 2 * row + 1, r)
    if done == 0:
        _bisect_and_draw(x_row, V, row, temp, m, lo_v, P, minp, h, out_ptr, thr_ptr, BLOCK)
    else:
        tl.store(out_ptr + row, tok.to(tl.int64))


@triton.jit
def _bisect_and_draw(x_row, V, row, temp, m, lo_v, P, minp, h, out_ptr, thr_ptr, BLOCK: tl.constexpr):
    """The fallback: the top-p boundary itself, then one draw over the kept set."""
    # bisection for the smallest key t with A(t) < P: A(key of max) = 0 < P, A(below every key) = z >= P
    mb = m.to(tl.int32, bitcast=True)
    hi = tl.where(mb >= 0, mb, mb ^ 0x7FFFFFFF).to(tl.int64)
    lb = lo_v.to(tl.int32, bitcast=True)
    lo = tl.where(lb >= 0, lb, lb ^ 0x7FFFFFFF).to(tl.int64) - 1
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if _mass_ahead(x_row, V, temp, m, mid, 0, BLOCK) < P:
            hi = mid
        else:
            lo = mid
    a_t = _mass_ahead(x_row, V, temp, m, hi, 0, BLOCK)
    # the tokens tied at t: their common weight, how many there are, how many of them top-p keeps
    w_t = tl.zeros((), tl.float32)
    n_t = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp + 0.0
        b = v.to(tl.int32, bitcast=True)
        tie = (tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64) == hi) & (offs < V)
        w_t = tl.maximum(w_t, tl.reduce(tl.where(tie, tl.exp(v - m), 0.0), 0, _elementwise_max))
        n_t += tl.reduce(tie.to(tl.int32), 0, _sum_combine)
    c = tl.minimum(tl.maximum(tl.ceil((P - a_t) / tl.maximum(w_t, 1e-38)), 1.0), n_t.to(tl.float32)).to(tl.int32)
    # two passes in vocabulary order (ties kept by increasing id): the kept mass, then the draw with u
    total = tl.zeros((), tl.float64)
    seen = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        kw, n = _kept_chunk(x_row, start + tl.arange(0, BLOCK), V, temp, m, hi, c, minp, seen)
        total += tl.reduce(kw, 0, _sum_combine)
        seen += n
    u = _uniform(_mix32(h ^ 0x2545F491))
    run = tl.zeros((), tl.float64)
    seen = tl.zeros((), tl.int32)
    pick = tl.zeros((), tl.int32) + V
    last = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        kw, n = _kept_chunk(x_row, offs, V, temp, m, hi, c, minp, seen)
        run, pick, last = _cdf_step(kw, offs, V, u * total, run, pick, last)
        seen += n
    tl.store(out_ptr + row, tl.where(pick < V, pick, last).to(tl.int64))
    tl.store(thr_ptr + 2 * row, hi)
    tl.store(thr_ptr + 2 * row + 1, c.to(tl.int64))


def nucleus_draw(x: torch.Tensor, ints: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, which: tuple[int, ...], out: torch.Tensor, rounds: int = 8,
                 block: int = 4096) -> torch.Tensor:
    """Write the token of every row whose path (`ints[4]`) is one of `which` (one or two paths) into `out` (other
    rows are left as they are). x [B, V] (any float dtype, unit last stride); `ints` [5, B] int64 (key0, key1,
    position, top_k, path) and temperature, top_p, min_p fp32 [B], as `runtime/sampler.py` packs them. Returns [B, 2] int64 per row: (-1,
    rounds used) when a rejection round was accepted, else (order key of the top-p boundary, how many tokens tied
    there are kept)."""
    B, V = x.shape
    assert x.stride(1) == 1 and ints.stride(1) == 1
    thr = torch.zeros(B, 2, dtype=torch.int64, device=x.device)
    block = min(block, triton.next_power_of_2(V))
    _nucleus_kernel[(B,)](x, x.stride(0), V, ints, ints.stride(0), temperature, top_p, min_p, out, thr,
                          PATH_A=which[0], PATH_B=which[-1], ROUNDS=rounds, BLOCK=block,
                          num_warps=8 if block >= 2048 else 4)
    return thr
