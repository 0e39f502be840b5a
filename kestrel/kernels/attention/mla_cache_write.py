"""Write new tokens' MLA latent and k_pe into one layer's paged latent cache.

kv_cache [num_pages, page_size, L + R]: token t of request `req_idx[t]` at position `positions[t]` goes to
`kv_cache[block_tables[req, pos // page_size], pos % page_size]`, `[:L]` <- latent[t], `[L:]` <- k_pe[t].
A negative position marks a padding token (CUDA-graph batch padding) and writes nothing.
Grid `(cdiv(T, BLOCK_T),)`: each program copies BLOCK_T tokens' rows; everything is read on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mla_cache_write_kernel(
    lat_ptr, pe_ptr, kv_ptr, bt_ptr, req_ptr, pos_ptr,
    T,
    stride_lat, stride_pe, stride_kvp, stride_kvt, stride_bt,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = offs_t < T
    pos = tl.load(pos_ptr + offs_t, mask=in_range, other=-1).to(tl.int64)
    live = in_range & (pos >= 0)
    req = tl.load(req_ptr + offs_t, mask=live, other=0).to(tl.int64)
    pos = tl.where(live, pos, 0)
    page = tl.load(bt_ptr + req * stride_bt + pos // PAGE_SIZE, mask=live, other=0).to(tl.int64)
    dst = kv_ptr + page * stride_kvp + (pos % PAGE_SIZE) * stride_kvt
    offs_t64 = offs_t.to(tl.int64)

    offs_l = tl.arange(0, BLOCK_L)
    m_l = live[:, None] & (offs_l < L)[None, :]
    lat = tl.load(lat_ptr + offs_t64[:, None] * stride_lat + offs_l[None, :], mask=m_l, other=0.0)
    tl.store(dst[:, None] + offs_l[None, :], lat.to(kv_ptr.dtype.element_ty), mask=m_l)

    offs_r = tl.arange(0, BLOCK_R)
    m_r = live[:, None] & (offs_r < R)[None, :]
    pe = tl.load(pe_ptr + offs_t64[:, None] * stride_pe + offs_r[None, :], mask=m_r, other=0.0)
    tl.store(dst[:, None] + L + offs_r[None, :], pe.to(kv_ptr.dtype.element_ty), mask=m_r)


def mla_cache_write(latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    req_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """In place; returns kv_cache."""
    T, L = latent.shape
    R = k_pe.shape[1]
    if T == 0:
        return kv_cache
    BLOCK_T = 4 if kv_cache.device.type == "cuda" else 8
    _mla_cache_write_kernel[(triton.cdiv(T, BLOCK_T),)](
        latent, k_pe, kv_cache, block_tables, req_idx, positions,
        T,
        latent.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        L=L, R=R, BLOCK_L=triton.next_power_of_2(L), BLOCK_R=triton.next_power_of_2(R),
        PAGE_SIZE=kv_cache.shape[1], BLOCK_T=BLOCK_T, num_warps=4)
    return kv_cache


__all__ = ["mla_cache_write"]
