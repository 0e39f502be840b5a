"""W4A16 GEMMs: y = x @ dequant(W)^T with FP4 (e2m1) weights, bf16 activations and bf16 tensor-core math.

Hopper has no FP4 math, so each weight tile is dequantized in the load path: packed bytes (element 2j in the low
nibble, 2j+1 in the high one) -> e2m1 values -> times the block scale -> bf16, then a bf16 `tl.dot` with fp32
accumulation. Two formats, told apart by the scale's dtype:
- MXFP4: uint8 e8m0 scale per 32 elements along K (2**(code - 127)).
- NVFP4: float8_e4m3fn scale per 16, and a per-row fp32 tensor scale applied to the accumulator in the epilogue
  (a divisor, compressed-tensors' `weight_global_scale`, or a multiplier, ModelOpt's `weight_scale_2`).

The nibble decode uses no table and no 16-bit conversion (a slow pipe on Hopper): the three magnitude bits placed
at fp32 bits 24..22 (sign at 31) make an fp32 whose value is the e2m1 value times 2**-126 (code 1, 0.5, is an fp32
subnormal: Triton's multiplies keep subnormals, only libdevice calls flush), so one shift-and-mask per nibble
and two fp32 multiplies (by 2**63, then by the block scale times 2**63) give the weight. The packed tile is loaded
as [BN, K blocks, bytes per block] so that the block scale broadcasts without a reshape. Every dequantized weight
(e2m1 x e8m0, or e2m1 x e4m3: at most 2 + 4 significant bits) is exact in bf16, so the dot sees exactly the
reference's weights.

Layouts are the checkpoint's (`QuantizedWeight`'s buffers): packed [E, N, K/2] uint8, scale [E, N, K/G],
NVFP4 tensor scale [E, N, 1]; dense weights are the same with no E. Grouped rows are found on the device from
expert_offsets exactly as in the bf16 grouped GEMM (kestrel/kernels/moe/grouped_gemm.py): grid (M tiles bounded on
the host, N tiles), each program counts which expert owns its tile. Decode (a few rows per expert) takes 16-row
tiles and narrow N tiles so that enough programs stream the weights (and, when even those are too few, as for a
dense decode projection, K is split over a third grid axis into an fp32 workspace summed in a fixed order);
prefill takes 128 x 128 tiles. The K step's pieces (`fp4_tile_ptrs`, `fp4_dot`, `tensor_scale`) are shared with the
GLU-fused grouped GEMM (w4a16_glu.py), so both read exactly the same weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels import interpreting
from kestrel.kernels.moe._common import expert_tile, pow2, tile_rows
from kestrel.kernels.quant._common import split_k_plan, tensor_scale
from kestrel.kernels.quant.w4a16_gemv import ROW_CHOICES, decode_rows, decode_tiles, gemv_launch
from kestrel.kernels.quant.w4a16_tc import tc_launch

TWO63: tl.constexpr = tl.constexpr(9.223372036854775808e18)     # 2**63: 2**126 split so the scale never overflows



@triton.jit
def dequant_fp4_tile(packed, scale, NVFP4: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """packed uint8 [BN, BK/32, 16] (the bytes of each 32 elements) and the block scales [BN, BK/G] (e4m3 bits
    per 16 for NVFP4, e8m0 codes per 32 for MXFP4) -> bf16 [BN, BK] in K order, exact. Both formats load the
    bytes in 16-byte rows: NVFP4's 8-byte rows ([BN, BK/16, 8]) made Triton 3.6's OptimizeDotOperands pass fail
    on sm_90 for 128-wide N tiles ("Illegal shared layout"); its two scales per row are broadcast instead."""
    p = packed.to(tl.uint32)
    lo = (((p & 8) << 28) | ((p & 7) << 22)).to(tl.float32, bitcast=True)         # e2m1(low nibble) * 2**-126
    hi = (((p & 0x80) << 24) | ((p & 0x70) << 18)).to(tl.float32, bitcast=True)   # e2m1(high nibble) * 2**-126
    if NVFP4:
        s = scale.to(tl.float32) * TWO63                                        # [BN, BK/16]
        s = tl.reshape(tl.broadcast_to(tl.reshape(s, (BN, BK // 32, 2, 1)), (BN, BK // 32, 2, 8)),
                       (BN, BK // 32, 16))                                       # bytes 0..7: first scale
    else:
        s = ((scale.to(tl.int32) + 63) << 23).to(tl.float32, bitcast=True)     # 2**(code - 127) * 2**63
        s = s[:, :, None]
    w = tl.join(((lo * TWO63) * s).to(tl.bfloat16), ((hi * TWO63) * s).to(tl.bfloat16))
    return tl.reshape(w, (BN, BK))


@triton.jit
def fp4_tile_ptrs(q_ptr, s_ptr, e, rn, k_lo, s_qe, s_qn, s_se, s_sn, NVFP4: tl.constexpr, BK: tl.constexpr):
    """Pointers to the first K step (from element k_lo) of weight rows rn of expert e: the packed bytes as
    [BN, BK/32, 16] and the block scales as [BN, BK/G]; a K step advances them by BK/2 and BK/G."""
    G: tl.constexpr = 16 if NVFP4 else 32
    q_ptrs = (q_ptr + e.to(tl.int64) * s_qe + rn.to(tl.int64)[:, None, None] * s_qn + k_lo // 2
              + (tl.arange(0, BK // 32) * 16)[None, :, None] + tl.arange(0, 16)[None, None, :])
    s_ptrs = (s_ptr + e.to(tl.int64) * s_se + rn.to(tl.int64)[:, None] * s_sn
              + (k_lo // G + tl.arange(0, BK // G))[None, :])
    return q_ptrs, s_ptrs


@triton.jit
def fp4_dot(a, q_ptrs, s_ptrs, nmask, acc, NVFP4: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            F32_DOT: tl.constexpr):
    """One K step: acc + a [BM, BK] @ dequant(weight tile [BN, BK])^T, loading the tile's bytes and scales (rows
    past nmask read as zero). fp32 IEEE dot under the interpreter (its bf16 dot is wrong) and for fp32
    activations (a bf16 dot takes one dtype), bf16 tensor cores otherwise."""
    w = dequant_fp4_tile(tl.load(q_ptrs, mask=nmask[:, None, None], other=0),
                         tl.load(s_ptrs, mask=nmask[:, None]), NVFP4, BN, BK)
    if a.dtype == tl.float32:
        acc = tl.dot(a, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    elif F32_DOT:
        acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _w4a16_kernel(a_ptr, rows_ptr, q_ptr, s_ptr, g_ptr, y_ptr, offs_ptr, M, E, N, K, K_SPLIT, s_a, s_qe, s_qn,
                  s_se, s_sn, s_ge, s_y, s_ys, GROUPED: tl.constexpr, GATHER: tl.constexpr, NVFP4: tl.constexpr,
                  DIVISOR: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, F32_DOT: tl.constexpr):
    G: tl.constexpr = 16 if NVFP4 else 32
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if GROUPED:
        e, row_hi, row0 = expert_tile(offs_ptr, E, pid_m, E_PAD, BM)
        if e >= E:
            return
    else:
        e = 0
        row_hi = M
        row0 = pid_m * BM
    rm, mmask, src = tile_rows(rows_ptr, row0, row_hi, GATHER, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    k_lo = pid_k * K_SPLIT
    rk = k_lo + tl.arange(0, BK)
    a_ptrs = a_ptr + src.to(tl.int64)[:, None] * s_a + rk[None, :]
    q_ptrs, s_ptrs = fp4_tile_ptrs(q_ptr, s_ptr, e, rn, k_lo, s_qe, s_qn, s_se, s_sn, NVFP4, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BK):
        a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
        acc = fp4_dot(a, q_ptrs, s_ptrs, nmask, acc, NVFP4, BN, BK, F32_DOT)
        a_ptrs += BK
        q_ptrs += BK // 2
        s_ptrs += BK // G
    if NVFP4:
        acc = tensor_scale(acc, g_ptr, e, s_ge, rn, nmask, DIVISOR)
    y_ptrs = y_ptr + pid_k.to(tl.int64) * s_ys + rm.to(tl.int64)[:, None] * s_y + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def block_k(K: int, group: int, cap: int = 128) -> int:
    """The largest K step <= cap that divides K and holds whole scale blocks (K is a multiple of `group`)."""
    bk = cap
    while bk > group and K % bk:
        bk //= 2
    return bk


# The decode path the host picks at a few rows per expert: "tc", the tensor-core decode kernel (w4a16_tc.py, BM 16),
# "gemv", the FMA kernel (w4a16_gemv.py, BM 1 / 2 / 4), "split", both in two launches: the FMA kernel over the
# experts that hold one row, the tensor-core one over the others, or "auto": the FMA kernel at about one row per
# touched expert (decode_rows 1), the split up to 3 (decode_rows 2: at uniform routing a third or more of the
# touched experts hold one row), the tensor-core kernel past that. H200 (benchmarks/results/h200_quant_gemm_tc.json,
# % of copy bandwidth, w13 / w2): at one row (batch 1 and 8 of both models) the FMA kernel led, K3 MXFP4 55 / 26%
# at batch 1 and 63 / 60% at batch 8 against 28 / 23% and 39 / 37%; at two (batch 64) the tensor-core one, K3 40 / 39% against 32 / 30%, Kimi Linear
# 37 / 32% against 33 / 23%. Both stay selectable by `config` (the bench's --sweep). The split: at K3's batch 64
# the FMA kernel streamed one-row experts at 62% of copy bandwidth and the tensor-core one 49%, at any rows
# (benchmarks/results/h200_w4a16_probe_session12.json: ncu found the latter latency bound, 12 warps a SM, 55% of
# its issue slots without an eligible warp).
DECODE_PATH = "auto"
TC_DECODE_BM = 16


def decode_path(rows: int, experts: int, path: str | None = None) -> str:
    """"tc", "gemv" or "split" for `rows` spread over `experts` (`path`, else DECODE_PATH; "auto" as above)."""
    path = path or DECODE_PATH
    if path == "auto":
        return {1: "gemv", 2: "split"}.get(decode_rows(rows, experts), "tc")
    return path


def w4a16_config(rows: int, experts: int, N: int, K: int, group: int, decode: bool = True,
                 path: str | None = None) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) from the shapes (no autotune). Up to 16 rows per touched expert with bf16
    activations (`decode`) is decode: BM 16 picks the tensor-core decode kernel (w4a16_tc.py), BM 1, 2 or 4 the FMA
    kernel (w4a16_gemv.py, that many rows per program, only while the rows per expert are that few), by `path`
    ("tc" | "gemv" | "split" | "auto", default DECODE_PATH: `decode_path`; "split" returns the tensor-core config,
    w4a16_gemm adds the FMA launch). Past that, or with other activations, the
    general tensor-core tiles (16-row ones for non-bf16 decode, 64 / 128 for prefill)."""
    per_expert = rows / max(1, min(experts, rows))
    rows_per = decode_rows(rows, experts) if decode and decode_path(rows, experts, path) == "gemv" else None
    if interpreting():
        if rows_per:        # wide tiles: the interpreter's cost is per op and the decode kernel has many
            return rows_per, min(128, pow2(N, 16)), block_k(K, group, 256), 4, 1
        if decode and per_expert <= 16:
            return TC_DECODE_BM, min(128, pow2(N, 16)), block_k(K, group, 256), 4, 1
        return 16, min(32, pow2(N, 16)), block_k(K, group, 64), 4, 1
    if rows_per:
        # 64 weight rows x 256 values per K step: 8 KB of packed words in flight per program, 16 B per thread
        return rows_per, 64, block_k(K, group, 256), 4, 3
    if decode and per_expert <= 16:
        # 128 weight rows x 128 values per K step (8 KB of packed bytes), 3 stages, 2 warps: each warp's MMA
        # fragments hold the whole activation tile, so fewer warps per weight tile split it fewer times. The
        # kernel is latency bound, not issue bound: 256-value steps took 255 registers (4 programs, 8 warps a
        # SM), 128-value ones take 139 (7 programs, 14 warps) for 3.34 SASS instructions per weight against 3.20;
        # on the H200 (benchmarks/results/h200_quant_gemm_tcgrid.json) K3 MXFP4 batch 64 went from 40 to 47% of
        # copy bandwidth (w13 4.18 -> 3.52 ms, w2 2.21 -> 1.84), the best of 10 configs
        return TC_DECODE_BM, 128, block_k(K, group, 128), 2, 3
    if per_expert <= 16:
        # weight streaming; narrow N tiles so that (touched experts x N tiles) fills the 132 SMs
        return 16, 32, block_k(K, group, 256), 4, 4
    if per_expert <= 64:
        return 64, 128, block_k(K, group, 64), 4, 4
    return 128, 128, block_k(K, group, 64), 8, 3


