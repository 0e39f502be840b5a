"""W4A16 decode GEMM on tensor cores: the FP4 grouped (and dense) GEMM when each expert holds a few rows, with a
register dequantize of 2.25 instructions per weight (3.2-3.5 all told) whatever the number of rows.

The FMA decode kernel (w4a16_gemv.py) spends ~2.6 integer ops plus one FFMA per weight and row, so it is issue
bound below HBM speed and slows down as rows per expert grow. Here the tensor cores do every multiply-add (rows
padded to a 16-row tile are free: the MMA units are idle at decode) and the SM's issue slots go to the decode alone:
- No nibble interleave: the packed tile [BN, BK/2] (byte j = elements 2j, 2j+1) decodes into two bf16 tiles, the
  low nibbles (even K) and the high nibbles (odd K), and the activation tile [16, BK] (loaded contiguous) is split into its even and odd
  columns (`tl.split`): acc += x_even @ w_lo^T + x_odd @ w_hi^T.
- e2m1 -> bf16 by bit placement: the three magnitude bits at bf16 bits 8..6 and the sign at 15 make a bf16 equal to
  e2m1 x 2**-126 (code 1, 0.5, is a bf16 subnormal; PTX's bf16 arithmetic has no `.ftz` form: `mul.rn.bf16x2` keeps
  subnormal inputs and outputs). One bf16x2 multiply by the block scale times 2**(126 - 63) (MXFP4: the bf16 whose
  exponent field is code + 63, i.e. 2**(code - 64); NVFP4: e4m3 x 2**63) leaves the exact weight times 2**-63
  (e2m1 x e8m0 and e2m1 x e4m3 hold at most 6 significant bits, bf16 8), and the fp32 accumulator is multiplied
  back by 2**63 in the epilogue (a power of two: the same sums as unscaled ones). MXFP4 codes 65..191 give normal
  bf16 weights, 58..64 subnormal ones (exact where the tensor cores keep bf16 subnormals: the every-code test in
  tests/test_w4a16_decode.py checks it on CUDA), below 58 they flush (weights under 2**-69; random and real
  weights sit near code 120); codes above 191 are refused by the entries (MX_CODE_MAX, the FMA kernels' bound too).
  NVFP4's per-row tensor scale is applied in the epilogue (`tensor_scale`).
- On the GPU the decode is one inline PTX block per 4 packed bytes (`pack=4`): two PRMT spread bytes (b0, b1) and
  (b2, b3) into the two halves of a word, then per bf16 pair an AND, an IMAD (one multiply places the magnitude and
  the sign: their two copies do not overlap), an AND and one HMUL2 with the scale pair: 8 weights in 18
  instructions. Under TRITON_INTERPRET the same values come from a pure-Triton fp32 expression (inline asm does
  not run there) and the dot is an fp32 IEEE dot.

Tiles: BM = 16 rows of one expert (`expert_tile`), BN weight rows, BK K values per step (whole 32-element rows of
packed bytes, as w4a16.py's tiles, so NVFP4's two scales per row broadcast); the loads feed the dots, so Triton
pipelines them (num_stages). K may be split over a third grid axis (an fp32 workspace, as w4a16.py). The GLU
variant reads the gate and up rows of the same intermediate columns (two accumulators, `glu_epilogue`).

sm_90 SASS of the inner K loop (Triton 3.6, benchmarks/w4a16_sass.py; thread instructions per weight at the host's
configs for K3 / Kimi Linear 48B decode, the same at every batch since the rows ride in the MMA's 16):
| kernel, config (BM, BN, BK, warps, stages) | regs | total | LOP3 | PRMT | IMAD | HMUL2 | FFMA | HMMA | LDGSTS | LDS(M) |
| tc MXFP4 (16, 128, 256, 2, 3)              |  255 |  3.20 | 1.00 | 0.50 | 0.53 |  0.50 |    - | 0.25 |  0.051 |   0.08 |
| tc NVFP4 (16, 128, 256, 2, 3)              |  255 |  3.51 | 1.01 | 0.38 | 0.60 |  0.50 |    - | 0.25 |  0.051 |   0.19 |
| tc GLU MXFP4 / NVFP4 (16, 64, 256, 2, 3)   |  255 |  3.20 / 3.51 (gate + up weights)                               |
| tc MXFP4 / NVFP4 with 4 warps              |  187 |  3.43 / 3.71 (GLU 3.45 / 3.77)                                 |
| gemv MXFP4 1 row (1, 64, 256, 4, 3)        |  152 |  5.52 | 1.69 | 0.09 | 1.27 |     - | 1.03 |    - | LDG 0.19        |
| gemv MXFP4 2 rows (2, 64, 256, 4, 3)       |  196 |  7.21 | 1.72 | 0.09 | 1.15 |     - | 2.06 |    - | LDG 0.22        |
| gemv NVFP4 1 / 2 rows, GLU 1 / 2 rows      |      |  5.54 / 7.15, 5.63 / 7.58                                       |
The host now runs 128-value K steps (w4a16.w4a16_config: 139 registers, 3.34 per weight, 14 warps a SM instead of 8;
the kernel is latency bound, and on the H200 that took K3 MXFP4 batch 64 from 40 to 47% of copy bandwidth).
No spills at these configs (the dense NVFP4 ModelOpt kernel at 2 warps spills 24 bytes). The FMA rows above left
K unmarked as 16-divisible, which a launch does mark: as launched on the H200 (Triton's cache, twelfth session)
this kernel ran 851 instructions a K step (3.32 a weight) and the two-row FMA kernel 876 (6.84 a weight for its two
rows), before the FMA kernel's shared shift (benchmarks/w4a16_sass.py now marks sizes as a launch does).
The decode asm is 2.25 of the tc total (8 LOP3, 4 IMAD, 2 PRMT, 4 HMUL2 per 8 weights); the rest is the
activation's even / odd split (PRMT, the [16, BK] tile sits whole in every warp's MMA fragments), the block
scales' conversion and broadcast (one per 8 weights a thread holds), addressing and the pipeline's waits.
Swap-AB (the weights as wgmma's A operand from registers, y^T = W x^T) compiled to 4.3-5.3 per weight (the
activation tile through shared memory every step, more PRMT), so the kernel keeps x as the A operand.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kestrel.kernels import interpreting
from kestrel.kernels.moe._common import expert_tile_sel, pow2, tile_rows
from kestrel.kernels.quant._common import glu_store, tensor_scale

TWO63: tl.constexpr = tl.constexpr(9.223372036854775808e18)


def _nibble_pair(out: str, spread: str, nibbles: str, place: str, scale: str) -> str:
    """One bf16 pair: isolate a nibble in each 16-bit half of `spread`, one multiply puts its magnitude at bits 8..6
    and a second copy's top bit (the sign) at 15 (the copies do not overlap), keep those bits, times the scales."""
    return (f"and.b32 u, {spread}, {nibbles};\nmul.lo.u32 u, u, {place};\nand.b32 u, u, 0x81C081C0;\n"
            f"mul.rn.bf16x2 {out}, u, {scale};\n")


