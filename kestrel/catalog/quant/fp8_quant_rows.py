"""Per-token FP8 quantization of activations: the input of the W8A8 GEMM (`Fp8Linear`)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn, rows_ok
from kestrel.kernels.quant.fp8 import quantize_rows
from kestrel.quant.codes import e4m3_encode, fp8_scale

E4M3 = torch.float8_e4m3fn


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scale = amax / 448 per row (1 for an all-zero row, quantize_fp8's convention), q = e4m3(x / scale)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = fp8_scale(amax)
    return e4m3_encode(xf / scale), scale


class Fp8QuantRows(OpWrapper):
    """x [M, K] (bf16 / fp16 / fp32, contiguous last dim) -> (q float8_e4m3fn [M, K], scale fp32 [M, 1]): each
    row scaled by amax / 448 (1 when all zero) and rounded to e4m3 (nearest even, saturating). One program per
    row (kestrel/kernels/quant/fp8.py); the division is IEEE, so the result is the reference's bit for bit."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "bitwise: the same IEEE division and round-to-nearest-even conversion as the reference"
    WIDTHS = ("K", "dtype")
    CELLS = (
        tiny("unit: 5 rows of 96, bf16", M=5, K=96, dtype=torch.bfloat16),
        tiny("unit: 3 rows of 40 (a masked tail), fp32 input", M=3, K=40, dtype=torch.float32),
        gpu("K3 trunk FP8 decode bs1: hidden 7168", M=1, K=7168, dtype=torch.bfloat16),
        gpu("K3 trunk FP8 decode bs64: hidden 7168", M=64, K=7168, dtype=torch.bfloat16),
        gpu("K3 trunk FP8 prefill 8192: hidden 7168", M=8192, K=7168, dtype=torch.bfloat16),
        gpu("K3 trunk FP8 prefill 8192: o_proj input 96 x 128", M=8192, K=12288, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B FP8 prefill 8192: hidden 2304", M=8192, K=2304, dtype=torch.bfloat16),
        # --fp8-weight-read moe-mlp: the inputs of the second projections (K3 [latent | shared act], the shared
        # expert's down) at decode and prefill sizes
        *(gpu(f"{what} FP8 {phase}: {name} {K}", M=M, K=K, dtype=torch.bfloat16)
          for what, name, K in (("K3 --fp8-weight-read", "latent | shared activation", 9728),
                                ("Kimi Linear 48B --fp8-weight-read", "shared expert activation", 1024))
          for phase, M in (("decode bs1", 1), ("decode bs64", 64), ("prefill 8192", 8192))),
    )

    @staticmethod
    def raw_call(x, out=None, scale_out=None):
        return quantize_rows(x, out, scale_out)

    @staticmethod
    def reference(x, out=None, scale_out=None):
        return quantize_rows_reference(x)

    @staticmethod
    def widths(x, out=None, scale_out=None):
        return {"K": x.shape[1], "dtype": x.dtype}

    @staticmethod
    def is_valid(x, out=None, scale_out=None):
        why = rows_ok(x, "x")
        if why:
            return why
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"x must be bf16, fp16 or fp32, got {x.dtype}"
        M, K = x.shape
        if out is not None and (out.shape != (M, K) or out.dtype != E4M3 or out.stride(-1) != 1):
            return f"out must be float8_e4m3fn [{M}, {K}] with a contiguous last dim"
        if scale_out is not None and (scale_out.shape != (M, 1) or scale_out.dtype != torch.float32
                                      or not scale_out.is_contiguous()):
            return f"scale_out must be contiguous fp32 [{M}, 1]"
        if overlaps(out, x) or overlaps(scale_out, x) or overlaps(out, scale_out):
            return "outputs overlap the input or each other"
        return None

    @staticmethod
    def compare(out, ref):
        (q, s), (rq, rs) = out, ref
        if q.shape != rq.shape or s.shape != rs.shape:
            raise AssertionError(f"Fp8QuantRows shapes {tuple(q.shape)}, {tuple(s.shape)} != reference "
                                 f"{tuple(rq.shape)}, {tuple(rs.shape)}")
        if not torch.equal(s.cpu(), rs.cpu()):
            raise AssertionError(f"Fp8QuantRows: {int((s.cpu() != rs.cpu()).sum())} row scales differ")
        diff = q.view(torch.uint8).cpu() != rq.view(torch.uint8).cpu()
        if diff.any():
            raise AssertionError(f"Fp8QuantRows: {int(diff.sum())}/{q.numel()} codes differ")

    @staticmethod
    def make_inputs(spec, device, generator):
        M, K = spec["M"], spec["K"]
        return dict(x=randn((M, K), generator, device, spec["dtype"], scale=3.0))
