"""A quantized linear layer in a checkpoint (its tensors per layout and format) and in memory (`QuantizedWeight`).

Checkpoint forms of a linear `X` with weight [N, K] (a scalar is written [] or [1]; both are read):

| layout / format | values | scale | tensor scale | activation scale (optional) |
|---|---|---|---|---|
| compressed-tensors MXFP4 | `X.weight_packed` u8 [N, K/2] | `X.weight_scale` u8 e8m0 [N, K/32] | - | - |
| compressed-tensors NVFP4 | `X.weight_packed` u8 [N, K/2] | `X.weight_scale` e4m3 [N, K/16] | `X.weight_global_scale` fp32, divisor | `X.input_global_scale` |
| compressed-tensors MXFP8 | `X.weight` e4m3 [N, K] | `X.weight_scale` u8 e8m0 [N, K/32] | - | - |
| compressed-tensors FP8 | `X.weight` e4m3 [N, K] | `X.weight_scale` float: [1], [N, 1] or [N/128, K/128] | - | `X.input_scale` |
| ModelOpt NVFP4 | `X.weight` u8 [N, K/2] | `X.weight_scale` e4m3 [N, K/16] | `X.weight_scale_2` fp32, multiplier | `X.input_scale` |
| ModelOpt FP8 | `X.weight` e4m3 [N, K] | `X.weight_scale` fp32 [] | - | `X.input_scale` |

In memory a `QuantizedWeight` keeps the stored codes and scales (stacked over experts where the model stacks them;
per-tensor scalars and FP8 block scales are widened to one value per row, so that w1 and w3 stacked into w13 keep
their own), and `dequantize()` is the plain-torch reference read of the weight. Activation scales are checked and
not kept: the reference runs weight-only (activations stay in the model dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kestrel.quant.formats import (FP8_BLOCK, MX_BLOCK, NVFP4_BLOCK, dequantize_fp8, dequantize_mx, dequantize_nvfp4,
                                   fp8_scale_shape, quantize_fp8, quantize_mx, quantize_nvfp4)

E4M3 = torch.float8_e4m3fn
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
E8M0 = (torch.uint8, torch.float8_e8m0fnu)


@dataclass(frozen=True)
class Form:
    """One checkpoint tensor of a quantized linear: `suffix` after the module name, which `part` of the weight it
    fills, its checkpoint `shape` (() = a scalar), the dtypes accepted, and whether it may be absent."""
    suffix: str
    part: str                 # "values" | "scale" | "second" | "input_scale"
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    optional: bool = False


def block_of(fmt: str) -> int | None:
    return {"mxfp4": MX_BLOCK, "nvfp4": NVFP4_BLOCK, "mxfp8": MX_BLOCK}.get(fmt)


def tensor_forms(layout: str, fmt: str, granularity: str, n: int, k: int) -> list[Form]:
    """The checkpoint tensors of a linear [n, k] stored as `fmt` in `layout` (raises ValueError when k does not
    divide into the format's blocks)."""
    block = block_of(fmt)
    if block and k % block:
        raise ValueError(f"{fmt} needs the input width to be a multiple of {block}, this layer has {k}")
    ct = layout == "compressed-tensors"
    if fmt in ("mxfp4", "nvfp4"):
        values = Form("weight_packed" if ct else "weight", "values", (n, k // 2), (torch.uint8,))
    else:
        values = Form("weight", "values", (n, k), (E4M3,))
    if fmt == "mxfp4" or fmt == "mxfp8":
        return [values, Form("weight_scale", "scale", (n, k // MX_BLOCK), E8M0)]
    if fmt == "nvfp4":
        return [values, Form("weight_scale", "scale", (n, k // NVFP4_BLOCK), (E4M3,)),
                Form("weight_global_scale" if ct else "weight_scale_2", "second", (), (torch.float32,)),
                Form("input_global_scale" if ct else "input_scale", "input_scale", (), FLOATS, optional=True)]
    shape = fp8_scale_shape(n, k, granularity)
    return [values, Form("weight_scale", "scale", () if shape == (1,) else shape, FLOATS),
            Form("input_scale", "input_scale", (), FLOATS, optional=True)]


def encode(layout: str, fmt: str, granularity: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (by suffix) of the float weight w [N, K] quantized as `fmt` in `layout`; the inverse
    of `QuantizedWeight.fill` + `dequantize` up to the format's rounding."""
    ct = layout == "compressed-tensors"
    if fmt in ("mxfp4", "mxfp8"):
        values, scale = quantize_mx(w, "e2m1" if fmt == "mxfp4" else "e4m3")
        return {("weight_packed" if ct and fmt == "mxfp4" else "weight"): values, "weight_scale": scale}
    if fmt == "nvfp4":
        packed, scale, second = quantize_nvfp4(w, layout)
        if ct:
            return {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": second}
        return {"weight": packed, "weight_scale": scale, "weight_scale_2": second.reshape(())}
    values, scale = quantize_fp8(w, granularity)
    return {"weight": values, "weight_scale": scale if ct else scale.reshape(())}


class QuantizedWeight(nn.Module):
    """The stored form of one weight of logical shape [..., N, K] (leading dims: stacked experts), read through
    `dequantize()`. Buffers: `values` (packed e2m1 u8 [..., N, K/2] or e4m3 [..., N, K]), `scale` (e8m0 u8 /
    e4m3 per block, or fp32 [..., N, 1] per tensor / row, or fp32 [..., N, ceil(K/128)] per 128-block),
    `second` (NVFP4 tensor scale fp32 [..., N, 1])."""

    def __init__(self, layout: str, fmt: str, granularity: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.layout, self.format, self.granularity = layout, fmt, granularity
        self.shape, self.dtype = tuple(shape), dtype
        *lead, n, k = self.shape
        packed = fmt in ("mxfp4", "nvfp4")
        self.register_buffer("values", torch.zeros(*lead, n, k // 2 if packed else k,
                                                   dtype=torch.uint8 if packed else E4M3, device=device))
        if fmt in ("mxfp4", "mxfp8"):
            scale = torch.zeros(*lead, n, k // MX_BLOCK, dtype=torch.uint8, device=device)
        elif fmt == "nvfp4":
            scale = torch.zeros(*lead, n, k // NVFP4_BLOCK, dtype=E4M3, device=device)
        else:
            width = -(-k // FP8_BLOCK[1]) if granularity == "block" else 1
            scale = torch.zeros(*lead, n, width, dtype=torch.float32, device=device)
        self.register_buffer("scale", scale)
        self.register_buffer("second", torch.zeros(*lead, n, 1, dtype=torch.float32, device=device)
                             if fmt == "nvfp4" else None)

    def fill(self, part: str, value: torch.Tensor, index: int | None = None,
             rows: tuple[int, int] | None = None) -> None:
        """Copy one checkpoint tensor into its place (`index`: the expert; `rows`: w1 / w3 halves of w13)."""
        if part == "input_scale":
            return
        buf = getattr(self, part)
        dst = buf if index is None else buf[index]
        if rows is not None:
            dst = dst[rows[0]:rows[1]]
        value = value.to(dst.device)
        if value.dtype == torch.float8_e8m0fnu:
            value = value.view(torch.uint8)
        if part == "second" or (part == "scale" and self.format == "fp8"):
            value = value.float()
            if self.granularity == "block" and part == "scale":
                value = value.repeat_interleave(FP8_BLOCK[0], 0)[:dst.shape[0]]
            elif value.numel() == 1:
                value = value.reshape(1, 1)
            value = value.expand(dst.shape)
        dst.copy_(value.reshape(dst.shape))

    def dequantize(self, index: int | None = None) -> torch.Tensor:
        """The weight (or expert `index` of a stacked weight) in the model dtype, computed in fp32."""
        pick = (lambda t: t) if index is None else (lambda t: t[index])
        values, scale = pick(self.values), pick(self.scale)
        if self.format in ("mxfp4", "mxfp8"):
            w = dequantize_mx(values, scale)
        elif self.format == "nvfp4":
            w = dequantize_nvfp4(values, scale, pick(self.second), divisor=self.layout == "compressed-tensors")
        elif self.granularity == "block":
            w = values.float() * scale.repeat_interleave(FP8_BLOCK[1], -1)[..., :values.shape[-1]]
        else:
            w = dequantize_fp8(values, scale, "channel")
        return w.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.layout} {self.format} {self.granularity} {list(self.shape)} -> {self.dtype}"
