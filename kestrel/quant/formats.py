"""Weight formats: quantize (float -> stored tensors) and the plain-torch dequantize that is the reference for every
kernel that reads them. A weight is [..., N, K] (out rows, in columns); blocks run along K.

| format | values | scale | second level |
|---|---|---|---|
| MXFP4 | e2m1, two per byte | e8m0 per 32 | - |
| NVFP4 | e2m1, two per byte | e4m3 per 16 | fp32 per tensor |
| MXFP8 | e4m3 | e8m0 per 32 | - |
| FP8 | e4m3 | fp32 per tensor, per row (channel) or per 128x128 block | - |

Shapes: MX / NVFP4 need K to be a multiple of the block (32 / 16); other shapes are refused (ValueError), never
padded, as compressed-tensors does. FP8 blocks may be partial at the right and bottom edges (scale
[ceil(N/128), ceil(K/128)], the DeepSeek-V3 / compressed-tensors FP8_BLOCK convention).

NVFP4's tensor-level scale has two spellings with the same meaning: compressed-tensors stores `weight_global_scale`
g = 448*6/amax and dequantizes q * (s / g) (a divisor); ModelOpt stores `weight_scale_2` s2 = amax/(448*6) and
dequantizes q * (s * s2) (a multiplier). Each convention is computed the way its library does, so a checkpoint we
write is decoded bit for bit by that library. An all-zero block has scale 0 and decodes to zeros (compressed-tensors
writes its eps 0.125 there, ModelOpt 1.0; any value decodes to the same zeros).
"""

from __future__ import annotations

import math

import torch

from kestrel.quant.codes import (E2M1_EMAX, E2M1_MAX, E4M3_EMAX, E4M3_MAX, div_by, e2m1_decode, e2m1_encode,
                                 e4m3_encode, e8m0_decode, e8m0_encode, fp8_scale, mx_scale_exponent, pack_nibbles,
                                 unpack_nibbles)

MX_BLOCK = 32
NVFP4_BLOCK = 16
FP8_BLOCK = (128, 128)
FORMATS = ("mxfp4", "nvfp4", "mxfp8", "fp8")
FP8_GRANULARITIES = ("tensor", "channel", "block")


