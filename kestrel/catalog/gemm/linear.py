"""Dense projection y = x @ W^T (bf16 in, bf16 out, fp32 accumulation)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn, rows_ok

_DTYPES = (torch.bfloat16, torch.float16)


def _cells(model: str, shapes: list[tuple[str, int, int]], tokens: list[tuple[str, int]]):
    return tuple(gpu(f"{model} {phase}: {what} {k} -> {n}", T=t, K=k, N=n, dtype=torch.bfloat16)
                 for what, k, n in shapes for phase, t in tokens)


class Linear(OpWrapper):
    """y [T, N] = x [T, K] @ weight [N, K]^T via torch.mm (cuBLAS, fp32 accumulation, bf16 output). cuBLAS is
    already the best kernel for an unquantized dense GEMM of these shapes, so Kestrel writes none of its own;
    quantized projections (FP8 / MXFP8 / NVFP4) are separate entries under catalog/quant."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("bf16 output of a K<=7168 dot with fp32 accumulation: bf16 rounding 2^-9 -> rtol 1e-2, "
                 "atol 1e-2 at |y| ~ 1")
    CELLS = (
        tiny("unit: 5 tokens, 64 -> 96", T=5, K=64, N=96, dtype=torch.bfloat16),
        tiny("unit: fp16, 3 tokens, 96 -> 32", T=3, K=96, N=32, dtype=torch.float16),
        # Kimi Linear 48B (hidden 2304; KDA and MLA 32 heads; head dims 128 / qk 192; shared expert 1024)
        *_cells("Kimi Linear 48B", [
            ("KDA q/k/v proj (32 x 128)", 2304, 4096),
            ("KDA / MLA o_proj", 4096, 2304),
            ("MLA q_proj (32 x 192)", 2304, 6144),
            ("MLA kv_a_proj_with_mqa (512 + 64)", 2304, 576),
            ("MLA kv_b_proj (32 x (128 + 128))", 512, 8192),
            ("shared expert gate_up", 2304, 2048),
            ("shared expert down", 1024, 2304),
        ], [("decode bs1", 1), ("decode bs64", 64), ("prefill 8192", 8192)]),
        # K3 (hidden 7168; latent MoE 3584; q LoRA 1536; kv latent 512 + 64)
        *_cells("K3", [
            ("latent MoE routed_expert_down_proj", 7168, 3584),
            ("latent MoE routed_expert_up_proj", 3584, 7168),
            ("MLA q_a_proj", 7168, 1536),
            ("MLA kv_a_proj_with_mqa", 7168, 576),
        ], [("decode bs1", 1), ("decode bs64", 64), ("decode bs256", 256), ("prefill 8192", 8192)]),
    )

    @staticmethod
    def raw_call(x, weight, out=None):
        return torch.mm(x, weight.t(), out=out)

    @staticmethod
    def reference(x, weight, out=None):
        return (x.float() @ weight.float().t()).to(x.dtype)

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
