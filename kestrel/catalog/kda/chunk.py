"""KDA chunked prefill: the KdaRecurrent math for segments of any length (prefill chunks, varlen over requests),
starting from each request's state slot and writing the final state back.

Our own Triton kernel (kestrel/kernels/kda/chunk.py: 64-token chunks, UT / WY form, fp32 accumulation, exact
pairwise decays, 3xTF32 dots on GPUs), not a delegation to fla-core: it runs under the CPU interpreter so every
CPU test exercises the same code the GPU runs, takes the runtime's slot-indexed state pool directly (no gather /
scatter of initial and final states), and keeps the engine free of a compiled dependency. On a CPU without the
interpreter, raw_call takes `chunk_recurrence_varlen` (kestrel/ops/kda.py: plain torch, chunked, exact to fp32
rounding); the reference is the token loop itself.
"""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, tiny
from kestrel.catalog.kda._common import check_kda_inputs, close, make_kda_inputs
from kestrel.catalog.kda.recurrent import o_tolerance
from kestrel.kernels.kda._common import triton_runs_on
from kestrel.kernels.kda.chunk import kda_chunk_prefill
from kestrel.ops.kda import chunk_recurrence_varlen, recurrence_varlen

KLIN = dict(H=32, D=128)        # Kimi Linear 48B
K3 = dict(H=96, D=128)          # K3 tp1: 96 KDA heads of 128 (dt_bias 96 x 128)
K3_TP8 = dict(H=12, D=128)      # K3 with the 96 heads split over 8 ranks


class KdaChunkPrefill(OpWrapper):
    """raw_call(q, k, v [T, H, D] model dtype (heads and D contiguous, any token stride), g [T, H, D] fp32,
    beta [T, H] fp32, state [S, H, D, D] fp32 pool, cu_seqlens int32 [B+1], slots int32 [B], out=None)
    -> (o [T, H, D] in v's dtype, state updated in place): exactly KdaRecurrent's contract, for long segments."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("o: one rounding to the model dtype (bf16 rel 2^-7 -> 1e-2); state: fp32, chunked reassociation "
                 "plus within-chunk decays exp(G_t - G_s) from differences of cumulative sums (|G| 2^-24 abs each) "
                 "and 3xTF32 dots (~2^-22) over <= 64-token chunks, damped by the decay between chunks: "
                 "rtol 1e-3, atol 1e-4")

    WIDTHS = ("H", "D", "dtype")
    CELLS = (
        tiny("Kimi Linear prefill (tiny H=2 D=16): 1 + 19 + 70 tok (partial chunks, a 2-chunk request)",
             lens=(1, 19, 70), H=2, D=16, gate="kimi", dtype=torch.float32),
        tiny("K3 prefill (tiny H=2 D=32, bf16): exactly one chunk + 37 tok", lens=(64, 37), H=2, D=32, gate="k3",
             dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 prefill: 1 x 8192 tok, H=32 D=128", lens=(8192,), **KLIN, gate="kimi",
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 prefill: 4 x 2048 tok, H=32 D=128", lens=(2048,) * 4, **KLIN, gate="kimi",
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 chunked prefill mix: 1000 + 3000 + 1 + 37 tok, H=32 D=128",
            lens=(1000, 3000, 1, 37), **KLIN, gate="kimi", dtype=torch.bfloat16),
        gpu("K3 tp1 prefill: 1 x 8192 tok, H=96 D=128", lens=(8192,), **K3, gate="k3", dtype=torch.bfloat16),
        gpu("K3 tp1 prefill: 4 x 2048 tok, H=96 D=128", lens=(2048,) * 4, **K3, gate="k3", dtype=torch.bfloat16),
        gpu("K3 tp8 prefill: 4 x 2048 tok, H=12 D=128 per rank", lens=(2048,) * 4, **K3_TP8, gate="k3",
            dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(q, k, v, g, beta, state, cu_seqlens, slots, out=None):
        if triton_runs_on(q):
            return kda_chunk_prefill(q, k, v, g, beta, state, cu_seqlens, slots, out=out)
        o, state = chunk_recurrence_varlen(q, k, v, g, beta, state, cu_seqlens, slots)
        return (out.copy_(o) if out is not None else o.to(v.dtype)), state

    @staticmethod
    def reference(q, k, v, g, beta, state, cu_seqlens, slots, out=None):
        o, state = recurrence_varlen(q, k, v, g, beta, state, cu_seqlens, slots)
        return o.to(v.dtype), state

    @staticmethod
    def widths(q, k, v, g, beta, state, cu_seqlens, slots, out=None):
        return {"H": q.shape[1], "D": q.shape[2], "dtype": q.dtype}

    @staticmethod
    def is_valid(q, k, v, g, beta, state, cu_seqlens, slots, out=None):
        # D >= 16: the chunk kernel's tl.dot tiles need every dimension >= 16
        return check_kda_inputs(q, k, v, g, beta, state, cu_seqlens, slots, out, min_d=16)

    @staticmethod
    def compare(out, ref):
        rtol, atol = o_tolerance(out[0].dtype)
        close("KdaChunkPrefill o", out[0], ref[0], rtol=rtol, atol=atol)
        close("KdaChunkPrefill state pool", out[1], ref[1], rtol=1e-3, atol=1e-4)

    @staticmethod
    def make_inputs(spec, device, generator):
        return make_kda_inputs(spec, device, generator)
