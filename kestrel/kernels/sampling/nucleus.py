"""Temperature / top-k / top-p / min-p sampling on the device without sorting, split across the vocabulary.

For row b with scaled logits v = x / T and weights w = exp(v - max v) (the max token has weight 1), in the
canonical order (v descending, id ascending):
- top-k keeps the first k tokens;
- top-p keeps, of those, the first tokens while the mass before them is below P = top_p * Z_k (Z_k the mass of the
  top-k set, the whole row's mass without top-k); the first token is always kept;
- min-p keeps, of those, w >= min_p.
Order keys: a logit's fp32 bits as int32 with the magnitude bits of negatives flipped order like the logit (v is
loaded as x / T + 0.0, which turns -0.0 into +0.0, so equal logits share one key). A token j is kept iff its rank
(tokens ahead of it) is below k and A_j < P, where A_j is the mass ahead of it (keys above key_j, and the ids
below j tied with it), and w_j >= min_p.

Each row is split into chunks of `BLOCK` tokens, one program per (row, chunk), in a fixed sequence of launches:
1. `_stats_kernel`: the chunk's max and sum of exp (combined per row like an online softmax) and, for a top-k
   row, the counts of the top 8 bits of the keys (the first digit) in the `FIRST_DIGIT_WINDOW` bins from the
   chunk's own largest key's down (a few sums and relaxed atomic integer adds: exact, order-free; a 256-bin
   `tl.histogram` here cost 50 of the kernel's 64 us at batch 64 on the H200), whose ticket settles the first
   digit (below) where those counts prove it: the row's counts are exact in the window below its largest key's
   digit, where a top-k row's k-th key nearly always lies; a digit found lower is not proven, and the row goes to
2. `_first_digit_kernel` (top-k steps only): the first digit's whole histogram (`tl.histogram`, 4 chunks per
   program) for those rows alone, settled the same way; every other row's programs return at once;
3. `_radix_kernel` x3 (top-k steps only): a radix pass (4 chunks per program: counts do not depend on the split)
   histograms the next 8 bits of the keys that share the prefix found so far: a chunk whose max (from stage 1)
   lies below the prefix's keys is not read; a chunk with at most `SPARSE_KEYS` keys on the prefix (past the
   first digit nearly every chunk: few or none) adds them one by one, with each bin's least and largest key
   (relaxed atomic min / max), else it histograms them in registers and bounds the bins it touches by its least
   and largest such key. Each top-k launch ends with a ticket per row (`_settle_if_last`: a barrier, then one
   acq_rel atomic add per program): the row's last program reads the digit's histogram and writes the search's
   state (the prefix, how many keys on it are still to count, whether the search is over), so the next pass's
   programs load three integers and do no scans. The search is over (the later passes return at once, reading
   nothing of the row) when a digit's bin holds exactly the tokens still to count (every key sharing the prefix
   is in the top k) or its bounds meet (one key, tied: bf16 logits usually end so after two digits). The settle
   that ends it (at the latest after the fourth digit) writes the row's threshold: an order key t and how many c
   of its ties are in (the top k are the keys above t and the first c at t by id; c = 0 when the search ended on
   a full bin, t is then one below it), and resets the workspace (histograms, bounds, ticket) for the next call;
4. `_proposal_kernel`: the R rejection rounds' proposals, per chunk an exponential race (Gumbel-max)
   argmin E(row hash, round, j) / w_j over the tokens with w_j >= min_p and key above t, or at t if c > 0 (the
   smallest prefix min-p and top-k leave), E exponential: once reduced over the chunks (least score, lowest id),
   an exact draw from the weights restricted to that set; every candidate then passes min-p and top-k, and top-p
   accepts one with probability at least top_p. E is keyed by the token id, not by the chunk, so the candidate
   does not depend on BLOCK;
5. `_ahead_kernel`: per chunk, for each round's candidate, the mass and count of the tokens ahead of it, and the
   mass above t;
6. `_decide_kernel` (one program per row): Z_k = A(t) + c * w(t) (the ties at t share one weight), and the first
   round whose candidate passes top-k, top-p and min-p; the draws are rejection sampling from a superset of the
   kept set, so an accepted candidate is exact;
7. launches 4-6 again, for the rows whose R candidates were all refused (the others' programs return at once):
   R more rounds over the tokens ahead of the refused candidate first in the canonical order (every token after
   it is refused too), a smaller superset of the kept set; conditioned on stage 1 refusing, still an exact draw;
8. `_fallback_kernel` (one program per row, returns at once unless all 2R rounds were refused: rare but for a
   small top_p): the kept set's boundary itself by bisection over the order keys (about 32 passes of the row in
   one program: slow), then one inverse-CDF draw over the kept set.
v = x / T is an IEEE division everywhere (`div_rn`: Triton's `/` compiles to an approximate one on the GPU, which
moved keys by an ulp from torch's, and so ties and the threshold the tests and the sort path recompute).
Randoms are counter-based (request keys, token position, round, token id); `chunk_block` depends on V alone, so the
float sums, and the token, of a row do not depend on the batch.
Every launch serves the rows whose path (`ints[4]`) has its bit set in `paths` (`path_mask`), a runtime int32 marked
`do_not_specialize` (Triton would specialize it on == 1 and on divisibility by 16): one compiled variant serves every
mix of paths. The constexprs left are TOP_K (the step has top-k rows), WINDOW, STAGE, D, R, CP2, BLOCK, SPARSE, SUB,
and the integer arguments (V, strides, CM, C) are fixed by the vocabulary and the sampler's buffers, so a vocabulary
has 19 variants: `_stats_kernel` x2 (TOP_K), `_first_digit_kernel` x1, `_radix_kernel` x3 (D), `_proposal_kernel`,
`_ahead_kernel`, `_decide_kernel` x4 each (TOP_K x STAGE), `_fallback_kernel` x1; `runtime/sampler.py`'s
`Sampler.warm_up` runs them all at engine start-up. No host sync, no allocation (`NucleusWork` holds
the workspaces), no data-dependent launch: graph-capturable. `runtime/sampler.py`'s sort path defines the same
kept set; the tests compare them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _elementwise_min, _sum_combine

FIRST_DIGIT_WINDOW = 4    # first-digit bins the stats pass counts below each chunk's largest key's (4**4 in size)
ROUNDS = 4          # rejection rounds per stage: at top_p = 0.95 stage 1 refuses a row at most once in 1.6e5
SPARSE_KEYS = 128   # a radix pass's chunk with at most this many keys on the prefix adds them one by one
RADIX_SUB = 4       # chunks per radix-pass program: most return at once, fewer programs are fewer waves


@triton.jit
def _mix32(x):
    """The 32-bit finaliser of runtime/sampler.py's `mix32` on int64 values below 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _mix32u(x):
    """The same finaliser on uint32 (products wrap mod 2**32, shifts are logical): the per-token hashes."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x1B873593
    return x ^ (x >> 16)


@triton.jit
def _uniform(a):
    """u in [0, 1) from a 32-bit hash a and one more mix of it: 53 bits."""
    return ((a >> 5) * 67108864 + (_mix32(a ^ 0x1B873593) >> 6)).to(tl.float64) * (1.0 / 9007199254740992.0)


@triton.jit
def _row_hash(ints_ptr, ints_stride, row):
    key0 = tl.load(ints_ptr + row)
    key1 = tl.load(ints_ptr + ints_stride + row)
    pos = tl.load(ints_ptr + 2 * ints_stride + row) & 0xFFFFFFFF
    return _mix32(_mix32(pos ^ key0) ^ key1)


@triton.jit
def _selected(ints_ptr, ints_stride, row, paths):
    """A row whose path (`ints[4]`) is one of the launch's: bit `path` of the runtime bit mask `paths` is set."""
    path = tl.load(ints_ptr + 4 * ints_stride + row)
    return ((paths >> path) & 1) != 0


