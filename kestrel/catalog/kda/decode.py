"""KDA decode as one kernel: short-conv state update + SiLU, q / k L2 norm and q scale, the forget gate (Kimi Linear
or K3 form), beta, the delta-rule step on each request's fp32 state slot, and the gated per-head RMSNorm, for a
batch of decode tokens (one per request). Replaces ShortConv (2 launches) + KdaGate + KdaRecurrent + GatedRmsNorm.
"""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, overlaps, tiny
from kestrel.catalog.kda._common import K3_LOWER_BOUND, MODEL_DTYPES, close, gate_params, randn
from kestrel.kernels.kda._common import triton_runs_on
from kestrel.kernels.kda.decode import kda_decode
from kestrel.ops.kda import gates, recurrence_varlen, short_conv_varlen
from kestrel.ops.norm import gated_rms_norm

KLIN = dict(H=32, D=128)        # Kimi Linear 48B (linear_attn_config: 32 heads x 128)
K3 = dict(H=96, D=128)          # K3 tp1: 96 KDA heads x 128
K3_TP8 = dict(H=12, D=128)      # K3 with the heads split over 8 ranks


def _rows(t, name: str, B: int, N: int) -> str | None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or tuple(t.shape) != (B, N):
        return f"{name} must be [B={B}, {N}], got {tuple(getattr(t, 'shape', ()))}"
    if t.stride(1) != 1:
        return f"{name} needs unit stride along its last dim (any row stride), got {t.stride()}"
    if t.dtype not in MODEL_DTYPES:
        return f"{name} dtype {t.dtype} unsupported"
    return None


