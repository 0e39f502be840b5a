"""The FP4 experts' first grouped GEMM (w13, gathering tokens) with SiLU-GLU / SiTU-GLU in its epilogue:
W4A16GroupedGemm + SiluGlu / SituGlu -> one launch, and the [S, 2I] gate|up intermediate never reaches memory."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, tiny
from kestrel.catalog.moe.grouped_gemm_glu import GLU_TOLERANCE, compare_glu, glu_args_ok, glu_reference
from kestrel.catalog.quant._common import fp4_cell_widths, fp4_widths
from kestrel.catalog.quant.w4a16_grouped_gemm import DECODE, K3_MOE, KL_MOE, PREFILL, W4A16GroupedGemm
from kestrel.kernels.quant.w4a16_glu import w4a16_glu_gemm

ACT = {"K3 latent MoE": "situ", "Kimi Linear 48B": "silu"}


def _cells(model, E, k, n13, hidden, fmt, phases, divisor=True):
    name = fmt if divisor else f"{fmt} ModelOpt"
    act = ACT[model]
    return tuple(gpu(f"{model} {name} {phase}: w13 + {act.upper()}-GLU, {T * k} slots, {hidden} -> {n13 // 2}",
                     T=T, E=E, k=k, I=n13 // 2, K=hidden, fmt=fmt, divisor=divisor, act=act)
                 for phase, T in phases)


class W4A16GroupedGemmGlu(OpWrapper):
    """raw_call(x [T, K] bf16, packed uint8 [E, 2I, K/2], scale [E, 2I, K/G], expert_offsets int32 [E+1],
    sorted_token_ids int32 [S], second=None, divisor=True, act 'silu' | 'situ', beta=4.0, linear_beta=25.0,
    out=None) -> h [S, I] bf16 in sorted (expert-grouped) order: h = act(g) * u with [g | u] =
    W4A16GroupedGemm(x, packed, scale, expert_offsets, second, divisor, sorted_token_ids) rounded to bf16 (the
    weight is w13's stacked `QuantizedWeight`: MXFP4 e8m0 codes per 32, or NVFP4 e4m3 per 16 with the fp32 tensor
    scale per row, see `W4A16Linear`; gate rows 0..I, up rows I..2I). Triton kernels
    kestrel/kernels/quant/w4a16_tc.py (decode, up to 16 rows per expert: 16-row tensor-core tiles of 64 columns,
    gate and up accumulators side by side), w4a16_gemv.py (the FMA decode kernel, 1, 2 or 4 rows per program: the
    host's pick at one row per touched expert, w4a16.decode_path) and w4a16_glu.py (64 / 128-row tiles of 64 columns, gate + up the separate GEMM's
    128, past 16 rows per expert and for prefill); tiles found on the device (capturable)."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "the dequantized weights are exact in bf16 (W4A16GroupedGemm), so as MoeGroupedGemmGlu: " + \
        GLU_TOLERANCE
    WIDTHS = ("E", "I", "K", "act", "fmt", "divisor", "out_dtype")     # rows = tokens x top-k
    CELLS = (
        tiny("unit: Kimi Linear in miniature, MXFP4, SiLU, 6 tokens, E=8, top-2, 64 -> 32", T=6, E=8, k=2, I=32,
             K=64, fmt="mxfp4", act="silu"),
        tiny("unit: K3 in miniature, NVFP4 compressed-tensors (divisor), SiTU, ragged I=40 (a partial column "
             "tile), skewed routing (empty experts)", T=9, E=8, k=2, I=40, K=96, fmt="nvfp4", act="situ",
             skew=4.0),
        tiny("unit: NVFP4 ModelOpt (multiplier), SiLU, 40 slots skewed so that one expert spans two 16-row tiles, "
             "K=128", T=20, E=8, k=2, I=48, K=128, fmt="nvfp4", divisor=False, act="silu", skew=4.0),
        tiny("unit: MXFP4, SiTU, ~3.5 rows per expert: the tensor-core decode kernel", T=14, E=8, k=2, I=32,
             K=64, fmt="mxfp4", act="situ"),
        tiny("unit: NVFP4, SiLU, one token: the tensor-core decode kernel, one row per expert", T=1, E=8, k=2, I=32,
             K=96, fmt="nvfp4", act="silu"),
        tiny("unit: MXFP4, SiLU, 20 rows per expert: past decode, the 64-row tiles", T=80, E=8, k=2, I=32, K=64,
             fmt="mxfp4", act="silu"),
        *_cells(*K3_MOE, "mxfp4", DECODE + [("chunked prefill 2048", 2048)] + PREFILL),
        *_cells(*K3_MOE, "nvfp4", DECODE + PREFILL),
        *_cells(*KL_MOE, "mxfp4", DECODE + PREFILL),
        *_cells(*KL_MOE, "nvfp4", DECODE + PREFILL),
        # ModelOpt NVFP4 (nvidia/Kimi-K3-NVFP4): the tensor scale is a multiplier (weight_scale_2)
        *_cells(*K3_MOE, "nvfp4", DECODE[:1] + DECODE[2:] + PREFILL, divisor=False),
        *_cells(*KL_MOE, "nvfp4", DECODE[:1] + DECODE[2:], divisor=False),
    )

    @staticmethod
    def raw_call(x, packed, scale, expert_offsets, sorted_token_ids, second=None, divisor=True, act="silu",
                 beta=4.0, linear_beta=25.0, out=None):
        return w4a16_glu_gemm(x, packed, scale, second, divisor, expert_offsets, sorted_token_ids, act, beta,
                              linear_beta, out=out)

    @staticmethod
    def reference(x, packed, scale, expert_offsets, sorted_token_ids, second=None, divisor=True, act="silu",
                  beta=4.0, linear_beta=25.0, out=None):
        # dequantize + grouped matmul (rounded to x's dtype, as the separate GEMM stores it), then the GLU
        gu = W4A16GroupedGemm.reference(x, packed, scale, expert_offsets, second, divisor, sorted_token_ids)
        return glu_reference(gu, act, beta, linear_beta, out)

    @staticmethod
    def widths(x, packed, scale, expert_offsets, sorted_token_ids, second=None, divisor=True, act="silu",
               beta=4.0, linear_beta=25.0, out=None):
        E, two_i, Kh = packed.shape
        return {"E": E, "I": two_i // 2, "K": 2 * Kh, "act": act, **fp4_widths(scale, divisor, out)}

    @classmethod
    def cell_widths(cls, spec):
        return {"E": spec["E"], "I": spec["I"], "K": spec["K"], "act": spec["act"], **fp4_cell_widths(spec)}

    @staticmethod
    def is_valid(x, packed, scale, expert_offsets, sorted_token_ids, second=None, divisor=True, act="silu",
                 beta=4.0, linear_beta=25.0, out=None):
        if sorted_token_ids is None:
            return "sorted_token_ids is required (the first GEMM gathers tokens)"
        # weights, x, the routing: the W4A16 grouped GEMM's checks (it returns the gate|up rows this fuses)
        why = W4A16GroupedGemm.is_valid(x, packed, scale, expert_offsets, second, divisor, sorted_token_ids)
        if why:
            return why
        return glu_args_ok(x, packed.shape[1], sorted_token_ids.numel(), act, beta, linear_beta, out,
                           (packed, scale, second))

    @staticmethod
    def compare(out, ref):
        compare_glu(out, ref, "W4A16GroupedGemmGlu")

    @staticmethod
    def make_inputs(spec, device, generator):
        # the W4A16 grouped GEMM's draw over w13's 2I rows (|g|, |u| ~ 1), gathering tokens
        d = W4A16GroupedGemm.make_inputs(dict(spec, N=2 * spec["I"], gather=True), device, generator)
        del d["out"], d["split_k"]
        return dict(d, act=spec["act"], beta=4.0, linear_beta=25.0)