@triton.jit
def _active(ints_ptr, ints_stride, rowf_ptr, row, paths, STAGE: tl.constexpr):
    """A row of the selected paths; in stage 2 only while every candidate so far was refused."""
    sel = _selected(ints_ptr, ints_stride, row, paths)
    if STAGE == 2:
        sel = sel & (tl.load(rowf_ptr + 4 * row + 3) > 0)
    return sel


@triton.jit
def _order_key(v):
    b = v.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _radix(v):
    """The order key as an unsigned 32-bit value in int64 (0 for the lowest key): radix digits order like v."""
    return _order_key(v).to(tl.int64) + 2147483648


@triton.jit
def _hist_row(hist_ptr, row):
    """A row's radix workspace: 256 counts for each of the 4 digits, then for digits 1-3 each bin's lower bound of
    its keys (8-bit bins of order keys), then its upper bound."""
    return hist_ptr + row * 2560


@triton.jit
def _radix_digit(hist_row, d: tl.constexpr, prefix, rem):
    """One digit of the search for the k-th largest key, from digit d's histogram (8-bit bins of the keys sharing
    the `prefix` of the digits before it, `rem` >= 1 of them still to count): the prefix and the count still to
    count after it, and whether the search is over: once the digit's bin holds exactly the tokens still to count
    (`full`: every token sharing the prefix is in the top k) or only one key (its bounds meet: that key is the
    k-th), the later digits are not needed (their passes leave them empty). Also the row's threshold as it is
    stored (valid once the search is over or d = 3): an order key t and how many of its ties are in."""
    idx = tl.arange(0, 256)
    h = tl.load(hist_row + d * 256 + idx, cache_modifier=".cg")
    incl = tl.sum(h, 0) - tl.cumsum(h, 0) + h                    # tokens with this digit or a larger one
    dig = tl.max(tl.where(incl >= rem, idx, -1), 0)
    over = tl.sum(tl.where(idx == dig, incl - h, 0), 0)
    here = tl.sum(tl.where(idx == dig, h, 0), 0)
    prefix = prefix * 256 + dig
    rem = rem - over
    full = here == rem
    one = tl.zeros((), tl.int1)
    key = tl.zeros((), tl.int32)
    if d > 0:
        key = tl.load(hist_row + (3 + d) * 256 + tl.maximum(dig, 0), cache_modifier=".cg")
        hi = tl.load(hist_row + (6 + d) * 256 + tl.maximum(dig, 0), cache_modifier=".cg")
        one = (full == 0) & (key == hi)
    low = prefix << (24 - 8 * d)                                 # the smallest radix key sharing the prefix
    t = tl.where(one, key, (tl.where(full, low - 1, low) - 2147483648).to(tl.int32))
    return prefix, rem, full | one, t, tl.where(full, 0, rem)


