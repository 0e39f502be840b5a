"""KDA short convolution: causal depthwise conv (width K = 4) + SiLU over the fused q|k|v channels of a flat varlen
token batch, continuing each request from its conv state slot and leaving the slot holding its last K-1 inputs."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, overlaps, tiny
from kestrel.catalog.kda._common import batch_layout, check_batch, close, randn
from kestrel.kernels.kda._common import triton_runs_on
from kestrel.kernels.kda.conv import short_conv
from kestrel.ops.kda import short_conv_varlen

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KLIN = dict(H=32, D=128)        # Kimi Linear 48B: 32 KDA heads x 128 -> C = 3 * 4096
K3 = dict(H=96, D=128)          # K3 (hidden 7168), tp1: 96 KDA heads x 128 -> C = 3 * 12288
K3_TP8 = dict(H=12, D=128)      # K3 with the 96 heads split over 8 ranks


class ShortConv(OpWrapper):
    """raw_call(x [T, C], weight [C, K], conv_state [S, C, K-1], cu_seqlens int32 [B+1], slots int32 [B], out=None)
    -> (out [T, C] in x's dtype, conv_state updated in place). C = 3*H*D channels ordered q|k|v; conv_state has the
    model dtype and column K-2 holds the most recent input."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("out: fp32 sum of K=4 products then SiLU, rounded once to the output dtype: rel 1 ulp "
                 "(bf16 2^-7 -> 1e-2, fp16 2^-10 -> 2e-3, fp32 -> 1e-5) + atol 1e-5; state: a copy of inputs, exact")

    WIDTHS = ("C", "K", "dtype")
    CELLS = (
        tiny("Kimi Linear (tiny H=2 D=16) mixed batch: decode, segments shorter than K-1, prefill",
             lens=(1, 2, 5, 9), H=2, D=16, dtype=torch.float32),
        tiny("K3 (tiny H=2 D=32) bf16 state pool, verify 4 tok + decode", lens=(4, 1, 3), H=2, D=32,
             dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 decode: 1 req x 1 tok, C=12288", lens=(1,), **KLIN, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 decode: 256 req x 1 tok, C=12288", lens=(1,) * 256, **KLIN, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 verify: 64 req x 4 tok, C=12288", lens=(4,) * 64, **KLIN, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 prefill: 1 x 8192 tok, C=12288", lens=(8192,), **KLIN, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 prefill: 4 x 2048 tok, C=12288", lens=(2048,) * 4, **KLIN, dtype=torch.bfloat16),
        gpu("K3 tp1 decode: 64 req x 1 tok, H=96 D=128 (C=36864)", lens=(1,) * 64, **K3, dtype=torch.bfloat16),
        gpu("K3 tp1 DSpark verify: 64 req x 4 tok, H=96 D=128", lens=(4,) * 64, **K3, dtype=torch.bfloat16),
        gpu("K3 tp1 prefill: 1 x 8192 tok, H=96 D=128", lens=(8192,), **K3, dtype=torch.bfloat16),
        gpu("K3 tp8 decode: 256 req x 1 tok, H=12 D=128 per rank", lens=(1,) * 256, **K3_TP8, dtype=torch.bfloat16),
        gpu("K3 tp8 chunked prefill + decode mix: 2048 + 3 x 1 tok, H=12 D=128", lens=(2048, 1, 1, 1), **K3_TP8,
            dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(x, weight, conv_state, cu_seqlens, slots, out=None):
        if triton_runs_on(x):
            return short_conv(x, weight, conv_state, cu_seqlens, slots, out=out)
        y, conv_state = short_conv_varlen(x, weight, conv_state, cu_seqlens, slots)
        if out is None:
            return y.to(x.dtype), conv_state
        out.copy_(y)
        return out, conv_state

    @staticmethod
    def reference(x, weight, conv_state, cu_seqlens, slots, out=None):
        y, conv_state = short_conv_varlen(x, weight, conv_state, cu_seqlens, slots)
        return y.to(x.dtype), conv_state

    @classmethod
    def cell_widths(cls, spec):
        return {"C": 3 * spec["H"] * spec["D"], "K": spec.get("K", 4), "dtype": spec["dtype"]}

    @staticmethod
    def widths(x, weight, conv_state, cu_seqlens, slots, out=None):
        return {"C": x.shape[1], "K": weight.shape[1], "dtype": x.dtype}

    @staticmethod
    def is_valid(x, weight, conv_state, cu_seqlens, slots, out=None):
        if x.dtype not in _DTYPES:
            return f"x dtype {x.dtype} unsupported"
        if x.dim() != 2 or x.stride(1) != 1:
            return "x must be [T, C] with unit stride along C"
        T, C = x.shape
        if weight.dim() != 2 or weight.shape[0] != C or not weight.is_contiguous() or weight.dtype not in _DTYPES:
            return f"weight must be a contiguous [C={C}, K] float tensor"
        KW = weight.shape[1]
        if KW < 2:
            return "conv width K must be >= 2"
        if conv_state.dim() != 3 or conv_state.shape[1:] != (C, KW - 1):
            return f"conv_state must be [S, C={C}, K-1={KW - 1}], got {tuple(conv_state.shape)}"
        if conv_state.stride(2) != 1:
            return "conv_state needs unit stride along its K-1 columns"
        if conv_state.dtype != x.dtype:
            return f"conv_state dtype {conv_state.dtype} differs from the model dtype {x.dtype}"
        for name, t in (("weight", weight), ("conv_state", conv_state)):
            if t.device != x.device:
                return f"{name} is on {t.device}, x on {x.device}"
        why = check_batch(T, conv_state.shape[0], cu_seqlens, slots, x.device)
        if why:
            return why
        if out is not None:
            if out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device:
                return "out must match x's shape and dtype with unit stride along C"
            if overlaps(out, x) or overlaps(out, conv_state) or overlaps(out, weight):
                return "out aliases an input (the conv reads neighbouring tokens of x and the old state)"
        if overlaps(x, conv_state):
            return "x aliases conv_state"
        return None

    @staticmethod
    def compare(out, ref):
        y, state = out
        y_ref, state_ref = ref
        rtol = {torch.bfloat16: 1e-2, torch.float16: 2e-3}.get(y.dtype, 1e-5)
        close("ShortConv out", y, y_ref, rtol=rtol, atol=1e-5)
        close("ShortConv conv_state pool", state, state_ref, rtol=0.0, atol=0.0)

    @staticmethod
    def make_inputs(spec, device, generator):
        H, D, dtype = spec["H"], spec["D"], spec["dtype"]
        KW = spec.get("K", 4)
        C = 3 * H * D
        cu, slots, pool = batch_layout(spec["lens"], spec.get("pool"), generator, device)
        T = int(sum(spec["lens"]))
        bound = KW ** -0.5                      # nn.Conv1d's init bound 1/sqrt(fan_in), fan_in = K (depthwise)
        weight = ((torch.rand(C, KW, generator=generator) * 2 - 1) * bound).to(device=device, dtype=dtype)
        return dict(x=randn((T, C), generator, device, dtype), weight=weight,
                    conv_state=randn((pool, C, KW - 1), generator, device, dtype),
                    cu_seqlens=cu, slots=slots)
