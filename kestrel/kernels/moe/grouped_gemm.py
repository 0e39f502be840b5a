"""Grouped GEMM over experts: y[rows of e] = a[rows of e] @ W[e]^T, rows grouped by expert_offsets.

W is [E, N, K] (checkpoint layout: w13 [E, 2I, H], w2 [E, H, I]). Row p of the output (sorted order) reads
a[sorted_token_ids[p]] when GATHER (the first GEMM reads x by token id, no gathered copy) or a[p] otherwise
(the second GEMM, on the activation output).

Grid: M tiles x N tiles in one dimension, the N tiles of an M tile adjacent (`tile_of_program`). The M-tile
count is bounded on the host without reading the routing: sum_e ceil(n_e / BM) <= ceil(S / BM) + min(E, S). Each program finds its expert on the device: it loads the
E + 1 offsets, takes the cumulative tile counts, and counts how many experts end at or before its tile; programs
past the last real tile return at once. An expert's last tile holding at most half the rows runs at half height
(`TAIL_MIN_BM`: prefill's 128-row tiles), since a partly filled tile costs the MMA work of a full one: at an 8K
prompt over Kimi Linear's experts 21% of the tiles are such tails, and on the H200 w13 / w2 went from 475 / 410
to 486 / 423 TFLOP/s (benchmarks/results/h200_moe_gemm_tail_session13.json). fp32 accumulation, bf16
tensor-core dots on GPU (fp32 IEEE dots under the interpreter, whose bf16 dot is wrong).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kestrel.kernels import interpreting
from kestrel.kernels.moe._common import expert_tile, pow2, tile_of_program, tile_rows


@triton.jit
def _tile(a_ptr, rows_ptr, w_ptr, y_ptr, e, row0, row_hi, pid_n, N, K, s_a, s_we, s_wn, s_y, GATHER: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, F32_DOT: tl.constexpr):
    """One output tile: rows row0.. (< row_hi) of expert e against weight rows pid_n * BN.. over the whole K."""
    rm, mmask, src = tile_rows(rows_ptr, row0, row_hi, GATHER, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + src.to(tl.int64)[:, None] * s_a + rk[None, :]
    w_ptrs = w_ptr + e.to(tl.int64) * s_we + rn.to(tl.int64)[None, :] * s_wn + rk[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = rk + k0 < K
            a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
        if F32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BK
        w_ptrs += BK
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * s_y + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _grouped_gemm_kernel(a_ptr, rows_ptr, w_ptr, y_ptr, offs_ptr, E, N, K, s_a, s_we, s_wn, s_y,
                         GATHER: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, EVEN_K: tl.constexpr, F32_DOT: tl.constexpr, TAIL: tl.constexpr):
    pid_m, pid_n = tile_of_program(N, BN)
    e, row_hi, row0 = expert_tile(offs_ptr, E, pid_m, E_PAD, BM)
    if e >= E:
        return
    if TAIL and row_hi - row0 <= BM // 2:
        # an expert's last tile holding at most half the rows runs as a half-height tile: half the MMA work
        _tile(a_ptr, rows_ptr, w_ptr, y_ptr, e, row0, row_hi, pid_n, N, K, s_a, s_we, s_wn, s_y, GATHER, BM // 2,
              BN, BK, EVEN_K, F32_DOT)
    else:
        _tile(a_ptr, rows_ptr, w_ptr, y_ptr, e, row0, row_hi, pid_n, N, K, s_a, s_we, s_wn, s_y, GATHER, BM, BN,
              BK, EVEN_K, F32_DOT)


# The half-height tail tiles are taken from this M tile size up (prefill's 128-row tiles; decode's are mostly
# tails). An 8K-token prompt over Kimi Linear's 256 experts gives ~256 +- 16 rows an expert: 643 128-row tiles hold
# its 65,536 rows (80% full), 135 of them tails of at most 64 rows (133 of at most 32).
TAIL_MIN_BM = 128


def _config(S: int, E: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages), picked by the mean rows per expert (no autotune)."""
    if interpreting():
        return 16, min(64, pow2(N, 16)), min(64, pow2(K, 16)), 4, 1
    per_expert = S / max(1, min(E, S))
    if per_expert <= 16:
        return 16, 128, 64, 4, 5          # decode: weight-bandwidth bound, small M tiles
    if per_expert <= 64:
        return 64, 128, 64, 4, 4
    # H200, 8K-token prefill at Kimi Linear's widths (benchmarks/results/h200_moe_gemm_sweep.json): 477 / 427
    # TFLOP/s for w13 / w2 against 440 / 395 with 128 x 128 x 64, 8 warps, 3 stages (cuBLAS dense: 712)
    return 128, 256, 64, 8, 4


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor,
                 sorted_token_ids: torch.Tensor | None = None, num_rows: int | None = None,
                 out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 tma: bool | str | None = None) -> torch.Tensor:
    """a [T, K] (gathered by sorted_token_ids) or [S, K] (contiguous); w [E, N, K]; -> y [S, N] in sorted order.
    tma: None takes the module's TMA (env KESTREL_MOE_TMA); False / "off" the pointer kernel; True / "on" the
    TMA kernel; "persistent" the persistent TMA kernel. Where the descriptors do not apply (`_tma_ok`) the pointer
    kernel runs."""
    E, N, K = w.shape
    S = num_rows if num_rows is not None else (sorted_token_ids.numel() if sorted_token_ids is not None
                                                 else a.shape[0])
    if out is None:
        out = torch.empty((S, N), dtype=out_dtype or a.dtype, device=a.device)
    if S == 0:
        return out
    BM, BN, BK, warps, stages = _config(S, E, N, K)
    mode = _tma_mode(TMA if tma is None else tma)
    if mode != "off" and _tma_ok(w):
        return _grouped_gemm_tma(a, w, expert_offsets, sorted_token_ids, out, S, (BM, BN, BK, warps, stages),
                                 mode == "persistent")
    grid = ((triton.cdiv(S, BM) + min(E, S)) * triton.cdiv(N, BN),)        # tile_of_program's order
    gather = sorted_token_ids is not None
    _grouped_gemm_kernel[grid](
        a, sorted_token_ids if gather else expert_offsets, w, out, expert_offsets, E, N, K, a.stride(0),
        w.stride(0), w.stride(1), out.stride(0), GATHER=gather, E_PAD=pow2(E), BM=BM, BN=BN, BK=BK,
        EVEN_K=K % BK == 0, F32_DOT=interpreting(), TAIL=BM >= TAIL_MIN_BM, num_warps=warps, num_stages=stages)
    return out