# 4 packed bytes ($4) and their 4 scales as 2 bf16 pairs ($5, $6) -> the low nibbles' bf16 weights ($0, $1) and
# the high nibbles' ($2, $3), each pair (byte 0, byte 1) / (byte 2, byte 3) in one register: t0 / t1 hold bytes
# 0, 1 / 2, 3 in the low bytes of their two halves; a low nibble moves up by 6 (magnitude) and 12 (sign), a high
# one by 2 and 8.
_DECODE_PTX: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 t0, t1, u;\nprmt.b32 t0, $4, 0, 0x4140;\nprmt.b32 t1, $4, 0, 0x4342;\n"
    + _nibble_pair("$0", "t0", "0x000F000F", "0x1040", "$5") + _nibble_pair("$1", "t1", "0x000F000F", "0x1040", "$6")
    + _nibble_pair("$2", "t0", "0x00F000F0", "0x104", "$5") + _nibble_pair("$3", "t1", "0x00F000F0", "0x104", "$6")
    + "}\n")


@triton.jit
def _decode_ref(p, s):
    """The asm's values in pure Triton: bytes p (uint8) and bf16 scales s -> the (low, high) nibbles' weights
    e2m1 x 2**-126 (placed as fp32 bits) x s, exact. Kept in fp32: they are bf16 values, and the interpreter's bf16
    conversion flushes the subnormal ones (MXFP4 codes 58..64) that the PTX path keeps."""
    p = p.to(tl.uint32)
    lo = (((p & 8) << 28) | ((p & 7) << 22)).to(tl.float32, bitcast=True)
    hi = (((p & 0x80) << 24) | ((p & 0x70) << 18)).to(tl.float32, bitcast=True)
    sf = s.to(tl.float32)
    return lo * sf, hi * sf


