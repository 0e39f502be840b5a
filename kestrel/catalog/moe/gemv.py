"""The experts' second GEMM (w2, on the sorted rows) as a GEMV for decode steps whose experts hold at most 8 rows:
each touched expert's weights streamed once for all its rows (MoeGroupedGemm pads them into 16-row tiles)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, tiny
from kestrel.catalog.moe._common import randn, topk_ids
from kestrel.catalog.moe.grouped_gemm import MoeGroupedGemm
from kestrel.catalog.moe.permute import permute_reference
from kestrel.kernels.moe.expert_gemv import MAX_ROWS, expert_gemv


def decode_routing(spec: dict, generator: torch.Generator, device):
    """The Permutation of a decode step: T tokens' top-k over the routed experts (E, or E - 1 with `shared`) and,
    with `shared`, every token on the last expert too (Kimi Linear's shared expert stacked as expert E - 1)."""
    T, E, k = spec["T"], spec["E"], spec["k"]
    shared = spec.get("shared", False)
    ids = topk_ids(T, E - int(shared), k, generator, "cpu", spec.get("skew", 0.0))
    if shared:
        ids = torch.cat([ids, torch.full((T, 1), E - 1, dtype=torch.int32)], dim=1)
    return permute_reference(ids.to(device), E)


def rows_bound_ok(max_rows: int, expert_offsets: torch.Tensor) -> str | None:
    """`max_rows` is a row count the GEMV tiles take (1..MAX_ROWS) and bounds every expert's rows."""
    if not isinstance(max_rows, int) or not 1 <= max_rows <= MAX_ROWS:
        return f"max_rows {max_rows!r} must be an int in 1..{MAX_ROWS} (past that the grouped GEMM's tiles run)"
    counts = expert_offsets.cpu().long().diff()
    if counts.numel() and int(counts.max()) > max_rows:
        return f"an expert holds {int(counts.max())} rows, more than max_rows {max_rows}"
    return None


def gemv_cells(what: str, n_key: str, n_kl: int, k_kl: int, n_k3: int, k_k3: int, **extra) -> tuple:
    """The real-width cells of both GEMVs: Kimi Linear 48B (256 routed experts, top-8, the shared expert stacked as
    expert 256) at batch 1, 2, 4, 8, its 256 routed experts alone (the shared expert stored FP8) and K3's latent MoE (896 experts, top-16) at batch 1 and 8."""
    kl = tuple(gpu(f"Kimi Linear 48B decode bs{T}: {what}, {9 * T} slots (shared expert as expert 256: {T} rows)",
                   T=T, E=257, k=8, shared=True, **{n_key: n_kl}, K=k_kl, **extra.get("kl", {}))
               for T in (1, 2, 4, 8))
    fp8_shared = tuple(gpu(f"Kimi Linear 48B --fp8-weight-read moe-mlp decode bs{T}: {what}, {8 * T} slots over the "
                           "256 routed experts (the FP8 shared expert runs its own GEMMs)", T=T, E=256, k=8,
                           **{n_key: n_kl}, K=k_kl, **extra.get("kl", {}))
                       for T in (1, 8))
    k3 = tuple(gpu(f"K3 latent MoE decode bs{T}: {what}, {16 * T} slots over 896 experts", T=T, E=896, k=16,
                   **{n_key: n_k3}, K=k_k3, **extra.get("k3", {}))
               for T in (1, 8))
    return kl + fp8_shared + k3


class MoeGemv(OpWrapper):
    """raw_call(x [S, K] in sorted order, w [E, N, K] contiguous, expert_offsets int32 [E+1], max_rows, out=None)
    -> y [S, N] in x's dtype: MoeGroupedGemm(x, w, expert_offsets) (no gather) for steps whose experts each hold at
    most max_rows <= 8 rows (decode: max_rows = the step's tokens, as top-k experts are distinct per token).
    Triton kernel kestrel/kernels/moe/expert_gemv.py: one program a (expert, BN weight rows), fp32 FMA over the
    whole K for all the expert's rows, each weight byte read once."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "bf16 output of a K<=3072 dot, fp32 accumulation in another order than the reference's: bf16 " \
        "rounding 2^-9 -> rtol 1e-2, atol 1e-2 at |y| ~ 1 (as MoeGroupedGemm)"
    WIDTHS = ("E", "N", "K", "dtype")
    CELLS = (
        tiny("unit: Kimi Linear in miniature, batch 1: 8 routed experts + shared, top-2, I=32 -> H=64", T=1, E=9,
             k=2, shared=True, N=64, K=32),
        tiny("unit: batch 8 (the shared expert's 8 rows: 8-row programs), ragged N=40 and K=72 (a partial K "
             "step), skewed routing so some experts are empty", T=8, E=9, k=2, shared=True, N=40, K=72, skew=4.0),
        tiny("unit: batch 3 without a shared expert (4-row programs, 1..3 live rows)", T=3, E=8, k=3, N=48, K=64),
        *gemv_cells("w2", "N", 2304, 1024, 3584, 3072),
    )

    @staticmethod
    def raw_call(x, w, expert_offsets, max_rows, out=None):
        return expert_gemv(x, w, expert_offsets, max_rows, out=out)

    @staticmethod
    def reference(x, w, expert_offsets, max_rows, out=None):
        return MoeGroupedGemm.reference(x, w, expert_offsets, out=out)

    @staticmethod
    def widths(x, w, expert_offsets, max_rows, out=None):
        return {"E": w.shape[0], "N": w.shape[1], "K": w.shape[2], "dtype": x.dtype}

    @classmethod
    def cell_widths(cls, spec):
        return {"E": spec["E"], "N": spec["N"], "K": spec["K"], "dtype": spec.get("dtype", torch.bfloat16)}

    @staticmethod
    def is_valid(x, w, expert_offsets, max_rows, out=None):
        if out is not None and out.dtype != x.dtype:
            return "out must be in x's dtype"
        return MoeGroupedGemm.is_valid(x, w, expert_offsets, out=out) or rows_bound_ok(max_rows, expert_offsets)

    @staticmethod
    def compare(out, ref):
        assert_close(out, ref, rtol=1e-2, atol=1e-2, what="MoeGemv")

    @staticmethod
    def make_inputs(spec, device, generator):
        perm = decode_routing(spec, generator, device)
        E, N, K = spec["E"], spec["N"], spec["K"]
        S = perm.sorted_token_ids.numel()
        dtype = spec.get("dtype", torch.bfloat16)
        return dict(x=randn((S, K), generator, device, dtype), w=randn((E, N, K), generator, device, dtype,
                                                                        scale=K ** -0.5),
                    expert_offsets=perm.expert_offsets, max_rows=spec["T"])
