"""LM head: logits in fp32 from the final hidden state."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn, rows_ok

VOCAB = 163840      # the Kimi tokenizer's vocabulary (Kimi Linear and K3)


class LmHead(OpWrapper):
    """logits fp32 [T, V] = x [T, H] @ weight [V, H]^T, bf16 operands, fp32 accumulation and output.
    On CUDA one cuBLAS GEMM writes fp32 directly (torch.mm(..., out_dtype=torch.float32)); a GEMM of this
    shape is what cuBLAS is best at, so Kestrel writes no kernel of its own here. On the CPU it upcasts."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("fp32 logits of a K<=7168 bf16 dot (products exact in fp32; cuBLAS summation order / split-K): "
                 "rtol 1e-3, atol 1e-3 at |logit| ~ 1")
    WIDTHS = ("V", "H")
    CELLS = (
        tiny("unit: 3 tokens, vocab 1000, hidden 64", T=3, V=1000, H=64),
        gpu("Kimi Linear 48B decode bs1: lm_head, hidden 2304 -> vocab 163840", T=1, V=VOCAB, H=2304),
        gpu("Kimi Linear 48B decode bs64: lm_head", T=64, V=VOCAB, H=2304),
        gpu("Kimi Linear 48B decode bs256: lm_head", T=256, V=VOCAB, H=2304),
        gpu("K3 decode bs1: lm_head, hidden 7168 -> vocab 163840", T=1, V=VOCAB, H=7168),
        gpu("K3 decode bs64: lm_head", T=64, V=VOCAB, H=7168),
        gpu("K3 decode bs256 (DSpark verify blocks): lm_head", T=256, V=VOCAB, H=7168),
    )

    @staticmethod
    def raw_call(x, weight, out=None):
        if x.is_cuda:
            if out is None:
                return torch.mm(x, weight.t(), out_dtype=torch.float32)
            return torch.mm(x, weight.t(), out_dtype=torch.float32, out=out)
        res = torch.mm(x.float(), weight.float().t())
        if out is not None:
            out.copy_(res)
            res = out
        return res

    @staticmethod
    def reference(x, weight, out=None):
        return x.float() @ weight.float().t()

    @staticmethod
    def widths(x, weight, out=None):
        return {"V": weight.shape[0], "H": weight.shape[1]}

    @staticmethod
    def is_valid(x, weight, out=None):
        why = rows_ok(x, "x") or rows_ok(weight, "weight")
        if why:
            return why
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
            return f"x and weight must be bf16, got {x.dtype} / {weight.dtype}"
        if weight.shape[1] != x.shape[1]:
            return f"weight {tuple(weight.shape)} does not match hidden {x.shape[1]}"
        if out is not None and (out.shape != (x.shape[0], weight.shape[0]) or out.dtype != torch.float32
                                or not out.is_contiguous() or overlaps(out, x) or overlaps(out, weight)):
            return "out must be a contiguous fp32 [T, V] not overlapping the inputs"
        return None

    @staticmethod
    def compare(out, ref):
        if out.dtype != torch.float32:
            raise AssertionError(f"LmHead logits must be fp32, got {out.dtype}")
        assert_close(out, ref, rtol=1e-3, atol=1e-3, what="LmHead")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, V, H = spec["T"], spec["V"], spec["H"]
        return dict(x=randn((T, H), generator, device), weight=randn((V, H), generator, device, scale=H ** -0.5))
