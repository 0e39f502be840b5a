"""Sigmoid MoE router kernels: the logits GEMV of decode-sized batches, and logits -> (topk_ids int32 [T, k],
topk_weights fp32 [T, k]).

The logits GEMM ([T, H] x [E, H]^T in fp32) is a torch matmul (cuBLAS; TF32 must stay off) past one token. For
one token cuBLAS picks 64-expert tiles, so Kimi Linear's 256 experts run on 4 CTAs that each walk all of K (about
6 us a layer on the H200 for 1.2 MB of weight); `router_logits_small` spreads the experts over many programs
instead (fp32 products of the bf16 / fp32 operands, fp32 sums: the fp32 GEMM up to summation order). The top-k
kernel does the rest in one pass per token, over the E scores held in registers as a [G_PAD, GS_PAD] tile (groups
x experts of a group):
    s = sigmoid(logits); choice = s + bias
    grouped top-k: group score = sum of the two best choices in the group; keep the topk_group best groups
    top-k by choice (k rounds of max / lowest index of the max / mask), weights = s of the chosen experts,
    renormalized to sum 1 when asked, times routed_scaling_factor.
Ties go to the lowest expert index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.moe._common import pow2, warps_for


@triton.jit
def _router_topk_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, s_l, scale,
                        TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr, GS_PAD: tl.constexpr, K_PAD: tl.constexpr,
                        HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_PAD)
    j = tl.arange(0, GS_PAD)
    valid = (g < N_GROUP)[:, None] & (j < GROUP_SIZE)[None, :]
    big: tl.constexpr = G_PAD * GS_PAD * 2
    e = tl.where(valid, g[:, None] * GROUP_SIZE + j[None, :], big)      # padding never aliases an expert
    logit = tl.load(logits_ptr + t * s_l + e, mask=valid, other=0.0).to(tl.float32)
    s = tl.sigmoid(logit)
    choice = s
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    if TOPK_GROUP < N_GROUP:
        m1 = tl.max(choice, axis=1)
        first = tl.min(tl.where(choice == m1[:, None], j[None, :], GS_PAD), axis=1)
        m2 = tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), choice), axis=1)
        gscore = tl.where(g < N_GROUP, m1 + m2, float("-inf"))
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gscore, axis=0)
            bi = tl.min(tl.where(gscore == best, g, G_PAD), axis=0)
            keep = keep | (g == bi)
            gscore = tl.where(g == bi, float("-inf"), gscore)
        choice = tl.where(keep[:, None], choice, float("-inf"))

    kk = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    wts = tl.zeros([K_PAD], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        bi = tl.min(tl.min(tl.where(choice == best, e, big), axis=1), axis=0)   # ties: lowest index
        sel = e == bi
        sw = tl.sum(tl.sum(tl.where(sel, s, 0.0), axis=1), axis=0)
        ids = tl.where(kk == i, bi, ids)
        wts = tl.where(kk == i, sw, wts)
        choice = tl.where(sel, float("-inf"), choice)
    if RENORM:
        wts = wts / tl.sum(wts, axis=0)
    wts = wts * scale
    kmask = kk < TOP_K
    tl.store(ids_ptr + t * TOP_K + kk, ids, mask=kmask)
    tl.store(w_ptr + t * TOP_K + kk, wts, mask=kmask)


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, T, E, H, s_x, s_w, s_o,
                          BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """logits[:, e0:e0+BE] of all T (<= BT) tokens: products summed per lane over K, reduced once at the end."""
    re = tl.program_id(0) * BE + tl.arange(0, BE)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    emask, tmask = re < E, rt < T
    x_ptrs = x_ptr + rt.to(tl.int64)[:, None] * s_x + rk[None, :]
    w_ptrs = w_ptr + re.to(tl.int64)[:, None] * s_w + rk[None, :]
    acc = tl.zeros([BT, BE, BK], dtype=tl.float32)
    for k0 in range(0, H, BK):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=tmask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=emask[:, None], other=0.0)
        else:
            kmask = rk + k0 < H
            x = tl.load(x_ptrs, mask=tmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=emask[:, None] & kmask[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        x_ptrs += BK
        w_ptrs += BK
    out = tl.sum(acc, axis=2)
    tl.store(out_ptr + rt.to(tl.int64)[:, None] * s_o + re[None, :], out, mask=tmask[:, None] & emask[None, :])


SMALL_T = 1      # router_logits_small on the serving path: batch-1 decode steps (H200, in a graph: 2.6 us against
#                  cuBLAS's 6.0; at 8 tokens its 4-expert programs took 21 us, cuBLAS 6.0)


def small_config(T: int, H: int) -> tuple[int, int, int]:
    """(BE experts a program, BK, num_warps). One token: 2 experts a program over the whole of K at once (K up to
    4096 in one masked step, so every load of a program is in flight together: the kernel is load latency, not
    bandwidth); more tokens: 4 experts, K in steps sized so that [BT, BE, BK] stays at 16-32 values a thread."""
    bt = pow2(T)
    if bt == 1:
        return 2, min(4096, pow2(H, 16)), 8
    return 4, {2: 256, 4: 128}.get(bt, 64), 4


def router_logits_small(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 [T, E] = x [T, H] @ weight [E, H]^T for a few tokens (both operands' last dim contiguous): a few experts
    a program (128 programs for 256 experts at one token), each streaming its weight rows once. Correct for any
    T up to 16; `router_logits` calls it for T <= SMALL_T."""
    T, H = x.shape
    E = weight.shape[0]
    if T > 16:
        raise ValueError(f"router_logits_small takes at most 16 tokens, got {T}")
    out = torch.empty((T, E), dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    be, bk, warps = small_config(T, H)
    _router_logits_kernel[(triton.cdiv(E, be),)](
        x, weight, out, T, E, H, x.stride(0), weight.stride(0), out.stride(0), BT=pow2(T), BE=be, BK=bk,
        EVEN_K=H % bk == 0, num_warps=warps)
    return out


def router_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int = 1,
                topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                out_ids: torch.Tensor | None = None, out_weights: torch.Tensor | None = None):
    """logits fp32 [T, E] (last dim contiguous) -> (topk_ids int32 [T, k], topk_weights fp32 [T, k])."""
    T, E = logits.shape
    if out_ids is None:
        out_ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    if out_weights is None:
        out_weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    if T == 0:
        return out_ids, out_weights
    gsize = E // n_group
    g_pad, gs_pad = pow2(n_group), pow2(gsize)
    _router_topk_kernel[(T,)](
        logits, bias if bias is not None else logits, out_ids, out_weights, logits.stride(0),
        float(routed_scaling_factor), TOP_K=top_k, N_GROUP=n_group,
        TOPK_GROUP=topk_group if n_group > 1 else n_group, GROUP_SIZE=gsize, G_PAD=g_pad, GS_PAD=gs_pad,
        K_PAD=pow2(top_k), HAS_BIAS=bias is not None, RENORM=bool(norm_topk_prob),
        num_warps=warps_for(g_pad * gs_pad // 4))
    return out_ids, out_weights