@triton.jit
def _settle_if_last(hist_ptr, kth_ptr, tick_ptr, row, k, D: tl.constexpr, WINDOW: tl.constexpr = 0):
    """Run by every program of a top-k row once its digit-(D - 1) histogram atomics are issued; the row's last
    program to get here (a ticket per row, counting the launch's programs of the row) reads that histogram and
    writes the search's state for the next radix pass (the prefix found, whether the search is over, the count
    still to find) or, once it is over (always at D = 4), the row's threshold t (an order key) and the count c of
    its ties in the top k (the top k are the keys above t and the first c tied at it; c = 0 when the search ended
    on a full bin: t is then one below the bin's smallest key), and resets the workspace (ticket included) for the
    next call. WINDOW > 0 (the stats pass's first digit): each chunk counted only the WINDOW bins from its own
    largest key's down, so the counts are exact in the WINDOW bins from the row's largest down; a digit found below
    them is not proven, and the row is handed to `_first_digit_kernel` instead: its first digit counts zeroed, the
    prefix stored as -1."""
    # the barrier orders every thread's relaxed adds before the ticket, whose release (one thread, cumulative)
    # publishes them at GPU scope; the last ticket's acquire (then the broadcast of its value through shared memory)
    # orders the histogram loads after every program's adds; the loads bypass L1 (`.cg`)
    tl.debug_barrier()
    if tl.atomic_add(tick_ptr + row, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
        hrow = _hist_row(hist_ptr, row)
        prefix = tl.zeros((), tl.int64)
        rem = k
        if D > 1:
            prefix = tl.load(kth_ptr + 5 * row + 2).to(tl.int64)
            rem = tl.load(kth_ptr + 5 * row + 4).to(tl.int64)
        prefix, rem, done, t, ties = _radix_digit(hrow, D - 1, prefix, rem)
        tl.store(tick_ptr + row, 0)
        if WINDOW > 0:
            bins = tl.arange(0, 256)
            h0 = tl.load(hrow + bins, cache_modifier=".cg")
            top = tl.max(tl.where(h0 > 0, bins, -1), 0)          # the row's largest key's first digit
            if prefix < top - WINDOW + 1:                          # found below the exact bins (or not at all)
                tl.store(hrow + bins, tl.zeros((256,), tl.int32))
                prefix = tl.full((), -1, tl.int64)
                done = tl.zeros((), tl.int1)
                rem = k
        tl.store(kth_ptr + 5 * row + 2, prefix.to(tl.int32))
        tl.store(kth_ptr + 5 * row + 3, done.to(tl.int32))
        tl.store(kth_ptr + 5 * row + 4, rem.to(tl.int32))
        if done | (D == 4):
            tl.store(kth_ptr + 5 * row, t)
            tl.store(kth_ptr + 5 * row + 1, ties.to(tl.int32))
            bins = tl.arange(0, 256)
            for d in tl.static_range(D):
                tl.store(hrow + d * 256 + bins, tl.zeros((256,), tl.int32))
            for d in tl.static_range(1, D):
                tl.store(hrow + (3 + d) * 256 + bins, tl.full((256,), 2147483647, tl.int32))
                tl.store(hrow + (6 + d) * 256 + bins, tl.full((256,), -2147483648, tl.int32))


@triton.jit
def _proposals(offs, ok, iw, hr, cs_ptr, cj_ptr, base, R: tl.constexpr, ROUND0: tl.constexpr):
    """Each round's candidate of one chunk over the tokens `ok`, by an exponential race (Gumbel-max without its
    second log): the least E_j / w_j, E_j = -log(1 - t_j) exponential from the token's 32-bit hash t_j (a series
    for small t, where 1 - t would round), iw = 1 / w = exp(max - v); its lowest id."""
    for r in tl.static_range(R):
        hrr = _mix32u(hr + (ROUND0 + r + 1) * 40503)
        t = (_mix32u(hrr ^ offs.to(tl.uint32)).to(tl.float32) + 0.5) * 2.3283064365386963e-10
        e = tl.where(t < 0.015625, t * (1.0 + t * (0.5 + t * (0.33333334 + t * 0.25))), -tl.log(1.0 - t))
        s = tl.where(ok, e * iw, float("inf"))
        best = tl.min(s, 0)
        tl.store(cs_ptr + base * R + r, best)
        tl.store(cj_ptr + base * R + r, tl.min(tl.where(s == best, offs, 2147483647), 0))


@triton.jit(do_not_specialize=["paths"])
def _stats_kernel(x_ptr, stride, V, ints_ptr, ints_stride, temp_ptr, stats_ptr, hist_ptr, kth_ptr, tick_ptr, CM,
                  paths, TOP_K: tl.constexpr, WINDOW: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    if _selected(ints_ptr, ints_stride, row, paths):
        temp = tl.load(temp_ptr + row)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        inside = offs < V
        v = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=inside, other=float("-inf")).to(tl.float32)
        v = tl.math.div_rn(v, temp) + 0.0
        mc = tl.max(v, 0)
        sc = tl.sum(tl.where(inside, tl.exp(v - tl.where(mc == float("-inf"), 0.0, mc)), 0.0), 0)
        base = row * CM + c
        tl.store(stats_ptr + 2 * base, mc)
        tl.store(stats_ptr + 2 * base + 1, sc)
        if TOP_K:
            k = tl.load(ints_ptr + 3 * ints_stride + row)
            if k < V:
                # the first digit counted in the WINDOW bins from the chunk's largest key's down only (a few sums,
                # not a 256-bin histogram: 50 of 64 us at batch 64 on the H200); the k-th key of a top-k row lies
                # near its row's largest, where these counts are exact (`_settle_if_last` proves it, or hands the
                # row to `_first_digit_kernel`)
                dig = (_radix(v) >> 24).to(tl.int32)
                top = (_radix(mc) >> 24).to(tl.int32)
                hrow = _hist_row(hist_ptr, row)
                for i in tl.static_range(WINDOW):
                    n = tl.sum(((dig == top - i) & inside).to(tl.int32), 0)
                    # relaxed: order-free integer adds, published by the ticket (acq_rel on each of them fenced
                    # every thread and invalidated the SM's L1 around its add)
                    if (n > 0) & (top - i >= 0):
                        tl.atomic_add(hrow + top - i, n, sem="relaxed")
                _settle_if_last(hist_ptr, kth_ptr, tick_ptr, row, k, 1, WINDOW)


@triton.jit(do_not_specialize=["paths"])
def _first_digit_kernel(x_ptr, stride, V, ints_ptr, ints_stride, temp_ptr, hist_ptr, kth_ptr, tick_ptr, paths,
                        SUB: tl.constexpr, BLOCK: tl.constexpr):
    """The first digit's whole histogram, SUB chunks per program, for the top-k rows whose k-th key the stats pass's
    windowed counts could not place (prefix -1: rare, a k-th key far below the row's largest); the row's last program
    settles the digit. Every other row's programs return at once."""
    row = tl.program_id(0)
    sel = _selected(ints_ptr, ints_stride, row, paths)
    k = tl.load(ints_ptr + 3 * ints_stride + row)
    prefix = tl.load(kth_ptr + 5 * row + 2)
    temp = tl.load(temp_ptr + row)
    if sel & (k < V) & (prefix < 0):
        bins = tl.arange(0, 256)
        hrow = _hist_row(hist_ptr, row)
        for sub in range(SUB):
            offs = (tl.program_id(1) * SUB + sub) * BLOCK + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=offs < V, other=float("-inf"))
            v = tl.math.div_rn(v.to(tl.float32), temp) + 0.0
            h = tl.histogram((_radix(v) >> 24).to(tl.int32), 256, mask=offs < V)
            tl.atomic_add(hrow + bins, h, mask=h > 0, sem="relaxed")
        _settle_if_last(hist_ptr, kth_ptr, tick_ptr, row, k, 1)


