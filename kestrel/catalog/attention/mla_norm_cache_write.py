"""kv_a_layernorm + MLA cache write in one kernel: the kv_a projection's rows [c_kv | k_pe] land in the paged latent
cache as [RMSNorm(c_kv) | k_pe] (AddRmsNorm + MlaCacheWrite -> one launch)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.attention.mla_cache_write import MlaCacheWrite
from kestrel.catalog.moe._common import randn
from kestrel.kernels.attention.mla_norm_cache_write import mla_norm_cache_write
from kestrel.ops.norm import rms_norm

_REAL = dict(kv_lora_rank=512, rope_dim=64, page_size=64, dtype=torch.bfloat16)
_TINY = dict(kv_lora_rank=32, rope_dim=16, page_size=16, dtype=torch.float32)
LOWRANK_EPS = 1e-6      # kv_a_layernorm's eps (Moonshot builds it with the default)


class MlaNormCacheWrite(OpWrapper):
    """raw_call(kv [T, L + R] (the kv_a output: latent then k_pe; unit stride along the row, any row stride),
    norm_weight [L], eps, kv_cache [pages, page_size, L + R], block_tables, req_idx int32 [T], positions int64 [T])
    -> kv_cache, written in place: MlaCacheWrite(AddRmsNorm(kv[:, :L], None, norm_weight, eps)[0], kv[:, L:], ...).
    positions < 0 are padding and write nothing. Triton kernel: kestrel/kernels/attention/mla_norm_cache_write.py."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("latent columns: fp32 norm of an L=512 row (reduction order ~1e-6 rel can flip one bf16 rounding: "
                 "1 ulp = 2^-7 rel) -> rtol 1e-2, atol 1e-3 at |y| ~ 1, over the whole cache: k_pe and the bytes not "
                 "written are equal in both, so a misplaced or missing write shows as an O(1) error")

    WIDTHS = MlaCacheWrite.WIDTHS
    CELLS = (
        tiny("tiny widths, decode step: 1 new token per request after 0, 15, 16 and 40 cached tokens (page 16), "
             "one padding slot", ctx=(0, 15, 16, 40), new=1, pad=1, **_TINY),
        tiny("tiny widths, prefill chunk in bf16: 20 tokens after 30, 5 after 0 (page 64)", ctx=(30, 0), new=(20, 5),
             pad=0, **{**_TINY, "page_size": 64, "dtype": torch.bfloat16}),
        gpu("Kimi Linear / K3 decode step: batch 128 x 1 token, up to 8k context, 8 CUDA-graph padding slots",
            batch=128, ctx=8192, new=1, pad=8, **_REAL),
        gpu("Kimi Linear / K3 decode step: batch 1, 1k context", batch=1, ctx=1024, new=1, pad=0, **_REAL),
        gpu("K3 DSpark verify: batch 32 x 8 draft tokens, up to 8k context", batch=32, ctx=8192, new=8, pad=0,
            **_REAL),
        gpu("Kimi Linear / K3 prefill: 1 x 4096-token prompt", ctx=(0,), new=4096, pad=0, **_REAL),
    )

    @staticmethod
    def raw_call(kv, norm_weight, eps, kv_cache, block_tables, req_idx, positions):
        return mla_norm_cache_write(kv, norm_weight, eps, kv_cache, block_tables, req_idx, positions)

    @staticmethod
    def reference(kv, norm_weight, eps, kv_cache, block_tables, req_idx, positions):
        L = norm_weight.numel()
        latent = rms_norm(kv[:, :L], norm_weight, eps).to(kv.dtype)
        return MlaCacheWrite.reference(latent, kv[:, L:], kv_cache, block_tables, req_idx, positions)

    @staticmethod
    def widths(kv, norm_weight, eps, kv_cache, block_tables, req_idx, positions):
        L = norm_weight.numel()
        return {"kv_lora_rank": L, "rope_dim": kv.shape[1] - L, "page_size": kv_cache.shape[1],
                "dtype": kv_cache.dtype}

    @staticmethod
    def is_valid(kv, norm_weight, eps, kv_cache, block_tables, req_idx, positions):
        if kv.dim() != 2 or norm_weight.dim() != 1 or not norm_weight.is_contiguous():
            return "kv must be [T, L + R] and norm_weight a contiguous [L]"
        L = norm_weight.numel()
        if not 0 < L < kv.shape[1]:
            return f"norm_weight [{L}] must cover the latent part of kv's {kv.shape[1]} columns"
        if L > 16384:
            return "latent wider than 16384: the kernel holds a row in registers"
        if norm_weight.device != kv.device:
            return "norm_weight is on another device"
        if overlaps(norm_weight, kv_cache):
            return "norm_weight aliases the cache"
        if not eps > 0:
            return f"eps must be > 0, got {eps}"
        return MlaCacheWrite.is_valid(kv[:, :L], kv[:, L:], kv_cache, block_tables, req_idx, positions)

    @staticmethod
    def compare(out, ref):
        assert_close(out, ref, rtol=1e-2, atol=1e-3, what="MlaNormCacheWrite kv_cache")

    @staticmethod
    def make_inputs(spec, device, generator):
        """MlaCacheWrite's paged cache and token layout; kv = [unnormalized latent (scale 3) | k_pe] as one row."""
        inp = MlaCacheWrite.make_inputs(spec, device, generator)
        latent, k_pe = inp.pop("latent"), inp.pop("k_pe")
        L = latent.shape[1]
        kv = torch.cat([latent.float() * 3.0, k_pe.float()], dim=1).to(latent.dtype)
        return dict(kv=kv, norm_weight=randn((L,), generator, device, latent.dtype, scale=0.1, shift=1.0),
                    eps=LOWRANK_EPS, **inp)
