"""MLA absorbed-form decode / speculative verify over one layer's paged latent cache."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.attention._mla_common import (build_paged_cache, check_paging, context_lengths,
                                                   device_generator, gather_rows, randn)
from kestrel.kernels.attention.mla_decode import mla_decode
from kestrel.ops.attention import attention

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Real widths: kv_lora_rank 512 + rope 64 = 576 per cached token; softmax scale (128 + 64)^-0.5.
_REAL = dict(kv_lora_rank=512, rope_dim=64, page_size=64, d_qk=192, dtype=torch.bfloat16)
# Tiny widths for the CPU interpreter: 32 + 16 = 48, scale 32^-0.5 (score spread like the real model's).
_TINY = dict(kv_lora_rank=32, rope_dim=16, page_size=16, d_qk=32, dtype=torch.float32)


class MlaDecode(OpWrapper):
    """out[t, h] = softmax(scale * q[t, h] . kv[0:kv_lens[t]]) @ kv[0:kv_lens[t], :L], with lse[t, h] its natural
    log-sum-exp (fp32), kv the request's rows of the paged cache. Split-K over the sequence when num_splits > 1."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("bf16: scores are fp32 sums of exact products of the same bf16 inputs (lse atol 2e-3 covers "
                 "summation order + ex2/lg2 approx at |lse| ~ 10); out moves by <= 2^-9 * max|c_kv| (~5 after "
                 "RMSNorm x weight) from rounding p to bf16 before P@V -> atol 1e-2, plus bf16 output rounding "
                 "-> rtol 2^-8 ~ 4e-3 (use 1e-2); fp32 (interpreter): summation order only -> rtol 1e-4, atol 1e-5")

    # split-K (num_splits) is chosen from the context length, tokens_per_req by the step: neither is a width
    WIDTHS = ("heads", "kv_lora_rank", "rope_dim", "page_size", "d_qk", "dtype")
    CELLS = (
        # --- tiny: CPU interpreter and GPUs ---
        tiny("tiny widths, decode: 1 token/request, lengths 1, one full page, one past a page edge, 2.5 pages "
             "(page 16)",
             heads=4, ctx=(1, 16, 17, 40), num_splits=1, **_TINY),
        tiny("tiny widths, DSpark-style verify: 4 consecutive tokens/request, each seeing itself and the ones before",
             heads=2, ctx=(4, 19, 35), tokens_per_req=4, num_splits=1, **_TINY),
        tiny("tiny widths, split-K decode: 3 splits, a length-1 request leaves empty splits for the merge",
             heads=4, ctx=(1, 50, 70), num_splits=3, **_TINY),
        tiny("tiny widths, decode with 64-token pages (the runtime default) and 2 splits",
             heads=3, ctx=(70, 3), num_splits=2, **{**_TINY, "page_size": 64}),
        tiny("tiny widths, decode in the GPU model dtype (bf16 cache and query), 2 splits",
             heads=4, ctx=(9, 45), num_splits=2, **{**_TINY, "dtype": torch.bfloat16}),
        # --- real widths: GPUs ---
        gpu("Kimi Linear 48B tp1 decode (32 heads): batch 1, 1k context", heads=32, batch=1, ctx=1024,
            num_splits=1, **_REAL),
        gpu("Kimi Linear 48B tp1 decode (32 heads): batch 32, 8k context", heads=32, batch=32, ctx=8192,
            num_splits=1, **_REAL),
        gpu("Kimi Linear 48B tp1 decode (32 heads): batch 128, 1k context", heads=32, batch=128, ctx=1024,
            num_splits=1, **_REAL),
        gpu("K3 tp1 decode (96 heads): batch 32, 8k context", heads=96, batch=32, ctx=8192, num_splits=1, **_REAL),
        gpu("K3 tp1 decode (96 heads): batch 128, 32k context", heads=96, batch=128, ctx=32768, num_splits=1,
            **_REAL),
        gpu("K3 tp4 decode (24 heads/rank): batch 128, 8k context", heads=24, batch=128, ctx=8192, num_splits=1,
            **_REAL),
        gpu("K3 tp8 decode (12 heads/rank): batch 32, 32k context, split-K 4 (32 CTAs alone would idle the SMs)",
            heads=12, batch=32, ctx=32768, num_splits=4, **_REAL),
        gpu("K3 tp1 DSpark verify (96 heads): batch 32 x 8 draft tokens, 8k context", heads=96, batch=32, ctx=8192,
            tokens_per_req=8, num_splits=1, **_REAL),
        gpu("Kimi Linear 48B tp1 spec verify (32 heads): batch 16 x 4 tokens, 1k context", heads=32, batch=16,
            ctx=1024, tokens_per_req=4, num_splits=1, **_REAL),
        gpu("K3 tp1 long-context decode (96 heads): batch 1 x 128k, split-K 32 (6 head tiles x 32 = 192 CTAs)",
            heads=96, batch=1, ctx=131072, num_splits=32, **_REAL),
        gpu("Kimi Linear 48B tp1 long-context decode (32 heads): batch 1 x 128k, split-K 64", heads=32, batch=1,
            ctx=131072, num_splits=64, **_REAL),
        gpu("K3 tp4 long-context decode (24 heads/rank): batch 1 x 128k, split-K 128", heads=24, batch=1,
            ctx=131072, num_splits=128, **_REAL),
        gpu("K3 tp1 decode (96 heads): batch 4 x 32k, split-K 8 (the targets' choice past 8192 tokens)", heads=96,
            batch=4, ctx=32768, num_splits=8, **_REAL),
        gpu("Kimi Linear 48B tp1 decode (32 heads): batch 16 x 16k, split-K 8 (the targets' choice past 8192 tokens)",
            heads=32, batch=16, ctx=16384, num_splits=8, **_REAL),
        gpu("Kimi Linear 48B tp1 decode (32 heads): batch 1 x 4k, split-K 32 (the targets' choice for up to 4 "
            "requests from 2048 tokens)", heads=32, batch=1, ctx=4096, num_splits=32, **_REAL),
        gpu("K3 tp1 decode (96 heads): batch 4 x 2k, split-K 32 (the targets' small-batch long-context choice)",
            heads=96, batch=4, ctx=2048, num_splits=32, **_REAL),
    )

    @staticmethod
    def raw_call(q, kv_cache, block_tables, req_idx, kv_lens, scale, kv_lora_rank, num_splits=1, out=None,
                 lse=None):
        """-> (out [T, H, kv_lora_rank] in q.dtype, lse [T, H] fp32)."""
        return mla_decode(q, kv_cache, block_tables, req_idx, kv_lens, scale, kv_lora_rank, num_splits, out, lse)

    @staticmethod
    def reference(q, kv_cache, block_tables, req_idx, kv_lens, scale, kv_lora_rank, num_splits=1, out=None,
                  lse=None):
        T, H, W = q.shape
        L = kv_lora_rank
        o = torch.empty((T, H, L), dtype=torch.float32, device=q.device)
        s_lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
        for t, (r, n) in enumerate(zip(req_idx.tolist(), kv_lens.tolist())):
            kv = gather_rows(kv_cache, block_tables, r, n)                  # [n, W]
            o[t], s_lse[t] = attention(q[t], kv, kv[:, :L], scale)
        return o.to(q.dtype), s_lse

    @staticmethod
    def widths(q, kv_cache, block_tables, req_idx, kv_lens, scale, kv_lora_rank, num_splits=1, out=None,
               lse=None):
        return {"heads": q.shape[1], "kv_lora_rank": kv_lora_rank, "rope_dim": q.shape[2] - kv_lora_rank,
                "page_size": kv_cache.shape[1], "d_qk": round(scale ** -2), "dtype": q.dtype}

    @staticmethod
    def is_valid(q, kv_cache, block_tables, req_idx, kv_lens, scale, kv_lora_rank, num_splits=1, out=None,
                 lse=None):
        if q.dim() != 3 or kv_cache.dim() != 3:
            return f"q must be [T, H, W] and kv_cache [pages, page_size, W]; got {tuple(q.shape)}, " \
                   f"{tuple(kv_cache.shape)}"
        T, H, W = q.shape
        if kv_cache.shape[2] != W:
            return f"q width {W} != cache width {kv_cache.shape[2]}"
        if not 16 <= kv_lora_rank < W:
            return f"kv_lora_rank {kv_lora_rank} must be in [16, W={W})"
        if q.dtype != kv_cache.dtype or q.dtype not in _DTYPES:
            return f"q {q.dtype} and kv_cache {kv_cache.dtype} must share one of {_DTYPES}"
        if q.stride(2) != 1 or kv_cache.stride(2) != 1:
            return "q and kv_cache need a unit stride along W"
        devs = {t.device for t in (q, kv_cache, block_tables, req_idx, kv_lens)}
        if len(devs) != 1:
            return f"inputs on several devices {devs}"
        if not isinstance(num_splits, int) or num_splits < 1:
            return f"num_splits must be a positive int, got {num_splits!r}"
        if kv_lens.dtype != torch.int32 or tuple(kv_lens.shape) != (T,):
            return f"kv_lens must be int32 [{T}], got {kv_lens.dtype} {tuple(kv_lens.shape)}"
        if tuple(req_idx.shape) != (T,):
            return f"req_idx must be [{T}], got {tuple(req_idx.shape)}"
        if T and int(kv_lens.min()) < 1:
            return "every token sees at least itself: kv_lens >= 1"
        why = check_paging(kv_cache, block_tables, req_idx, kv_lens.long() - 1)
        if why:
            return why
        for name, t, shape, dt in (("out", out, (T, H, kv_lora_rank), q.dtype), ("lse", lse, (T, H), torch.float32)):
            if t is None:
                continue
            if tuple(t.shape) != shape or t.dtype != dt or t.stride(-1) != 1:
                return f"{name} must be {dt} {shape} with unit last stride"
            if any(overlaps(t, x) for x in (q, kv_cache)):
                return f"{name} aliases an input"
        return None

    @staticmethod
    def compare(out, ref):
        o, lse = out
        ro, rlse = ref
        if o.dtype == torch.float32:
            assert_close(o, ro, rtol=1e-4, atol=1e-5, what="mla_decode out")
            assert_close(lse, rlse, rtol=1e-5, atol=1e-5, what="mla_decode lse")
        else:
            assert_close(o, ro, rtol=1e-2, atol=1e-2, what="mla_decode out")
            assert_close(lse, rlse, rtol=0.0, atol=2e-3, what="mla_decode lse")

    @staticmethod
    def make_inputs(spec, device, generator):
        device = torch.device(device)
        L, R, H = spec["kv_lora_rank"], spec["rope_dim"], spec["heads"]
        dtype = spec["dtype"]
        k = int(spec.get("tokens_per_req", 1))
        lens = context_lengths(spec, generator)
        kv_cache, block_tables = build_paged_cache(lens, spec["page_size"], L, R, dtype, device, generator)
        order = torch.randperm(len(lens), generator=generator).tolist()   # batch order != block-table order
        req_idx, kv_lens = [], []
        for b in order:
            for j in range(k):
                req_idx.append(b)
                kv_lens.append(lens[b] - k + 1 + j)
        T = len(req_idx)
        q = randn((T, H, L + R), device_generator(generator, device), device, dtype)
        return dict(q=q, kv_cache=kv_cache, block_tables=block_tables,
                    req_idx=torch.tensor(req_idx, dtype=torch.int32, device=device),
                    kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
                    scale=spec["d_qk"] ** -0.5, kv_lora_rank=L, num_splits=int(spec["num_splits"]))