@triton.jit(do_not_specialize=["paths"])
def _radix_kernel(x_ptr, stride, V, ints_ptr, ints_stride, temp_ptr, stats_ptr, hist_ptr, kth_ptr, tick_ptr, CM,
                  paths, D: tl.constexpr, SPARSE: tl.constexpr, SUB: tl.constexpr, BLOCK: tl.constexpr):
    """Digit D's histogram and bin bounds over the keys sharing the prefix found so far, SUB chunks per program
    (integer counts: the split does not change them); the row's last program settles the next digit."""
    row = tl.program_id(0)
    # every per-row scalar loaded at once (one memory latency, not four in a row): most programs stop here
    sel = _selected(ints_ptr, ints_stride, row, paths)
    k = tl.load(ints_ptr + 3 * ints_stride + row)
    done = tl.load(kth_ptr + 5 * row + 3)
    prefix = tl.load(kth_ptr + 5 * row + 2).to(tl.uint32)
    temp = tl.load(temp_ptr + row)
    # the program's chunks' largest keys (the stats pass's maxima), loaded with the scalars: a chunk whose largest
    # key lies below the prefix's keys has none on it (the search is near the top: past the first digit most
    # chunks are not read again)
    subs = tl.arange(0, SUB)
    cs = tl.program_id(1) * SUB + subs
    mk = (_order_key(tl.load(stats_ptr + 2 * (row * CM + cs), mask=cs * BLOCK < V, other=float("-inf")))
          ^ -2147483648).to(tl.uint32, bitcast=True)
    reach = ((cs * BLOCK < V) & ((mk >> (32 - 8 * D)) >= prefix)).to(tl.int32)
    if sel & (k < V) & (done == 0):
        hrow = _hist_row(hist_ptr, row)
        cnt, lo, hi = hrow + D * 256, hrow + (3 + D) * 256, hrow + (6 + D) * 256
        for sub in range(SUB):
            if tl.sum(tl.where(subs == sub, reach, 0), 0) > 0:
                offs = (tl.program_id(1) * SUB + sub) * BLOCK + tl.arange(0, BLOCK)
                v = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=offs < V, other=float("-inf"))
                key = _order_key(tl.math.div_rn(v.to(tl.float32), temp) + 0.0)
                u = (key ^ -2147483648).to(tl.uint32, bitcast=True)      # the radix key, in 32 bits
                match = ((u >> (32 - 8 * D)) == prefix) & (offs < V)
                dig = ((u >> (24 - 8 * D)) & 255).to(tl.int32)
                n = tl.sum(match.to(tl.int32), 0)
                # past the first digits few keys of a chunk share the prefix (most chunks none): one add (and
                # bounds) per such key; a chunk with many (a flat row, ties) histograms them in registers, adds the
                # counts of the bins it has and bounds each by its least and largest such key (bounds that meet
                # still prove one key)
                if n > SPARSE:
                    h = tl.histogram(dig, 256, mask=match)
                    bins = tl.arange(0, 256)
                    tl.atomic_add(cnt + bins, h, mask=h > 0, sem="relaxed")
                    kmin = tl.min(tl.where(match, key, 2147483647), 0)
                    kmax = tl.max(tl.where(match, key, -2147483648), 0)
                    tl.atomic_min(lo + bins, tl.full((256,), 0, tl.int32) + kmin, mask=h > 0, sem="relaxed")
                    tl.atomic_max(hi + bins, tl.full((256,), 0, tl.int32) + kmax, mask=h > 0, sem="relaxed")
                elif n > 0:
                    tl.atomic_add(cnt + dig, tl.full((BLOCK,), 1, tl.int32), mask=match, sem="relaxed")
                    tl.atomic_min(lo + dig, key, mask=match, sem="relaxed")
                    tl.atomic_max(hi + dig, key, mask=match, sem="relaxed")
        _settle_if_last(hist_ptr, kth_ptr, tick_ptr, row, k, D + 1)


