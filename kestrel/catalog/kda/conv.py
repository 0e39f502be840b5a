"""KDA short convolution: causal depthwise conv (width K = 4) + SiLU over the fused q|k|v channels of a flat varlen
token batch, continuing each request from its conv state slot and leaving the slot holding its last K-1 inputs.
With parts=3 the output comes as contiguous q, k, v planes [3, T, W] (what the KDA kernels read without a copy)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, overlaps, tiny
from kestrel.catalog.kda._common import batch_layout, check_batch, close, randn
from kestrel.kernels.kda._common import triton_runs_on
from kestrel.kernels.kda.conv import MAX_K, short_conv
from kestrel.ops.kda import short_conv_varlen

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KLIN = dict(H=32, D=128)        # Kimi Linear 48B: 32 KDA heads x 128 -> C = 3 * 4096
K3 = dict(H=96, D=128)          # K3 (hidden 7168), tp1: 96 KDA heads x 128 -> C = 3 * 12288
K3_TP8 = dict(H=12, D=128)      # K3 with the 96 heads split over 8 ranks
# x is a row view of the joined KDA projection [T, 3W + (D + G) + H] (catalog/_layers.py kda_views): the extra
# columns of each row past the conv's 3W (Kimi Linear: low-rank gate G = D; K3: full-rank gate G = W)
KLIN_ROW = dict(KLIN, x_pad=128 + 128 + 32)
K3_ROW = dict(K3, x_pad=128 + 12288 + 96)
K3_TP8_ROW = dict(K3_TP8, x_pad=128 + 1536 + 12)
PLANES = dict(parts=3)


def in_planes(y: torch.Tensor, parts: int) -> torch.Tensor:
    """[T, C] -> [parts, T, C/parts] (channel c in plane c // (C/parts)), contiguous; parts = 1: y itself."""
    if parts == 1:
        return y
    T, C = y.shape
    return y.view(T, parts, C // parts).transpose(0, 1).contiguous()


class ShortConv(OpWrapper):
    """raw_call(x [T, C], weight [C, K], conv_state [S, C, K-1], cu_seqlens int32 [B+1], slots int32 [B], out=None,
    parts=1) -> (out in x's dtype, conv_state updated in place). C = 3*H*D channels ordered q|k|v; conv_state has
    the model dtype and column K-2 holds the most recent input. parts=1: out [T, C]; parts=3: out [3, T, C/3], the
    contiguous q, k, v planes (`q, k, v = out` are contiguous [T, W] views, no copy); an `out=` given for parts=3
    needs unit stride along W and a plane stride that is a multiple of its row stride. x may be a row view (any row
    stride, unit stride along C). K <= 4 (the kernel keeps the previous K-1 rows in registers)."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("out: fp32 sum of K=4 products then SiLU, rounded once to the output dtype: rel 1 ulp "
                 "(bf16 2^-7 -> 1e-2, fp16 2^-10 -> 2e-3, fp32 -> 1e-5) + atol 1e-5; state: a copy of inputs, exact")

    WIDTHS = ("C", "K", "dtype", "parts")
    CELLS = (
        tiny("Kimi Linear (tiny H=2 D=16) mixed batch: decode, segments shorter than K-1, prefill",
             lens=(1, 2, 5, 9), H=2, D=16, dtype=torch.float32),
        tiny("K3 (tiny H=2 D=32) bf16 state pool, verify 4 tok + decode", lens=(4, 1, 3), H=2, D=32,
             dtype=torch.bfloat16),
        tiny("Kimi Linear (tiny H=2 D=16) q|k|v planes, row view of the joined projection: decode, segments shorter "
             "than K-1, prefills past one conv tile", lens=(1, 2, 3, 40, 5, 70), H=2, D=16,
             dtype=torch.float32, x_pad=40, **PLANES),
        tiny("K3 (tiny H=2 D=32) q|k|v planes in bf16, 8 segments of a chunked prefill, row view", lens=(9,) * 8,
             H=2, D=32, dtype=torch.bfloat16, x_pad=72, **PLANES),
        gpu("Kimi Linear 48B tp1 decode: 1 req x 1 tok, C=12288", lens=(1,), **KLIN, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 decode: 256 req x 1 tok, C=12288", lens=(1,) * 256, **KLIN, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 verify: 64 req x 4 tok, C=12288", lens=(4,) * 64, **KLIN, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 prefill: 1 x 8192 tok, C=12288", lens=(8192,), **KLIN, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 prefill: 4 x 2048 tok, C=12288", lens=(2048,) * 4, **KLIN, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 prefill into q|k|v planes: 1 x 8192 tok of the joined projection, C=12288",
            lens=(8192,), **KLIN_ROW, dtype=torch.bfloat16, **PLANES),
        gpu("Kimi Linear 48B tp1 prefill into q|k|v planes: 8 x 1024 tok of the joined projection",
            lens=(1024,) * 8, **KLIN_ROW, dtype=torch.bfloat16, **PLANES),
        gpu("Kimi Linear 48B tp1 chunked prefill + decode into q|k|v planes: 2 x 1 + 1000 + 16 x 1 + 3 tok",
            lens=(1, 1, 1000) + (1,) * 16 + (3,), **KLIN_ROW, dtype=torch.bfloat16, **PLANES),
        gpu("K3 tp1 decode: 64 req x 1 tok, H=96 D=128 (C=36864)", lens=(1,) * 64, **K3, dtype=torch.bfloat16),
        gpu("K3 tp1 DSpark verify: 64 req x 4 tok, H=96 D=128", lens=(4,) * 64, **K3, dtype=torch.bfloat16),
        gpu("K3 tp1 prefill: 1 x 8192 tok, H=96 D=128", lens=(8192,), **K3, dtype=torch.bfloat16),
        gpu("K3 tp1 prefill into q|k|v planes: 1 x 8192 tok of the joined projection, H=96 D=128 (C=36864)",
            lens=(8192,), **K3_ROW, dtype=torch.bfloat16, **PLANES),
        gpu("K3 tp1 chunked prefill + decode into q|k|v planes: 3 x 1 + 4 x 1024 + 2 tok, H=96 D=128",
            lens=(1, 1, 1) + (1024,) * 4 + (2,), **K3_ROW, dtype=torch.bfloat16, **PLANES),
        gpu("K3 tp8 decode: 256 req x 1 tok, H=12 D=128 per rank", lens=(1,) * 256, **K3_TP8, dtype=torch.bfloat16),
        gpu("K3 tp8 chunked prefill + decode mix: 2048 + 3 x 1 tok, H=12 D=128", lens=(2048, 1, 1, 1), **K3_TP8,
            dtype=torch.bfloat16),
        gpu("K3 tp8 chunked prefill + decode into q|k|v planes: 2048 + 3 x 1 tok, H=12 D=128 (row stride 6284: "
            "only 4-element aligned)", lens=(2048, 1, 1, 1), **K3_TP8_ROW, dtype=torch.bfloat16, **PLANES),
    )

    @staticmethod
    def raw_call(x, weight, conv_state, cu_seqlens, slots, out=None, parts=1):
        if triton_runs_on(x):
            return short_conv(x, weight, conv_state, cu_seqlens, slots, out=out, parts=parts)
        y, conv_state = short_conv_varlen(x, weight, conv_state, cu_seqlens, slots)
        y = in_planes(y, parts)
        if out is None:
            return y.to(x.dtype), conv_state
        out.copy_(y)
        return out, conv_state

    @staticmethod
    def reference(x, weight, conv_state, cu_seqlens, slots, out=None, parts=1):
        y, conv_state = short_conv_varlen(x, weight, conv_state, cu_seqlens, slots)
        return in_planes(y, parts).to(x.dtype), conv_state

    @classmethod
    def cell_widths(cls, spec):
        return {"C": 3 * spec["H"] * spec["D"], "K": spec.get("K", 4), "dtype": spec["dtype"],
                "parts": spec.get("parts", 1)}

    @staticmethod
    def widths(x, weight, conv_state, cu_seqlens, slots, out=None, parts=1):
        return {"C": x.shape[1], "K": weight.shape[1], "dtype": x.dtype, "parts": parts}

    @staticmethod
    def is_valid(x, weight, conv_state, cu_seqlens, slots, out=None, parts=1):
        if x.dtype not in _DTYPES:
            return f"x dtype {x.dtype} unsupported"
        if x.dim() != 2 or x.stride(1) != 1:
            return "x must be [T, C] with unit stride along C"
        T, C = x.shape
        if weight.dim() != 2 or weight.shape[0] != C or not weight.is_contiguous() or weight.dtype not in _DTYPES:
            return f"weight must be a contiguous [C={C}, K] float tensor"
        KW = weight.shape[1]
        if not 2 <= KW <= MAX_K:
            return f"conv width K={KW} outside 2..{MAX_K} (the kernel keeps K-1 rows in registers)"
        if conv_state.dim() != 3 or conv_state.shape[1:] != (C, KW - 1):
            return f"conv_state must be [S, C={C}, K-1={KW - 1}], got {tuple(conv_state.shape)}"
        if conv_state.stride(2) != 1:
            return "conv_state needs unit stride along its K-1 columns"
        if conv_state.dtype != x.dtype:
            return f"conv_state dtype {conv_state.dtype} differs from the model dtype {x.dtype}"
        for name, t in (("weight", weight), ("conv_state", conv_state)):
            if t.device != x.device:
                return f"{name} is on {t.device}, x on {x.device}"
        if not isinstance(parts, int) or parts < 1 or C % parts:
            return f"parts={parts} must be a positive integer dividing C={C}"
        why = check_batch(T, conv_state.shape[0], cu_seqlens, slots, x.device)
        if why:
            return why
        if out is not None:
            shape = (T, C) if parts == 1 else (parts, T, C // parts)
            if tuple(out.shape) != shape or out.dtype != x.dtype or out.stride(-1) != 1 or out.device != x.device:
                return f"out must be {list(shape)} in x's dtype with unit stride along its last dim"
            if parts > 1 and T > 0 and out.stride(0) % out.stride(1):
                return "out's plane stride must be a multiple of its row stride"
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
        # x_pad > 0: x is the first C columns of wider rows, as the joined projection's view is
        x = randn((T, C + spec.get("x_pad", 0)), generator, device, dtype)[:, :C]
        inputs = dict(x=x, weight=weight, conv_state=randn((pool, C, KW - 1), generator, device, dtype),
                      cu_seqlens=cu, slots=slots)
        if spec.get("parts", 1) != 1:
            inputs["parts"] = spec["parts"]
        return inputs
