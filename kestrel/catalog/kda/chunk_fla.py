"""KDA chunked prefill through fla-core's `chunk_kda` (the optional `fla` extra), on our slot pools and varlen
layout: exactly KdaChunkPrefill's contract, so a target can launch either.

fla-core is a dependency made for this kernel (Moonshot's KDA authors maintain it); its kernels are autotuned
Triton that need a GPU (the autotuner has no CPU benchmarker, so they do not run under TRITON_INTERPRET=1): the
cells are GPU-only and the entry runs on sm_90. Without fla-core installed, raw_call raises an ImportError naming
the extra to install. Launch helper: kestrel/kernels/kda/fla_chunk.py.
"""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper
from kestrel.catalog.kda.chunk import KdaChunkPrefill
from kestrel.catalog.kda._common import check_kda_inputs, make_kda_inputs
from kestrel.kernels.kda.fla_chunk import fla_available, fla_chunk_prefill


O_RMS, STATE_RMS = 1e-2, 1e-2


def rms_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over all elements, in fp64 (fla's own test metric)."""
    o, r = out.double(), ref.double()
    return float((o - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt().clamp_min(1e-30))


class KdaChunkFla(OpWrapper):
    """raw_call(q, k, v [T, H, D] model dtype (heads and D contiguous, any token stride), g [T, H, D] fp32,
    beta [T, H] fp32, state [S, H, D, D] fp32 pool, cu_seqlens int32 [B+1], slots int32 [B], out=None)
    -> (o [T, H, D] in v's dtype, state updated in place), the KdaRecurrent / KdaChunkPrefill contract: per request
    and token, q, k L2-normalized (eps 1e-6), q scaled by D^-0.5, S = S * exp(g)[:, None],
    S += beta k (v - S^T k)^T, o = S^T q, from the request's slot and back into it."""

    @staticmethod
    def runs_on(x: torch.Tensor) -> bool:
        """fla-core is installed and `x` lives on a GPU (its kernels are autotuned: no CPU interpreter)."""
        return x.is_cuda and fla_available()

    ARCHS = (Arch.SM90,)
    TOLERANCE = ("fla rounds the L2-normalized q, k to bf16 (2^-9 rel) and runs its intra-chunk products on bf16 "
                 "tensor cores with fp32 accumulation; o is bf16: relative RMS error <= 1e-2 for o and for every "
                 "state slot, touched or not (fla's own tests accept 5e-3 per tensor)")

    WIDTHS = ("H", "D", "dtype")
    # the prefill shapes our own chunked kernel is certified at, on GPUs only (fla's kernels need one)
    CELLS = tuple(cell for cell in KdaChunkPrefill.CELLS if Arch.CPU not in cell.archs)

    @staticmethod
    def raw_call(q, k, v, g, beta, state, cu_seqlens, slots, out=None, fla_cu=None):
        return fla_chunk_prefill(q, k, v, g, beta, state, cu_seqlens, slots, out=out, fla_cu=fla_cu)

    reference = staticmethod(KdaChunkPrefill.reference)      # one contract, one spec
    widths = staticmethod(KdaChunkPrefill.widths)

    @staticmethod
    def is_valid(q, k, v, g, beta, state, cu_seqlens, slots, out=None, fla_cu=None):
        why = check_kda_inputs(q, k, v, g, beta, state, cu_seqlens, slots, out, min_d=16)
        if why:
            return why
        if not q.is_cuda:
            return "fla's chunk_kda runs on CUDA devices only"
        if q.dtype == torch.float32:
            return "fla's chunk_kda runs bf16 / fp16 tensor-core products: fp32 inputs are not its contract"
        cu = cu_seqlens.tolist()
        if any(b <= a for a, b in zip(cu[:-1], cu[1:])):
            return "every segment needs at least one token (fla's varlen chunk list has no empty sequences)"
        return None

    @staticmethod
    def compare(out, ref):
        (o, state), (o_ref, state_ref) = out, ref
        if o.shape != o_ref.shape or state.shape != state_ref.shape:
            raise AssertionError(f"shapes {tuple(o.shape)} / {tuple(state.shape)} vs reference "
                                 f"{tuple(o_ref.shape)} / {tuple(state_ref.shape)}")
        o, o_ref, state, state_ref = (t.detach().float().cpu() for t in (o, o_ref, state, state_ref))
        if not (torch.isfinite(o).all() and torch.isfinite(state).all()):
            raise AssertionError("KdaChunkFla: non-finite output or state")
        err = rms_ratio(o, o_ref)
        if err > O_RMS:
            raise AssertionError(f"KdaChunkFla o: relative RMS error {err:.3g} > {O_RMS}")
        for s in range(state.shape[0]):
            err = rms_ratio(state[s], state_ref[s])
            if err > STATE_RMS:
                raise AssertionError(f"KdaChunkFla state slot {s}: relative RMS error {err:.3g} > {STATE_RMS} "
                                     "(a slot the call must leave alone, or a wrong final state)")

    @staticmethod
    def make_inputs(spec, device, generator):
        return make_kda_inputs(spec, device, generator)
