"""Helpers the MoE / norm / embedding / gemm entries share: input generation and validity checks.

Large tensors are drawn on the target device, in their own dtype, from a seed taken from the cell's CPU generator,
so a K3 expert stack (39 GB) is not generated on the host; small ones come from the generator itself.
"""

from __future__ import annotations

import torch

_DEVICE_DRAW = 1 << 22      # elements above which the draw happens on the device


def _device_gen(device: torch.device, gen: torch.Generator) -> torch.Generator:
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape, gen: torch.Generator, device, dtype=torch.bfloat16, scale: float = 1.0,
          shift: float = 0.0) -> torch.Tensor:
    """shift + scale * N(0, 1), drawn in fp32, then cast."""
    device = torch.device(device)
    numel = 1
    for s in shape:
        numel *= int(s)
    if device.type != "cpu" and numel > _DEVICE_DRAW:
        # drawn in the target dtype: a K3 expert stack (39 GB in bf16) would need 79 GB more as an fp32 draw
        t = torch.randn(shape, generator=_device_gen(device, gen), device=device,
                        dtype=dtype if dtype.is_floating_point else torch.float32)
    else:
        t = torch.randn(shape, generator=gen, dtype=torch.float32).to(device)
    if scale != 1.0:
        t.mul_(scale)
    if shift:
        t.add_(shift)
    return t.to(dtype)


def topk_ids(T: int, E: int, k: int, gen: torch.Generator, device, skew: float = 0.0) -> torch.Tensor:
    """int32 [T, k], k distinct experts per token; `skew` > 0 concentrates tokens on low-numbered experts so
    some experts receive none."""
    scores = torch.rand((T, E), generator=gen)
    if skew:
        scores = scores * torch.exp(-skew * torch.arange(E, dtype=torch.float32) / E)
    return scores.topk(k, dim=-1).indices.to(torch.int32).to(device)


def rows_ok(t: torch.Tensor, name: str, ndim: int = 2) -> str | None:
    """A [.., N] tensor whose last dim is contiguous (rows may be strided)."""
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a tensor"
    if t.dim() != ndim:
        return f"{name} must be {ndim}-D, got shape {tuple(t.shape)}"
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return f"{name} must have a contiguous last dim (stride {t.stride(-1)})"
    return None


def first(*reasons: str | None) -> str | None:
    for r in reasons:
        if r:
            return r
    return None
