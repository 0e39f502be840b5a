"""K3's residual step in one kernel: residual add into the partial + attention-residual mix + RMSNorm.

Replaces, per K3 layer, `partial.add_(y)` + AttnResMix + AddRmsNorm (and the block-start copy of the partial into
the stored blocks) on both the attention side and the MLP side: 6-7 launches -> 2."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn, rows_ok
from kestrel.catalog.norm.attn_res_mix import AttnResMix
from kestrel.kernels.norm.add_mix_rmsnorm import MAX_N, add_mix_rmsnorm
from kestrel.ops.norm import attn_res_mix, rms_norm

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
K3_N = 7168


class AddMixRmsNorm(OpWrapper):
    """raw_call(delta [T, N] or None, partial [T, N], blocks [NB, T, N] (NB >= 0), w [N] fp32 (= res_norm.weight *
    res_proj.weight), norm_weight [N], eps, out=None, r_out=None) -> (y [T, N], r).
    r = partial + delta, rounded once to partial's dtype and written to r_out (default: into partial in place);
    with delta None, r = partial (copied into r_out when given: the block-start store of the partial).
    h = AttnResMix(blocks, r, w, eps) (rounded to partial's dtype, as the separate entry returns it),
    y = AddRmsNorm(h, None, norm_weight, eps). fp32 math; y in partial's dtype. One eps for the mix and the norm
    (K3 uses rms_norm_eps for both). Triton kernel: kestrel/kernels/norm/add_mix_rmsnorm.py."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("y: fp32 math over the composed references' own roundings (r and h rounded to the model dtype in "
                 "both); online vs two-pass softmax and reassociated N=7168 dots differ ~1e-6 rel, which can flip "
                 "h's bf16 rounding (2^-8) before the norm, plus y's own rounding: rtol 2e-2, atol 2e-2 at "
                 "|y| ~ 1 (fp32: 1e-5); r: one add rounded once (RNE) -> exact")
    WIDTHS = ("N", "delta", "r_out", "dtype")     # NB grows with depth, T with the step
    CELLS = (
        tiny("unit: layer 0: no blocks, no delta, the partial stored as block 0 (r_out)", NB=0, T=3, N=64,
             delta=False, r_out=True, dtype=torch.bfloat16),
        tiny("unit: attention side: partial += ffn output, 2 blocks, bf16", NB=2, T=4, N=64, delta=True,
             dtype=torch.bfloat16),
        tiny("unit: block start: partial + delta stored as the new block, 1 older block", NB=1, T=2, N=64,
             delta=True, r_out=True, dtype=torch.bfloat16),
        tiny("unit: fp32, width not a power of two, 3 blocks", NB=3, T=2, N=96, delta=True, dtype=torch.float32),
        gpu("K3 decode bs64: layer 0 attention side: the embedding stored as block 0, nothing to add or mix",
            NB=0, T=64, N=K3_N, delta=False, r_out=True, dtype=torch.bfloat16),
        gpu("K3 decode bs64: mlp side of a block-start layer: the partial is the attention output (no add)", NB=2,
            T=64, N=K3_N, delta=False, dtype=torch.bfloat16),
        gpu("K3 decode bs1: mlp-side add + mix + post_attention_layernorm, 8 blocks", NB=8, T=1, N=K3_N,
            delta=True, dtype=torch.bfloat16),
        gpu("K3 decode bs64: attention-side add + mix + input_layernorm, 4 blocks", NB=4, T=64, N=K3_N,
            delta=True, dtype=torch.bfloat16),
        gpu("K3 decode bs64: block start (layer 12k): add, store the new block, mix over the older ones", NB=3,
            T=64, N=K3_N, delta=True, r_out=True, dtype=torch.bfloat16),
        gpu("K3 decode bs256: final mix (output_attn_res) + final norm, 8 blocks", NB=8, T=256, N=K3_N,
            delta=True, dtype=torch.bfloat16),
        gpu("K3 prefill chunk 8192: add + mix + norm, 8 blocks", NB=8, T=8192, N=K3_N, delta=True,
            dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(delta, partial, blocks, w, norm_weight, eps, out=None, r_out=None):
        return add_mix_rmsnorm(delta, partial, blocks, w, norm_weight, eps, out=out, r_out=r_out)

    @staticmethod
    def reference(delta, partial, blocks, w, norm_weight, eps, out=None, r_out=None):
        r = r_out if r_out is not None else partial
        if delta is not None:
            r.copy_((partial.float() + delta.float()).to(partial.dtype))
        elif r_out is not None:
            r_out.copy_(partial)
        h = attn_res_mix(blocks, r, w, eps)                 # in partial's dtype, as AttnResMix returns it
        y = rms_norm(h, norm_weight, eps).to(partial.dtype)
        if out is not None:
            y = out.copy_(y)
        return y, r

    @staticmethod
    def widths(delta, partial, blocks, w, norm_weight, eps, out=None, r_out=None):
        return {"N": partial.shape[1], "delta": delta is not None, "r_out": r_out is not None,
                "dtype": partial.dtype}

    @classmethod
    def cell_widths(cls, spec):
        return {"N": spec["N"], "delta": spec["delta"], "r_out": spec.get("r_out", False), "dtype": spec["dtype"]}

    @staticmethod
    def is_valid(delta, partial, blocks, w, norm_weight, eps, out=None, r_out=None):
        why = rows_ok(partial, "partial") or rows_ok(blocks, "blocks", ndim=3) \
            or (rows_ok(delta, "delta") if delta is not None else None) \
            or (rows_ok(r_out, "r_out") if r_out is not None else None)
        if why:
            return why
        T, N = partial.shape
        if partial.dtype not in _FLOATS:
            return f"partial dtype {partial.dtype} unsupported"
        if N > MAX_N:
            return f"N={N} > {MAX_N}: the kernel holds a row in registers"
        if blocks.shape[1:] != partial.shape or blocks.dtype != partial.dtype:
            return f"blocks {tuple(blocks.shape)} {blocks.dtype} must be [NB, {T}, {N}] {partial.dtype}"
        if w.shape != (N,) or w.dtype != torch.float32 or not w.is_contiguous():
            return f"w must be contiguous fp32 [{N}], got {tuple(w.shape)} {w.dtype}"
        if norm_weight.shape != (N,) or not norm_weight.is_contiguous() or norm_weight.dtype not in _FLOATS:
            return f"norm_weight must be a contiguous float [{N}]"
        tensors = [t for t in (partial, blocks, w, norm_weight) if t is not None]
        if delta is not None:
            if delta.shape != partial.shape or delta.dtype not in _FLOATS:
                return f"delta must be a float [{T}, {N}] tensor"
            if overlaps(delta, partial):
                return "delta and partial overlap: the sum is written in place"
            tensors.append(delta)
        if r_out is not None:
            if r_out.shape != partial.shape or r_out.dtype != partial.dtype:
                return f"r_out must be [{T}, {N}] in partial's dtype"
            if any(overlaps(r_out, t) for t in tensors):
                return "r_out overlaps an input (give the new block slot, not a stored block or the partial)"
        elif delta is not None and overlaps(partial, blocks):
            return "partial overlaps the stored blocks: the add would rewrite a block"
        if out is not None:
            if out.shape != partial.shape or out.stride(-1) != 1 or out.dtype not in _FLOATS:
                return f"out must be [{T}, {N}] with a contiguous last dim"
            if any(overlaps(out, t) for t in tensors + ([r_out] if r_out is not None else [])):
                return "out overlaps an input"
        if not eps > 0:
            return f"eps must be > 0, got {eps}"
        return None

    @staticmethod
    def compare(out, ref):
        (y, r), (y_ref, r_ref) = out, ref
        tol = 1e-5 if y_ref.dtype == torch.float32 else 2e-2
        assert_close(y, y_ref, rtol=tol, atol=tol, what="AddMixRmsNorm y")
        assert_close(r, r_ref, rtol=0, atol=0, what="AddMixRmsNorm r")

    @staticmethod
    def make_inputs(spec, device, generator):
        """AttnResMix's inputs (blocks growing with depth, the partial, the mix query), plus the sublayer output
        to add, the norm weight, and a garbage-filled new block slot for r_out."""
        T, N, dtype = spec["T"], spec["N"], spec["dtype"]
        inp = AttnResMix.make_inputs(spec, device, generator)
        inp.update(eps=1e-5, delta=randn((T, N), generator, device, dtype) if spec["delta"] else None,
                   norm_weight=randn((N,), generator, device, dtype, scale=0.1, shift=1.0),
                   r_out=randn((T, N), generator, device, dtype, scale=7.0) if spec.get("r_out") else None)
        return inp