# ---------------------------------------------------------------- TMA variants (off by default)

# "off" (the pointer kernel), "on" (TMA loads), "persistent" (TMA loads, one program a SM); the host's default for
# `grouped_gemm(tma=None)`. Off: the H200 sweep at the 8K-prefill shapes (128 x 256 x 64, 8 warps) measured w13
# pointer 486.8 / TMA 497.5 / persistent 473.1 TFLOP/s and w2 435.4 / 396.6 / 439.9 (3 stages), too little to carry
# a second kernel on the serving path (benchmarks/results/h200_moe_gemm_tma_session14.json)
TMA = os.environ.get("KESTREL_MOE_TMA", "off")
# the persistent kernel's knobs (the sweep sets them): flatten the tile and K loops into one software pipeline (the
# next tile's loads run under this tile's epilogue); store the accumulator in two column halves (halves the
# epilogue's shared-memory scratch, which the flattened pipeline's buffers stay live across)
PERSISTENT_FLATTEN = True
EPILOGUE_SPLIT = False
_SMS: dict[int, int] = {}


def _tma_mode(tma: bool | str) -> str:
    if tma is True or tma in ("1", "on", "tma"):
        return "on"
    if tma is False or tma in ("", "0", "off", "pointer"):
        return "off"
    if tma == "persistent":
        return tma
    raise ValueError(f"tma: expected off / on / persistent, got {tma!r}")


def _aligned(t: torch.Tensor) -> bool:
    """A 2-D view TMA can describe: last dim contiguous, base and row pitch 16-byte aligned."""
    es = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(-2) * es) % 16 == 0


def _tma_ok(w: torch.Tensor) -> bool:
    """The weight descriptor applies: W views as [E*N, K] (rows contiguous one after another, aligned), on Hopper or
    later, or under the interpreter (which runs descriptors, zero padding included)."""
    E, N, K = w.shape
    if not interpreting() and not (w.is_cuda and torch.cuda.get_device_capability(w.device)[0] >= 9):
        return False
    return w.stride(0) == N * w.stride(1) and _aligned(w[0])


def _num_sms(device: torch.device) -> int:
    if interpreting():
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


@triton.jit
def _tile_tma(a_ptr, a_desc, rows_ptr, w_desc, y_ptr, e, row0, row_hi, pid_n, N, K, s_a, s_y,
              GATHER: tl.constexpr, A_TMA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              EVEN_K: tl.constexpr, F32_DOT: tl.constexpr, SPLIT: tl.constexpr):
    """`_tile` with the weight tile (and, when A_TMA, the activation tile) loaded through descriptors."""
    rm, mmask, src = tile_rows(rows_ptr, row0, row_hi, GATHER, BM)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + src.to(tl.int64)[:, None] * s_a + rk[None, :]
    w_row = e * N + pid_n * BN
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if A_TMA:
            a = a_desc.load([row0, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=mmask[:, None] & (rk + k0 < K)[None, :], other=0.0)
        b = w_desc.load([w_row, k0])
        if F32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.T, acc)
        a_ptrs += BK
    _store_tile(y_ptr, acc, rm, mmask, pid_n, N, s_y, BM, BN, SPLIT)


