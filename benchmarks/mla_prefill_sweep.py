"""MLA prefill attention at Kimi Linear 48B's widths (one 8,192-token prompt, 32 heads, q/k 128 + 64, v 128) under
several tile configs of our kernel, against torch SDPA's backends on the same work (the issue's baseline: the
flash backend; flash needs one head dim for q, k and v, so v is padded to 192 there and its extra P @ V work is not
counted). TFLOP/s count the causal pairs' useful FLOPs: 2 * H * (192 + 128) per (query, visible key). CUDA
events, median of `--iters`; every config is checked against SDPA's output first.
    python3 benchmarks/mla_prefill_sweep.py --json $OUT/mla_prefill_sweep.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._results import median_ms                              # noqa: E402
from kestrel.kernels.attention.mla_prefill import _config, mla_prefill  # noqa: E402

# (BLOCK_M, BLOCK_N, num_warps, num_stages); the host's config is timed first. Session 14's H200 sweep also
# tried starting the longest query blocks first (6% slower) and 128 x 128 at 3 stages (over shared memory).
CONFIGS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 8, 3)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    T, H, dn, dr, dv = args.tokens, args.heads, 128, 64, 128
    q = torch.randn(T, H, dn + dr, device=dev, generator=gen).to(torch.bfloat16)
    kv = torch.randn(T, H, dn + dv, device=dev, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(T, dr, device=dev, generator=gen).to(torch.bfloat16)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k_whole = torch.cat([k_nope, k_pe[:, None].expand(-1, H, -1)], dim=-1)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    scale = (dn + dr) ** -0.5
    flops = 2.0 * H * (dn + dr + dv) * (T * (T + 1) / 2)
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k_whole, v.contiguous()))
    ref = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)[0].transpose(0, 1).float()
    rows = []

    def row(name, cfg, fn, check=True):
        try:
            if check:
                err = (fn().float() - ref).abs().max().item()
            else:
                err = None
            ms = median_ms(fn, args.iters, warmup=3)
        except Exception as e:          # one config that fails to compile must not lose the others
            print(f"{name:34s} {str(cfg):30s} FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
            rows.append({"name": name, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            return
        rows.append({"name": name, "config": cfg, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                     "max_abs_err_vs_sdpa": err})
        print(f"{name:34s} {str(cfg):30s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s"
              + (f"  err {err:.2e}" if err is not None else ""), flush=True)

    host = _config(dev)
    row("kestrel (host config, k_rope)", host, lambda: mla_prefill(q, k_nope, v, cu, cu, scale, k_rope=k_pe))
    row("kestrel (host config, whole k)", host, lambda: mla_prefill(q, k_whole, v, cu, cu, scale))
    for bm, bn, w, st in CONFIGS:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
        row("kestrel k_rope", cfg, lambda cfg=cfg: mla_prefill(q, k_nope, v, cu, cu, scale, k_rope=k_pe, config=cfg))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    v_pad = F.pad(v, (0, dn + dr - dv)).transpose(0, 1)[None]
    for name, backend, vv in (("SDPA flash (v padded to 192)", SDPBackend.FLASH_ATTENTION, v_pad),
                              ("SDPA efficient", SDPBackend.EFFICIENT_ATTENTION, vh),
                              ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION, vh),
                              ("SDPA cuDNN (v padded to 192)", SDPBackend.CUDNN_ATTENTION, v_pad)):
        def fn(backend=backend, vv=vv):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(qh, kh, vv, is_causal=True, scale=scale)
            return o[0, ..., :dv].transpose(0, 1)
        row(name, None, fn)
    row("k = cat(k_nope, k_pe) copy", None,
        lambda: torch.cat([k_nope, k_pe[:, None].expand(-1, H, -1)], dim=-1), check=False)
    if args.json:
        from kestrel.bench.latency import machine_info
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(dev), "command": " ".join(["benchmarks/mla_prefill_sweep.py"] + sys.argv[1:]),
                       "tokens": T, "heads": H, "flops": flops, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
