"""The bf16 experts' decode GEMMs as GEMVs: when every expert holds a few rows (decode at batch 1..8: one row per
routed expert, the batch's rows on the shared expert), a program streams BN weight rows of one expert once and
applies them to all of that expert's rows with fp32 FMAs, instead of padding them into 16-row tensor-core tiles.

One program: up to ROWS rows of one expert (a tile of `expert_tile` with BM = ROWS; ROWS is at least the rows any
expert holds when the caller's bound is right, so each touched expert is one tile and each weight byte is read
once; an expert with more rows takes several tiles, still correct), BN weight rows, the whole K (no split: the
touched experts x N / BN programs already fill the GPU). Per K step of BK it loads the weight tile [BN, BK] (8 bf16
= one 16-byte load per thread, a warp's lanes along K, warps along N) and each live row's activation in the same
[BN, BK] shape (so it shares the weights' layout and needs no conversion; the repeats along N are one load in the
SASS), and sums each thread's 8 products (a reshape to [BN, BK / 8, 8], reduced over the last axis inside the
thread): the partial sums [BN, BK / 8] stay in registers over the K loop and cross lanes once at the end. Rows
past the tile's live rows skip their FMAs (a runtime branch: a routed expert at batch 8 holds one row, the shared
one eight). The K loop is a `tl.range` of STAGES stages: Triton 3.6 pipelines the weight loads through shared
memory (cp.async, LDGSTS in the sm_90 SASS), so each program keeps STAGES - 1 steps of weights in flight while it
sums one (a load issued before the FMAs by hand is sunk after them by ptxas).

GLU variant (w13 [E, 2I, K], gathering x by token id): the gate and up rows of the same BN intermediate columns,
two accumulators per row, each row's activation loaded once for both; `glu_epilogue` rounds gate and up to x's
dtype before the activation, as MoeGroupedGemmGlu does. Plain variant (w2 [E, N, K] on the sorted rows): bf16 of
the fp32 sum. Both equal the grouped GEMMs up to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels import interpreting
from kestrel.kernels.activation.glu import ACTS, glu_epilogue
from kestrel.kernels.moe._common import expert_tile, pow2
from kestrel.kernels.norm.rmsnorm import _bf16_rne
from kestrel.kernels.quant.w4a16_gemv import decode_tiles

MAX_ROWS = 8            # rows per program at most: 8 rows x 2 accumulators of [BN, BK / 8] stay in registers


@triton.jit
def _row_source(rows_ptr, row0, r: tl.constexpr, live, GATHER: tl.constexpr):
    """The activation row tile row r reads (its token id when GATHER); a row past the live ones reads row0's (real
    memory; it is never computed nor stored)."""
    row = tl.where(r < live, row0 + r, row0)
    if GATHER:
        row = tl.load(rows_ptr + row)
    return row.to(tl.int64)


@triton.jit
def _load_w(ptrs, k0, kx, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs + k0)
    return tl.load(ptrs + k0, mask=k0 + kx < K, other=0.0)


@triton.jit
def _partial(p):
    """[BN, BK] products -> [BN, BK / 8] sums of each thread's own 8 (the load's 16-byte vector): no lane crossing."""
    return tl.sum(tl.reshape(p, (p.shape[0], p.shape[1] // 8, 8)), axis=2)


@triton.jit
def _row_step(wg, wu, x_ptr, src, s_x, k0, kx, K, g, u, GLU: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step of one row: g (u) += the per-thread partial dot of its activation with the gate (up) tile."""
    ptrs = x_ptr + src * s_x + k0 + kx
    if EVEN_K:
        x = tl.load(ptrs).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=k0 + kx < K, other=0.0).to(tl.float32)
    g += _partial(wg * x)
    if GLU:
        u += _partial(wu * x)
    return g, u


@triton.jit
def _store_row(y_ptr, row, s_y, rn, nmask, g, u, beta, lin_beta, GLU: tl.constexpr, ACT: tl.constexpr,
               RNE_BF16: tl.constexpr):
    dt = y_ptr.dtype.element_ty
    h = tl.sum(g, axis=1)
    if GLU:
        h = glu_epilogue(h, tl.sum(u, axis=1), beta, lin_beta, ACT, dt, RNE_BF16)
    if RNE_BF16:
        h = _bf16_rne(h)            # the interpreter's cast truncates; the GPU's rounds to nearest even
    tl.store(y_ptr + row.to(tl.int64) * s_y + rn, h.to(dt), mask=nmask)


