"""W4A16 FMA decode path: the FP4 grouped (and dense) GEMM when each expert holds a few rows, as a GEMV-like stream
over each touched expert's packed bytes with fp32 FMA accumulation. The host picks it at one row per touched
expert, and the one-row experts of a split decode (w4a16.decode_path "split", up to 3 rows per touched expert), and
the tensor-core decode kernel (w4a16_tc.py: ~3.2-3.5 sm_90 instructions per weight against this kernel's ~4.8 at one
row and ~6.6 at two) the rest (on the H200 this kernel led at one row, 57-65% of copy bandwidth against 33-47% at
K3's widths, and trailed from two); config BM 1, 2 or 4 selects it anyway.

One program: ROWS rows of one expert (a tile of `expert_tile`; an expert with more rows takes several tiles, whose
repeated weight reads run side by side and mostly hit L2), BN weight rows, one K range. Per K step it loads the
packed weights as uint32 words [BN, K blocks, words per block] (16-byte loads for MXFP4, 8 for NVFP4) and the
block scales once per 32 (16) values, and for each row the activation as bf16 pairs (uint32 words: element 2c is the
low half, 2c+1 the high one, so bf16 -> fp32 is a shift or a mask, and no even/odd interleave is ever built).

Nibble decode: element 8j + i of the K row is nibble i of word j (bytes little-endian, the low nibble first).
Nibbles i and i + 4 (16 bits apart) are isolated with one mask; the isolated word times (2**a + 2**(a + 6)) holds
one nibble's three magnitude bits at fp32 bits 22..24 and its sign at bit 31 (the two copies do not overlap, so the
product is their OR) and one more mask leaves an fp32 equal to e2m1 * 2**-126 (code 1, 0.5, an fp32 subnormal:
Triton's FMAs keep subnormals): about 2.6 integer instructions per weight (sm_90 SASS: LOP3, IMAD, LOP3 per nibble,
one shift a word for the upper nibbles), one FFMA per weight and row (`tl.fma`: Triton 3.9 left the product and the
sum unfused, two instructions). The activation carries
2**63 and the block scale the other 2**63, so no product is subnormal and the scale, applied once per block to the
block's partial sum, restores e2m1 * scale * x exactly as the reference's fp32 product (the sum order differs).
NVFP4's per-row tensor scale is applied to the finished row (divided or multiplied as `tensor_scale`).

K can be split over a third grid axis into an fp32 workspace (summed in a fixed order on the host), for dense
decode projections whose rows alone give too few programs. The GLU variant reads the gate and up rows of the same
intermediate columns, keeps two accumulators per row and applies `glu_epilogue` (K is never split there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.activation.glu import glu_epilogue
from kestrel.kernels.moe._common import expert_tile_sel, pow2

TWO63: tl.constexpr = tl.constexpr(9.223372036854775808e18)
ROW_CHOICES = (1, 2, 4)          # rows per program of the decode kernels (the config's first field)


@triton.jit
def _nibbles(w, J: tl.constexpr):
    """Elements 8j + J and 8j + J + 4 of packed uint32 words w (nibbles J and J + 4, 16 bits apart, isolated by one
    mask) as fp32 = e2m1 * 2**-126, sign included. Nibble n times (2**a + 2**(a + 6)) puts its magnitude at bits
    22..24 and its sign at 31 (the copies do not overlap, so the product is their OR); the other nibble lands
    either past bit 31 (dropped) or below bit 16 (masked off). Nibbles 2, 3, 6, 7 are nibbles 0, 1, 4, 5 of
    w >> 8 (one shift a word, shared by J = 2 and 3), so every nibble is placed by a multiply alone."""
    if J >= 2:
        lo, hi = _nibbles(w >> 8, J - 2)
    else:
        u = w & (0x000F000F << (4 * J))
        lo = ((u * ((1 << (22 - 4 * J)) + (1 << (28 - 4 * J)))) & 0x81C00000).to(tl.float32, bitcast=True)
        hi = ((u * ((1 << (6 - 4 * J)) + (1 << (12 - 4 * J)))) & 0x81C00000).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _pair_lo(a):
    """The even element of bf16 pairs (uint32 words) as fp32 times 2**63."""
    return (a << 16).to(tl.float32, bitcast=True) * TWO63


@triton.jit
def _pair_hi(a):
    return (a & 0xFFFF0000).to(tl.float32, bitcast=True) * TWO63


@triton.jit
def weight_words(q_ptr, s_ptr, e, rn, nmask, kw, s_qe, s_qn, s_se, s_sn, NVFP4: tl.constexpr, NB: tl.constexpr,
                 WPB: tl.constexpr):
    """One K step of weight rows rn of expert e from packed word kw on: the words [BN, NB * WPB] (uint32; a 2D
    tile contiguous along K, so that lanes run along K and each thread's activation serves several weight rows)
    and the block scales [BN, NB] as fp32 multipliers carrying 2**63 (rows past nmask read as zero)."""
    G: tl.constexpr = 8 * WPB
    q = q_ptr + e.to(tl.int64) * s_qe + rn.to(tl.int64)[:, None] * s_qn + kw + tl.arange(0, NB * WPB)[None, :]
    w = tl.load(q, mask=nmask[:, None], other=0).to(tl.uint32, bitcast=True)
    s = tl.load(s_ptr + e.to(tl.int64) * s_se + rn.to(tl.int64)[:, None] * s_sn + (kw * 8 // G + tl.arange(0, NB))[None, :],
                mask=nmask[:, None])
    if NVFP4:
        s = s.to(tl.float32) * TWO63
    else:
        s = ((s.to(tl.int32) + 63) << 23).to(tl.float32, bitcast=True)        # 2**(code - 127) * 2**63
    return w, s


@triton.jit
def _act(x_ptr, src, s_x, kw, BKW: tl.constexpr):
    """Row src's activation for packed words kw.. kw + BKW: the 4 bf16 pairs of each word (uint32 [1, BKW] each;
    pair c of word j is elements 8j + 2c, 8j + 2c + 1)."""
    a = x_ptr + src.to(tl.int64) * s_x + 4 * kw + tl.arange(0, BKW) * 4
    return (tl.load(a).to(tl.uint32, bitcast=True)[None, :], tl.load(a + 1).to(tl.uint32, bitcast=True)[None, :],
            tl.load(a + 2).to(tl.uint32, bitcast=True)[None, :], tl.load(a + 3).to(tl.uint32, bitcast=True)[None, :])


@triton.jit
def _fma2(p, qa, qb, x, J: tl.constexpr):
    """p + the products of nibbles J and J + 4 (qa, qb) with their activations: elements 8j + J and 8j + J + 4 are
    pair J // 2 and J // 2 + 2, low half for even J."""
    if J % 2 == 0:
        return tl.fma(qb, _pair_lo(x[J // 2 + 2]), tl.fma(qa, _pair_lo(x[J // 2]), p))
    return tl.fma(qb, _pair_hi(x[J // 2 + 2]), tl.fma(qa, _pair_hi(x[J // 2]), p))


@triton.jit
def _blocks(p, s, NB: tl.constexpr, WPB: tl.constexpr):
    """Per-word partial sums [BN, NB * WPB] -> per scale block, scaled: [BN, NB]."""
    return tl.sum(tl.reshape(p, (p.shape[0], NB, WPB)), axis=2) * s


@triton.jit
def rows_step(w, s, x_ptr, src0, src1, src2, src3, s_x, kw, acc0, acc1, acc2, acc3, ROWS: tl.constexpr,
              NB: tl.constexpr, WPB: tl.constexpr):
    """One K step for up to 4 rows: acc_r += sum over the step of dequant(w) * x[src_r] per weight row and block.
    Each decoded nibble pair feeds every row's FMAs at once, so no decoded tile is ever held whole in registers.
    x_ptr points at the activation as bf16 pairs (int32 words, row stride s_x)."""
    BKW: tl.constexpr = NB * WPB
    x0 = _act(x_ptr, src0, s_x, kw, BKW)
    p0 = tl.zeros(w.shape, dtype=tl.float32)
    if ROWS > 1:
        x1 = _act(x_ptr, src1, s_x, kw, BKW)
        p1 = tl.zeros(w.shape, dtype=tl.float32)
    if ROWS > 2:
        x2 = _act(x_ptr, src2, s_x, kw, BKW)
        x3 = _act(x_ptr, src3, s_x, kw, BKW)
        p2 = tl.zeros(w.shape, dtype=tl.float32)
        p3 = tl.zeros(w.shape, dtype=tl.float32)
    for J in tl.static_range(4):
        qa, qb = _nibbles(w, J)
        p0 = _fma2(p0, qa, qb, x0, J)
        if ROWS > 1:
            p1 = _fma2(p1, qa, qb, x1, J)
        if ROWS > 2:
            p2 = _fma2(p2, qa, qb, x2, J)
            p3 = _fma2(p3, qa, qb, x3, J)
    acc0 += _blocks(p0, s, NB, WPB)
    if ROWS > 1:
        acc1 += _blocks(p1, s, NB, WPB)
    if ROWS > 2:
        acc2 += _blocks(p2, s, NB, WPB)
        acc3 += _blocks(p3, s, NB, WPB)
    return acc0, acc1, acc2, acc3


@triton.jit
def _row_source(rows_ptr, row0, r: tl.constexpr, live, GATHER: tl.constexpr):
    """The activation row that tile row r reads: row0 + r's (its token id when GATHER); a row past the tile's
    live rows reads row0's (real memory, its sums are never stored), so no load needs a mask."""
    row = tl.where(r < live, row0 + r, row0)
    if GATHER:
        return tl.load(rows_ptr + row)
    return row


@triton.jit
def _finish(acc, g_ptr, e, s_ge, rn, nmask, NVFP4: tl.constexpr, DIVISOR: tl.constexpr):
    """A row's [BN, NB] partial sums -> [BN] with NVFP4's per-row tensor scale applied (as `tensor_scale`)."""
    y = tl.sum(acc, axis=1)
    if NVFP4:
        g = tl.load(g_ptr + e.to(tl.int64) * s_ge + rn, mask=nmask, other=1.0)
        if DIVISOR:
            y = tl.math.div_rn(y, g)
        else:
            y = y * g
    return y


@triton.jit
def _tile_of(offs_ptr, E, M, pid, GROUPED: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr,
             SEL: tl.constexpr):
    """(expert, first row, number of live rows <= ROWS) of decode tile pid (over the experts SEL picks, as
    `expert_tile_sel`)."""
    if GROUPED:
        e, row_hi, row0 = expert_tile_sel(offs_ptr, E, pid, E_PAD, ROWS, SEL)
    else:
        e = 0
        row0 = pid * ROWS
        row_hi = M
    return e, row0, tl.minimum(row_hi - row0, ROWS)


@triton.jit
def _w4a16_gemv_kernel(x_ptr, rows_ptr, q_ptr, s_ptr, g_ptr, y_ptr, offs_ptr, M, E, N, KW, KW_SPLIT, s_x, s_qe,
                       s_qn, s_se, s_sn, s_ge, s_y, s_ys, GROUPED: tl.constexpr, GATHER: tl.constexpr,
                       NVFP4: tl.constexpr, DIVISOR: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, SEL: tl.constexpr):
    WPB: tl.constexpr = 2 if NVFP4 else 4           # packed words per scale block
    NB: tl.constexpr = BK // (8 * WPB)
    e, row0, live = _tile_of(offs_ptr, E, M, tl.program_id(0), GROUPED, E_PAD, ROWS, SEL)
    if e >= E:
        return
    pid_k = tl.program_id(2)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = rn < N
    src0 = _row_source(rows_ptr, row0, 0, live, GATHER)
    src1 = _row_source(rows_ptr, row0, 1, live, GATHER)
    src2 = _row_source(rows_ptr, row0, 2, live, GATHER)
    src3 = _row_source(rows_ptr, row0, 3, live, GATHER)
    acc0 = tl.zeros([BN, NB], dtype=tl.float32)
    acc1 = tl.zeros([BN, NB], dtype=tl.float32)
    acc2 = tl.zeros([BN, NB], dtype=tl.float32)
    acc3 = tl.zeros([BN, NB], dtype=tl.float32)
    kw_lo = pid_k * KW_SPLIT
    kw_hi = tl.minimum(kw_lo + KW_SPLIT, KW)
    # the next K step's words are loaded before this one's FMAs (Triton does not pipeline loads that feed no dot):
    # twice the bytes in flight per thread; the last step reloads itself (an L1 / L2 hit) instead of a mask
    w, s = weight_words(q_ptr, s_ptr, e, rn, nmask, kw_lo, s_qe, s_qn, s_se, s_sn, NVFP4, NB, WPB)
    for kw in range(kw_lo, kw_hi, BK // 8):
        w_next, s_next = weight_words(q_ptr, s_ptr, e, rn, nmask, tl.minimum(kw + BK // 8, kw_hi - BK // 8), s_qe,
                                      s_qn, s_se, s_sn, NVFP4, NB, WPB)
        acc0, acc1, acc2, acc3 = rows_step(w, s, x_ptr, src0, src1, src2, src3, s_x, kw, acc0, acc1, acc2, acc3,
                                           ROWS, NB, WPB)
        w, s = w_next, s_next
    y = y_ptr + pid_k.to(tl.int64) * s_ys + row0.to(tl.int64) * s_y + rn
    dt = y_ptr.dtype.element_ty
    tl.store(y, _finish(acc0, g_ptr, e, s_ge, rn, nmask, NVFP4, DIVISOR).to(dt), mask=nmask)
    if ROWS > 1:
        tl.store(y + s_y, _finish(acc1, g_ptr, e, s_ge, rn, nmask, NVFP4, DIVISOR).to(dt), mask=nmask & (rn * 0 + live > 1))
    if ROWS > 2:
        tl.store(y + 2 * s_y, _finish(acc2, g_ptr, e, s_ge, rn, nmask, NVFP4, DIVISOR).to(dt),
                 mask=nmask & (rn * 0 + live > 2))
        tl.store(y + 3 * s_y, _finish(acc3, g_ptr, e, s_ge, rn, nmask, NVFP4, DIVISOR).to(dt),
                 mask=nmask & (rn * 0 + live > 3))


@triton.jit
def _glu_row(acc_g, acc_u, g_ptr, e, s_ge, rn, I, nmask, beta, lin_beta, NVFP4: tl.constexpr,
             DIVISOR: tl.constexpr, ACT: tl.constexpr, DT: tl.constexpr, RNE_BF16: tl.constexpr):
    g = _finish(acc_g, g_ptr, e, s_ge, rn, nmask, NVFP4, DIVISOR)
    u = _finish(acc_u, g_ptr, e, s_ge, I + rn, nmask, NVFP4, DIVISOR)
    return glu_epilogue(g, u, beta, lin_beta, ACT, DT, RNE_BF16).to(DT)


@triton.jit
def _w4a16_gemv_glu_kernel(x_ptr, rows_ptr, q_ptr, s_ptr, g_ptr, y_ptr, offs_ptr, E, I, KW, s_x, s_qe, s_qn, s_se,
                           s_sn, s_ge, s_y, beta, lin_beta, ACT: tl.constexpr, NVFP4: tl.constexpr,
                           DIVISOR: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, RNE_BF16: tl.constexpr, SEL: tl.constexpr):
    WPB: tl.constexpr = 2 if NVFP4 else 4
    NB: tl.constexpr = BK // (8 * WPB)
    e, row0, live = _tile_of(offs_ptr, E, 0, tl.program_id(0), True, E_PAD, ROWS, SEL)
    if e >= E:
        return
    rn = tl.program_id(1) * BN + tl.arange(0, BN)       # intermediate columns: gate rows rn, up rows I + rn
    nmask = rn < I
    src0 = _row_source(rows_ptr, row0, 0, live, True)
    src1 = _row_source(rows_ptr, row0, 1, live, True)
    src2 = _row_source(rows_ptr, row0, 2, live, True)
    src3 = _row_source(rows_ptr, row0, 3, live, True)
    g0 = tl.zeros([BN, NB], dtype=tl.float32)
    u0 = tl.zeros([BN, NB], dtype=tl.float32)
    g1 = tl.zeros([BN, NB], dtype=tl.float32)
    u1 = tl.zeros([BN, NB], dtype=tl.float32)
    g2 = tl.zeros([BN, NB], dtype=tl.float32)
    u2 = tl.zeros([BN, NB], dtype=tl.float32)
    g3 = tl.zeros([BN, NB], dtype=tl.float32)
    u3 = tl.zeros([BN, NB], dtype=tl.float32)
    wg, sg = weight_words(q_ptr, s_ptr, e, rn, nmask, 0, s_qe, s_qn, s_se, s_sn, NVFP4, NB, WPB)
    wu, su = weight_words(q_ptr, s_ptr, e, I + rn, nmask, 0, s_qe, s_qn, s_se, s_sn, NVFP4, NB, WPB)
    for kw in range(0, KW, BK // 8):
        kn = tl.minimum(kw + BK // 8, KW - BK // 8)           # the next K step, loaded ahead (as above)
        wg_next, sg_next = weight_words(q_ptr, s_ptr, e, rn, nmask, kn, s_qe, s_qn, s_se, s_sn, NVFP4, NB, WPB)
        wu_next, su_next = weight_words(q_ptr, s_ptr, e, I + rn, nmask, kn, s_qe, s_qn, s_se, s_sn, NVFP4, NB, WPB)
        g0, g1, g2, g3 = rows_step(wg, sg, x_ptr, src0, src1, src2, src3, s_x, kw, g0, g1, g2, g3, ROWS, NB, WPB)
        u0, u1, u2, u3 = rows_step(wu, su, x_ptr, src0, src1, src2, src3, s_x, kw, u0, u1, u2, u3, ROWS, NB, WPB)
        wg, sg, wu, su = wg_next, sg_next, wu_next, su_next
    y = y_ptr + row0.to(tl.int64) * s_y + rn
    dt = y_ptr.dtype.element_ty
    tl.store(y, _glu_row(g0, u0, g_ptr, e, s_ge, rn, I, nmask, beta, lin_beta, NVFP4, DIVISOR, ACT, dt, RNE_BF16),
             mask=nmask)
    if ROWS > 1:
        tl.store(y + s_y, _glu_row(g1, u1, g_ptr, e, s_ge, rn, I, nmask, beta, lin_beta, NVFP4, DIVISOR, ACT, dt,
                                   RNE_BF16), mask=nmask & (rn * 0 + live > 1))
    if ROWS > 2:
        tl.store(y + 2 * s_y, _glu_row(g2, u2, g_ptr, e, s_ge, rn, I, nmask, beta, lin_beta, NVFP4, DIVISOR, ACT,
                                       dt, RNE_BF16), mask=nmask & (rn * 0 + live > 2))
        tl.store(y + 3 * s_y, _glu_row(g3, u3, g_ptr, e, s_ge, rn, I, nmask, beta, lin_beta, NVFP4, DIVISOR, ACT,
                                       dt, RNE_BF16), mask=nmask & (rn * 0 + live > 3))


def decode_rows(rows: int, experts: int) -> int | None:
    """Rows per program of the decode kernels for `rows` spread over `experts` (the mean rows per touched expert
    under uniform routing, from shapes alone: no host sync), or None when the tensor-core tiles are the better fit
    (more than 4 rows per expert, where FMA accumulation would make the GEMM compute bound)."""
    touched = experts * (1.0 - (1.0 - 1.0 / experts) ** rows) if experts > 1 else 1.0
    mean = rows / max(1.0, touched)
    if mean <= 1.25:
        return 1
    if mean <= 3.0:
        return 2
    return 4 if mean <= 4.0 else None


def decode_tiles(S: int, E: int, grouped: bool, rows: int, sel: int = 0) -> int:
    """A bound on the decode tiles (programs along M) over S rows: each touched expert's rows in ceil(n / rows)
    tiles sum to at most min(E, S) + (S - min(E, S)) // rows; dense rows in cdiv(S, rows); the one-row experts
    alone (sel 1) in min(E, S)."""
    if not grouped:
        return triton.cdiv(S, rows)
    m = min(E, S)
    return m if sel == 1 else m + (S - m) // rows


def words(t: torch.Tensor) -> torch.Tensor:
    """An int32 view of a tensor whose rows hold a multiple of 4 bytes (bf16 pairs, packed FP4 words)."""
    try:
        return t.view(torch.int32)
    except RuntimeError:
        return t.contiguous().view(torch.int32)


def gemv_launch(x, packed, scale, g, divisor, expert_offsets, sorted_token_ids, dst, split, per_split, config,
                nvfp4: bool, sel: int = 0):
    """Launch the decode kernel: x [T or S, K] bf16, packed [E, N, K/2], dst [S, N] or the [split, S, N] fp32
    workspace; per_split (elements of K per split) a multiple of BK; `sel` 1: the one-row experts only."""
    rows, BN, BK, warps, stages = config
    E, N, Kh = packed.shape
    grouped = expert_offsets is not None
    gather = sorted_token_ids is not None
    S = dst.shape[-2]
    x32, q32 = words(x), words(packed)
    grid = (decode_tiles(S, E, grouped, rows, sel), triton.cdiv(N, BN), split)
    _w4a16_gemv_kernel[grid](
        x32, sorted_token_ids if gather else dst, q32, scale, g, dst, expert_offsets if grouped else dst, S, E, N,
        Kh // 4, per_split // 8, x32.stride(0), q32.stride(0), q32.stride(1), scale.stride(0), scale.stride(1),
        g.stride(0), dst.stride(-2), dst.stride(0) if split > 1 else 0, GROUPED=grouped, GATHER=gather,
        NVFP4=nvfp4, DIVISOR=divisor, E_PAD=pow2(E), ROWS=rows, BN=BN, BK=BK, SEL=sel, num_warps=warps,
        num_stages=stages)


def gemv_glu_launch(x, packed, scale, g, divisor, expert_offsets, sorted_token_ids, out, act, beta, linear_beta,
                    config, nvfp4: bool, rne_bf16: bool, sel: int = 0):
    """Launch the GLU-fused decode kernel: packed [E, 2I, K/2] (gate rows 0..I, up rows I..2I) -> out [S, I]
    (`sel` 1: the one-row experts only)."""
    rows, BN, BK, warps, stages = config
    E, two_i, Kh = packed.shape
    S, I = out.shape
    x32, q32 = words(x), words(packed)
    grid = (decode_tiles(S, E, True, rows, sel), triton.cdiv(I, BN))
    _w4a16_gemv_glu_kernel[grid](
        x32, sorted_token_ids, q32, scale, g, out, expert_offsets, E, I, Kh // 4, x32.stride(0), q32.stride(0),
        q32.stride(1), scale.stride(0), scale.stride(1), g.stride(0), out.stride(0), float(beta), float(linear_beta),
        ACT=act, NVFP4=nvfp4, DIVISOR=divisor, E_PAD=pow2(E), ROWS=rows, BN=BN, BK=BK, RNE_BF16=rne_bf16, SEL=sel,
        num_warps=warps, num_stages=stages)
