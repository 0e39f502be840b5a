"""MLA context (prefill) attention over caller-quantized FP8 q, k, v: no conversion of its own."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.attention.mla_prefill import MlaPrefill
from kestrel.kernels.attention.mla_prefill import FP8_MIN_K, mla_prefill
from kestrel.quant.formats import dequantize_fp8, quantize_fp8

E4M3 = torch.float8_e4m3fn
_OUT = (torch.bfloat16, torch.float16, torch.float32)
_REAL = dict(d_nope=128, d_rope=64, d_v=128, dtype=torch.bfloat16)
_TINY = dict(d_nope=32, d_rope=16, d_v=32, dtype=torch.float32)


def _dequant(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8(x.reshape(-1, x.shape[-1]), s, "tensor").view(x.shape)


class MlaPrefillFp8(OpWrapper):
    """MlaPrefill with q, k, v in float8_e4m3fn, each with an fp32 tensor scale [1] (x = e4m3 * scale), as a caller
    that already quantized them hands them over (an FP8 attention input projection, FP8 latents expanded in FP8):
    the kernel reads the e4m3 operands as they are (q . k on the FP8 tensor cores; the scales folded into the
    softmax scale and the output), so there is no conversion pass. out [Tq, H, Dv] in `out_dtype`.
    Reference: dequantize q, k, v (quant.formats), then MlaPrefill's reference."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("scores: products of e4m3 values are exact in fp32, so they differ from the dequantized "
                 "reference's by summation order and the folded scale's rounding (2^-24 relative); P is rounded "
                 "to bf16 before P @ V as in MlaPrefill's bf16 path -> its bound: atol/rtol 1e-2 for bf16 out; "
                 "fp32 out: rtol/atol 1e-2 as well (the P rounding is there whatever the output dtype)")
    WIDTHS = ("heads", "d_qk", "d_v", "dtype")
    CELLS = (
        tiny("tiny widths, FP8 context attention: fresh prompts of 1, 20 and 37 tokens, fp32 out", heads=2,
             q_lens=(1, 20, 37), **_TINY),
        tiny("tiny widths, FP8 chunked prefill (16 after 24, 30 after 40 cached), bf16 out", heads=3,
             q_lens=(5, 16, 30), k_lens=(5, 40, 70), **{**_TINY, "dtype": torch.bfloat16}),
        gpu("Kimi Linear 48B tp1 FP8 prefill (32 heads): 1 x 4096-token prompt", heads=32, q_lens=(4096,), **_REAL),
        gpu("K3 tp1 FP8 prefill (96 heads): 1 x 4096-token prompt", heads=96, q_lens=(4096,), **_REAL),
        gpu("K3 tp1 FP8 chunked prefill (96 heads): 2048-token chunk over 8192 context", heads=96,
            q_lens=(2048,), k_lens=(8192,), **_REAL),
        gpu("Kimi Linear 48B tp1 FP8 chunked prefill (32 heads): 2048-token chunk over 8192 context", heads=32,
            q_lens=(2048,), k_lens=(8192,), **_REAL),
    )

    @staticmethod
    def raw_call(q, k, v, q_scale, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k, scale, out_dtype=torch.bfloat16,
                 out=None):
        return mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, out, fp8_scales=(q_scale, k_scale, v_scale),
                           out_dtype=out_dtype)

    @staticmethod
    def reference(q, k, v, q_scale, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k, scale, out_dtype=torch.bfloat16,
                  out=None):
        o = MlaPrefill.reference(_dequant(q, q_scale), _dequant(k, k_scale), _dequant(v, v_scale), cu_seqlens_q,
                                 cu_seqlens_k, scale)
        return o.to(out_dtype)

    @classmethod
    def cell_widths(cls, spec):
        return MlaPrefill.cell_widths(spec)

    @staticmethod
    def widths(q, k, v, q_scale, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k, scale, out_dtype=torch.bfloat16,
               out=None):
        return {"heads": q.shape[1], "d_qk": q.shape[2], "d_v": v.shape[2], "dtype": out_dtype}

    @staticmethod
    def is_valid(q, k, v, q_scale, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k, scale, out_dtype=torch.bfloat16,
                 out=None):
        if not (q.dtype == k.dtype == v.dtype == E4M3):
            return f"q, k, v must be {E4M3} (quantized by the caller), got {q.dtype}, {k.dtype}, {v.dtype}"
        for name, s in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
            if s.dtype != torch.float32 or s.numel() != 1 or s.device != q.device:
                return f"{name} must be one fp32 value on {q.device}"
        if out_dtype not in _OUT:
            return f"out_dtype must be one of {_OUT}"
        if out is not None and out.dtype != out_dtype:
            return "out must be in out_dtype"
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or any(t.stride(2) != 1 for t in (q, k, v)):
            return "q, k, v must be [tokens, heads, dim] with a unit stride along the head dim"
        if q.shape[2] < FP8_MIN_K:
            return f"FP8 q . k needs a head dim of at least {FP8_MIN_K} (the FP8 MMA depth), got {q.shape[2]}"
        if out is not None and any(overlaps(out, t) for t in (q, k, v)):
            return "out aliases an input"
        # the shape and sequence checks of the bf16 entry, on fp32 copies (tests only: never on the hot path)
        return MlaPrefill.is_valid(q.float(), k.float(), v.float(), cu_seqlens_q, cu_seqlens_k, scale,
                                   None if out is None else out.float())

    @staticmethod
    def compare(out, ref):
        assert_close(out, ref, rtol=1e-2, atol=1e-2, what="mla_prefill_fp8")

    @staticmethod
    def make_inputs(spec, device, generator):
        inputs = MlaPrefill.make_inputs(spec, device, generator)
        out = {}
        for name in ("q", "k", "v"):
            x = inputs[name].float()
            qx, s = quantize_fp8(x.reshape(-1, x.shape[-1]), "tensor")
            out[name], out[name + "_scale"] = qx.view(x.shape), s
        return dict(**out, cu_seqlens_q=inputs["cu_seqlens_q"], cu_seqlens_k=inputs["cu_seqlens_k"],
                    scale=inputs["scale"], out_dtype=spec["dtype"])
