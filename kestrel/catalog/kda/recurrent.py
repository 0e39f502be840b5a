"""KDA recurrent step: decode (1 token per request) and speculative verify (N <= 8 tokens per request), reading and
writing each request's recurrent state slot in place. The token loop runs inside the kernel, one program per
(request, head, 32-wide v-tile)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, tiny
from kestrel.catalog.kda._common import check_kda_inputs, close, make_kda_inputs
from kestrel.kernels.kda._common import triton_runs_on
from kestrel.kernels.kda.recurrent import kda_recurrent
from kestrel.ops.kda import recurrence_varlen

MAX_TOKENS = 8          # tokens per request the cells certify (verify blocks); longer segments are correct but
                        # walk token by token: prefill goes through KdaChunkPrefill
KLIN = dict(H=32, D=128)        # Kimi Linear 48B
K3 = dict(H=96, D=128)          # K3 tp1: 96 KDA heads of 128 (dt_bias 96 x 128)
K3_TP8 = dict(H=12, D=128)      # K3 with the 96 heads split over 8 ranks


def o_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for o: one rounding to the output dtype (bf16 truncation in the interpreter: 2^-7) on top of
    fp32 reassociation (~1e-6 of |o| ~ 0.1)."""
    return {torch.bfloat16: (1e-2, 1e-4), torch.float16: (2e-3, 1e-4)}.get(dtype, (1e-4, 1e-5))


class KdaRecurrent(OpWrapper):
    """raw_call(q, k, v [T, H, D] model dtype (heads and D contiguous, any token stride), g [T, H, D] fp32,
    beta [T, H] fp32, state [S, H, D, D] fp32 pool, cu_seqlens int32 [B+1], slots int32 [B], out=None,
    update=True) -> (o [T, H, D] in v's dtype, state updated in place; left as it was with update=False: a
    speculative verify, whose state advances over the accepted tokens in KdaVerifyCommit). Per request, per token in order: q, k L2-normalized
    (eps 1e-6 inside the sqrt), q scaled by D^-0.5; S = S * exp(g)[:, None]; S += beta k (v - S^T k)^T; o = S^T q."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("o: one rounding to the model dtype (bf16 rel 2^-7 -> 1e-2) over fp32 math identical up to "
                 "reassociation; state: fp32, <= 8 steps of D=128-term dot products -> rtol 1e-4, atol 1e-5")

    WIDTHS = ("H", "D", "dtype")
    CELLS = (
        tiny("Kimi Linear decode (tiny H=2 D=16): 3 req x 1 tok", lens=(1, 1, 1), H=2, D=16, gate="kimi",
             dtype=torch.float32),
        tiny("K3 DSpark verify (tiny H=2 D=32, bf16): 4 + 1 + 3 tok", lens=(4, 1, 3), H=2, D=32, gate="k3",
             dtype=torch.bfloat16),
        tiny("Kimi Linear verify with replay (tiny H=2 D=16): 5 + 9 tok, the state left as it was", lens=(5, 9),
             H=2, D=16, gate="kimi", dtype=torch.float32, update=False),
        gpu("Kimi Linear 48B tp1 decode: 1 req x 1 tok, H=32 D=128", lens=(1,), **KLIN, gate="kimi",
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 decode: 64 req x 1 tok, H=32 D=128", lens=(1,) * 64, **KLIN, gate="kimi",
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 decode: 256 req x 1 tok, H=32 D=128", lens=(1,) * 256, **KLIN, gate="kimi",
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 verify: 64 req x 4 tok, H=32 D=128", lens=(4,) * 64, **KLIN, gate="kimi",
            dtype=torch.bfloat16),
        gpu("K3 tp1 decode: 64 req x 1 tok, H=96 D=128", lens=(1,) * 64, **K3, gate="k3", dtype=torch.bfloat16),
        gpu("K3 tp1 DSpark verify: 64 req x 4 tok, H=96 D=128", lens=(4,) * 64, **K3, gate="k3",
            dtype=torch.bfloat16),
        gpu("K3 tp1 verify, longest block: 16 req x 8 tok, H=96 D=128", lens=(8,) * 16, **K3, gate="k3",
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 verify with replay (state kept): 8 req x 9 tok, H=32 D=128", lens=(9,) * 8, **KLIN,
            gate="kimi", dtype=torch.bfloat16, update=False),
        gpu("K3 tp1 DSpark verify with replay (state kept): 8 req x 8 tok, H=96 D=128", lens=(8,) * 8, **K3,
            gate="k3", dtype=torch.bfloat16, update=False),
        gpu("K3 tp8 decode: 256 req x 1 tok, H=12 D=128 per rank", lens=(1,) * 256, **K3_TP8, gate="k3",
            dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(q, k, v, g, beta, state, cu_seqlens, slots, out=None, update=True):
        if triton_runs_on(q):
            return kda_recurrent(q, k, v, g, beta, state, cu_seqlens, slots, out=out, update=update)
        o, _ = recurrence_varlen(q, k, v, g, beta, state if update else state.clone(), cu_seqlens, slots)
        return (out.copy_(o) if out is not None else o.to(v.dtype)), state

    @staticmethod
    def reference(q, k, v, g, beta, state, cu_seqlens, slots, out=None, update=True):
        o, _ = recurrence_varlen(q, k, v, g, beta, state if update else state.clone(), cu_seqlens, slots)
        return o.to(v.dtype), state

    @staticmethod
    def widths(q, k, v, g, beta, state, cu_seqlens, slots, out=None, update=True):
        return {"H": q.shape[1], "D": q.shape[2], "dtype": q.dtype}

    @staticmethod
    def is_valid(q, k, v, g, beta, state, cu_seqlens, slots, out=None, update=True):
        return check_kda_inputs(q, k, v, g, beta, state, cu_seqlens, slots, out, min_d=16)

    @staticmethod
    def compare(out, ref):
        rtol, atol = o_tolerance(out[0].dtype)
        close("KdaRecurrent o", out[0], ref[0], rtol=rtol, atol=atol)
        close("KdaRecurrent state pool", out[1], ref[1], rtol=1e-4, atol=1e-5)

    @staticmethod
    def make_inputs(spec, device, generator):
        return dict(make_kda_inputs(spec, device, generator), update=spec.get("update", True))