@triton.jit
def _store_tile(y_ptr, acc, rm, mmask, pid_n, N, s_y, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """Masked store of an output tile: only this expert's rows and the real columns. SPLIT stores it in two column
    halves (half the layout-conversion scratch)."""
    y_rows = y_ptr + rm.to(tl.int64)[:, None] * s_y
    if SPLIT:
        acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        rn = pid_n * BN + tl.arange(0, BN // 2)
        tl.store(y_rows + rn[None, :], acc0.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & (rn < N)[None, :])
        rn += BN // 2
        tl.store(y_rows + rn[None, :], acc1.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & (rn < N)[None, :])
    else:
        rn = pid_n * BN + tl.arange(0, BN)
        tl.store(y_rows + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & (rn < N)[None, :])


@triton.jit
def _grouped_gemm_tma_kernel(a_ptr, a_desc, a_desc_half, rows_ptr, w_desc, y_ptr, offs_ptr, E, N, K, s_a, s_y,
                             GATHER: tl.constexpr, A_TMA: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, F32_DOT: tl.constexpr,
                             TAIL: tl.constexpr, SPLIT: tl.constexpr):
    pid_m, pid_n = tile_of_program(N, BN)
    e, row_hi, row0 = expert_tile(offs_ptr, E, pid_m, E_PAD, BM)
    if e >= E:
        return
    if TAIL and row_hi - row0 <= BM // 2:
        _tile_tma(a_ptr, a_desc_half, rows_ptr, w_desc, y_ptr, e, row0, row_hi, pid_n, N, K, s_a, s_y, GATHER,
                  A_TMA, BM // 2, BN, BK, EVEN_K, F32_DOT, SPLIT)
    else:
        _tile_tma(a_ptr, a_desc, rows_ptr, w_desc, y_ptr, e, row0, row_hi, pid_n, N, K, s_a, s_y, GATHER, A_TMA,
                  BM, BN, BK, EVEN_K, F32_DOT, SPLIT)


@triton.jit
def _grouped_gemm_persistent_kernel(a_ptr, a_desc, rows_ptr, w_desc, y_ptr, offs_ptr, E, N, K, s_a, s_y,
                                    NUM_PROGRAMS,
                                    GATHER: tl.constexpr, A_TMA: tl.constexpr, E_PAD: tl.constexpr,
                                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                                    F32_DOT: tl.constexpr, SPLIT: tl.constexpr, FLATTEN: tl.constexpr):
    """One program a SM over every real tile (M tiles x N tiles, the N tiles of an M tile adjacent as in
    `tile_of_program`). The expert map is `expert_tile`'s, taken once: each tile then costs three reductions."""
    ev = tl.arange(0, E_PAD)
    lo = tl.load(offs_ptr + ev, mask=ev < E, other=0)
    hi = tl.load(offs_ptr + ev + 1, mask=ev < E, other=0)
    tiles = (hi - lo + BM - 1) // BM
    ends = tl.cumsum(tiles, axis=0)
    base = lo - (ends - tiles) * BM          # tile m of expert e starts at row base[e] + m * BM
    nt = tl.cdiv(N, BN)
    total = tl.sum(tiles, axis=0) * nt
    for t in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m = t // nt
        pid_n = t % nt
        e = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
        row0 = tl.sum(tl.where(ev == e, base, 0), axis=0) + pid_m * BM
        row_hi = tl.sum(tl.where(ev == e, hi, 0), axis=0)
        _tile_tma(a_ptr, a_desc, rows_ptr, w_desc, y_ptr, e, row0, row_hi, pid_n, N, K, s_a, s_y, GATHER, A_TMA,
                  BM, BN, BK, EVEN_K, F32_DOT, SPLIT)


def _grouped_gemm_tma(a, w, expert_offsets, sorted_token_ids, out, S, cfg, persistent):
    from triton.tools.tensor_descriptor import TensorDescriptor
    E, N, K = w.shape
    BM, BN, BK, warps, stages = cfg
    gather = sorted_token_ids is not None
    w_desc = TensorDescriptor(w, [E * N, K], [w.stride(1), 1], [BN, BK])
    a_tma = not gather and _aligned(a)
    tail = BM >= TAIL_MIN_BM and not persistent
    a_desc = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [BM, BK]) if a_tma else None
    a_half = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [BM // 2, BK]) if a_tma and tail else None
    rows = sorted_token_ids if gather else expert_offsets
    common = dict(GATHER=gather, A_TMA=a_tma, E_PAD=pow2(E), BM=BM, BN=BN, BK=BK, EVEN_K=K % BK == 0,
                  F32_DOT=interpreting(), SPLIT=EPILOGUE_SPLIT and BN >= 32, num_warps=warps, num_stages=stages)
    tiles = (triton.cdiv(S, BM) + min(E, S)) * triton.cdiv(N, BN)          # the bound of `grouped_gemm`'s grid
    if persistent:
        progs = min(_num_sms(a.device), tiles)
        _grouped_gemm_persistent_kernel[(progs,)](
            a, a_desc, rows, w_desc, out, expert_offsets, E, N, K, a.stride(0), out.stride(0), progs,
            FLATTEN=PERSISTENT_FLATTEN, **common)
    else:
        _grouped_gemm_tma_kernel[(tiles,)](
            a, a_desc, a_half, rows, w_desc, out, expert_offsets, E, N, K, a.stride(0), out.stride(0), TAIL=tail,
            **common)
    return out
