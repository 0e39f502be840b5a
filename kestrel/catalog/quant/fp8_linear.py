"""W8A8 FP8 projection: per-token FP8 activations times FP8 weights (per-row, 128 x 128 block or MXFP8 scales)."""

from __future__ import annotations

import math

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, tiny
from kestrel.catalog.moe._common import randn
from kestrel.catalog.quant._common import gemm_out_ok, into_out, rand_uint8, rand_uniform
from kestrel.catalog.quant.fp8_quant_rows import E4M3, quantize_rows_reference
from kestrel.kernels.quant.fp8 import fp8_gemm, scale_block
from kestrel.quant.formats import FP8_BLOCK, dequantize_fp8, dequantize_mx

_PHASES = (("decode bs1", 1), ("decode bs64", 64), ("prefill 8192", 8192))


def _cells(model: str, shapes, granularity: str):
    return tuple(gpu(f"{model} FP8 {granularity} {phase}: {what} {K} -> {N}", M=m, K=K, N=N,
                     granularity=granularity) for what, K, N in shapes for phase, m in _PHASES)


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] of an e4m3 weight in `QuantizedWeight`'s in-memory scale forms."""
    K = weight.shape[-1]
    block = scale_block(weight_scale, K)
    if block == 32:
        return dequantize_mx(weight, weight_scale)
    if block == 0:
        return dequantize_fp8(weight, weight_scale, "channel")
    return weight.float() * weight_scale.float().repeat_interleave(FP8_BLOCK[1], -1)[..., :K]


