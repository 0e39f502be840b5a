"""Reading and writing quantized MLA page rows inside Triton kernels (the layout: kestrel/quant/kv_cache.py).

A quantized layer's pages are bytes `[num_pages, page_size, row_bytes]`; a row is `[fp32 scales | bf16 k_pe |
values | (nvfp4) e4m3 block scales]`, each field aligned for its dtype, so the kernels address it through three
views of the same storage: bytes, fp32 words (row offset / 4) and bf16 halves (row offset / 2).

Codes are decoded with integer arithmetic, not fp8 conversions: the same bits on the GPU and under the CPU
interpreter, and the same fp32 products (value * scale) as the plain-torch dequantize, so a kernel's dequantized
tile equals `KvPageFormat.decode` bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FMT_PLAIN, FMT_FP8, FMT_NVFP4 = 0, 1, 2
FMT_CODES = {"fp8": FMT_FP8, "nvfp4": FMT_NVFP4}


@triton.jit
def e4m3_to_f32(b):
    """float8_e4m3fn codes (uint8) -> fp32: bias 7, subnormals m * 2^-9, 0x7F / 0xFF NaN."""
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    v = tl.where((e == 15) & (m == 7), float("nan"), v)
    return tl.where((b & 128) != 0, -v, v)


@triton.jit
def e2m1_to_f32(c):
    """e2m1 codes (0..15, int32) -> fp32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (bit 3)."""
    e = (c >> 1) & 3
    m = c & 1
    pow2 = (((e + 126) << 23)).to(tl.float32, bitcast=True)       # 2^(e-1)
    v = tl.where(e == 0, m.to(tl.float32) * 0.5, pow2 * (1.0 + 0.5 * m.to(tl.float32)))
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype`, to nearest even also for bf16 (the CPU interpreter's bf16 conversion truncates;
    rounding the fp32 bits first makes that truncation exact, and costs the GPU three integer ops)."""
    if dtype == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def load_quant_latent(kv_ptr, kvf_ptr, row, offs_l, mask, FMT: tl.constexpr, GROUP: tl.constexpr,
                      VAL_OFF: tl.constexpr, BS_OFF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
                      L: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_L] c_kv of quantized rows at byte offsets `row` [BLOCK_N] (channels offs_l, `mask`).
    When L fills the tile (a power of two: 512, the tiny 32) the scales are loaded once per group and broadcast over
    a [rows, groups, group] view (those loads are unmasked: a masked row reads page 0, in bounds, and is zeroed at
    the end); otherwise each channel gathers its own scale."""
    base = kv_ptr + row[:, None] + VAL_OFF
    if FMT == 1:
        v = e4m3_to_f32(tl.load(base + offs_l[None, :], mask=mask, other=0))
        if L == BLOCK_L:
            offs_g = tl.arange(0, L // GROUP)
            s = tl.load(kvf_ptr + (row // 4)[:, None] + offs_g[None, :])
            v = tl.reshape(tl.reshape(v, (BLOCK_N, L // GROUP, GROUP)) * s[:, :, None], (BLOCK_N, BLOCK_L))
            return tl.where(mask, v, 0.0)     # masked rows read page 0's scales: never let one reach the sum
        else:
            s = tl.load(kvf_ptr + (row // 4)[:, None] + (offs_l // GROUP)[None, :], mask=mask, other=0.0)
            return v * s
    else:
        s2 = tl.load(kvf_ptr + row // 4)
        if L == BLOCK_L:
            offs_p = tl.arange(0, L // 2)
            byte = tl.load(base + offs_p[None, :]).to(tl.int32)
            v = tl.interleave(e2m1_to_f32(byte & 15), e2m1_to_f32(byte >> 4))        # element 2j: low nibble
            offs_b = tl.arange(0, L // 16)
            bs = e4m3_to_f32(tl.load(kv_ptr + row[:, None] + BS_OFF + offs_b[None, :]))
            blocks = tl.reshape(v, (BLOCK_N, L // 16, 16)) * (bs * s2[:, None])[:, :, None]
            return tl.where(mask, tl.reshape(blocks, (BLOCK_N, BLOCK_L)), 0.0)
        else:
            byte = tl.load(base + (offs_l // 2)[None, :], mask=mask, other=0).to(tl.int32)
            v = e2m1_to_f32((byte >> ((offs_l % 2) * 4)[None, :]) & 15)
            bs = e4m3_to_f32(tl.load(kv_ptr + row[:, None] + BS_OFF + (offs_l // 16)[None, :], mask=mask,
                                     other=0))
            return v * (bs * s2[:, None])


def page_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 words, bf16 halves) of a quantized page tensor's bytes; the plain cache itself for plain pages."""
    if kv_cache.dtype != torch.uint8:
        return kv_cache, kv_cache
    return kv_cache.view(torch.float32), kv_cache.view(torch.bfloat16)


def layout_args(fmt) -> dict:
    """The constexprs of a page format (a `KvPageFormat`, or None for plain rows)."""
    if fmt is None or not fmt.quantized:
        return dict(FMT=FMT_PLAIN, GROUP=1, PE_OFF=0, VAL_OFF=0, BS_OFF=0)
    return dict(FMT=FMT_CODES[fmt.kind], GROUP=fmt.group, PE_OFF=fmt.pe_offset, VAL_OFF=fmt.values_offset,
                BS_OFF=fmt.block_scale_offset if fmt.kind == "nvfp4" else 0)
