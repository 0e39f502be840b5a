"""KDA gates: the per-channel log decay g (Kimi Linear softplus form, or K3 lower-bound sigmoid form) fused with
beta = sigmoid(b). Both outputs fp32, whatever the model dtype."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, overlaps, tiny
from kestrel.catalog.kda._common import K3_LOWER_BOUND, close, gate_params, randn
from kestrel.kernels.kda._common import triton_runs_on
from kestrel.kernels.kda.gate import kda_gate
from kestrel.ops.kda import gates

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KdaGate(OpWrapper):
    """raw_call(f [T, H*D], A_log [H] fp32, dt_bias [H*D] fp32, b [T, H], lower_bound=None, g_out=None,
    beta_out=None) -> (g [T, H, D] fp32, beta [T, H] fp32).
    lower_bound None: Kimi Linear g = -exp(A_log) * softplus(f + dt_bias);
    lower_bound < 0:  K3 g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)). f and b are in the model dtype."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("fp32 chain of <= 4 transcendentals (exp, log / sigmoid) on identical inputs; GPU exp/log are "
                 "approximate to ~2^-21 rel and log(1+e) near 1 loses a few more bits: rtol 1e-4, atol 1e-6 "
                 "(g only enters as exp(g))")

    WIDTHS = ("H", "D", "lower_bound", "dtype")
    CELLS = (
        tiny("Kimi Linear gate (tiny H=2 D=16): 7 tok", T=7, H=2, D=16, lower_bound=None, dtype=torch.float32),
        tiny("K3 gate (tiny H=2 D=32, lb=-5), bf16 f / b: 5 tok", T=5, H=2, D=32, lower_bound=K3_LOWER_BOUND,
             dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 decode: 256 tok, H=32 D=128", T=256, H=32, D=128, lower_bound=None,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 prefill: 8192 tok, H=32 D=128", T=8192, H=32, D=128, lower_bound=None,
            dtype=torch.bfloat16),
        gpu("K3 tp1 decode: 64 tok, H=96 D=128", T=64, H=96, D=128, lower_bound=K3_LOWER_BOUND,
            dtype=torch.bfloat16),
        gpu("K3 tp1 prefill: 8192 tok, H=96 D=128", T=8192, H=96, D=128, lower_bound=K3_LOWER_BOUND,
            dtype=torch.bfloat16),
        gpu("K3 tp8 DSpark verify: 64 req x 4 tok, H=12 D=128", T=256, H=12, D=128, lower_bound=K3_LOWER_BOUND,
            dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(f, A_log, dt_bias, b, lower_bound=None, g_out=None, beta_out=None):
        if triton_runs_on(f):
            return kda_gate(f, A_log, dt_bias, b, lower_bound, g_out=g_out, beta_out=beta_out)
        g, beta = gates(f, A_log, dt_bias, b, lower_bound)
        if g_out is not None:
            g = g_out.copy_(g)
        if beta_out is not None:
            beta = beta_out.copy_(beta)
        return g, beta

    @staticmethod
    def reference(f, A_log, dt_bias, b, lower_bound=None, g_out=None, beta_out=None):
        return gates(f, A_log, dt_bias, b, lower_bound)

    @staticmethod
    def widths(f, A_log, dt_bias, b, lower_bound=None, g_out=None, beta_out=None):
        return {"H": A_log.numel(), "D": f.shape[1] // A_log.numel(), "lower_bound": lower_bound,
                "dtype": f.dtype}

    @staticmethod
    def is_valid(f, A_log, dt_bias, b, lower_bound=None, g_out=None, beta_out=None):
        if f.dtype not in _DTYPES or b.dtype not in _DTYPES:
            return f"f / b dtypes {f.dtype} / {b.dtype} unsupported"
        if A_log.dtype != torch.float32 or dt_bias.dtype != torch.float32:
            return "A_log and dt_bias must be fp32"
        if A_log.dim() != 1 or not A_log.is_contiguous() or A_log.numel() == 0:
            return "A_log must be a contiguous [H] tensor (flatten the checkpoint's [1, 1, H, 1])"
        H = A_log.numel()
        if f.dim() != 2 or f.stride(1) != 1 or f.shape[1] % H:
            return f"f must be [T, H*D] with unit stride along H*D (H={H})"
        T, HD = f.shape
        D = HD // H
        if dt_bias.shape != (HD,) or not dt_bias.is_contiguous():
            return f"dt_bias must be a contiguous [{HD}] tensor"
        if b.shape != (T, H) or b.stride(1) != 1:
            return f"b must be [T={T}, H={H}] with unit stride along H"
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("b", b)):
            if t.device != f.device:
                return f"{name} is on {t.device}, f on {f.device}"
        if lower_bound is not None and not (float(lower_bound) < 0):
            return f"lower_bound must be a negative float or None, got {lower_bound}"
        if g_out is not None and (g_out.shape != (T, H, D) or g_out.dtype != torch.float32
                                  or not g_out.is_contiguous() or g_out.device != f.device):
            return "g_out must be a contiguous fp32 [T, H, D] tensor"
        if beta_out is not None and (beta_out.shape != (T, H) or beta_out.dtype != torch.float32
                                     or not beta_out.is_contiguous() or beta_out.device != f.device):
            return "beta_out must be a contiguous fp32 [T, H] tensor"
        outs = [o for o in (g_out, beta_out) if o is not None]
        if any(overlaps(o, i) for o in outs for i in (f, b, A_log, dt_bias)):
            return "an output aliases an input"
        if len(outs) == 2 and overlaps(g_out, beta_out):
            return "g_out and beta_out overlap"
        return None

    @staticmethod
    def compare(out, ref):
        close("KdaGate g", out[0], ref[0], rtol=1e-4, atol=1e-6)
        close("KdaGate beta", out[1], ref[1], rtol=1e-4, atol=1e-6)

    @staticmethod
    def make_inputs(spec, device, generator):
        T, H, D, dtype = spec["T"], spec["H"], spec["D"], spec["dtype"]
        A_log, dt_bias = gate_params(H, D, generator, device)
        return dict(f=randn((T, H * D), generator, device, dtype), A_log=A_log, dt_bias=dt_bias,
                    b=randn((T, H), generator, device, dtype), lower_bound=spec["lower_bound"])