@triton.jit
def _in_top_k(key, kth_ptr, row):
    """The keys the top k leave, by the threshold `_settle_if_last` stores: above t, or at t when some of its ties are in
    (all of them may pass here: the count ahead decides each candidate)."""
    t = tl.load(kth_ptr + 5 * row)
    return (key > t) | ((key == t) & (tl.load(kth_ptr + 5 * row + 1) > 0))


@triton.jit
def _row_max_sum(stats_ptr, row, CM, C, CP2: tl.constexpr):
    ci = tl.arange(0, CP2)
    mcs = tl.load(stats_ptr + 2 * (row * CM + ci), mask=ci < C, other=float("-inf"))
    scs = tl.load(stats_ptr + 2 * (row * CM + ci) + 1, mask=ci < C, other=0.0)
    m = tl.max(mcs, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.sum(tl.where(scs > 0, scs * tl.exp(mcs - m), 0.0), 0)


@triton.jit(do_not_specialize=["paths"])
def _proposal_kernel(x_ptr, stride, V, ints_ptr, ints_stride, temp_ptr, min_p_ptr, stats_ptr, kth_ptr, cs_ptr,
                     cj_ptr, rowf_ptr, rowj_ptr, CM, C, paths, TOP_K: tl.constexpr, STAGE: tl.constexpr,
                     R: tl.constexpr, CP2: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    if _active(ints_ptr, ints_stride, rowf_ptr, row, paths, STAGE):
        m, z = _row_max_sum(stats_ptr, row, CM, C, CP2)
        temp = tl.load(temp_ptr + row)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=offs < V, other=float("-inf"))
        v = tl.math.div_rn(v.to(tl.float32), temp) + 0.0
        # the smallest prefix of the canonical order that min-p and top-k leave: every candidate passes both
        ok = (offs < V) & (tl.exp(v - m) >= tl.load(min_p_ptr + row))
        if TOP_K:
            k = tl.load(ints_ptr + 3 * ints_stride + row)
            if k < V:
                ok = ok & _in_top_k(_order_key(v), kth_ptr, row)
        if STAGE == 2:
            # only the tokens ahead of the first refused candidate: every token after it is refused too
            kb = tl.load(rowj_ptr + row * (R + 2) + R)
            jb = tl.load(rowj_ptr + row * (R + 2) + R + 1)
            key = _order_key(v)
            ok = ok & ((key > kb) | ((key == kb) & (offs < jb)))
        _proposals(offs, ok, tl.exp(m - v), _row_hash(ints_ptr, ints_stride, row).to(tl.uint32), cs_ptr, cj_ptr,
                   row * CM + c, R, (STAGE - 1) * R)


@triton.jit
def _candidate(cs_ptr, cj_ptr, row, CM, C, V, r, R: tl.constexpr, CP2: tl.constexpr):
    """Round r's candidate of the row: the least chunk score, its lowest id."""
    ci = tl.arange(0, CP2)
    s = tl.load(cs_ptr + (row * CM + ci) * R + r, mask=ci < C, other=float("inf"))
    j = tl.load(cj_ptr + (row * CM + ci) * R + r, mask=ci < C, other=2147483647)
    return tl.minimum(tl.min(tl.where(s == tl.min(s, 0), j, 2147483647), 0), V - 1)


@triton.jit(do_not_specialize=["paths"])
def _ahead_kernel(x_ptr, stride, V, ints_ptr, ints_stride, temp_ptr, stats_ptr, kth_ptr, cs_ptr, cj_ptr,
                  am_ptr, an_ptr, rowf_ptr, rowj_ptr, CM, C, paths, TOP_K: tl.constexpr,
                  STAGE: tl.constexpr, R: tl.constexpr, CP2: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    if _active(ints_ptr, ints_stride, rowf_ptr, row, paths, STAGE):
        m, z = _row_max_sum(stats_ptr, row, CM, C, CP2)
        temp = tl.load(temp_ptr + row)
        x_row = x_ptr + row.to(tl.int64) * stride
        offs = c * BLOCK + tl.arange(0, BLOCK)
        v = tl.math.div_rn(tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32), temp) + 0.0
        key = _order_key(v)
        w = tl.where(offs < V, tl.exp(v - m), 0.0)
        base = row * CM + c
        for r in tl.static_range(R):
            j = _candidate(cs_ptr, cj_ptr, row, CM, C, V, r, R, CP2)
            kj = _order_key(tl.math.div_rn(tl.load(x_row + j).to(tl.float32), temp) + 0.0)
            ahead = ((key > kj) | ((key == kj) & (offs < j))) & (offs < V)
            tl.store(am_ptr + base * (R + 1) + r, tl.sum(tl.where(ahead, w, 0.0), 0))
            tl.store(an_ptr + base * R + r, tl.sum(ahead.to(tl.int32), 0))
            if c == 0:
                tl.store(rowj_ptr + row * (R + 2) + r, j)
        if TOP_K and STAGE == 1:
            if tl.load(ints_ptr + 3 * ints_stride + row) < V:
                tl.store(am_ptr + base * (R + 1) + R, tl.sum(tl.where(key > tl.load(kth_ptr + 5 * row), w, 0.0), 0))
        if STAGE == 1:
            if c == 0:
                tl.store(rowf_ptr + 4 * row, m)
                tl.store(rowf_ptr + 4 * row + 1, z)


@triton.jit(do_not_specialize=["paths"])
def _decide_kernel(x_ptr, stride, V, ints_ptr, ints_stride, temp_ptr, top_p_ptr, min_p_ptr, kth_ptr, am_ptr,
                   an_ptr, rowf_ptr, rowj_ptr, out_ptr, thr_ptr, CM, C, paths, TOP_K: tl.constexpr,
                   STAGE: tl.constexpr, R: tl.constexpr, CP2: tl.constexpr):
    row = tl.program_id(0)
    if _active(ints_ptr, ints_stride, rowf_ptr, row, paths, STAGE):
        m = tl.load(rowf_ptr + 4 * row)
        zk = tl.load(rowf_ptr + 4 * row + 1 + STAGE - 1)      # stage 2: the top-k mass stage 1 found
        k = tl.load(ints_ptr + 3 * ints_stride + row)
        temp = tl.load(temp_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        minp = tl.load(min_p_ptr + row)
        ci = tl.arange(0, CP2)
        base = row * CM + ci
        if TOP_K and STAGE == 1:
            if k < V:
                kb = tl.load(kth_ptr + 5 * row)
                rem = tl.load(kth_ptr + 5 * row + 1)
                vk = tl.where(kb >= 0, kb, kb ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
                ak = tl.sum(tl.load(am_ptr + base * (R + 1) + R, mask=ci < C, other=0.0), 0)
                # c = 0 (the search ended on a full bin): t is no key of the top k, its weight is not wanted
                zk = ak + tl.where(rem > 0, rem.to(tl.float32) * tl.exp(vk - m), 0.0)
        tl.store(rowf_ptr + 4 * row + 2, zk)
        P = top_p * zk
        tok = tl.zeros((), tl.int32)
        used = tl.zeros((), tl.int32)
        first_n = tl.zeros((), tl.int64) + V            # the refused candidate first in the canonical order
        first_j = tl.zeros((), tl.int32)
        x_row = x_ptr + row.to(tl.int64) * stride
        for r in tl.static_range(R):
            a = tl.sum(tl.load(am_ptr + base * (R + 1) + r, mask=ci < C, other=0.0), 0)
            n = tl.sum(tl.load(an_ptr + base * R + r, mask=ci < C, other=0), 0).to(tl.int64)
            j = tl.load(rowj_ptr + row * (R + 2) + r)
            wj = tl.exp(tl.math.div_rn(tl.load(x_row + j).to(tl.float32), temp) + 0.0 - m)
            ok = (wj >= minp) & (n < k) & ((top_p >= 1.0) | (a < P) | (n == 0))
            take = ok & (used == 0)
            tok = tl.where(take, j, tok)
            used = tl.where(take, r + 1, used)
            first = (~ok) & (n < first_n)
            first_j = tl.where(first, j, first_j)
            first_n = tl.where(first, n, first_n)
        tl.store(thr_ptr + 2 * row, -1)
        tl.store(thr_ptr + 2 * row + 1, (used + tl.where(used > 0, (STAGE - 1) * R, 0)).to(tl.int64))
        tl.store(rowf_ptr + 4 * row + 3, (used == 0).to(tl.float32))     # stage 2's, then the fallback's flag
        if used > 0:
            tl.store(out_ptr + row, tok.to(tl.int64))
        else:
            vf = tl.math.div_rn(tl.load(x_row + first_j).to(tl.float32), temp) + 0.0
            tl.store(rowj_ptr + row * (R + 2) + R, _order_key(vf))
            tl.store(rowj_ptr + row * (R + 2) + R + 1, first_j)


# Under the interpreter every call of a jit helper re-patches the language (milliseconds), so the fallback's loads
# and order keys are written out in each of its ~32 passes, and sums use the builtin reductions.

@triton.jit(do_not_specialize=["paths"])
def _fallback_kernel(x_ptr, stride, V, ints_ptr, ints_stride, temp_ptr, top_p_ptr, min_p_ptr, rowf_ptr, out_ptr,
                     thr_ptr, paths, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if _selected(ints_ptr, ints_stride, row, paths):
        if tl.load(rowf_ptr + 4 * row + 3) > 0:
            _bisect_and_draw(x_ptr + row.to(tl.int64) * stride, V, row, ints_ptr, ints_stride, temp_ptr, top_p_ptr,
                             min_p_ptr, rowf_ptr, out_ptr, thr_ptr, BLOCK)


@triton.jit
def _cdf_step(w, offs, V, target, run, pick, last):
    """One chunk of an inverse-CDF draw over weights w (float64): the first index whose running sum passes
    `target`, and the last positive one (taken when rounding leaves the target past the whole sum)."""
    cs = run + tl.associative_scan(w, 0, _sum_combine)
    pick = tl.minimum(pick, tl.reduce(tl.where((w > 0) & (cs > target), offs, V), 0, _elementwise_min))
    last = tl.maximum(last, tl.reduce(tl.where(w > 0, offs, 0), 0, _elementwise_max))
    return run + tl.reduce(w, 0, _sum_combine), pick, last


@triton.jit
def _kept_chunk(x_row, offs, V, temp, m, hi, c, minp, seen):
    """Weights (float64, 0 where dropped) of one chunk of the fallback's kept set: keys above the boundary `hi`,
    the first `c` ties at it by id (`seen` ties came before this chunk), min-p; and the chunk's tie count."""
    v = tl.math.div_rn(tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32), temp) + 0.0
    b = v.to(tl.int32, bitcast=True)
    k = tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)
    tie = (k == hi) & (offs < V)
    rank = seen + tl.associative_scan(tie.to(tl.int32), 0, _sum_combine) - 1
    w = tl.exp(v - m)
    kept = ((k > hi) | (tie & (rank < c))) & (w >= minp) & (offs < V)
    return tl.where(kept, w, 0.0).to(tl.float64), tl.reduce(tie.to(tl.int32), 0, _sum_combine)


@triton.jit
def _mass_ahead(x_row, V, temp, m, key, BLOCK: tl.constexpr):
    """Mass and count of the keys above `key`."""
    acc = tl.zeros((), tl.float32)
    cnt = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.math.div_rn(tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32), temp) + 0.0
        b = v.to(tl.int32, bitcast=True)
        ahead = (tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64) > key) & (offs < V)
        acc += tl.reduce(tl.where(ahead, tl.exp(v - m), 0.0), 0, _sum_combine)
        cnt += tl.reduce(ahead.to(tl.int64), 0, _sum_combine)
    return acc, cnt