@triton.jit
def decode_fp4(p, s, ASM: tl.constexpr):
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_DECODE_PTX, "=r,=r,=r,=r,r,r,r", [p, s],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = _decode_ref(p, s)
    return lo, hi


@triton.jit
def scale_bf16(sc, NVFP4: tl.constexpr):
    """Block scales (e8m0 codes / e4m3) -> bf16 multipliers carrying 2**63 of the 2**126 (2**(code - 64) / e4m3 x
    2**63)."""
    if NVFP4:
        s = (sc.to(tl.float32) * TWO63).to(tl.bfloat16)
    else:
        s = ((sc.to(tl.int32) + 63) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return s


@triton.jit
def tc_step(xe, xo, q_ptrs, s_ptrs, nmask, acc, NVFP4: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            ASM: tl.constexpr):
    """acc [BM, BN] + one K step: x's even / odd columns xe, xo [BM, BK/2] against the weight tile [BN, BK] read
    from q_ptrs ([BN, BK/32, 16] packed bytes, rows past nmask as zero) and s_ptrs ([BN, BK/G] block scales)."""
    q = tl.load(q_ptrs, mask=nmask[:, None, None], other=0)
    sc = scale_bf16(tl.load(s_ptrs, mask=nmask[:, None]), NVFP4)
    if NVFP4:       # two scales per 16-byte row
        s = tl.reshape(tl.broadcast_to(tl.reshape(sc, (BN, BK // 32, 2, 1)), (BN, BK // 32, 2, 8)),
                       (BN, BK // 32, 16))
    else:
        s = sc[:, :, None]
    lo, hi = decode_fp4(q, s, ASM)
    lo = tl.trans(tl.reshape(lo, (BN, BK // 2)))
    hi = tl.trans(tl.reshape(hi, (BN, BK // 2)))
    if ASM:
        acc = tl.dot(xe, lo, acc)
        acc = tl.dot(xo, hi, acc)
    else:           # the interpreter's bf16 dot is wrong: an fp32 IEEE dot over the same exact values
        acc = tl.dot(xe.to(tl.float32), lo.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(xo.to(tl.float32), hi.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _weight_ptrs(q_ptr, s_ptr, e, rn, k_lo, s_qe, s_qn, s_se, s_sn, NVFP4: tl.constexpr, BK: tl.constexpr):
    G: tl.constexpr = 16 if NVFP4 else 32
    row = tl.multiple_of(e.to(tl.int64) * s_qe + rn.to(tl.int64) * s_qn + k_lo // 2, 16)
    q_ptrs = (q_ptr + row[:, None, None] + (tl.arange(0, BK // 32) * 16)[None, :, None]
              + tl.arange(0, 16)[None, None, :])
    srow = tl.multiple_of(e.to(tl.int64) * s_se + rn.to(tl.int64) * s_sn + k_lo // G, BK // G)
    s_ptrs = s_ptr + srow[:, None] + tl.arange(0, BK // G)[None, :]
    return q_ptrs, s_ptrs


@triton.jit
def _tile(offs_ptr, rows_ptr, M, E, GROUPED: tl.constexpr, GATHER: tl.constexpr, E_PAD: tl.constexpr,
          BM: tl.constexpr, SEL: tl.constexpr):
    if GROUPED:
        e, row_hi, row0 = expert_tile_sel(offs_ptr, E, tl.program_id(0), E_PAD, BM, SEL)
    else:
        e = 0
        row_hi = M
        row0 = tl.program_id(0) * BM
    rm, mmask, src = tile_rows(rows_ptr, row0, row_hi, GATHER, BM)
    return e, rm, mmask, src


@triton.jit
def _w4a16_tc_kernel(x_ptr, rows_ptr, q_ptr, s_ptr, g_ptr, y_ptr, offs_ptr, M, E, N, K, K_SPLIT, s_x, s_qe, s_qn,
                     s_se, s_sn, s_ge, s_y, s_ys, GROUPED: tl.constexpr, GATHER: tl.constexpr,
                     NVFP4: tl.constexpr, DIVISOR: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr, SEL: tl.constexpr):
    G: tl.constexpr = 16 if NVFP4 else 32
    e, rm, mmask, src = _tile(offs_ptr, rows_ptr, M, E, GROUPED, GATHER, E_PAD, BM, SEL)
    if e >= E:
        return
    pid_k = tl.program_id(2)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = rn < N
    k_lo = tl.multiple_of(pid_k * K_SPLIT, BK)
    x_ptrs = x_ptr + src.to(tl.int64)[:, None] * s_x + k_lo + tl.arange(0, BK)[None, :]
    q_ptrs, s_ptrs = _weight_ptrs(q_ptr, s_ptr, e, rn, k_lo, s_qe, s_qn, s_se, s_sn, NVFP4, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BK):
        xe, xo = tl.split(tl.reshape(tl.load(x_ptrs, mask=mmask[:, None], other=0.0), (BM, BK // 2, 2)))
        acc = tc_step(xe, xo, q_ptrs, s_ptrs, nmask, acc, NVFP4, BN, BK, ASM)
        x_ptrs += BK
        q_ptrs += BK // 2
        s_ptrs += BK // G
    acc = acc * TWO63
    if NVFP4:
        acc = tensor_scale(acc, g_ptr, e, s_ge, rn, nmask, DIVISOR)
    y_ptrs = y_ptr + pid_k.to(tl.int64) * s_ys + rm.to(tl.int64)[:, None] * s_y + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _w4a16_tc_glu_kernel(x_ptr, rows_ptr, q_ptr, s_ptr, g_ptr, y_ptr, offs_ptr, E, I, K, s_x, s_qe, s_qn, s_se,
                         s_sn, s_ge, s_y, beta, lin_beta, ACT: tl.constexpr, NVFP4: tl.constexpr,
                         DIVISOR: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, ASM: tl.constexpr, RNE_BF16: tl.constexpr, SEL: tl.constexpr):
    G: tl.constexpr = 16 if NVFP4 else 32
    e, rm, mmask, src = _tile(offs_ptr, rows_ptr, 0, E, True, True, E_PAD, BM, SEL)
    if e >= E:
        return
    rn = tl.program_id(1) * BN + tl.arange(0, BN)       # intermediate columns: gate rows rn, up rows I + rn
    nmask = rn < I
    x_ptrs = x_ptr + src.to(tl.int64)[:, None] * s_x + tl.arange(0, BK)[None, :]
    qg_ptrs, sg_ptrs = _weight_ptrs(q_ptr, s_ptr, e, rn, 0, s_qe, s_qn, s_se, s_sn, NVFP4, BK)
    qu_ptrs, su_ptrs = _weight_ptrs(q_ptr, s_ptr, e, I + rn, 0, s_qe, s_qn, s_se, s_sn, NVFP4, BK)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(0, K, BK):
        xe, xo = tl.split(tl.reshape(tl.load(x_ptrs, mask=mmask[:, None], other=0.0), (BM, BK // 2, 2)))
        acc_g = tc_step(xe, xo, qg_ptrs, sg_ptrs, nmask, acc_g, NVFP4, BN, BK, ASM)
        acc_u = tc_step(xe, xo, qu_ptrs, su_ptrs, nmask, acc_u, NVFP4, BN, BK, ASM)
        x_ptrs += BK
        qg_ptrs += BK // 2
        qu_ptrs += BK // 2
        sg_ptrs += BK // G
        su_ptrs += BK // G
    acc_g = acc_g * TWO63
    acc_u = acc_u * TWO63
    glu_store(acc_g, acc_u, g_ptr, e, s_ge, rn, I, nmask, beta, lin_beta, y_ptr, rm, mmask, s_y, NVFP4, DIVISOR, ACT,
              RNE_BF16)


def _check_strides(packed, scale, BK: int, nvfp4: bool):
    """The kernel tells Triton that every weight row starts 16-byte aligned and every scale row on a whole K step
    (`tl.multiple_of`, so the loads vectorize): true of the checkpoint's contiguous stacks, refused otherwise."""
    step = BK // (16 if nvfp4 else 32)
    if any(st % 16 for st in packed.stride()[:-1]) or any(st % step for st in scale.stride()[:-1]):
        raise ValueError(f"w4a16 tensor-core decode: packed row strides {packed.stride()[:-1]} must be multiples of "
                         f"16 and scale row strides {scale.stride()[:-1]} of {step} (use contiguous weights)")


def tc_launch(x, packed, scale, g, divisor, expert_offsets, sorted_token_ids, dst, split, per_split, config,
              nvfp4: bool, sel: int = 0):
    """Launch the decode kernel: x [T or S, K] bf16, packed [E, N, K/2], dst [S, N] or the [split, S, N] fp32
    workspace; per_split (elements of K per split) a multiple of BK; `sel` 2: the experts of two rows or more
    only (`expert_tile_sel`)."""
    BM, BN, BK, warps, stages = config
    _check_strides(packed, scale, BK, nvfp4)
    E, N, Kh = packed.shape
    grouped = expert_offsets is not None
    gather = sorted_token_ids is not None
    S = dst.shape[-2]
    grid = (triton.cdiv(S, BM) + (min(E, S) if grouped else 0), triton.cdiv(N, BN), split)
    _w4a16_tc_kernel[grid](
        x, sorted_token_ids if gather else dst, packed, scale, g, dst, expert_offsets if grouped else dst, S, E, N,
        2 * Kh, per_split, x.stride(0), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1),
        g.stride(0), dst.stride(-2), dst.stride(0) if split > 1 else 0, GROUPED=grouped, GATHER=gather,
        NVFP4=nvfp4, DIVISOR=divisor, E_PAD=pow2(E), BM=BM, BN=BN, BK=BK, ASM=not interpreting(), SEL=sel,
        num_warps=warps, num_stages=stages)


def tc_glu_launch(x, packed, scale, g, divisor, expert_offsets, sorted_token_ids, out, act, beta, linear_beta,
                  config, nvfp4: bool, rne_bf16: bool, sel: int = 0):
    """Launch the GLU-fused decode kernel: packed [E, 2I, K/2] (gate rows 0..I, up rows I..2I) -> out [S, I]."""
    BM, BN, BK, warps, stages = config
    _check_strides(packed, scale, BK, nvfp4)
    E, two_i, Kh = packed.shape
    S, I = out.shape
    grid = (triton.cdiv(S, BM) + min(E, S), triton.cdiv(I, BN))
    _w4a16_tc_glu_kernel[grid](
        x, sorted_token_ids, packed, scale, g, out, expert_offsets, E, I, 2 * Kh, x.stride(0), packed.stride(0),
        packed.stride(1), scale.stride(0), scale.stride(1), g.stride(0), out.stride(0), float(beta),
        float(linear_beta), ACT=act, NVFP4=nvfp4, DIVISOR=divisor, E_PAD=pow2(E), BM=BM, BN=BN, BK=BK,
        ASM=not interpreting(), RNE_BF16=rne_bf16, SEL=sel, num_warps=warps, num_stages=stages)
