"""What the quantized-GEMM entries share: random stored weights (codes and scales drawn directly, so a K3 expert
stack never exists in fp32), the reference dequantize per format, and the validity checks of FP4 weights.

Random weights are scaled so that y = x @ W^T has |y| ~ 1 for x ~ N(0, 1): the mean square of a uniformly random
e2m1 code is 8.56 (rms 2.93), so the effective block scale is about K^-0.5 / 2.93.
"""

from __future__ import annotations

import math

import torch

from kestrel.catalog._op import overlaps
from kestrel.catalog.moe._common import _DEVICE_DRAW, _device_gen
from kestrel.quant.formats import dequantize_mx, dequantize_nvfp4

E2M1_RMS = 2.93
E4M3 = torch.float8_e4m3fn
MX_CODE_MAX = 191           # e8m0 codes above this would overflow the kernel's folded 2**63 (|w| > 2**64)


def _gen_for(numel: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Generator, torch.device]:
    if device.type != "cpu" and numel > _DEVICE_DRAW:
        return _device_gen(device, gen), device
    return gen, torch.device("cpu")


def rand_uint8(shape, lo: int, hi: int, gen: torch.Generator, device) -> torch.Tensor:
    """Uniform uint8 codes in [lo, hi), drawn on the device when large."""
    device = torch.device(device)
    g, where = _gen_for(math.prod(shape), device, gen)
    return torch.randint(lo, hi, tuple(shape), generator=g, device=where, dtype=torch.uint8).to(device)


def rand_uniform(shape, lo: float, hi: float, gen: torch.Generator, device) -> torch.Tensor:
    device = torch.device(device)
    g, where = _gen_for(math.prod(shape), device, gen)
    return (torch.rand(tuple(shape), generator=g, device=where) * (hi - lo) + lo).to(device)


def random_fp4_weight(fmt: str, lead: tuple[int, ...], N: int, K: int, gen: torch.Generator, device,
                      divisor: bool = True) -> dict:
    """Stored FP4 weight [*lead, N, K]: every byte uniformly random (all 16 codes in both nibbles), scales random
    around K^-0.5 / 2.93. MXFP4: {packed, scale (e8m0 codes)}; NVFP4: {packed, scale (e4m3), second (fp32 per row,
    compressed-tensors' divisor or ModelOpt's multiplier)}."""
    packed = rand_uint8((*lead, N, K // 2), 0, 256, gen, device)
    target = K ** -0.5 / E2M1_RMS
    if fmt == "mxfp4":
        c = 127 + round(math.log2(target))
        return dict(packed=packed, scale=rand_uint8((*lead, N, K // 32), c - 2, c + 2, gen, device))
    scale = rand_uniform((*lead, N, K // 16), 16.0, 448.0, gen, device).to(E4M3)
    g = 232.0 / target * rand_uniform((*lead, N, 1), 0.5, 2.0, gen, device)     # 232: mean of the e4m3 draw
    return dict(packed=packed, scale=scale, second=g if divisor else g.reciprocal(), divisor=divisor)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, second: torch.Tensor | None = None,
                   divisor: bool = True) -> torch.Tensor:
    """fp32 weights through the formats' reference dequantize (NVFP4 when the scale is e4m3)."""
    if scale.dtype == E4M3:
        return dequantize_nvfp4(packed, scale, second, divisor=divisor)
    return dequantize_mx(packed, scale)


def fp4_widths(scale: torch.Tensor, divisor: bool, out: torch.Tensor | None) -> dict:
    """The format widths of a W4A16 launch: the format, NVFP4's tensor-scale convention, the output dtype."""
    nv = scale.dtype == E4M3
    return {"fmt": "nvfp4" if nv else "mxfp4", "divisor": bool(divisor) if nv else None,
            "out_dtype": out.dtype if out is not None else torch.bfloat16}


def fp4_cell_widths(spec: dict) -> dict:
    return {"fmt": spec["fmt"], "divisor": spec.get("divisor", True) if spec["fmt"] == "nvfp4" else None,
            "out_dtype": spec.get("out_dtype", torch.bfloat16)}


def fp4_weight_ok(packed: torch.Tensor, scale: torch.Tensor, second: torch.Tensor | None, ndim: int) -> str | None:
    """Why an FP4 weight (`ndim` 2 dense, 3 stacked) would be read wrong, or None."""
    if packed.dtype != torch.uint8 or packed.dim() != ndim or packed.stride(-1) != 1:
        return f"packed must be uint8 with {ndim} dims and a contiguous last dim, got {packed.dtype} " \
               f"{tuple(packed.shape)}"
    *lead, N, Kh = packed.shape
    nv = scale.dtype == E4M3
    if not nv and scale.dtype != torch.uint8:
        return f"scale must be e8m0 codes (uint8, MXFP4) or float8_e4m3fn (NVFP4), got {scale.dtype}"
    group = 16 if nv else 32
    K = 2 * Kh
    if K % 32:
        return f"K={K} is not a multiple of 32 (the kernel's packed rows; {group}-element scale blocks)"
    if tuple(scale.shape) != (*lead, N, K // group) or scale.stride(-1) != 1:
        return f"scale must be [{', '.join(map(str, (*lead, N, K // group)))}] with a contiguous last dim, " \
               f"got {tuple(scale.shape)}"
    if nv:
        if second is None or second.dtype != torch.float32 or tuple(second.shape) != (*lead, N, 1) \
                or second.stride(-2) != 1:
            return f"NVFP4 needs second, fp32 [{', '.join(map(str, (*lead, N)))}, 1] (one tensor scale per row)"
        if not bool(torch.isfinite(second).all()) or bool((second == 0).any()):
            return "NVFP4 tensor scale holds zero or non-finite values"
    else:
        if second is not None:
            return "MXFP4 has no tensor scale (second must be None)"
        if scale.numel() and int(scale.max()) > MX_CODE_MAX:
            return f"e8m0 scale codes above {MX_CODE_MAX} (NaN blocks or |w| > 2**64) are not supported"
    return None


def gemm_out_ok(out: torch.Tensor | None, M: int, N: int, inputs: tuple, split_k: int | None) -> str | None:
    """The checks every quantized GEMM makes of `out` (bf16 or fp32 [M, N], contiguous rows, no aliasing) and of
    its `split_k`."""
    if out is not None:
        if out.shape != (M, N) or out.stride(-1) != 1 or out.dtype not in (torch.bfloat16, torch.float32):
            return f"out must be [{M}, {N}] bf16 or fp32 with a contiguous last dim"
        if any(overlaps(out, t) for t in inputs):
            return "out overlaps an input"
    if split_k is not None and split_k < 1:
        return "split_k must be >= 1"
    return None


def into_out(y: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A reference's fp32 result in out's dtype (written into out when given), else in `dtype`."""
    y = y.to(out.dtype if out is not None else dtype)
    if out is not None:
        out.copy_(y)
        y = out
    return y