@triton.jit
def _bisect_and_draw(x_row, V, row, ints_ptr, ints_stride, temp_ptr, top_p_ptr, min_p_ptr, rowf_ptr, out_ptr,
                     thr_ptr, BLOCK: tl.constexpr):
    """The kept set's boundary itself, then one draw over it."""
    temp = tl.load(temp_ptr + row)
    minp = tl.load(min_p_ptr + row)
    k = tl.load(ints_ptr + 3 * ints_stride + row)
    m = tl.load(rowf_ptr + 4 * row)
    P = tl.load(top_p_ptr + row) * tl.load(rowf_ptr + 4 * row + 2)
    lo_v = tl.full((), float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.math.div_rn(tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32), temp) + 0.0
        lo_v = tl.minimum(lo_v, tl.reduce(tl.where(offs < V, v, float("inf")), 0, _elementwise_min))
    lo_v = tl.where(lo_v == float("-inf"), -3.0e38, lo_v)
    # bisection for the smallest key t with A(t) < P and N(t) < k (both hold at the max's key, neither below
    # every key): t is the key of the last kept token before min-p
    mv = (m + 0.0).to(tl.int32, bitcast=True)
    hi = tl.where(mv >= 0, mv, mv ^ 0x7FFFFFFF).to(tl.int64)
    lb = lo_v.to(tl.int32, bitcast=True)
    lo = tl.where(lb >= 0, lb, lb ^ 0x7FFFFFFF).to(tl.int64) - 1
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        a_mid, n_mid = _mass_ahead(x_row, V, temp, m, mid, BLOCK)
        if (a_mid < P) & (n_mid < k):
            hi = mid
        else:
            lo = mid
    a_t, n_above = _mass_ahead(x_row, V, temp, m, hi, BLOCK)
    # the tokens tied at t: their common weight, how many there are, how many of them the filters keep
    w_t = tl.zeros((), tl.float32)
    n_t = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.math.div_rn(tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32), temp) + 0.0
        b = v.to(tl.int32, bitcast=True)
        tie = (tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64) == hi) & (offs < V)
        w_t = tl.maximum(w_t, tl.reduce(tl.where(tie, tl.exp(v - m), 0.0), 0, _elementwise_max))
        n_t += tl.reduce(tie.to(tl.int32), 0, _sum_combine)
    c = tl.minimum(tl.maximum(tl.ceil((P - a_t) / tl.maximum(w_t, 1e-38)), 1.0), n_t.to(tl.float32)).to(tl.int32)
    c = tl.minimum(c, tl.maximum(k - n_above, 1).to(tl.int32))
    # two passes in vocabulary order (ties kept by increasing id): the kept mass, then the draw with u
    total = tl.zeros((), tl.float64)
    seen = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        kw, n = _kept_chunk(x_row, start + tl.arange(0, BLOCK), V, temp, m, hi, c, minp, seen)
        total += tl.reduce(kw, 0, _sum_combine)
        seen += n
    u = _uniform(_mix32(_row_hash(ints_ptr, ints_stride, row) ^ 0x2545F491))
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