def _blocks(w: torch.Tensor, block: int, what: str) -> torch.Tensor:
    if w.dim() < 2 or w.shape[-1] % block:
        raise ValueError(f"{what} needs [..., N, K] with K a multiple of {block}, got {tuple(w.shape)}")
    return w.float().unflatten(-1, (w.shape[-1] // block, block))


def _finite_amax(w: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """The largest finite magnitude (a NaN / inf element must not poison the tensor-level scale), of the whole
    tensor or of each row ([..., N, 1])."""
    a = w.float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    return a.amax(-1, keepdim=True) if per_row else a.amax()


# ---------------------------------------------------------------------------------------------------------------
# MXFP4 / MXFP8

def quantize_mx(w: torch.Tensor, elem: str, rule: str = "ocp") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (elem "e2m1": packed uint8 [..., N, K/2]) or MXFP8 (elem "e4m3": float8_e4m3fn [..., N, K]), and the
    e8m0 scale codes (uint8 [..., N, K/32]). `rule` picks the scale exponent (see codes.mx_scale_exponent)."""
    emax = {"e2m1": E2M1_EMAX, "e4m3": E4M3_EMAX}[elem]
    x = _blocks(w, MX_BLOCK, "MX" + ("FP4" if elem == "e2m1" else "FP8"))
    exp = mx_scale_exponent(x.abs().amax(-1), emax, rule)
    codes = e8m0_encode(exp)
    scaled = x * e8m0_decode(codes).nan_to_num(nan=1.0).reciprocal().unsqueeze(-1)   # exact: a power of two
    if elem == "e2m1":
        return pack_nibbles(e2m1_encode(scaled.flatten(-2))), codes
    return e4m3_encode(scaled.flatten(-2)), codes


def dequantize_mx(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [..., N, K] of MX values (packed uint8 e2m1 or float8_e4m3fn) times their e8m0 block scales."""
    v = e2m1_decode(unpack_nibbles(values)) if values.dtype == torch.uint8 else values.float()
    return (v.unflatten(-1, (-1, MX_BLOCK)) * e8m0_decode(scale).unsqueeze(-1)).flatten(-2)


# ---------------------------------------------------------------------------------------------------------------
# NVFP4

def quantize_nvfp4(w: torch.Tensor, convention: str = "compressed-tensors", per_row: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., N, K/2], e4m3 block scales [..., N, K/16], tensor scale fp32 [1]): the tensor scale is
    compressed-tensors' divisor `weight_global_scale` or ModelOpt's multiplier `weight_scale_2` (`convention`).
    `per_row`: one second-level scale per row instead, fp32 [..., N, 1] (the quantized KV cache, whose rows are
    written one token at a time, so no tensor-wide amax exists)."""
    x = _blocks(w, NVFP4_BLOCK, "NVFP4")
    amax = _finite_amax(w, per_row)
    some = amax > 0
    block_amax = x.abs().amax(-1)                      # NaN / inf blocks: NaN / saturated scale below
    # every division by a constant is `div_by`'s IEEE quotient: torch on CUDA would multiply by a rounded
    # reciprocal instead, and the quantized KV cache's write kernel must match this bit for bit on every device
    if convention == "compressed-tensors":
        second = torch.where(some, torch.full_like(amax, E4M3_MAX * E2M1_MAX) / amax, 1.0)  # true division
        scale = e4m3_encode(div_by(block_amax, E2M1_MAX) * second)
        effective = scale.float() / second
    elif convention == "modelopt":
        second = torch.where(some, div_by(amax, E4M3_MAX * E2M1_MAX), 1.0)
        scale = e4m3_encode(div_by(block_amax, E2M1_MAX) / second)
        effective = scale.float() * second
    else:
        raise ValueError(f"NVFP4 convention {convention!r}: use 'compressed-tensors' or 'modelopt'")
    nan_block = torch.isnan(block_amax) | torch.isinf(block_amax)
    scale = torch.where(nan_block, torch.full_like(scale, float("nan")), scale)
    inv = torch.where(effective > 0, effective.reciprocal(), torch.zeros_like(effective)).nan_to_num(nan=0.0)
    packed = pack_nibbles(e2m1_encode((x * inv.unsqueeze(-1)).flatten(-2)))
    return packed, scale, second.float() if per_row else second.float().reshape(1)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, second: torch.Tensor,
                     divisor: bool = True) -> torch.Tensor:
    """fp32 [..., N, K]: e2m1 values times (scale / second) when `second` is compressed-tensors' global scale
    (`divisor`), times (scale * second) when it is ModelOpt's weight_scale_2. `second` broadcasts against scale
    (a scalar, or one value per row [..., N, 1])."""
    s = scale.float() / second.float() if divisor else scale.float() * second.float()
    v = e2m1_decode(unpack_nibbles(packed)).unflatten(-1, (-1, NVFP4_BLOCK))
    return (v * s.unsqueeze(-1)).flatten(-2)


# ---------------------------------------------------------------------------------------------------------------
# FP8 e4m3 with fp32 scales

def fp8_scale_shape(n: int, k: int, granularity: str) -> tuple[int, ...]:
    if granularity == "tensor":
        return (1,)
    if granularity == "channel":
        return (n, 1)
    if granularity == "block":
        return (math.ceil(n / FP8_BLOCK[0]), math.ceil(k / FP8_BLOCK[1]))
    raise ValueError(f"FP8 granularity {granularity!r}: use one of {FP8_GRANULARITIES}")


def expand_block_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[..., ceil(N/128), ceil(K/128)] block scales -> one per element [..., N, K] (edge blocks cut)."""
    return scale.repeat_interleave(FP8_BLOCK[0], -2).repeat_interleave(FP8_BLOCK[1], -1)[..., :n, :k]


def quantize_fp8(w: torch.Tensor, granularity: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [N, K], fp32 scale of `fp8_scale_shape`): scale = amax / 448 of the tensor, each row or each
    128x128 block (1.0 where that amax is 0); NaN stays NaN, inf saturates."""
    if w.dim() != 2:
        raise ValueError(f"FP8 quantization takes a [N, K] weight, got {tuple(w.shape)}")
    n, k = w.shape
    a = w.float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    if granularity == "tensor":
        amax = a.amax().reshape(1)
    elif granularity == "channel":
        amax = a.amax(-1, keepdim=True)
    else:
        nb, kb = fp8_scale_shape(n, k, granularity)
        padded = torch.nn.functional.pad(a, (0, kb * FP8_BLOCK[1] - k, 0, nb * FP8_BLOCK[0] - n))
        amax = padded.view(nb, FP8_BLOCK[0], kb, FP8_BLOCK[1]).amax((1, 3))
    scale = fp8_scale(amax)
    return e4m3_encode(w.float() / _per_element(scale, n, k, granularity)), scale


def _per_element(scale: torch.Tensor, n: int, k: int, granularity: str) -> torch.Tensor:
    return expand_block_scale(scale, n, k) if granularity == "block" else scale


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """fp32 [..., N, K] = e4m3 values * scale (broadcast per tensor / row, or expanded per 128x128 block)."""
    n, k = values.shape[-2:]
    return values.float() * _per_element(scale.float(), n, k, granularity)
