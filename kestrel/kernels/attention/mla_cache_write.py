"""Write new tokens' MLA latent and k_pe into one layer's paged latent cache.

kv_cache [num_pages, page_size, L + R]: token t of request `req_idx[t]` at position `positions[t]` goes to
`kv_cache[block_tables[req, pos // page_size], pos % page_size]`, `[:L]` <- latent[t], `[L:]` <- k_pe[t].
A negative position marks a padding token (CUDA-graph batch padding) and writes nothing.
`mla_cache_write_quant` writes FP8 / NVFP4 byte pages instead (kestrel/quant/kv_cache.py): it quantizes each
token's latent on the way in.
Grid `(cdiv(T, BLOCK_T),)`: each program copies BLOCK_T tokens' rows; everything is read on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.attention._kv_pages import layout_args, page_views, round_to
from kestrel.kernels.quant.fp8 import _round_to_e4m3 as round_to_e4m3


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


@triton.jit
def _e2m1_code(v):
    """e2m1 codes (int32 0..15) of fp32 v: ties to the even code, saturating at 6, the sign bit from v's (so -0.0 is
    code 8); NaN gives 0 (quant.codes.e2m1_encode's rule)."""
    mag = tl.abs(v)
    c = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32) \
        + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32) + (mag > 5.0).to(tl.int32)
    return c | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3)


@triton.jit
def _mla_cache_write_quant_kernel(
    lat_ptr, pe_ptr, kv_ptr, kv8_ptr, kvf_ptr, kvh_ptr, bt_ptr, req_ptr, pos_ptr,
    T,
    stride_lat, stride_pe, stride_kvp, stride_kvt, stride_bt,
    L: tl.constexpr, R: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, FMT: tl.constexpr, PE_OFF: tl.constexpr, VAL_OFF: tl.constexpr, BS_OFF: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Quantized rows (kestrel/quant/kv_cache.py), with the plain-torch quantize's bits: IEEE divisions (div_rn),
    ties-to-even e4m3 / e2m1 / bf16 rounding.
    FMT 1 (fp8): per group of GROUP channels scale = amax / 448 (1 if all zero), e4m3(x / scale).
    FMT 2 (nvfp4): s2 = row amax / 2688 (1 if zero); per 16 channels block scale e4m3(amax / 6 / s2), e2m1 codes
    of x * (1 / (scale * s2)), two per byte (even channel in the low nibble)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = offs_t < T
    pos = tl.load(pos_ptr + offs_t, mask=in_range, other=-1).to(tl.int64)
    live = in_range & (pos >= 0)
    req = tl.load(req_ptr + offs_t, mask=live, other=0).to(tl.int64)
    pos = tl.where(live, pos, 0)
    page = tl.load(bt_ptr + req * stride_bt + pos // PAGE_SIZE, mask=live, other=0).to(tl.int64)
    row = page * stride_kvp + (pos % PAGE_SIZE) * stride_kvt          # bytes
    lat = lat_ptr + offs_t.to(tl.int64)[:, None] * stride_lat

    if FMT == 1:
        offs_g = tl.arange(0, BLOCK_G)
        m_g = live[:, None] & (offs_g < GROUP)[None, :]
        for g in tl.static_range(L // GROUP):
            x = tl.load(lat + g * GROUP + offs_g[None, :], mask=m_g, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=1)
            s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
            q = round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, s[:, None]), -448.0), 448.0))
            tl.store(kv8_ptr + row[:, None] + VAL_OFF + g * GROUP + offs_g[None, :], q.to(tl.float8e4nv), mask=m_g)
            tl.store(kvf_ptr + row // 4 + g, s, mask=live)
    else:
        offs_l = tl.arange(0, BLOCK_L)
        x = tl.load(lat + offs_l[None, :], mask=live[:, None] & (offs_l < L)[None, :], other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        s2 = tl.where(amax > 0, tl.math.div_rn(amax, 2688.0), 1.0)
        tl.store(kvf_ptr + row // 4, s2, mask=live)
        offs_j = tl.arange(0, 8)
        m_j = live[:, None] & (offs_j < 8)[None, :]
        for b in tl.static_range(L // 16):
            even = tl.load(lat + b * 16 + 2 * offs_j[None, :], mask=m_j, other=0.0).to(tl.float32)
            odd = tl.load(lat + b * 16 + 2 * offs_j[None, :] + 1, mask=m_j, other=0.0).to(tl.float32)
            bamax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))
            sc = round_to_e4m3(tl.minimum(tl.math.div_rn(tl.math.div_rn(bamax, 6.0), s2), 448.0))
            tl.store(kv8_ptr + row + BS_OFF + b, sc.to(tl.float8e4nv), mask=live)
            eff = sc * s2
            inv = tl.where(eff > 0, tl.math.div_rn(1.0, tl.where(eff > 0, eff, 1.0)), 0.0)
            byte = _e2m1_code(even * inv[:, None]) | (_e2m1_code(odd * inv[:, None]) << 4)
            tl.store(kv_ptr + row[:, None] + VAL_OFF + b * 8 + offs_j[None, :], byte.to(tl.uint8), mask=m_j)

    offs_r = tl.arange(0, BLOCK_R)
    m_r = live[:, None] & (offs_r < R)[None, :]
    pe = tl.load(pe_ptr + offs_t.to(tl.int64)[:, None] * stride_pe + offs_r[None, :], mask=m_r,
                 other=0.0).to(tl.float32)
    tl.store(kvh_ptr + (row // 2)[:, None] + PE_OFF // 2 + offs_r[None, :], round_to(pe, tl.bfloat16), mask=m_r)


def mla_cache_write_quant(latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                          block_tables: torch.Tensor, req_idx: torch.Tensor, positions: torch.Tensor,
                          fmt) -> torch.Tensor:
    """Quantize and write into byte pages [P, page_size, row_bytes] of `fmt` (an fp8 or nvfp4 `KvPageFormat`),
    in place; returns kv_cache."""
    T, L = latent.shape
    R = k_pe.shape[1]
    if T == 0:
        return kv_cache
    kvf, kvh = page_views(kv_cache)
    lay = layout_args(fmt)
    BLOCK_T = 4 if kv_cache.device.type == "cuda" else 8
    _mla_cache_write_quant_kernel[(triton.cdiv(T, BLOCK_T),)](
        latent, k_pe, kv_cache, kv_cache.view(torch.float8_e4m3fn), kvf, kvh, block_tables, req_idx, positions,
        T,
        latent.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        L=L, R=R, GROUP=fmt.group, BLOCK_G=triton.next_power_of_2(fmt.group), BLOCK_L=triton.next_power_of_2(L),
        BLOCK_R=triton.next_power_of_2(R), FMT=lay["FMT"], PE_OFF=lay["PE_OFF"], VAL_OFF=lay["VAL_OFF"],
        BS_OFF=lay["BS_OFF"], PAGE_SIZE=kv_cache.shape[1], BLOCK_T=BLOCK_T, num_warps=4)
    return kv_cache


__all__ = ["mla_cache_write", "mla_cache_write_quant"]
