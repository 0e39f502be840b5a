"""kv_a_layernorm fused into the MLA cache write: the kv_a projection's row [c_kv | k_pe] goes to its page slot as
[norm_weight * rmsnorm(c_kv) | k_pe] in one pass (AddRmsNorm + MlaCacheWrite -> one launch).

kv_cache [num_pages, page_size, L + R]: token t of request `req_idx[t]` at position `positions[t]` goes to
`kv_cache[block_tables[req, pos // page_size], pos % page_size]`; a negative position is padding (CUDA-graph
batch padding) and writes nothing. The norm is fp32 math over the L latent columns held in registers, cast once
to the cache dtype (round to nearest even, spelled out under the interpreter whose bf16 cast truncates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels import interpreting
from kestrel.kernels.norm.rmsnorm import _bf16_rne


@triton.jit
def _mla_norm_cache_write_kernel(
    kv_ptr, w_ptr, cache_ptr, bt_ptr, req_ptr, pos_ptr,
    T, eps,
    stride_kv, stride_cp, stride_ct, stride_bt,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, RNE_BF16: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = offs_t < T
    pos = tl.load(pos_ptr + offs_t, mask=in_range, other=-1).to(tl.int64)
    live = in_range & (pos >= 0)
    req = tl.load(req_ptr + offs_t, mask=live, other=0).to(tl.int64)
    pos = tl.where(live, pos, 0)
    page = tl.load(bt_ptr + req * stride_bt + pos // PAGE_SIZE, mask=live, other=0).to(tl.int64)
    dst = cache_ptr + page * stride_cp + (pos % PAGE_SIZE) * stride_ct
    row = kv_ptr + offs_t.to(tl.int64) * stride_kv

    offs_l = tl.arange(0, BLOCK_L)
    lmask = offs_l < L
    m_l = live[:, None] & lmask[None, :]
    c = tl.load(row[:, None] + offs_l[None, :], mask=m_l, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(c * c, axis=1) / L + eps)
    y = c * inv[:, None] * tl.load(w_ptr + offs_l, mask=lmask, other=0.0).to(tl.float32)[None, :]
    if RNE_BF16:
        yq = _bf16_rne(y)
    else:
        yq = y.to(cache_ptr.dtype.element_ty)
    tl.store(dst[:, None] + offs_l[None, :], yq, mask=m_l)

    offs_r = tl.arange(0, BLOCK_R)
    m_r = live[:, None] & (offs_r < R)[None, :]
    pe = tl.load(row[:, None] + L + offs_r[None, :], mask=m_r, other=0.0)
    tl.store(dst[:, None] + L + offs_r[None, :], pe.to(cache_ptr.dtype.element_ty), mask=m_r)


def mla_norm_cache_write(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, kv_cache: torch.Tensor,
                         block_tables: torch.Tensor, req_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """kv [T, L + R] (unit stride along the row, any row stride), norm_weight [L]. In place; returns kv_cache."""
    T = kv.shape[0]
    L = norm_weight.numel()
    R = kv.shape[1] - L
    if T == 0:
        return kv_cache
    BLOCK_T = 4 if kv_cache.device.type == "cuda" else 8
    _mla_norm_cache_write_kernel[(triton.cdiv(T, BLOCK_T),)](
        kv, norm_weight, kv_cache, block_tables, req_idx, positions,
        T, float(eps),
        kv.stride(0), kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        L=L, R=R, BLOCK_L=triton.next_power_of_2(L), BLOCK_R=triton.next_power_of_2(R),
        PAGE_SIZE=kv_cache.shape[1], BLOCK_T=BLOCK_T, RNE_BF16=interpreting() and kv_cache.dtype == torch.bfloat16,
        num_warps=4)
    return kv_cache