def is_nvfp4(scale: torch.Tensor) -> bool:
    return scale.dtype == torch.float8_e4m3fn


def w4a16_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, second: torch.Tensor | None = None,
               divisor: bool = True, expert_offsets: torch.Tensor | None = None,
               sorted_token_ids: torch.Tensor | None = None, out: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, split_k: int | None = None,
               config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Dense (packed [N, K/2], no expert_offsets): x [M, K] -> y [M, N]. Grouped (packed [E, N, K/2]):
    x [T, K] gathered by sorted_token_ids, or [S, K] in sorted order -> y [S, N] in sorted order. `split_k`
    (None: chosen from the shape) splits K over a third grid axis into an fp32 workspace summed in a fixed
    order, for shapes whose output tiles alone cannot fill the GPU. `config` overrides (BM, BN, BK, num_warps,
    num_stages) (benchmarks/quant_gemm_bench.py --sweep; BK must divide K and hold whole scale blocks)."""
    grouped = expert_offsets is not None
    if not grouped:
        packed, scale = packed.unsqueeze(0), scale.unsqueeze(0)
        second = second.unsqueeze(0) if second is not None else None
    E, N, Kh = packed.shape
    K = 2 * Kh
    nv = is_nvfp4(scale)
    gather = sorted_token_ids is not None
    S = sorted_token_ids.numel() if gather else x.shape[0]
    if out is None:
        out = torch.empty((S, N), dtype=out_dtype or x.dtype, device=x.device)
    if S == 0:
        return out
    # K steps hold whole 32-element rows of packed bytes (dequant_fp4_tile), for NVFP4 too
    bf16 = x.dtype == torch.bfloat16
    BM, BN, BK, warps, stages = config or w4a16_config(S, E if grouped else 1, N, K, 32, decode=bf16)
    if K % BK or BK % 32:
        raise ValueError(f"w4a16_gemm: K step {BK} must divide K={K} and be a multiple of 32")
    decode = BM in ROW_CHOICES
    tc = BM == TC_DECODE_BM and bf16          # 16-row tiles of other activations: the general kernel
    if decode and not bf16:
        # its words are bf16 pairs: other activations would be read as such (the fp32 CPU targets did, and wrote
        # past their output)
        raise ValueError(f"w4a16_gemm: the decode kernel (BM {BM}) takes bf16 activations, not {x.dtype}")
    if decode:
        m_tiles = decode_tiles(S, E, grouped, BM)
    else:
        m_tiles = triton.cdiv(S, BM) + (min(E, S) if grouped else 0)
    n_tiles = triton.cdiv(N, BN)
    split_k, per_split = split_k_plan(m_tiles * n_tiles, K, BK, split_k)
    dst = out if split_k == 1 else torch.empty((split_k, S, N), dtype=torch.float32, device=x.device)
    g = second if nv else scale
    if decode:
        gemv_launch(x, packed, scale, g, divisor, expert_offsets, sorted_token_ids, dst, split_k, per_split,
                    (BM, BN, BK, warps, stages), nv)
    elif tc:
        sel = 0
        if config is None and grouped and split_k == 1 and decode_path(S, E) == "split":
            sel = 2         # the tensor-core kernel over the experts of two rows or more, the FMA one the rest
            gemv_launch(x, packed, scale, g, divisor, expert_offsets, sorted_token_ids, dst, 1, per_split,
                        (1,) + w4a16_config(S, E, N, K, 32, path="gemv")[1:], nv, sel=1)
        tc_launch(x, packed, scale, g, divisor, expert_offsets, sorted_token_ids, dst, split_k, per_split,
                  (BM, BN, BK, warps, stages), nv, sel=sel)
    else:
        _w4a16_kernel[(m_tiles, n_tiles, split_k)](
            x, sorted_token_ids if gather else out, packed, scale, g, dst,
            expert_offsets if grouped else out, S, E, N, K, per_split, x.stride(0), packed.stride(0),
            packed.stride(1), scale.stride(0), scale.stride(1), g.stride(0), dst.stride(-2),
            dst.stride(0) if split_k > 1 else 0, GROUPED=grouped, GATHER=gather, NVFP4=nv, DIVISOR=divisor,
            E_PAD=pow2(E), BM=BM, BN=BN, BK=BK, F32_DOT=interpreting(), num_warps=warps, num_stages=stages)
    if split_k > 1:
        out.copy_(dst.sum(0))
    return out
