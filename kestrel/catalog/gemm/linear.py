"""Dense projection y = x @ W^T (bf16 in, bf16 out, fp32 accumulation)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn, rows_ok
from kestrel.kernels.gemm.gemv import WIDE_BK, gemv

_DTYPES = (torch.bfloat16, torch.float16)


DECODE_PREFILL = [("decode bs1", 1), ("decode bs64", 64), ("prefill 8192", 8192)]
CONTEXT = [("prefill chunk over 8192 cached tokens", 8192)]     # kv_b_proj expands the context's latents


def _cells(model: str, shapes: list[tuple[str, int, int, list[tuple[str, int]]]]):
    return tuple(gpu(f"{model} tp1 {phase}: {what} {k} -> {n}", T=t, K=k, N=n, dtype=torch.bfloat16)
                 for what, k, n, tokens in shapes for phase, t in tokens)


def use_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> bool:
    """One row on CUDA with K a multiple of the GEMV's WIDE_BK (1024): kestrel/kernels/gemm/gemv.py beat cuBLAS
    there on the H200 inside a graph (o_proj 4096 -> 2304: 8.0 against 9.9 us, cuBLAS's split K and its reduce
    launch; dense down 9216 -> 2304: 14.6 against 18.0); at K = 2304 it does not (the joined KDA input projection:
    20.1 against 19.8)."""
    return (x.is_cuda and x.shape[0] == 1 and weight.shape[1] % WIDE_BK == 0 and x.stride(-1) == 1
            and weight.stride(-1) == 1 and (out is None or out.stride(-1) == 1))


class Linear(OpWrapper):
    """y [T, N] = x [T, K] @ weight [N, K]^T, fp32 accumulation, bf16 output: torch.mm (cuBLAS), except a batch-1
    row whose K is a multiple of 1024 on CUDA, which the bf16 GEMV (kestrel/kernels/gemm/gemv.py: whole weight
    rows a program, no split K) serves. Quantized projections (FP8 / MXFP8 / NVFP4) are separate entries under
    catalog/quant."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("bf16 output of a K<=33792 dot with fp32 accumulation: bf16 rounding 2^-9 -> rtol 1e-2, "
                 "atol 1e-2 at |y| ~ 1")
    WIDTHS = ("K", "N", "dtype")
    CELLS = (
        tiny("unit: 5 tokens, 64 -> 96", T=5, K=64, N=96, dtype=torch.bfloat16),
        tiny("unit: fp16, 3 tokens, 96 -> 32", T=3, K=96, N=32, dtype=torch.float16),
        # Kimi Linear 48B: hidden 2304; KDA 32 heads x 128 (width 4096), low-rank gates of rank 128; MLA 32
        # heads, q_proj (no q LoRA), qk 128 + 64, v 128, kv latent 512 + 64; dense layer 0 intermediate 9216;
        # one shared expert of 1024
        *_cells("Kimi Linear 48B", [
            ("KDA q|k|v fused proj (3 x 32 x 128)", 2304, 12288, DECODE_PREFILL),
            ("KDA joined input proj q|k|v|f_a|g_a|b (12288 + 128 + 128 + 32)", 2304, 12576, DECODE_PREFILL),
            ("MLA joined input proj q|kv_a (6144 + 576)", 2304, 6720, DECODE_PREFILL),
            ("KDA f_a_proj / g_a_proj (rank 128)", 2304, 128, DECODE_PREFILL),
            ("KDA f_b_proj / g_b_proj (128 -> 32 x 128)", 128, 4096, DECODE_PREFILL),
            ("KDA b_proj (beta, 32 heads)", 2304, 32, DECODE_PREFILL),
            ("KDA / MLA o_proj (32 x 128)", 4096, 2304, DECODE_PREFILL),
            ("MLA q_proj (32 x 192)", 2304, 6144, DECODE_PREFILL),
            ("MLA kv_a_proj_with_mqa (512 + 64)", 2304, 576, DECODE_PREFILL),
            ("MLA kv_b_proj (32 x (128 + 128))", 512, 8192, CONTEXT),
            ("dense layer 0 gate|up (2 x 9216)", 2304, 18432, DECODE_PREFILL),
            ("dense layer 0 down", 9216, 2304, DECODE_PREFILL),
            ("shared expert gate|up (2 x 1024)", 2304, 2048, DECODE_PREFILL),
            ("shared expert down", 1024, 2304, DECODE_PREFILL),
        ]),
        # K3: hidden 7168; KDA 96 heads x 128 (width 12288), f rank 128, full-rank output gate; MLA 96 heads,
        # q LoRA 1536, qk 128 + 64, v 128, kv latent 512 + 64, output gate; dense layer 0 intermediate 33792;
        # latent MoE 7168 -> 3584; two shared experts of 3072 (fused 6144)
        *_cells("K3", [
            ("KDA q|k|v fused proj (3 x 96 x 128)", 7168, 36864, DECODE_PREFILL),
            ("KDA joined input proj q|k|v|f_a|g|b (36864 + 128 + 12288 + 96)", 7168, 49376, DECODE_PREFILL),
            ("MLA joined input proj q_a|kv_a (1536 + 576)", 7168, 2112, DECODE_PREFILL),
            ("latent MoE joined input proj: routed_expert_down | 2 shared experts gate|up (3584 + 12288)", 7168,
             15872, DECODE_PREFILL),
            ("latent MoE joined output proj: [normed latent | shared SiTU] @ [routed_expert_up | shared down] "
             "(3584 + 6144)", 9728, 7168, DECODE_PREFILL),
            ("KDA f_a_proj (rank 128)", 7168, 128, DECODE_PREFILL),
            ("KDA f_b_proj (128 -> 96 x 128)", 128, 12288, DECODE_PREFILL),
            ("KDA b_proj (beta, 96 heads)", 7168, 96, DECODE_PREFILL),
            ("KDA g_proj / MLA g_proj / shared experts gate|up (7168 -> 12288)", 7168, 12288, DECODE_PREFILL),
            ("KDA / MLA o_proj (96 x 128)", 12288, 7168, DECODE_PREFILL),
            ("MLA q_a_proj (q LoRA 1536)", 7168, 1536, DECODE_PREFILL),
            ("MLA q_b_proj (1536 -> 96 x 192)", 1536, 18432, DECODE_PREFILL),
            ("MLA kv_a_proj_with_mqa (512 + 64)", 7168, 576, DECODE_PREFILL),
            ("MLA kv_b_proj (512 -> 96 x (128 + 128))", 512, 24576, CONTEXT),
            ("dense layer 0 gate|up (2 x 33792)", 7168, 67584, DECODE_PREFILL),
            ("dense layer 0 down", 33792, 7168, DECODE_PREFILL),
            ("latent MoE routed_expert_down_proj", 7168, 3584, DECODE_PREFILL),
            ("latent MoE routed_expert_up_proj", 3584, 7168, DECODE_PREFILL),
            ("2 shared experts down (2 x 3072)", 6144, 7168, DECODE_PREFILL),
        ]),
    )

    @staticmethod
    def raw_call(x, weight, out=None):
        if use_gemv(x, weight, out):
            return gemv(x, weight, out=out)
        return torch.mm(x, weight.t(), out=out)

    @staticmethod
    def reference(x, weight, out=None):
        return (x.float() @ weight.float().t()).to(x.dtype)

    @staticmethod
    def widths(x, weight, out=None):
        return {"K": x.shape[1], "N": weight.shape[0], "dtype": x.dtype}

    @staticmethod
    def is_valid(x, weight, out=None):
        why = rows_ok(x, "x") or rows_ok(weight, "weight")
        if why:
            return why
        if x.dtype not in _DTYPES or weight.dtype != x.dtype:
            return f"x / weight must share bf16 or fp16, got {x.dtype} / {weight.dtype}"
        if weight.shape[1] != x.shape[1]:
            return f"weight {tuple(weight.shape)} does not match x width {x.shape[1]}"
        if out is not None and (out.shape != (x.shape[0], weight.shape[0]) or out.dtype != x.dtype
                                or overlaps(out, x) or overlaps(out, weight)):
            return "out must be [T, N] in x's dtype, not overlapping the inputs"
        return None

    @staticmethod
    def compare(out, ref):
        assert_close(out, ref, rtol=1e-2, atol=1e-2, what="Linear")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, K, N, dtype = spec["T"], spec["K"], spec["N"], spec["dtype"]
        return dict(x=randn((T, K), generator, device, dtype), weight=randn((N, K), generator, device, dtype,
                                                                             scale=K ** -0.5))
