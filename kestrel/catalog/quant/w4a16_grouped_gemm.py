"""Grouped W4A16 GEMM over the experts of one MoE layer: MXFP4 / NVFP4 expert weights, bf16 activations."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, tiny
from kestrel.catalog.moe._common import randn, topk_ids
from kestrel.catalog.moe.grouped_gemm import MoeGroupedGemm
from kestrel.catalog.moe.permute import permute_reference
from kestrel.catalog.quant._common import (dequantize_fp4, fp4_cell_widths, fp4_weight_ok, fp4_widths,
                                           gemm_out_ok, random_fp4_weight)
from kestrel.catalog.quant.w4a16_linear import TOLERANCE, compare_w4a16
from kestrel.kernels.quant.w4a16 import w4a16_gemm

# (model, E, top-k, w13 N = 2 x width, w2 N = hidden or latent, the GEMM's K for w13 = that same width)
K3_MOE = ("K3 latent MoE", 896, 16, 6144, 3584)           # 896 experts of width 3072 on the 3584 latent
KL_MOE = ("Kimi Linear 48B", 256, 8, 2048, 2304)         # 256 experts of width 1024 on hidden 2304


def _cells(model, E, k, n13, hidden, fmt, phases, divisor=True):
    name = fmt if divisor else f"{fmt} ModelOpt"
    cells = []
    for phase, T in phases:
        cells.append(gpu(f"{model} {name} {phase}: w13, {T * k} slots, {hidden} -> {n13}", T=T, E=E, k=k, N=n13,
                         K=hidden, gather=True, fmt=fmt, divisor=divisor))
        cells.append(gpu(f"{model} {name} {phase}: w2, {n13 // 2} -> {hidden}", T=T, E=E, k=k, N=hidden,
                         K=n13 // 2, gather=False, fmt=fmt, divisor=divisor))
    return tuple(cells)


DECODE = [("decode bs1", 1), ("decode bs8", 8), ("decode bs64", 64)]
PREFILL = [("prefill 8192", 8192)]


class DequantizedExperts:
    """A stacked FP4 weight seen as [E, N, K] floats: indexing by expert dequantizes that expert alone (fp32), so
    a reference never holds a whole K3 expert stack in fp32."""

    def __init__(self, packed, scale, second, divisor):
        self.packed, self.scale, self.second, self.divisor = packed, scale, second, divisor
        E, N, Kh = packed.shape
        self.shape = (E, N, 2 * Kh)

    def __getitem__(self, e: int) -> torch.Tensor:
        second = self.second[e] if self.second is not None else None
        return dequantize_fp4(self.packed[e], self.scale[e], second, self.divisor)


class W4A16GroupedGemm(OpWrapper):
    """y[rows of e] = x[rows of e] @ dequant(W[e])^T, rows e = expert_offsets[e]..expert_offsets[e+1], the
    routing of `MoeGroupedGemm` (sorted_token_ids: row p reads x[sorted_token_ids[p]], the first GEMM; without
    it x is [S, K] in sorted order, the second). W: packed uint8 [E, N, K/2] with MXFP4 e8m0 codes [E, N, K/32]
    or NVFP4 e4m3 [E, N, K/16] and `second` fp32 [E, N, 1] (divisor or multiplier, see `W4A16Linear`): a stacked
    `QuantizedWeight`'s buffers (w13 [E, 2I, H/2], w2 [E, H, I/2]). Returns y [S, N] bf16 (or out's fp32).
    Kernels kestrel/kernels/quant/w4a16_tc.py (decode, up to 16 rows per expert: 16-row tensor-core tiles over a
    register dequantize of ~2 instructions per weight), w4a16_gemv.py (the FMA decode kernel, 1, 2 or 4 rows per
    program: the host's pick at one row per touched expert, w4a16.decode_path) and w4a16.py (64 / 128-row tiles past 16 rows per
    expert and for prefill); tiles found on the device from expert_offsets; no host sync (capturable)."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = TOLERANCE
    WIDTHS = ("E", "N", "K", "gather", "fmt", "divisor", "out_dtype")     # rows = tokens x top-k
    CELLS = (
        tiny("unit: MXFP4 first GEMM (gather by token), 6 tokens, E=8, top-2, 64 -> 64", T=6, E=8, k=2, N=64,
             K=64, gather=True, fmt="mxfp4"),
        tiny("unit: NVFP4 second GEMM (contiguous), 32 -> 48, fp32 output", T=6, E=8, k=2, N=48, K=32,
             gather=False, fmt="nvfp4", out_dtype=torch.float32),
        tiny("unit: NVFP4 ModelOpt multiplier, skewed routing (empty experts), 20 slots on one expert tile edge",
             T=10, E=8, k=2, N=40, K=96, gather=True, skew=4.0, fmt="nvfp4", divisor=False),
        tiny("unit: MXFP4 with K split in 2, 2 tokens (most experts empty)", T=2, E=8, k=2, N=32, K=256,
             gather=True, fmt="mxfp4", split_k=2),
        tiny("unit: NVFP4, ~3.5 rows per expert: the tensor-core decode kernel", T=14, E=8, k=2, N=48, K=64,
             gather=True, fmt="nvfp4"),
        tiny("unit: MXFP4, 6 rows per expert, K=512 (two 256 K steps): the tensor-core decode kernel", T=24, E=8,
             k=2, N=32, K=512, gather=False, fmt="mxfp4"),
        tiny("unit: MXFP4, 20 rows per expert: past decode, the 64-row tiles", T=80, E=8, k=2, N=32, K=64,
             gather=False, fmt="mxfp4"),
        *_cells(*K3_MOE, "mxfp4", DECODE + [("chunked prefill 2048 (~36 rows per expert: the middle tiles)", 2048)]
                + PREFILL),
        *_cells(*K3_MOE, "nvfp4", DECODE + PREFILL),
        *_cells(*KL_MOE, "mxfp4", DECODE + PREFILL),
        # kimi_linear_nvfp4__sm_90__default's prefill (its 128 x 128 tiles) as well as its decode
        *_cells(*KL_MOE, "nvfp4", [("decode bs1", 1), ("decode bs64", 64)] + PREFILL),
        # ModelOpt NVFP4 (nvidia/Kimi-K3-NVFP4): the tensor scale is a multiplier (weight_scale_2)
        *_cells(*K3_MOE, "nvfp4", DECODE[:1] + DECODE[2:] + PREFILL, divisor=False),
        *_cells(*KL_MOE, "nvfp4", [("decode bs1", 1), ("decode bs64", 64)], divisor=False),
    )

    @staticmethod
    def raw_call(x, packed, scale, expert_offsets, second=None, divisor=True, sorted_token_ids=None, out=None,
                 split_k=None):
        return w4a16_gemm(x, packed, scale, second, divisor, expert_offsets=expert_offsets,
                          sorted_token_ids=sorted_token_ids, out=out, split_k=split_k)

    @staticmethod
    def reference(x, packed, scale, expert_offsets, second=None, divisor=True, sorted_token_ids=None, out=None,
                  split_k=None):
        # the bf16 grouped GEMM's reference, reading each expert's weight through the formats' dequantize
        return MoeGroupedGemm.reference(x, DequantizedExperts(packed, scale, second, divisor), expert_offsets,
                                        sorted_token_ids, out)

    @staticmethod
    def widths(x, packed, scale, expert_offsets, second=None, divisor=True, sorted_token_ids=None, out=None,
               split_k=None):
        E, N, Kh = packed.shape
        return {"E": E, "N": N, "K": 2 * Kh, "gather": sorted_token_ids is not None,
                **fp4_widths(scale, divisor, out)}

    @classmethod
    def cell_widths(cls, spec):
        return {"E": spec["E"], "N": spec["N"], "K": spec["K"], "gather": spec["gather"], **fp4_cell_widths(spec)}

    @staticmethod
    def is_valid(x, packed, scale, expert_offsets, second=None, divisor=True, sorted_token_ids=None, out=None,
                 split_k=None):
        why = fp4_weight_ok(packed, scale, second, 3)
        if why:
            return why
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
            return f"x must be bf16 (the dequantized weights are bf16), got {getattr(x, 'dtype', x)}"
        S = sorted_token_ids.numel() if sorted_token_ids is not None else x.shape[0]
        why = gemm_out_ok(out, S, packed.shape[1], (packed, scale, second), split_k)
        if why:
            return why
        # The routing checks are the bf16 grouped GEMM's: ask it with a shape-only stand-in for the weight.
        E, N, Kh = packed.shape
        stand_in = torch.empty((E, N, 2 * Kh), dtype=x.dtype, device="meta")
        return MoeGroupedGemm.is_valid(x, stand_in, expert_offsets, sorted_token_ids, out)

    @staticmethod
    def compare(out, ref):
        compare_w4a16(out, ref, "W4A16GroupedGemm")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, E, k, N, K = spec["T"], spec["E"], spec["k"], spec["N"], spec["K"]
        perm = permute_reference(topk_ids(T, E, k, generator, device, spec.get("skew", 0.0)), E)
        S = T * k
        out_dtype = spec.get("out_dtype")
        return dict(
            x=randn((T if spec["gather"] else S, K), generator, device),
            **random_fp4_weight(spec["fmt"], (E,), N, K, generator, device, spec.get("divisor", True)),
            expert_offsets=perm.expert_offsets,
            sorted_token_ids=perm.sorted_token_ids if spec["gather"] else None,
            out=torch.empty((S, N), dtype=out_dtype, device=device) if out_dtype else None,
            split_k=spec.get("split_k"),
        )