class Fp8Linear(OpWrapper):
    """y [M, N] = (xq * x_scale) @ (weight * weight_scale)^T, bf16 (default) or fp32 out. xq float8_e4m3fn [M, K]
    and x_scale fp32 [M, 1] come from `Fp8QuantRows`; weight float8_e4m3fn [N, K] with weight_scale in
    `QuantizedWeight`'s forms: fp32 [N, 1] (per channel, or a per-tensor scale widened), fp32 [N, ceil(K/128)]
    (128 x 128 blocks widened to rows), or uint8 e8m0 [N, K/32] (MXFP8). FP8 tensor-core dots with fp32
    accumulation promoted every K step (kestrel/kernels/quant/fp8.py); `split_k` (None: chosen from the shape)
    splits K for decode shapes whose output tiles cannot fill the GPU."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("e4m3 x e4m3 products are exact in fp32; the K sum: Hopper's FP8 accumulation keeps ~14 bits "
                 "within one K step of <= 128 (DeepSeek-V3), then fp32: <= 4 x 2^-13 of each step's partial "
                 "(|partial| ~ |y| sqrt(128/K)); scales applied in fp32; bf16 output 2^-8: rtol 2^-6, atol 4e-3 "
                 "at |y| ~ 1; fp32 output: rtol 1e-3, atol 1e-4 (the H200 was 1e-3 off at K=256 where a row's "
                 "terms cancel, even promoting every 32-deep MMA)")
    WIDTHS = ("K", "N", "granularity", "out_dtype")
    CELLS = (
        tiny("unit: per-row weight scales, 5 tokens, 128 -> 40", M=5, K=128, N=40, granularity="channel"),
        tiny("unit: 128 x 128 block scales, 3 column blocks, 2 row blocks (partial), 17 tokens", M=17, K=384, N=160,
             granularity="block"),
        tiny("unit: MXFP8 e8m0 per 32, fp32 output", M=4, K=96, N=32, granularity="mx", out_dtype=torch.float32),
        tiny("unit: split K in 3 (the decode path), block scales", M=2, K=384, N=48, granularity="block",
             split_k=3),
        *_cells("K3 trunk", [("MLA q_a_proj", 7168, 1536), ("MLA kv_a_proj_with_mqa", 7168, 576),
                             ("MLA q_b_proj (96 x 192)", 1536, 18432), ("KDA q/k/v proj (96 x 128)", 7168, 12288),
                             ("KDA / MLA o_proj", 12288, 7168), ("latent MoE routed_expert_down_proj", 7168, 3584),
                             ("latent MoE routed_expert_up_proj", 3584, 7168)], "block"),
        *_cells("K3 trunk", [("latent MoE routed_expert_down_proj", 7168, 3584),
                             ("KDA / MLA o_proj", 12288, 7168)], "channel"),
        *_cells("K3 trunk", [("latent MoE routed_expert_down_proj", 7168, 3584),
                             ("KDA q/k/v proj (96 x 128)", 7168, 12288)], "mx"),
        *_cells("Kimi Linear 48B", [("KDA q/k/v proj (32 x 128)", 2304, 4096)], "block"),
        # --fp8-weight-read moe-mlp (kestrel/models/kimi/fp8_read.py): the MoE blocks' bf16 projections per channel,
        # as the targets join them (K3: latent down | shared gate | up on x; [latent | shared act] -> hidden)
        *_cells("K3 --fp8-weight-read", [("latent down + shared gate|up", 7168, 15872),
                                         ("latent up | shared down", 9728, 7168)], "channel"),
        *_cells("Kimi Linear 48B --fp8-weight-read", [("shared gate|up", 2304, 2048), ("shared down", 1024, 2304)],
                "channel"),
    )

    @staticmethod
    def raw_call(xq, x_scale, weight, weight_scale, out=None, split_k=None):
        return fp8_gemm(xq, x_scale, weight, weight_scale, out=out, split_k=split_k)

    @staticmethod
    def reference(xq, x_scale, weight, weight_scale, out=None, split_k=None):
        return into_out((xq.float() * x_scale) @ dequantize_weight(weight, weight_scale).t(), out, torch.bfloat16)

    @staticmethod
    def widths(xq, x_scale, weight, weight_scale, out=None, split_k=None):
        K = xq.shape[1]
        return {"K": K, "N": weight.shape[0],
                "granularity": {0: "channel", 32: "mx", 128: "block"}[scale_block(weight_scale, K)],
                "out_dtype": out.dtype if out is not None else torch.bfloat16}

    @classmethod
    def cell_widths(cls, spec):
        granularity = "channel" if spec["granularity"] == "block" and spec["K"] <= 128 else spec["granularity"]
        return {"K": spec["K"], "N": spec["N"], "granularity": granularity,
                "out_dtype": spec.get("out_dtype", torch.bfloat16)}

    @staticmethod
    def is_valid(xq, x_scale, weight, weight_scale, out=None, split_k=None):
        if xq.dtype != E4M3 or xq.dim() != 2 or xq.stride(-1) != 1:
            return f"xq must be float8_e4m3fn [M, K] with a contiguous last dim, got {xq.dtype} {tuple(xq.shape)}"
        M, K = xq.shape
        if x_scale.dtype != torch.float32 or x_scale.shape != (M, 1) or x_scale.stride(0) != 1:
            return f"x_scale must be fp32 [{M}, 1] with unit stride"
        if weight.dtype != E4M3 or weight.dim() != 2 or weight.stride(-1) != 1 or weight.shape[1] != K:
            return f"weight must be float8_e4m3fn [N, {K}] with a contiguous last dim, got {tuple(weight.shape)}"
        if K % 32:
            return f"K={K} must be a multiple of 32 (the FP8 tensor-core K step)"
        N = weight.shape[0]
        if weight_scale.dtype == torch.uint8:
            want = (N, K // 32)
            if weight_scale.numel() and int(weight_scale.max()) == 0xFF:
                return "MXFP8 scale holds the NaN code 0xFF"
        elif weight_scale.dtype == torch.float32:
            want = (N, 1) if weight_scale.shape[-1] == 1 else (N, math.ceil(K / FP8_BLOCK[1]))
        else:
            return f"weight_scale must be fp32 (per row / block) or uint8 e8m0 (MXFP8), got {weight_scale.dtype}"
        if tuple(weight_scale.shape) != want or weight_scale.stride(-1) != 1:
            return f"weight_scale must be {list(want)} with a contiguous last dim, got {tuple(weight_scale.shape)}"
        return gemm_out_ok(out, M, N, (xq, x_scale, weight, weight_scale), split_k)

    @staticmethod
    def compare(out, ref):
        if out.dtype == torch.float32:
            assert_close(out, ref, rtol=1e-3, atol=1e-4, what="Fp8Linear")
        else:
            assert_close(out, ref, rtol=2 ** -6, atol=4e-3, what="Fp8Linear")

    @staticmethod
    def make_inputs(spec, device, generator):
        M, K, N, gran = spec["M"], spec["K"], spec["N"], spec["granularity"]
        xq, x_scale = quantize_rows_reference(randn((M, K), generator, device))
        weight = randn((N, K), generator, device, torch.float32, scale=150.0).clamp(-448, 448).to(E4M3)
        target = K ** -0.5 / 150.0              # |y| ~ 1 for x ~ N(0, 1)
        if gran == "mx":
            c = 127 + round(math.log2(target))
            weight_scale = rand_uint8((N, K // 32), c - 2, c + 2, generator, device)
        else:
            width = 1 if gran == "channel" else math.ceil(K / FP8_BLOCK[1])
            rows = N if gran == "channel" else math.ceil(N / FP8_BLOCK[0])
            weight_scale = rand_uniform((rows, width), 0.5 * target, 2 * target, generator, device)
            if gran == "block":          # one scale per 128 x 128 block, widened to rows as QuantizedWeight does
                weight_scale = weight_scale.repeat_interleave(FP8_BLOCK[0], 0)[:N].contiguous()
        out_dtype = spec.get("out_dtype")
        return dict(xq=xq, x_scale=x_scale, weight=weight, weight_scale=weight_scale,
                    out=torch.empty((M, N), dtype=out_dtype, device=device) if out_dtype else None,
                    split_k=spec.get("split_k"))
