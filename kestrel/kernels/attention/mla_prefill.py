"""MLA non-absorbed varlen causal attention for prefill chunks (flash-attention style, fp32 online softmax).

q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] packed over B sequences by `cu_seqlens_q` / `cu_seqlens_k`
(int32 [B+1]). Sequence b's Tq_b query tokens are the LAST Tq_b of its Tk_b keys (a chunk continuing earlier
context), so query i sits at position `Tk_b - Tq_b + i` and sees keys `0 ..` that position (causal, bottom-right).

Grid `(sum_b cdiv(Tq_b, BLOCK_M) <= cdiv(Tq, BLOCK_M) + B, H)`: the first axis is an upper bound the host knows
from shapes alone; each program finds its sequence and query block on the device (a cumulative sum of the
per-sequence block counts), and programs past the last block do nothing. No host sync, so it is graph-safe.

Dqk = 128 + 64 = 192 is not a power of two: the score dot is split into a D1 = largest-power-of-two part and a
padded (masked) remainder, at least 16 deep (32 with FP8 operands: the shallowest dot of each on sm_90). Key
blocks entirely left of the query block's first position run without a mask; only the blocks on the diagonal are
masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.attention._common import dot_flags, mma

LOG2E = 1.4426950408889634
FP8_MIN_K = 32          # the shallowest FP8 tl.dot Triton compiles for sm_90 (16-bit operands: 16)


@triton.jit(do_not_specialize=["B"])       # B changes every step: see BLOCK_B below
def _mla_prefill_kernel(
    q_ptr, k_ptr, k2_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, qs_ptr, ks_ptr, vs_ptr,
    scale_log2, B,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_k2t, stride_k2h, stride_vt, stride_vh, stride_ot, stride_oh,
    DQK: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, FP8: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    if FP8:     # caller-quantized e4m3 q, k, v with fp32 tensor scales: QK^T on the FP8 operands, scales folded here
        scale_log2 = scale_log2 * tl.load(qs_ptr) * tl.load(ks_ptr)

    # Which sequence and which of its query blocks this program owns.
    offs_b = tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    q_lo = tl.load(cu_q_ptr + offs_b, mask=mask_b, other=0)
    q_hi = tl.load(cu_q_ptr + offs_b + 1, mask=mask_b, other=0)
    nblk = tl.where(mask_b, tl.cdiv(q_hi - q_lo, BLOCK_M), 0)
    blk_end = tl.cumsum(nblk, axis=0)
    b = tl.sum((blk_end <= pid).to(tl.int32), axis=0)
    if b < B:
        m_blk = pid - tl.sum(tl.where(offs_b < b, nblk, 0), axis=0)
        q_start = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_start
        k_start = tl.load(cu_k_ptr + b)
        k_len = tl.load(cu_k_ptr + b + 1) - k_start
        ctx = k_len - q_len

        offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < q_len
        q_pos = ctx + offs_m
        offs_d1 = tl.arange(0, D1)
        offs_v = tl.arange(0, BLOCK_DV)
        mask_v = offs_v < DV

        q_rows = q_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh
        q1 = tl.load(q_rows + offs_d1[None, :], mask=mask_m[:, None], other=0.0)
        if D2 > 0:
            offs_d2 = tl.arange(0, D2)
            mask_d2 = offs_d2 < DQK - D1
            q2 = tl.load(q_rows + D1 + offs_d2[None, :], mask=mask_m[:, None] & mask_d2[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

        k_base = k_ptr + k_start.to(tl.int64) * stride_kt + h * stride_kh
        k2_base = k2_ptr + k_start.to(tl.int64) * stride_k2t + h * stride_k2h
        v_base = v_ptr + k_start.to(tl.int64) * stride_vt + h * stride_vh
        first_q = ctx + m_blk * BLOCK_M                         # every row of this block sees keys < first_q
        full_end = (first_q // BLOCK_N) * BLOCK_N
        diag_end = tl.minimum(k_len, first_q + BLOCK_M)

        # Unmasked key blocks: all keys precede every query row of the block (and lie inside the sequence).
        for n0 in range(0, full_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            kt_ptrs = k_base + offs_n.to(tl.int64)[None, :] * stride_kt
            s = mma(q1, tl.load(kt_ptrs + offs_d1[:, None]), None, DOT_PREC, UPCAST)
            if D2 > 0:
                k2 = tl.load(k2_base + offs_n.to(tl.int64)[None, :] * stride_k2t + offs_d2[:, None],
                             mask=mask_d2[:, None], other=0.0)
                s = mma(q2, k2, s, DOT_PREC, UPCAST)
            s = s * scale_log2
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vv = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vt + offs_v[None, :],
                         mask=mask_v[None, :], other=0.0)
            if FP8:
                vv = vv.to(tl.bfloat16)              # exact; P @ V in bf16, v's scale applied to the output
            acc = mma(p.to(vv.dtype), vv, acc * alpha[:, None], DOT_PREC, UPCAST)
            m_i = m_new

        # Diagonal key blocks: causal mask (key position <= query position) and the sequence's end.
        for n0 in range(full_end, diag_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < diag_end
            kt_ptrs = k_base + offs_n.to(tl.int64)[None, :] * stride_kt
            s = mma(q1, tl.load(kt_ptrs + offs_d1[:, None], mask=mask_n[None, :], other=0.0), None,
                    DOT_PREC, UPCAST)
            if D2 > 0:
                k2 = tl.load(k2_base + offs_n.to(tl.int64)[None, :] * stride_k2t + offs_d2[:, None],
                             mask=mask_d2[:, None] & mask_n[None, :], other=0.0)
                s = mma(q2, k2, s, DOT_PREC, UPCAST)
            visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row with nothing visible yet keeps m = -inf; guard the -inf - -inf of its rescale.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vv = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vt + offs_v[None, :],
                         mask=mask_n[:, None] & mask_v[None, :], other=0.0)
            if FP8:
                vv = vv.to(tl.bfloat16)
            acc = mma(p.to(vv.dtype), vv, acc * alpha[:, None], DOT_PREC, UPCAST)
            m_i = m_new

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if FP8:
            o = o * tl.load(vs_ptr)
        o_ptrs = o_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_v[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_v[None, :])


def _config(device: torch.device) -> dict:
    """H200: q [128, 192] bf16 stays in registers, K [128, 192] + V [128, 128] bf16 = 80 KiB a stage; 2 stages fit
    inside the 228 KiB of shared memory. The best of 8 tilings at an 8K prompt, 32 heads: 1.62 ms, 424 TFLOP/s
    (torch SDPA's flash backend 2.84 ms, cuDNN 1.22; benchmarks/results/h200_mla_prefill_sweep_session14.json).
    Starting the longest query blocks first was 6% slower there. The interpreter uses small tiles to keep its numpy
    work small."""
    if device.type == "cuda":
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)
    return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


def mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                fp8_scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                out_dtype: torch.dtype | None = None, k_rope: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:
    """Varlen causal (bottom-right aligned) attention: returns out [Tq, H, Dv] in q.dtype (`out_dtype` if given).
    `fp8_scales` (q_scale, k_scale, v_scale: fp32 [1] each): q, k, v are caller-quantized float8_e4m3fn, read as
    they are (q . k on the FP8 operands), their scales applied to the scores and the output.
    `k_rope` [Tk, R]: the keys' last R columns, shared by the heads, so that MLA's k =
    [k_nope per head | k_pe shared] is never built; k is then [Tk, H, Dqk - R]. `config`: the tiles (benchmarks)."""
    Tq, H, DQK = q.shape
    DV = v.shape[-1]
    B = cu_seqlens_q.shape[0] - 1
    if out is None:
        out = torch.empty((Tq, H, DV), dtype=out_dtype or q.dtype, device=q.device)
    if Tq == 0 or B == 0:
        return out
    cfg = {**_config(q.device), **(config or {})}
    BLOCK_M, BLOCK_N = cfg["BLOCK_M"], cfg["BLOCK_N"]
    D1 = 1 << (DQK.bit_length() - 1)                       # largest power of two <= DQK
    # the remainder's dot is at least one MMA deep: 16 for 16-bit operands, 32 for FP8 ones (sm_90's FP8 MMA)
    D2 = 0 if D1 == DQK else max(triton.next_power_of_2(DQK - D1), FP8_MIN_K if fp8_scales is not None else 16)
    if k_rope is None:
        k2, s_k2t, s_k2h = k[..., D1:], k.stride(0), k.stride(1)
    else:
        if k.shape[-1] != D1 or k_rope.shape[-1] != DQK - D1:
            raise ValueError(f"k_rope: k must hold the first {D1} of the {DQK} key columns, k_rope the rest")
        k2, s_k2t, s_k2h = k_rope, k_rope.stride(0), 0                 # one row a key for every head
    grid = (triton.cdiv(Tq, BLOCK_M) + B, H)
    qs, ks, vs = fp8_scales if fp8_scales is not None else (cu_seqlens_q,) * 3     # unread without FP8
    _mla_prefill_kernel[grid](
        q, k, k2, v, out, cu_seqlens_q, cu_seqlens_k, qs, ks, vs,
        float(scale) * LOG2E, B,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), s_k2t, s_k2h, v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        DQK=DQK, D1=D1, D2=D2, DV=DV, BLOCK_DV=max(triton.next_power_of_2(DV), 16),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_B=max(triton.next_power_of_2(B), 16),   # few variants: warm-up
        **dot_flags(q.dtype, q.device), FP8=fp8_scales is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


__all__ = ["FP8_MIN_K", "mla_prefill"]
