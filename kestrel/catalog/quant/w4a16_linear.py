"""Dense W4A16 projection: y = x @ dequant(W)^T with MXFP4 or NVFP4 weights, bf16 activations."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, tiny
from kestrel.catalog.moe._common import randn, rows_ok
from kestrel.catalog.quant._common import (dequantize_fp4, fp4_cell_widths, fp4_weight_ok, fp4_widths,
                                           gemm_out_ok, into_out, random_fp4_weight)
from kestrel.kernels.quant.w4a16 import w4a16_gemm

TOLERANCE = ("dequantized weights are exact in bf16 (e2m1 x e8m0 or e2m1 x e4m3: <= 6 significant bits), products "
             "exact in fp32, so only the fp32 summation order (K <= 7168 terms of |y| ~ 1: < 2^-12) and the bf16 "
             "output rounding (unit roundoff 2^-8; < 2^-7 under the interpreter, whose cast truncates) differ: "
             "rtol 2^-7, atol 1e-3; fp32 output rtol/atol 1e-4")


def compare_w4a16(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    if out.dtype == torch.float32:
        assert_close(out, ref, rtol=1e-4, atol=1e-4, what=what)
    else:
        assert_close(out, ref, rtol=2 ** -7, atol=1e-3, what=what)


def _cells(model: str, what: str, K: int, N: int, fmt: str):
    return tuple(gpu(f"{model} {fmt} ({what}, --modules all-linear) {phase}: {K} -> {N}", M=m, K=K, N=N, fmt=fmt)
                 for phase, m in (("decode bs1", 1), ("decode bs64", 64), ("prefill 8192", 8192)))


class W4A16Linear(OpWrapper):
    """y [M, N] = x [M, K] @ dequant(W)^T; W is packed e2m1 uint8 [N, K/2] (element 2j low nibble) with MXFP4
    e8m0 codes uint8 [N, K/32], or NVFP4 e4m3 [N, K/16] plus `second` fp32 [N, 1] (compressed-tensors'
    `weight_global_scale` when `divisor`, ModelOpt's `weight_scale_2` otherwise): exactly `QuantizedWeight`'s
    buffers. x bf16 with a contiguous last dim; out bf16 (default) or fp32; `split_k` (None: from the shape)
    splits K when the output tiles cannot fill the GPU (decode). Triton kernels kestrel/kernels/quant/w4a16_tc.py
    for M <= 16 (bf16 x: 16-row tensor-core tiles over a register dequantize; w4a16_gemv.py's FMA kernel for
    M = 1, w4a16.decode_path) and w4a16.py past that (dequantize in the load path, bf16 tensor-core
    dot, fp32 accumulation)."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = TOLERANCE
    WIDTHS = ("K", "N", "fmt", "divisor", "out_dtype")
    CELLS = (
        tiny("unit: MXFP4, 5 tokens, 128 -> 40 (a partial N tile)", M=5, K=128, N=40, fmt="mxfp4"),
        tiny("unit: NVFP4 compressed-tensors (divisor), 3 tokens, 96 -> 32 (K steps of 32)", M=3, K=96, N=32,
             fmt="nvfp4"),
        tiny("unit: NVFP4 ModelOpt (multiplier), fp32 output, 17 tokens (past decode: the 64-row tiles)", M=17, K=64, N=48,
             fmt="nvfp4", divisor=False, out_dtype=torch.float32),
        tiny("unit: MXFP4 with K split in 3 (the dense decode path)", M=2, K=384, N=32, fmt="mxfp4", split_k=3),
        tiny("unit: MXFP4, 4 tokens: the tensor-core decode kernel, fp32 output", M=4, K=128, N=40,
             fmt="mxfp4", out_dtype=torch.float32),
        *_cells("K3", "latent MoE routed_expert_down_proj", 7168, 3584, "nvfp4"),
        *_cells("K3", "latent MoE routed_expert_up_proj", 3584, 7168, "mxfp4"),
        *_cells("Kimi Linear 48B", "shared expert gate_up", 2304, 2048, "nvfp4"),
        *_cells("Kimi Linear 48B", "shared expert down", 1024, 2304, "mxfp4"),
    )

    @staticmethod
    def raw_call(x, packed, scale, second=None, divisor=True, out=None, split_k=None):
        return w4a16_gemm(x, packed, scale, second, divisor, out=out, split_k=split_k)

    @staticmethod
    def reference(x, packed, scale, second=None, divisor=True, out=None, split_k=None):
        return into_out(x.float() @ dequantize_fp4(packed, scale, second, divisor).t(), out, x.dtype)

    @staticmethod
    def widths(x, packed, scale, second=None, divisor=True, out=None, split_k=None):
        return {"K": x.shape[1], "N": packed.shape[0], **fp4_widths(scale, divisor, out)}

    @classmethod
    def cell_widths(cls, spec):
        return {"K": spec["K"], "N": spec["N"], **fp4_cell_widths(spec)}

    @staticmethod
    def is_valid(x, packed, scale, second=None, divisor=True, out=None, split_k=None):
        why = rows_ok(x, "x") or fp4_weight_ok(packed, scale, second, 2)
        if why:
            return why
        if x.dtype != torch.bfloat16:
            return f"x must be bf16 (the dequantized weights are bf16), got {x.dtype}"
        N, K = packed.shape[0], 2 * packed.shape[1]
        if x.shape[1] != K:
            return f"x width {x.shape[1]} != K {K}"
        return gemm_out_ok(out, x.shape[0], N, (x, packed, scale, second), split_k)

    @staticmethod
    def compare(out, ref):
        compare_w4a16(out, ref, "W4A16Linear")

    @staticmethod
    def make_inputs(spec, device, generator):
        M, K, N = spec["M"], spec["K"], spec["N"]
        w = random_fp4_weight(spec["fmt"], (), N, K, generator, device, spec.get("divisor", True))
        out_dtype = spec.get("out_dtype")
        return dict(x=randn((M, K), generator, device), **w,
                    out=torch.empty((M, N), dtype=out_dtype, device=device) if out_dtype else None,
                    split_k=spec.get("split_k"))
