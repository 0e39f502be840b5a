"""Helpers the KDA entries share: batch layouts for `make_inputs`, the `is_valid` checks, realistic gate inputs,
and tolerances. (A leading underscore keeps this module out of the entry scan.)"""

from __future__ import annotations

import math

import torch

from kestrel.catalog._op import assert_close, overlaps
from kestrel.ops.kda import gates

# realistic parameter ranges, as the models initialize them: exp(A_log) ~ U(1, 16), softplus(dt_bias) ~ logU(1e-3, 1e-1)
A_RANGE = (1.0, 16.0)
DT_RANGE = (1e-3, 1e-1)
K3_LOWER_BOUND = -5.0


def batch_layout(lens, pool: int | None, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """cu_seqlens int32 [B+1] and distinct random slots int32 [B] out of a pool of `pool` slots (default B + 3, so
    that the pool always has slots the call must leave alone). Returns (cu_seqlens, slots, pool)."""
    lens = list(lens)
    B = len(lens)
    pool = pool or B + 3
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    slots = torch.randperm(pool, generator=gen)[:B].to(torch.int32)
    return cu.to(device), slots.to(device), pool


def randn(shape, gen: torch.Generator, device, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def gate_params(H: int, D: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log [H] and dt_bias [H*D] (fp32) drawn from the ranges the checkpoints are initialized in."""
    a = torch.empty(H).uniform_(*A_RANGE, generator=gen)
    dt = torch.exp(torch.empty(H * D).uniform_(math.log(DT_RANGE[0]), math.log(DT_RANGE[1]), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))            # inverse softplus
    return a.log().to(device), dt_bias.to(device)


def realistic_g(T: int, H: int, D: int, form: str, gen: torch.Generator, device) -> torch.Tensor:
    """Per-channel log decays [T, H, D] fp32 through the model's own gate formula ('kimi' or 'k3')."""
    A_log, dt_bias = gate_params(H, D, gen, device)
    f = torch.randn(T, H * D, generator=gen).to(device)
    g, _ = gates(f, A_log, dt_bias, f[:, :H], None if form == "kimi" else K3_LOWER_BOUND)
    return g.contiguous()


# ---------------------------------------------------------------------------------------------------- validation

def check_batch(T: int, pool: int, cu_seqlens: torch.Tensor, slots: torch.Tensor, device) -> str | None:
    """cu_seqlens / slots layout: int32, 1-D contiguous, on the data's device, cu from 0 to T non-decreasing,
    slots in range and distinct (two requests on one slot would race)."""
    for name, t in (("cu_seqlens", cu_seqlens), ("slots", slots)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
            return f"{name} must be a contiguous 1-D int32 tensor"
        if t.device != torch.device(device):
            return f"{name} is on {t.device}, the data on {device}"
    B = slots.numel()
    if cu_seqlens.numel() != B + 1:
        return f"cu_seqlens has {cu_seqlens.numel()} entries for {B} slots (needs B+1)"
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T:
        return f"cu_seqlens must run from 0 to T={T}, got {cu[0]}..{cu[-1]}"
    if any(b > a for a, b in zip(cu[1:], cu[:-1])):
        return "cu_seqlens must be non-decreasing"
    sl = slots.tolist()
    if any(s < 0 or s >= pool for s in sl):
        return f"slots out of range [0, {pool})"
    if len(set(sl)) != len(sl):
        return "two requests share a state slot"
    return None


def check_heads(name: str, t: torch.Tensor, T: int, H: int, D: int) -> str | None:
    """[T, H, D] with heads and head dim contiguous (any token stride, e.g. a view of the fused conv output)."""
    if t.dim() != 3 or tuple(t.shape) != (T, H, D):
        return f"{name} must be [T={T}, H={H}, D={D}], got {tuple(t.shape)}"
    if t.stride(2) != 1 or t.stride(1) != D:
        return f"{name} needs heads and head dim contiguous (strides [*, {D}, 1]), got {t.stride()}"
    return None


def close(what: str, out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> None:
    assert_close(out, ref, rtol=rtol, atol=atol, what=what)


# ------------------------------------------------------------------------------- recurrent / chunk (same contract)

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_gates_and_state(g, beta, state, T: int, H: int, D: int) -> str | None:
    """The fp32 gates g [T, H, D], beta [T, H] and state pool [S, H, D, D] every KDA recurrence entry reads."""
    if g.dtype != torch.float32 or tuple(g.shape) != (T, H, D) or not g.is_contiguous():
        return "g must be a contiguous fp32 [T, H, D] tensor"
    if beta.dtype != torch.float32 or tuple(beta.shape) != (T, H) or not beta.is_contiguous():
        return "beta must be a contiguous fp32 [T, H] tensor"
    if state.dtype != torch.float32 or state.dim() != 4 or tuple(state.shape[1:]) != (H, D, D) \
            or not state.is_contiguous():
        return f"state must be a contiguous fp32 [S, H={H}, D={D}, D={D}] pool"
    return None


def check_kda_inputs(q, k, v, g, beta, state, cu_seqlens, slots, out=None, min_d: int = 1) -> str | None:
    """The shared contract of KdaRecurrent and KdaChunkPrefill."""
    if q.dim() != 3:
        return f"q must be [T, H, D], got {tuple(q.shape)}"
    T, H, D = q.shape
    if D & (D - 1) or D < min_d or D > 256:
        return f"head dim D={D} must be a power of two in [{min_d}, 256]"
    if q.dtype not in MODEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k, v must share a float model dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        why = check_heads(name, t, T, H, D)
        if why:
            return why
    why = check_gates_and_state(g, beta, state, T, H, D)
    if why:
        return why
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        if t.device != q.device:
            return f"{name} is on {t.device}, q on {q.device}"
    why = check_batch(T, state.shape[0], cu_seqlens, slots, q.device)
    if why:
        return why
    if any(overlaps(state, t) for t in (q, k, v, g, beta)):
        return "the state pool aliases an input"
    if out is not None:
        if tuple(out.shape) != (T, H, D) or out.dtype != v.dtype or not out.is_contiguous() \
                or out.device != q.device:
            return "out must be a contiguous [T, H, D] tensor in v's dtype"
        if any(overlaps(out, t) for t in (q, k, v, g, beta, state)):
            return "out aliases an input or the state pool"
    return None


def make_kda_inputs(spec: dict, device, gen: torch.Generator) -> dict:
    """q, k, v as views of one fused [T, 3*H*D] conv output (the layout the model hands over), realistic decays
    through the model's gate, beta = sigmoid(N(0, 1)), and a pool of non-zero states."""
    H, D, dtype = spec["H"], spec["D"], spec["dtype"]
    cu, slots, pool = batch_layout(spec["lens"], spec.get("pool"), gen, device)
    T = int(sum(spec["lens"]))
    qkv = randn((T, 3 * H * D), gen, device, dtype)
    q, k, v = (qkv[:, i * H * D:(i + 1) * H * D].view(T, H, D) for i in range(3))
    g = realistic_g(T, H, D, spec.get("gate", "kimi"), gen, device)
    beta = torch.sigmoid(torch.randn(T, H, generator=gen)).to(device)
    state = randn((pool, H, D, D), gen, device, torch.float32, scale=0.3)
    return dict(q=q, k=k, v=v, g=g, beta=beta, state=state, cu_seqlens=cu, slots=slots)
