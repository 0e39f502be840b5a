"""MLA absorbed-form decode over the paged latent cache (split-K flash decoding).

One MLA layer's cache is `kv_cache [num_pages, page_size, W]` with `W = L + R`: `[:L]` the RMS-normalized latent
c_kv (which is both the absorbed key's no-PE part and the absorbed value), `[L:]` the shared k_pe. A query token t
(absorbed: `q_nope @ W_UK` concatenated with `q_pe`, shape `[H, W]`) attends to its request's positions
`0 .. kv_lens[t]-1`; request `req_idx[t]`'s position p lives at `kv_cache[block_tables[req, p // page_size],
p % page_size]`.

Stage 1 (`_mla_decode_partial_kernel`), grid `(cdiv(H, BLOCK_H), T, num_splits)`: one program owns one token, a
tile of BLOCK_H heads (all heads share the single latent KV head, so a tile reads each KV row once for BLOCK_H heads)
and one contiguous slice of the sequence. It streams BLOCK_N cache rows at a time, scores them with two dots
(latent part `[BLOCK_H, L] x [L, BLOCK_N]` and rope part `[BLOCK_H, R] x [R, BLOCK_N]`), and keeps an online
softmax (base-2, fp32) with the value accumulator `[BLOCK_H, L]` reusing the latent tile it already loaded.
With one split it normalizes and writes the final output and log-sum-exp; with several it writes each split's
normalized partial output and LSE (fp32), and stage 2 (`_mla_decode_merge_kernel`, grid `(T, H)`) merges them by
LSE. Splits are sized from the device-side `kv_lens` (no host sync); a split past a short sequence's end is empty
and writes LSE = -inf, which the merge weighs by zero.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kestrel.kernels.attention._common import dot_flags, mma
from kestrel.kernels.attention._kv_pages import layout_args, load_quant_latent, page_views, round_to

LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_partial_kernel(
    q_ptr, kv_ptr, kvf_ptr, kvh_ptr, bt_ptr, req_ptr, lens_ptr, out_ptr, lse_ptr,
    scale_log2, H,
    stride_qt, stride_qh,
    stride_kvp, stride_kvt,
    stride_bt,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh, stride_ls,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, PE_OFF: tl.constexpr, VAL_OFF: tl.constexpr, BS_OFF: tl.constexpr,
):
    hb = tl.program_id(0)               # head tiles of one token run side by side: they share its KV rows in L2
    t = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    req = tl.load(req_ptr + t).to(tl.int64)
    kv_len = tl.load(lens_ptr + t)
    # Split boundaries in multiples of BLOCK_N, so that only a split's last tile is partial.
    per_split = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < L
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R

    q_row = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_l[None, :], mask=mask_h[:, None] & mask_l[None, :], other=0.0)
    q_pe = tl.load(q_row + L + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)

    bt_row = bt_ptr + req * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        row = page * stride_kvp + (offs_n % PAGE_SIZE).to(tl.int64) * stride_kvt   # elements; bytes if quantized
        if FMT == 0:
            kv_nope = tl.load(kv_ptr + row[:, None] + offs_l[None, :], mask=mask_n[:, None] & mask_l[None, :],
                              other=0.0)
            kv_pe = tl.load(kv_ptr + row[:, None] + L + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :],
                            other=0.0)
        else:
            # quantized rows dequantize in the load path, to the query's dtype (the dequantize reference's rounding)
            kv_nope = round_to(load_quant_latent(kv_ptr, kvf_ptr, row, offs_l, mask_n[:, None] & mask_l[None, :],
                                                 FMT, GROUP, VAL_OFF, BS_OFF, BLOCK_N, BLOCK_L, L), q_nope.dtype)
            kv_pe = tl.load(kvh_ptr + (row // 2)[:, None] + PE_OFF // 2 + offs_r[None, :],
                            mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(q_nope.dtype)

        s = mma(q_nope, tl.trans(kv_nope), None, DOT_PREC, UPCAST)
        s = mma(q_pe, tl.trans(kv_pe), s, DOT_PREC, UPCAST)
        s = tl.where(mask_n[None, :], s * scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(p.to(kv_nope.dtype), kv_nope, acc * alpha[:, None], DOT_PREC, UPCAST)
        m_i = m_new

    nonempty = l_i > 0.0
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    o = acc * inv_l[:, None]
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * 0.6931471805599453, float("-inf"))

    o_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + split * stride_os + offs_l[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_l[None, :])
    tl.store(lse_ptr + t * stride_lt + offs_h * stride_lh + split * stride_ls, lse, mask=mask_h)


@triton.jit
def _mla_decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, lse_ptr,
    stride_mot, stride_moh, stride_mos,
    stride_mlt, stride_mlh,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    L: tl.constexpr, BLOCK_L: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)

    offs_s = tl.arange(0, BLOCK_S)
    lses = tl.load(mid_lse_ptr + t * stride_mlt + h * stride_mlh + offs_s, mask=offs_s < NUM_SPLITS,
                   other=float("-inf"))
    m = tl.max(lses, axis=0)                     # finite: kv_len >= 1, so at least one split is non-empty
    w_sum = tl.sum(tl.exp(lses - m), axis=0)

    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < L
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    base = mid_o_ptr + t * stride_mot + h * stride_moh
    for s in range(NUM_SPLITS):
        lse_s = tl.load(mid_lse_ptr + t * stride_mlt + h * stride_mlh + s)
        o_s = tl.load(base + s * stride_mos + offs_l, mask=mask_l, other=0.0)
        acc += tl.exp(lse_s - m) * o_s           # an empty split has lse -inf (weight 0) and o = 0
    out = acc / w_sum
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_l, out.to(out_ptr.dtype.element_ty), mask=mask_l)
    tl.store(lse_ptr + t * stride_lt + h * stride_lh, m + tl.log(w_sum))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _config(device: torch.device, T: int, H: int, num_splits: int, q_dtype: torch.dtype, quantized: bool) -> dict:
    """Tiles, from an H200 sweep (Triton 3.6, bf16, W = 576). The kernel is bound by its dots more than by HBM at
    BLOCK_H = 16 (mma M = 16), so the widest head tile that still gives about one wave of CTAs wins: 64 heads x 64
    rows (8 warps) reached 1.75 TB/s of KV for 128 x 8k at 64 heads, against 0.8 with 16-head tiles; when T x splits
    is small, narrower tiles keep the SMs busy instead (batch 32 x 8k at 64 heads: 16-head tiles 357 us vs 658).
    Shared memory (sm_90 allows 227 KiB = 232448 bytes a CTA; Triton 3.6's `metadata.shared` at L 512, R 64):
    bf16 rows 16 x 128 take 170 KB, but quantized rows add their dequantized [BLOCK_N, L] tile to the staged bytes
    (FP8 16 x 128: 365 KB, NVFP4 334 KB), so quantized pages take 16 x 64 (FP8 191 KB, NVFP4 176 KB; 32 x 64 and
    64 x 64: <= 211 KB). fp32 queries (their KV tiles fp32 too) double the tiles: 64-head tiles do not fit (FP8
    64 x 32: 242 KB), so they take at most 32 heads x 32 rows (<= 169 KB).
    The interpreter (CPU) takes 16 x 32 tiles: numpy arrays there, nothing to tune."""
    if device.type != "cuda":
        return dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=1)
    min_ctas = (_sm_count(device.index if device.index is not None else torch.cuda.current_device()) * 3) // 4
    wide = q_dtype.itemsize > 2
    bh = min(32 if wide else 64, max(16, triton.next_power_of_2(H)))
    while bh > 16 and T * triton.cdiv(H, bh) * num_splits < min_ctas:
        bh //= 2
    if wide:
        return dict(BLOCK_H=bh, BLOCK_N=32, num_warps=8 if bh == 32 else 4, num_stages=3 if bh == 32 else 2)
    if bh == 64:
        return dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2)
    if bh == 32:
        return dict(BLOCK_H=32, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_H=16, BLOCK_N=64 if quantized else 128, num_warps=4, num_stages=2)


def pick_num_splits(num_tokens: int, heads: int, max_kv_len: int, sm_count: int = 132,
                    min_split_len: int = 1024) -> int:
    """A split-K count for the scheduler (it knows lengths on the host): enough (token, head-tile, split) CTAs for
    about two waves, but no split shorter than `min_split_len` positions (the merge and each split's fixed cost)."""
    tiles = num_tokens * triton.cdiv(heads, 16)
    want = triton.cdiv(2 * sm_count, max(tiles, 1))
    return int(max(1, min(want, triton.cdiv(max_kv_len, min_split_len), 256)))


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, req_idx: torch.Tensor,
               kv_lens: torch.Tensor, scale: float, kv_lora_rank: int, num_splits: int = 1,
               out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
               fmt=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention for T query tokens over the paged latent cache.

    q [T, H, W], kv_cache [P, page_size, W] (W = kv_lora_rank + rope_dim), block_tables int32 [B, max_pages],
    req_idx int32 [T], kv_lens int32 [T]. Returns (out [T, H, kv_lora_rank] in q.dtype, lse [T, H] fp32, natural
    log of the sum of exp(scale * q.k)). No host synchronization: every length is read on the device.
    `fmt` (a quantized `KvPageFormat`): kv_cache is its byte pages [P, page_size, row_bytes], dequantized as read."""
    T, H, W = q.shape
    L = kv_lora_rank
    R = W - L
    page_size = kv_cache.shape[1]
    if out is None:
        out = torch.empty((T, H, L), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    cfg = _config(q.device, T, H, num_splits, q.dtype, fmt is not None and fmt.quantized)
    BLOCK_H, BLOCK_N = cfg["BLOCK_H"], cfg["BLOCK_N"]
    BLOCK_L = triton.next_power_of_2(L)
    BLOCK_R = max(triton.next_power_of_2(R), 16)
    grid = (triton.cdiv(H, BLOCK_H), T, num_splits)
    common = dict(L=L, R=R, BLOCK_L=BLOCK_L, BLOCK_R=BLOCK_R, PAGE_SIZE=page_size, BLOCK_H=BLOCK_H,
                  BLOCK_N=BLOCK_N, NUM_SPLITS=num_splits, **dot_flags(q.dtype, q.device), **layout_args(fmt),
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    scale_log2 = float(scale) * LOG2E
    kvf, kvh = page_views(kv_cache)
    if num_splits == 1:
        _mla_decode_partial_kernel[grid](
            q, kv_cache, kvf, kvh, block_tables, req_idx, kv_lens, out, lse,
            scale_log2, H,
            q.stride(0), q.stride(1),
            kv_cache.stride(0), kv_cache.stride(1),
            block_tables.stride(0),
            out.stride(0), out.stride(1), 0,
            lse.stride(0), lse.stride(1), 0,
            **common)
        return out, lse
    mid_o = torch.empty((T, H, num_splits, L), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((T, H, num_splits), dtype=torch.float32, device=q.device)
    _mla_decode_partial_kernel[grid](
        q, kv_cache, kvf, kvh, block_tables, req_idx, kv_lens, mid_o, mid_lse,
        scale_log2, H,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), mid_lse.stride(2),
        **common)
    _mla_decode_merge_kernel[(T, H)](
        mid_o, mid_lse, out, lse,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        L=L, BLOCK_L=BLOCK_L, NUM_SPLITS=num_splits, BLOCK_S=max(triton.next_power_of_2(num_splits), 2),
        num_warps=4 if L >= 256 else 1)
    return out, lse


__all__ = ["mla_decode", "pick_num_splits"]