@triton.jit
def _expert_gemv_kernel(x_ptr, rows_ptr, w_ptr, y_ptr, offs_ptr, E, N, K, s_x, s_we, s_wn, s_y, beta, lin_beta,
                        GLU: tl.constexpr, GATHER: tl.constexpr, ACT: tl.constexpr, E_PAD: tl.constexpr,
                        ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                        RNE_BF16: tl.constexpr, STAGES: tl.constexpr):
    e, row_hi, row0 = expert_tile(offs_ptr, E, tl.program_id(0), E_PAD, ROWS)
    if e >= E:
        return
    live = tl.minimum(row_hi - row0, ROWS)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = rn < N
    rw = tl.minimum(rn, N - 1)                  # rows past N read the last one (no load mask; never stored)
    kx = tl.arange(0, BK)[None, :]
    kxb = kx + tl.zeros([BN, 1], dtype=tl.int32)      # the activations loaded in the weight tile's shape: the same
                                                      # layout, so no conversion per row (repeats merge in LLVM)
    g_ptrs = w_ptr + e.to(tl.int64) * s_we + rw.to(tl.int64)[:, None] * s_wn + kx
    u_ptrs = g_ptrs + N * s_wn                  # GLU: the up rows I + rn (N = I)
    src0 = _row_source(rows_ptr, row0, 0, live, GATHER)
    src1 = _row_source(rows_ptr, row0, 1, live, GATHER)
    src2 = _row_source(rows_ptr, row0, 2, live, GATHER)
    src3 = _row_source(rows_ptr, row0, 3, live, GATHER)
    src4 = _row_source(rows_ptr, row0, 4, live, GATHER)
    src5 = _row_source(rows_ptr, row0, 5, live, GATHER)
    src6 = _row_source(rows_ptr, row0, 6, live, GATHER)
    src7 = _row_source(rows_ptr, row0, 7, live, GATHER)
    z = tl.zeros([BN, BK // 8], dtype=tl.float32)
    g0, g1, g2, g3, g4, g5, g6, g7 = z, z, z, z, z, z, z, z
    u0, u1, u2, u3, u4, u5, u6, u7 = z, z, z, z, z, z, z, z
    for k0 in tl.range(0, K, BK, num_stages=STAGES):     # the weight loads pipelined (cp.async) STAGES deep
        wg = _load_w(g_ptrs, k0, kx, K, EVEN_K)
        wu = wg
        if GLU:
            wu = _load_w(u_ptrs, k0, kx, K, EVEN_K)
        wg = wg.to(tl.float32)             # widened once for every row
        wu = wu.to(tl.float32)
        g0, u0 = _row_step(wg, wu, x_ptr, src0, s_x, k0, kxb, K, g0, u0, GLU, EVEN_K)
        if ROWS > 1:
            if live > 1:
                g1, u1 = _row_step(wg, wu, x_ptr, src1, s_x, k0, kxb, K, g1, u1, GLU, EVEN_K)
        if ROWS > 2:
            if live > 2:
                g2, u2 = _row_step(wg, wu, x_ptr, src2, s_x, k0, kxb, K, g2, u2, GLU, EVEN_K)
            if live > 3:
                g3, u3 = _row_step(wg, wu, x_ptr, src3, s_x, k0, kxb, K, g3, u3, GLU, EVEN_K)
        if ROWS > 4:
            if live > 4:
                g4, u4 = _row_step(wg, wu, x_ptr, src4, s_x, k0, kxb, K, g4, u4, GLU, EVEN_K)
            if live > 5:
                g5, u5 = _row_step(wg, wu, x_ptr, src5, s_x, k0, kxb, K, g5, u5, GLU, EVEN_K)
            if live > 6:
                g6, u6 = _row_step(wg, wu, x_ptr, src6, s_x, k0, kxb, K, g6, u6, GLU, EVEN_K)
            if live > 7:
                g7, u7 = _row_step(wg, wu, x_ptr, src7, s_x, k0, kxb, K, g7, u7, GLU, EVEN_K)
    _store_row(y_ptr, row0, s_y, rn, nmask, g0, u0, beta, lin_beta, GLU, ACT, RNE_BF16)
    if ROWS > 1:
        if live > 1:
            _store_row(y_ptr, row0 + 1, s_y, rn, nmask, g1, u1, beta, lin_beta, GLU, ACT, RNE_BF16)
    if ROWS > 2:
        if live > 2:
            _store_row(y_ptr, row0 + 2, s_y, rn, nmask, g2, u2, beta, lin_beta, GLU, ACT, RNE_BF16)
        if live > 3:
            _store_row(y_ptr, row0 + 3, s_y, rn, nmask, g3, u3, beta, lin_beta, GLU, ACT, RNE_BF16)
    if ROWS > 4:
        if live > 4:
            _store_row(y_ptr, row0 + 4, s_y, rn, nmask, g4, u4, beta, lin_beta, GLU, ACT, RNE_BF16)
        if live > 5:
            _store_row(y_ptr, row0 + 5, s_y, rn, nmask, g5, u5, beta, lin_beta, GLU, ACT, RNE_BF16)
        if live > 6:
            _store_row(y_ptr, row0 + 6, s_y, rn, nmask, g6, u6, beta, lin_beta, GLU, ACT, RNE_BF16)
        if live > 7:
            _store_row(y_ptr, row0 + 7, s_y, rn, nmask, g7, u7, beta, lin_beta, GLU, ACT, RNE_BF16)


def gemv_rows(max_rows: int) -> int:
    """Rows per program for a step whose experts hold at most `max_rows` rows (1, 2, 4 or 8)."""
    return min(MAX_ROWS, pow2(max_rows))


def gemv_config(glu: bool, rows: int, N: int, K: int) -> tuple[int, int, int, int]:
    """(BN, BK, num_warps, stages), no autotune (benchmarks/moe_gemv_bench.py --sweep times a grid). BK = 256: a
    warp's 32 lanes x 8 bf16 span one K step of a weight row, so warps run along N and each thread's activation
    serves BN / 4 weight rows. Stage buffers are BN x 256 bf16 a weight tile (x 2 for the GLU's gate and up).
    One row a program (batch 1): BN 16 for the GLU (2 x 16 weight rows) and 32 for the plain GEMV, 2 stages:
    24 / 32 KB of shared memory and 62 / 96 registers (sm_90 ptxas, Triton 3.6), so 8 / 5 programs fit an SM and
    kl8's 576 (GLU) and 648 (w2) programs over 9 experts are all resident at once (3 stages would leave a second
    wave). More rows (batch
    >= 2: 17+ experts, thousands of programs): half those BN (8 rows' accumulators at <= 124 registers, no
    spills) and 3 stages, two K steps in flight beyond the one being summed (24 / 32 KB)."""
    if interpreting():
        return min(16, pow2(N, 4)), min(64, pow2(K, 8)), 4, 1
    bk = 256 if K >= 256 else pow2(K, 8)
    if rows == 1:
        return (16 if glu else 32), bk, 4, 2
    return (8 if glu else 16), bk, 4, 3


def expert_gemv(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor, max_rows: int,
                sorted_token_ids: torch.Tensor | None = None, glu: bool = False, act: str = "silu",
                beta: float = 4.0, linear_beta: float = 25.0, out: torch.Tensor | None = None,
                config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """GLU: x [T, K] gathered by sorted_token_ids [S], w [E, 2I, K] -> h [S, I]; plain: x [S, K] in sorted order,
    w [E, N, K] -> y [S, N]. Output in x's dtype. `max_rows` bounds the rows of any expert (the step's token
    count); `config` overrides (BN, BK, num_warps, stages) (BN, BK powers of two, BK >= 8)."""
    E, rows_w, K = w.shape
    N = rows_w // 2 if glu else rows_w
    S = sorted_token_ids.numel() if sorted_token_ids is not None else x.shape[0]
    if out is None:
        out = torch.empty((S, N), dtype=x.dtype, device=x.device)
    if S == 0:
        return out
    rows = gemv_rows(max_rows)
    BN, BK, warps, stages = config or gemv_config(glu, rows, N, K)
    gather = sorted_token_ids is not None
    grid = (decode_tiles(S, E, True, rows), triton.cdiv(N, BN))
    _expert_gemv_kernel[grid](
        x, sorted_token_ids if gather else expert_offsets, w, out, expert_offsets, E, N, K, x.stride(0),
        w.stride(0), w.stride(1), out.stride(0), float(beta), float(linear_beta), GLU=glu, GATHER=gather,
        ACT=ACTS[act], E_PAD=pow2(E), ROWS=rows, BN=BN, BK=BK, EVEN_K=K % BK == 0,
        RNE_BF16=interpreting() and x.dtype == torch.bfloat16, STAGES=stages, num_warps=warps)
    return out
