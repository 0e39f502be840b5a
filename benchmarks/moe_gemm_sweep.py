"""The prefill MoE GEMMs at Kimi Linear 48B's widths (one 8,192-token prompt: 65,536 expert rows over 256 experts,
w13 [256, 2048, 2304], w2 [256, 2304, 1024]) under several tile configs, against cuBLAS's dense GEMM of the same
FLOPs (the rows of all experts as one matrix against one expert's weight: the ceiling a grouped GEMM aims at).
Also the two ways the experts can run: MoeExperts' path (w13 GEMM -> GLU -> w2 GEMM) against the GLU fused into the
w13 GEMM's epilogue. CUDA events, median of `--iters`.
    python3 benchmarks/moe_gemm_sweep.py --json $OUT/moe_gemm_sweep.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kestrel.kernels.moe.grouped_gemm as gg          # noqa: E402
import kestrel.kernels.moe.grouped_gemm_glu as ggg     # noqa: E402
from kestrel.kernels.activation.glu import glu        # noqa: E402
from benchmarks._results import median_ms        # noqa: E402
from kestrel.kernels.moe.permute import moe_permute    # noqa: E402

# (BM, BN, BK, num_warps, num_stages); the first is what _config picks today for prefill-sized batches
CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
           (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
           (64, 128, 64, 4, 4)]


def timed(fn, iters: int) -> float:
    return median_ms(fn, iters, warmup=3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--configs", choices=["all", "current"], default="all",
                    help="current: only the config the host picks today (one compile per kernel)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    T, H, I, E, k = args.tokens, 2304, 1024, 256, 8
    x = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(torch.bfloat16)
    ids = torch.rand(T, E, device=dev, generator=gen).topk(k, dim=1).indices.to(torch.int32)
    perm = moe_permute(ids, E)
    S = T * k
    h = torch.randn(S, I, device=dev, generator=gen).to(torch.bfloat16)
    flops13, flops2 = 2.0 * S * 2 * I * H, 2.0 * S * H * I
    rows = []

    def row(name, ms, flops, cfg=None):
        rows.append({"gemm": name, "config": cfg, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)})
        print(f"{name:28s} {str(cfg):26s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)

    a13, b13 = torch.randn(S, H, device=dev).to(torch.bfloat16), w13[0].t().contiguous()
    a2, b2 = torch.randn(S, I, device=dev).to(torch.bfloat16), w2[0].t().contiguous()
    row("cublas dense (w13 shape)", timed(lambda: a13 @ b13, args.iters), flops13)
    row("cublas dense (w2 shape)", timed(lambda: a2 @ b2, args.iters), flops2)
    # torch's own grouped GEMM (CUTLASS on sm_90), the library candidate: it needs the gathered rows, so w13 is
    # timed with and without the gather copy that our kernel's sorted_token_ids load avoids
    offs = perm.expert_offsets[1:].to(torch.int32)
    xg = x[perm.sorted_token_ids.long()]
    row("torch._grouped_mm w13", timed(lambda: torch._grouped_mm(xg, w13.transpose(1, 2), offs=offs), args.iters),
        flops13)
    row("torch._grouped_mm w13+gather", timed(lambda: torch._grouped_mm(
        x[perm.sorted_token_ids.long()], w13.transpose(1, 2), offs=offs), args.iters), flops13)
    row("torch._grouped_mm w2", timed(lambda: torch._grouped_mm(h, w2.transpose(1, 2), offs=offs), args.iters),
        flops2)
    ref13 = gg.grouped_gemm(x, w13, perm.expert_offsets, sorted_token_ids=perm.sorted_token_ids).float()
    got13 = torch._grouped_mm(xg, w13.transpose(1, 2), offs=offs).float()
    print(f"torch._grouped_mm w13 vs ours: max |diff| {(got13 - ref13).abs().max().item():.3e} "
          f"(max |ref| {ref13.abs().max().item():.3e})", flush=True)
    real = gg._config
    try:
        for cfg in CONFIGS if args.configs == "all" else [real(S, E, 2 * I, H)]:
            gg._config = ggg._config = (lambda *_, c=cfg: c)
            try:
                row("w13 grouped (gather)", timed(lambda: gg.grouped_gemm(
                    x, w13, perm.expert_offsets, sorted_token_ids=perm.sorted_token_ids), args.iters), flops13, cfg)
                row("w2 grouped", timed(lambda: gg.grouped_gemm(h, w2, perm.expert_offsets), args.iters), flops2, cfg)
                row("w13 grouped + GLU epilogue", timed(lambda: ggg.grouped_gemm_glu(
                    x, w13, perm.expert_offsets, perm.sorted_token_ids), args.iters), flops13, cfg)
            except Exception as e:          # a config past shared memory or registers: reported, not fatal
                print(f"{str(cfg):26s} failed: {str(e).splitlines()[0][:120]}", flush=True)
                rows.append({"config": cfg, "error": str(e).splitlines()[0][:200]})
    finally:
        gg._config = ggg._config = real
    # the half-height tail tiles (grouped_gemm.TAIL_MIN_BM) on and off, today's config
    on = gg.TAIL_MIN_BM
    for label, tail in (("tail tiles off", 10 ** 9), ("tail tiles on", on)):
        gg.TAIL_MIN_BM = tail
        row(f"w13 grouped, {label}", timed(lambda: gg.grouped_gemm(
            x, w13, perm.expert_offsets, sorted_token_ids=perm.sorted_token_ids), args.iters), flops13)
        row(f"w2 grouped, {label}", timed(lambda: gg.grouped_gemm(h, w2, perm.expert_offsets), args.iters), flops2)
    gg.TAIL_MIN_BM = on
    # the experts end to end with today's configs: MoeExperts' path against the GLU-fused first GEMM
    gu = torch.empty(S, 2 * I, device=dev, dtype=torch.bfloat16)
    row("path: w13 -> GLU -> w2", timed(lambda: gg.grouped_gemm(glu(gg.grouped_gemm(
        x, w13, perm.expert_offsets, sorted_token_ids=perm.sorted_token_ids, out=gu), "silu"), w2,
        perm.expert_offsets), args.iters), flops13 + flops2)
    row("path: w13+GLU -> w2", timed(lambda: gg.grouped_gemm(ggg.grouped_gemm_glu(
        x, w13, perm.expert_offsets, perm.sorted_token_ids), w2, perm.expert_offsets), args.iters), flops13 + flops2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                       "shape": {"tokens": T, "hidden": H, "moe_intermediate": I, "experts": E, "k": k},
                       "records": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
