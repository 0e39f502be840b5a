"""The experts' first GEMM (w13, gathering tokens) with the GLU in its epilogue, as a GEMV for decode steps whose
experts hold at most 8 rows: MoeGroupedGemmGlu's result, each touched expert's gate and up rows streamed once."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, tiny
from kestrel.catalog.moe._common import randn
from kestrel.catalog.moe.gemv import decode_routing, gemv_cells, rows_bound_ok
from kestrel.catalog.moe.grouped_gemm_glu import GLU_TOLERANCE, MoeGroupedGemmGlu, compare_glu
from kestrel.kernels.moe.expert_gemv import expert_gemv


class MoeGemvGlu(OpWrapper):
    """raw_call(x [T, K], w13 [E, 2I, K] (gate rows then up rows, contiguous), expert_offsets int32 [E+1],
    sorted_token_ids int32 [S], max_rows, act 'silu' | 'situ', beta=4.0, linear_beta=25.0, out=None) -> h [S, I]
    in x's dtype, sorted order: MoeGroupedGemmGlu's h = act(g) * u (g, u rounded to x's dtype first) for steps
    whose experts each hold at most max_rows <= 8 rows (decode: max_rows = T). Triton kernel
    kestrel/kernels/moe/expert_gemv.py (GLU variant): one program a (expert, BN intermediate columns), gate and up
    fp32 FMA accumulators per row over the whole K, each weight byte read once."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = GLU_TOLERANCE
    WIDTHS = ("E", "I", "K", "act", "dtype")
    CELLS = (
        tiny("unit: Kimi Linear in miniature, batch 1, SiLU: 8 routed experts + shared, top-2, H=64 -> I=32", T=1,
             E=9, k=2, shared=True, I=32, K=64, act="silu"),
        tiny("unit: batch 8, SiTU (the shared expert's 8 rows: 8-row programs), ragged I=40 and K=72 (a partial "
             "K step), skewed routing so some experts are empty", T=8, E=9, k=2, shared=True, I=40, K=72,
             act="situ", skew=4.0),
        tiny("unit: batch 2, SiLU, no shared expert (2-row programs, 1 or 2 live rows)", T=2, E=8, k=3, I=24, K=48,
             act="silu"),
        *gemv_cells("w13 + GLU", "I", 1024, 2304, 3072, 3584, kl=dict(act="silu"), k3=dict(act="situ")),
    )

    @staticmethod
    def raw_call(x, w13, expert_offsets, sorted_token_ids, max_rows, act="silu", beta=4.0, linear_beta=25.0,
                 out=None):
        return expert_gemv(x, w13, expert_offsets, max_rows, sorted_token_ids, glu=True, act=act, beta=beta,
                           linear_beta=linear_beta, out=out)

    @staticmethod
    def reference(x, w13, expert_offsets, sorted_token_ids, max_rows, act="silu", beta=4.0, linear_beta=25.0,
                  out=None):
        return MoeGroupedGemmGlu.reference(x, w13, expert_offsets, sorted_token_ids, act, beta, linear_beta, out)

    @staticmethod
    def widths(x, w13, expert_offsets, sorted_token_ids, max_rows, act="silu", beta=4.0, linear_beta=25.0,
               out=None):
        return {"E": w13.shape[0], "I": w13.shape[1] // 2, "K": w13.shape[2], "act": act, "dtype": x.dtype}

    @classmethod
    def cell_widths(cls, spec):
        return MoeGroupedGemmGlu.cell_widths(spec)        # the same widths, the same spec keys

    @staticmethod
    def is_valid(x, w13, expert_offsets, sorted_token_ids, max_rows, act="silu", beta=4.0, linear_beta=25.0,
                 out=None):
        return MoeGroupedGemmGlu.is_valid(x, w13, expert_offsets, sorted_token_ids, act, beta, linear_beta, out) \
            or rows_bound_ok(max_rows, expert_offsets)

    @staticmethod
    def compare(out, ref):
        compare_glu(out, ref, "MoeGemvGlu")

    @staticmethod
    def make_inputs(spec, device, generator):
        perm = decode_routing(spec, generator, device)
        T, E, I, K = spec["T"], spec["E"], spec["I"], spec["K"]
        dtype = spec.get("dtype", torch.bfloat16)
        return dict(x=randn((T, K), generator, device, dtype),
                    w13=randn((E, 2 * I, K), generator, device, dtype, scale=2 * K ** -0.5),
                    expert_offsets=perm.expert_offsets, sorted_token_ids=perm.sorted_token_ids, max_rows=T,
                    act=spec["act"], beta=4.0, linear_beta=25.0)