class KdaDecode(OpWrapper):
    """raw_call(mixed [B, 3W] (projected q|k|v, before the conv), f [B, W] (f_b(f_a x), before dt_bias),
    b [B, H] (b_proj x), gate [B, W] (output-gate projection), conv_weight [3W, K], conv_state [S, 3W, K-1] (model
    dtype), rec_state [S, H, D, D] fp32, slots int32 [B], A_log [H] fp32, dt_bias [W] fp32, norm_weight [D], eps,
    lower_bound=None (Kimi Linear) or < 0 (K3), pad_slot=-1, out=None) -> (y [B, W] in gate's dtype, conv_state,
    rec_state), both pools updated in place; W = H*D. Rows with slots[b] == pad_slot are CUDA-graph padding:
    y = 0 there and no state is written (many padding rows may share the one scratch slot). The rows may be
    strided views of one wide projection output. Triton kernel: kestrel/kernels/kda/decode.py."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("y: fp32 chain (conv, gates, one D=128 delta step, norm) identical to the composed references up "
                 "to reassociation (~1e-6 rel), then one rounding to the model dtype (bf16 truncation in the "
                 "interpreter 2^-7) -> rtol 1e-2, atol 1e-3 (|y| ~ 1); fp32 y 1e-4; rec_state: fp32, one step of "
                 "D-term dots -> rtol 1e-4, atol 1e-5; conv_state: a copy of inputs, exact")

    WIDTHS = ("H", "D", "K", "lower_bound", "dtype")    # B is the step's batch; padding and row strides vary too
    CELLS = (
        tiny("Kimi Linear decode (tiny H=2 D=16): 3 req", B=3, H=2, D=16, gate="kimi", dtype=torch.float32),
        tiny("K3 decode (tiny H=2 D=32, bf16): 3 req + 2 padding rows on one scratch slot", B=5, pad=2, H=2, D=32,
             gate="k3", dtype=torch.bfloat16),
        tiny("Kimi Linear decode (tiny H=3 D=16, bf16): rows strided views of one wide projection", B=2, H=3, D=16,
             gate="kimi", dtype=torch.bfloat16, fused_rows=True),
        gpu("Kimi Linear 48B tp1 decode bs1: H=32 D=128", B=1, **KLIN, gate="kimi", dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 decode bs8: H=32 D=128", B=8, **KLIN, gate="kimi", dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 decode graph bucket 64: 61 req + 3 padding, H=32 D=128", B=64, pad=3, **KLIN,
            gate="kimi", dtype=torch.bfloat16, fused_rows=True),
        gpu("Kimi Linear 48B tp1 decode bs256: H=32 D=128", B=256, **KLIN, gate="kimi", dtype=torch.bfloat16),
        gpu("K3 tp1 decode bs1: H=96 D=128", B=1, **K3, gate="k3", dtype=torch.bfloat16),
        gpu("K3 tp1 decode bs16: H=96 D=128", B=16, **K3, gate="k3", dtype=torch.bfloat16),
        gpu("K3 tp1 decode bs64: H=96 D=128, rows of one wide projection", B=64, **K3, gate="k3",
            dtype=torch.bfloat16, fused_rows=True),
        gpu("K3 tp8 decode bs256: H=12 D=128 per rank", B=256, **K3_TP8, gate="k3", dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(mixed, f, b, gate, conv_weight, conv_state, rec_state, slots, A_log, dt_bias, norm_weight, eps,
                 lower_bound=None, pad_slot=-1, out=None):
        if triton_runs_on(mixed):
            return kda_decode(mixed, f, b, gate, conv_weight, conv_state, rec_state, slots, A_log, dt_bias,
                              norm_weight, eps, lower_bound, pad_slot, out=out)
        y, conv_state, rec_state = KdaDecode.reference(mixed, f, b, gate, conv_weight, conv_state, rec_state, slots,
                                                       A_log, dt_bias, norm_weight, eps, lower_bound, pad_slot)
        return (out.copy_(y) if out is not None else y), conv_state, rec_state

    @staticmethod
    def reference(mixed, f, b, gate, conv_weight, conv_state, rec_state, slots, A_log, dt_bias, norm_weight, eps,
                  lower_bound=None, pad_slot=-1, out=None):
        """kestrel.ops' conv, gates, delta rule and gated norm (the separate entries' references) over the
        non-padding rows; the conv output stays fp32 into the recurrence, as the kernel keeps it in registers."""
        B, H, D = slots.numel(), A_log.numel(), norm_weight.numel()
        y = torch.zeros((B, H * D), dtype=gate.dtype, device=gate.device)
        real = [i for i, s in enumerate(slots.tolist()) if s != pad_slot]
        if not real:
            return y, conv_state, rec_state
        rows = torch.tensor(real, device=slots.device)
        sl = slots.index_select(0, rows)
        cu = torch.arange(len(real) + 1, dtype=torch.int32, device=slots.device)
        qkv, _ = short_conv_varlen(mixed.index_select(0, rows), conv_weight, conv_state, cu, sl)
        q, k, v = (t.reshape(-1, H, D) for t in qkv.split(H * D, dim=-1))
        g, beta = gates(f.index_select(0, rows), A_log, dt_bias, b.index_select(0, rows), lower_bound)
        o, _ = recurrence_varlen(q, k, v, g, beta, rec_state, cu, sl)
        normed = gated_rms_norm(o.reshape(-1, D), gate.index_select(0, rows).reshape(-1, D), norm_weight, eps)
        y[rows] = normed.reshape(-1, H * D).to(y.dtype)
        return y, conv_state, rec_state

    @staticmethod
    def widths(mixed, f, b, gate, conv_weight, conv_state, rec_state, slots, A_log, dt_bias, norm_weight, eps,
               lower_bound=None, pad_slot=-1, out=None):
        return {"H": A_log.numel(), "D": norm_weight.numel(), "K": conv_weight.shape[1], "lower_bound": lower_bound,
                "dtype": mixed.dtype}

    @classmethod
    def cell_widths(cls, spec):
        return {"H": spec["H"], "D": spec["D"], "K": spec.get("K", 4),
                "lower_bound": K3_LOWER_BOUND if spec["gate"] == "k3" else None, "dtype": spec["dtype"]}

    @staticmethod
    def is_valid(mixed, f, b, gate, conv_weight, conv_state, rec_state, slots, A_log, dt_bias, norm_weight, eps,
                 lower_bound=None, pad_slot=-1, out=None):
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int32 or slots.dim() != 1 \
                or not slots.is_contiguous():
            return "slots must be a contiguous 1-D int32 tensor"
        if A_log.dtype != torch.float32 or A_log.dim() != 1 or not A_log.is_contiguous() or A_log.numel() == 0:
            return "A_log must be a contiguous fp32 [H] tensor (flatten the checkpoint's [1, 1, H, 1])"
        if norm_weight.dim() != 1 or not norm_weight.is_contiguous() or norm_weight.dtype not in MODEL_DTYPES:
            return "norm_weight must be a contiguous float [D] tensor"
        B, H, D = slots.numel(), A_log.numel(), norm_weight.numel()
        W = H * D
        if D & (D - 1) or not 16 <= D <= 128:
            return f"head dim D={D} must be a power of two in [16, 128] (the widths the kernel is compiled for)"
        for name, t, n in (("mixed", mixed, 3 * W), ("f", f, W), ("b", b, H), ("gate", gate, W)):
            why = _rows(t, name, B, n)
            if why:
                return why
        if dt_bias.dtype != torch.float32 or tuple(dt_bias.shape) != (W,) or not dt_bias.is_contiguous():
            return f"dt_bias must be a contiguous fp32 [{W}] tensor"
        if conv_weight.dim() != 2 or conv_weight.shape[0] != 3 * W or not conv_weight.is_contiguous() \
                or conv_weight.dtype not in MODEL_DTYPES or conv_weight.shape[1] < 2:
            return f"conv_weight must be a contiguous float [3W={3 * W}, K >= 2] tensor"
        KW = conv_weight.shape[1]
        if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (3 * W, KW - 1) or conv_state.stride(2) != 1:
            return f"conv_state must be [S, {3 * W}, {KW - 1}] with unit stride along K-1"
        if conv_state.dtype != mixed.dtype:
            return f"conv_state dtype {conv_state.dtype} differs from the model dtype {mixed.dtype}"
        if rec_state.dtype != torch.float32 or rec_state.dim() != 4 or tuple(rec_state.shape[1:]) != (H, D, D) \
                or not rec_state.is_contiguous():
            return f"rec_state must be a contiguous fp32 [S, H={H}, D={D}, D={D}] pool"
        if conv_state.shape[0] != rec_state.shape[0]:
            return "conv_state and rec_state pools must have the same number of slots"
        inputs = (mixed, f, b, gate, conv_weight, A_log, dt_bias, norm_weight)
        for name, t in zip(("f", "b", "gate", "conv_weight", "conv_state", "rec_state", "slots", "A_log", "dt_bias",
                            "norm_weight"), (f, b, gate, conv_weight, conv_state, rec_state, slots, A_log, dt_bias,
                                             norm_weight)):
            if t.device != mixed.device:
                return f"{name} is on {t.device}, mixed on {mixed.device}"
        S = rec_state.shape[0]
        sl = slots.tolist()
        if any(s < 0 or s >= S for s in sl):
            return f"slots out of range [0, {S})"
        real = [s for s in sl if s != pad_slot]
        if len(set(real)) != len(real):
            return "two requests share a state slot (only padding rows may repeat, on pad_slot)"
        if any(overlaps(st, t) for st in (conv_state, rec_state) for t in inputs) or overlaps(conv_state, rec_state):
            return "a state pool aliases an input or the other pool"
        if out is not None:
            if tuple(out.shape) != (B, W) or out.dtype != gate.dtype or out.stride(1) != 1 or out.device != gate.device:
                return f"out must be [{B}, {W}] in gate's dtype with unit stride along W"
            if any(overlaps(out, t) for t in inputs + (conv_state, rec_state)):
                return "out aliases an input or a state pool"
        if not eps > 0:
            return f"eps must be > 0, got {eps}"
        if lower_bound is not None and not float(lower_bound) < 0:
            return f"lower_bound must be a negative float or None, got {lower_bound}"
        return None

    @staticmethod
    def compare(out, ref):
        y, conv, rec = out
        y_ref, conv_ref, rec_ref = ref
        rtol, atol = (1e-4, 1e-5) if y.dtype == torch.float32 else (1e-2, 1e-3)
        close("KdaDecode y", y, y_ref, rtol=rtol, atol=atol)
        close("KdaDecode conv_state pool", conv, conv_ref, rtol=0.0, atol=0.0)
        close("KdaDecode rec_state pool", rec, rec_ref, rtol=1e-4, atol=1e-5)

    @staticmethod
    def make_inputs(spec, device, generator):
        """Real rows on distinct random slots, padding rows on one scratch slot, spare slots left alone; the
        projected rows fresh N(0, 1) (optionally views of one wide projection output, as a fused GEMM gives)."""
        B, H, D, dtype = spec["B"], spec["H"], spec["D"], spec["dtype"]
        pad, KW = spec.get("pad", 0), spec.get("K", 4)
        W = H * D
        pool = B + 3
        scratch = pool - 1
        slots = torch.randperm(pool - 1, generator=generator)[:B].to(torch.int32)
        if pad:
            slots[B - pad:] = scratch
        widths = (3 * W, W, H, W)
        if spec.get("fused_rows"):
            wide = randn((B, sum(widths) + 8), generator, device, dtype)
            mixed, f, b, gate, _ = wide.split(list(widths) + [8], dim=1)
        else:
            mixed, f, b, gate = (randn((B, n), generator, device, dtype) for n in widths)
        A_log, dt_bias = gate_params(H, D, generator, device)
        bound = KW ** -0.5                      # nn.Conv1d's init bound 1/sqrt(fan_in), fan_in = K (depthwise)
        conv_weight = ((torch.rand(3 * W, KW, generator=generator) * 2 - 1) * bound).to(device=device, dtype=dtype)
        return dict(mixed=mixed, f=f, b=b, gate=gate, conv_weight=conv_weight,
                    conv_state=randn((pool, 3 * W, KW - 1), generator, device, dtype),
                    rec_state=randn((pool, H, D, D), generator, device, torch.float32, scale=0.3),
                    slots=slots.to(device), A_log=A_log, dt_bias=dt_bias,
                    norm_weight=(1 + 0.1 * torch.randn(D, generator=generator)).to(device), eps=1e-5,
                    lower_bound=K3_LOWER_BOUND if spec["gate"] == "k3" else None,
                    pad_slot=scratch if pad else -1)
