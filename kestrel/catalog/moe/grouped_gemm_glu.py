"""The experts' first grouped GEMM (w13, gathering tokens) with SiLU-GLU / SiTU-GLU in its epilogue:
MoeGroupedGemm + SiluGlu / SituGlu -> one launch, and the [S, 2I] gate|up intermediate never reaches memory."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn, topk_ids
from kestrel.catalog.moe.grouped_gemm import MoeGroupedGemm
from kestrel.catalog.moe.permute import permute_reference
from kestrel.kernels.moe.grouped_gemm_glu import grouped_gemm_glu
from kestrel.ops.moe import glu

GLU_TOLERANCE = ("g, u: bf16 roundings of K<=3584 fp32-accumulated dots (summation order ~1e-6 rel can flip a "
                 "rounding, 2^-8) through the activation (|d act| <= ~1.1 |d g| + |d u|), then h's own bf16 "
                 "rounding: rtol 2e-2, atol 2e-2 x rms(h)")


def glu_args_ok(x: torch.Tensor, rows: int, S: int, act: str, beta: float, linear_beta: float,
                out: torch.Tensor | None, weights: tuple) -> str | None:
    """What a grouped GEMM with the GLU in its epilogue checks beyond its GEMM's: w13's `rows` (gate then up), the
    activation, and out [S, I] in x's dtype aliasing neither x nor the `weights` tensors."""
    if rows % 2:
        return f"w13 rows {rows} must be even (gate rows then up rows)"
    if act not in ("silu", "situ"):
        return f"act {act!r} must be 'silu' or 'situ'"
    if act == "situ" and not (beta > 0 and linear_beta > 0):
        return "SiTU betas must be > 0"
    if out is not None:
        if out.shape != (S, rows // 2) or out.stride(-1) != 1 or out.dtype != x.dtype:
            return f"out must be [{S}, {rows // 2}] in x's dtype with a contiguous last dim"
        if any(overlaps(out, t) for t in (x, *weights)):
            return "out overlaps an input"
    return None


def glu_reference(gu: torch.Tensor, act: str, beta: float, linear_beta: float, out: torch.Tensor | None):
    """The references' GLU over gate|up rows [S, 2I] (already rounded to x's dtype), written into out when given."""
    h = glu(*gu.chunk(2, dim=-1), act, beta, linear_beta)
    return out.copy_(h) if out is not None else h


def compare_glu(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """The tolerance of a grouped GEMM with the GLU in its epilogue against GEMM -> bf16 -> GLU."""
    scale = float(ref.float().pow(2).mean().sqrt()) if ref.numel() else 1.0
    assert_close(out, ref, rtol=2e-2, atol=2e-2 * scale, what=what)


class MoeGroupedGemmGlu(OpWrapper):
    """raw_call(x [T, K], w13 [E, 2I, K] (gate rows then up rows, contiguous), expert_offsets int32 [E+1],
    sorted_token_ids int32 [S], act 'silu' | 'situ', beta=4.0, linear_beta=25.0, out=None) -> h [S, I] in x's
    dtype, rows in sorted (expert-grouped) order: h = act(g) * u (SiTU: beta tanh(g/beta) sigmoid(g) *
    linear_beta tanh(u/linear_beta)) with [g | u] = MoeGroupedGemm(x, w13, expert_offsets, sorted_token_ids)
    rounded to x's dtype. Triton kernel: kestrel/kernels/moe/grouped_gemm_glu.py."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = GLU_TOLERANCE
    WIDTHS = ("E", "I", "K", "act", "dtype")     # rows = tokens x top-k (+ 1 with the shared expert stacked)
    CELLS = (
        tiny("unit: Kimi Linear in miniature, SiLU, 6 tokens, E=8, top-2, H=64 -> I=32", T=6, E=8, k=2, I=32,
             K=64, act="silu"),
        tiny("unit: K3 SiTU, ragged widths (I=40, K=48), skewed routing so some experts are empty", T=9, E=8,
             k=2, I=40, K=48, act="situ", skew=4.0),
        gpu("Kimi Linear 48B decode bs1: w13 + SiLU, 8 slots (+ shared as expert 256), H 2304 -> 1024", T=1,
            E=257, k=9, I=1024, K=2304, act="silu"),
        gpu("Kimi Linear 48B decode bs64: w13 + SiLU, 576 slots over 257 experts", T=64, E=257, k=9, I=1024,
            K=2304, act="silu"),
        gpu("Kimi Linear 48B prefill 8192: w13 + SiLU, 65536 slots", T=8192, E=256, k=8, I=1024, K=2304,
            act="silu"),
        # K3's whole stack, 896 experts of width 3072 on the 3584 latent: 39 GB of bf16 weights (run_cell shares
        # tensors this large with the reference instead of copying them)
        gpu("K3 latent MoE decode bs1: w13 + SiTU, 16 slots over 896 experts, latent 3584 -> 3072", T=1, E=896,
            k=16, I=3072, K=3584, act="situ"),
        gpu("K3 latent MoE decode bs64: w13 + SiTU, 1024 slots over 896 experts", T=64, E=896, k=16, I=3072,
            K=3584, act="situ"),
        gpu("K3 latent MoE prefill 8192: w13 + SiTU, 131072 slots over 896 experts", T=8192, E=896, k=16, I=3072,
            K=3584, act="situ"),
    )

    @staticmethod
    def raw_call(x, w13, expert_offsets, sorted_token_ids, act="silu", beta=4.0, linear_beta=25.0, out=None):
        return grouped_gemm_glu(x, w13, expert_offsets, sorted_token_ids, act, beta, linear_beta, out=out)

    @staticmethod
    def reference(x, w13, expert_offsets, sorted_token_ids, act="silu", beta=4.0, linear_beta=25.0, out=None):
        gu = MoeGroupedGemm.reference(x, w13, expert_offsets, sorted_token_ids)      # rounded to x's dtype
        return glu_reference(gu, act, beta, linear_beta, out)

    @staticmethod
    def widths(x, w13, expert_offsets, sorted_token_ids, act="silu", beta=4.0, linear_beta=25.0, out=None):
        return {"E": w13.shape[0], "I": w13.shape[1] // 2, "K": w13.shape[2], "act": act, "dtype": x.dtype}

    @classmethod
    def cell_widths(cls, spec):
        return {"E": spec["E"], "I": spec["I"], "K": spec["K"], "act": spec["act"],
                "dtype": spec.get("dtype", torch.bfloat16)}

    @staticmethod
    def is_valid(x, w13, expert_offsets, sorted_token_ids, act="silu", beta=4.0, linear_beta=25.0, out=None):
        if sorted_token_ids is None:
            return "sorted_token_ids is required (the first GEMM gathers tokens)"
        why = MoeGroupedGemm.is_valid(x, w13, expert_offsets, sorted_token_ids)
        if why:
            return why
        return glu_args_ok(x, w13.shape[1], sorted_token_ids.numel(), act, beta, linear_beta, out, (w13,))

    @staticmethod
    def compare(out, ref):
        compare_glu(out, ref, "MoeGroupedGemmGlu")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, E, k, I, K = spec["T"], spec["E"], spec["k"], spec["I"], spec["K"]
        perm = permute_reference(topk_ids(T, E, k, generator, device, spec.get("skew", 0.0)), E)
        dtype = spec.get("dtype", torch.bfloat16)
        return dict(x=randn((T, K), generator, device, dtype),
                    w13=randn((E, 2 * I, K), generator, device, dtype, scale=2 * K ** -0.5),
                    expert_offsets=perm.expert_offsets, sorted_token_ids=perm.sorted_token_ids,
                    act=spec["act"], beta=4.0, linear_beta=25.0)