# ---- the host side ---------------------------------------------------------------------------------------------
def chunk_block(V: int) -> int:
    """Tokens per program: 64 to 128 chunks per row (163,840 tokens: 80 of 2,048; 80 programs at batch 1, 5,120 at
    batch 64 over the H200's 132 SMs), at least 256 and at most 4,096 tokens each. A function of V alone: a row is
    split the same way in every batch, so its sums, and so its token, are bitwise the same alone or batched."""
    return max(256, min(4096, triton.next_power_of_2(-(-V // 128))))


@dataclass
class NucleusWork:
    """Preallocated workspaces of `nucleus_draw` for up to `max_rows` rows of `vocab` tokens (the chunk count of
    the smallest block): a call allocates nothing."""
    stats: torch.Tensor     # [R, CM, 2] fp32: chunk max, chunk sum of exp(v - chunk max)
    hist: torch.Tensor      # [R, 10, 256] int32: the k-th key's radix histograms and bin bounds (`_hist_row`)
    kth: torch.Tensor       # [R, 5] int32: the top-k threshold key, how many of its ties are in; the search's
                            # prefix so far, whether it is over, how many keys on the prefix it still counts
    cs: torch.Tensor        # [R, CM, ROUNDS] fp32: chunk race scores (least E / w)
    cj: torch.Tensor        # [R, CM, ROUNDS] int32: their ids
    am: torch.Tensor        # [R, CM, ROUNDS + 1] fp32: mass ahead of each candidate, mass above t
    an: torch.Tensor        # [R, CM, ROUNDS] int32: count ahead of each candidate
    rowf: torch.Tensor      # [R, 4] fp32: max, mass, top-k mass, fallback flag
    rowj: torch.Tensor      # [R, ROUNDS + 2] int32: the rounds' candidates, the first refused one's key and id
    thr: torch.Tensor       # [R, 2] int64: what `nucleus_draw` returns
    tick: torch.Tensor      # [R] int32: per row, the programs of the current top-k launch that are done with it

    @classmethod
    def allocate(cls, max_rows: int, vocab: int, device, rounds: int = ROUNDS, min_block: int = 64) -> "NucleusWork":
        cm = -(-vocab // min_block)
        f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
        n, r = max_rows, max(rounds, 1)
        hist = torch.zeros(n, 10, 256, **i32)           # as a call leaves it: counts 0, empty bounds
        hist[:, 4:7], hist[:, 7:] = 2 ** 31 - 1, -2 ** 31
        return cls(torch.zeros(n, cm, 2, **f32), hist, torch.zeros(n, 5, **i32),
                   torch.zeros(n, cm, r, **f32),
                   torch.zeros(n, cm, r, **i32), torch.zeros(n, cm, r + 1, **f32), torch.zeros(n, cm, r, **i32),
                   torch.zeros(n, 4, **f32), torch.zeros(n, r + 2, **i32),
                   torch.zeros(n, 2, dtype=torch.int64, device=device), torch.zeros(n, **i32))


def path_mask(which) -> int:
    """The launches' `paths` argument: bit p set for each path id p in `which` (0..30: an int32, and one bit
    test of the path each row's program has loaded anyway)."""
    which = tuple(which)
    if not which or any(not 0 <= int(p) <= 30 for p in which):
        raise ValueError(f"nucleus_draw serves one or more path ids in 0..30, not {which}")
    return sum(1 << int(p) for p in set(which))


def nucleus_draw(x: torch.Tensor, ints: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, which: tuple[int, ...], out: torch.Tensor, rounds: int = ROUNDS,
                 block: int | None = None, top_k: bool = True, work: NucleusWork | None = None,
                 fallback_block: int = 4096, sparse: int = SPARSE_KEYS,
                 window: int = FIRST_DIGIT_WINDOW) -> torch.Tensor:
    """Write the token of every row whose path (`ints[4]`) is one of `which` (path ids 0..30) into `out` (other
    rows are left as they are). x [B, V] (any float dtype, unit last stride); `ints` [5, B] int64 (key0, key1,
    position, top_k, path) and temperature, top_p, min_p fp32 [B], as `runtime/sampler.py` packs them; `top_k`:
    some row may have top_k < V (else the radix launches are left out). Returns [B, 2] int64 per row: (-1,
    round accepted, 1..2 * rounds) when a rejection round was accepted, else (order key of the boundary, how many
    tokens tied there are kept). `rounds` = 0 sends every row to the fallback (tests); `sparse`: a radix pass adds
    a chunk's keys that share the prefix one by one up to this many, else histograms them (tests force either);
    `window`: the first-digit bins the stats pass counts per chunk (tests force the whole-histogram pass with 1)."""
    B, V = x.shape
    assert x.stride(1) == 1 and ints.stride(1) == 1
    block = block or chunk_block(V)
    C = -(-V // block)
    if work is None:
        work = NucleusWork.allocate(B, V, x.device, rounds, block)
    CM = work.stats.shape[1]
    assert work.stats.shape[0] >= B and CM >= C and work.cs.shape[2] >= max(rounds, 1)
    R = rounds
    cp2 = max(16, triton.next_power_of_2(C))          # no degenerate one-element reductions
    paths = path_mask(which)       # a runtime argument: one compiled variant serves every set of paths
    warps = 8 if block >= 2048 else 4
    row_args = (x, x.stride(0), V, ints, ints.stride(0), temperature)
    grid = (B, C)
    _stats_kernel[grid](*row_args, work.stats, work.hist, work.kth, work.tick, CM, paths, TOP_K=top_k,
                        WINDOW=window, BLOCK=block, num_warps=warps)
    if top_k:
        _first_digit_kernel[(B, -(-C // RADIX_SUB))](*row_args, work.hist, work.kth, work.tick, paths,
                                                      SUB=RADIX_SUB, BLOCK=block, num_warps=warps)
        for d in (1, 2, 3):
            _radix_kernel[(B, -(-C // RADIX_SUB))](*row_args, work.stats, work.hist, work.kth, work.tick, CM, paths,
                                                    D=d, SPARSE=sparse, SUB=RADIX_SUB, BLOCK=block, num_warps=warps)
    for stage in (1, 2) if R > 0 else (1,):
        common = dict(TOP_K=top_k, STAGE=stage, R=R, CP2=cp2)
        if R > 0:
            _proposal_kernel[grid](*row_args, min_p, work.stats, work.kth, work.cs, work.cj, work.rowf, work.rowj,
                                   CM, C, paths, **common, BLOCK=block, num_warps=warps)
        _ahead_kernel[grid](*row_args, work.stats, work.kth, work.cs, work.cj, work.am, work.an, work.rowf,
                            work.rowj, CM, C, paths, **common, BLOCK=block, num_warps=warps)
        _decide_kernel[(B,)](*row_args, top_p, min_p, work.kth, work.am, work.an, work.rowf, work.rowj, out,
                             work.thr, CM, C, paths, **common, num_warps=4)
    fb = min(fallback_block, triton.next_power_of_2(V))
    _fallback_kernel[(B,)](*row_args, top_p, min_p, work.rowf, out, work.thr, paths, BLOCK=fb,
                           num_warps=8 if fb >= 2048 else 4)
    return work.thr[:B]
