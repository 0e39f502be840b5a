"""The W4A16 decode GEMMs at Kimi Linear 48B's widths and batch 1, timed as a decode step runs them: inside a CUDA
graph, each call on other experts (a ring of routings over 128 of the 256 experts, 300 MB of packed w13: no L2
reuse), so the time is the kernel's own and not the host's launch (eager timing at these sizes measures the
launcher: benchmarks/quant_gemm_bench.py's Kimi Linear batch-1 rows).

For the GLU-fused w13 (8 experts x 2048 rows x 2304, MXFP4) and w2 (8 x 2304 x 1024) it times the host's config
and a grid of FMA-kernel configs (BM 1: rows per program, BN weight rows, BK, warps, stages; w2 also split over
K), next to a device copy of the same bytes inside the same kind of graph (the floor a kernel of this size can
reach, launch and ramp included). Each config's output is checked against the host config's.

    python3 benchmarks/w4a16_small_probe.py --out $OUT/w4a16_small.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kestrel.kernels.quant.w4a16 import w4a16_config, w4a16_gemm          # noqa: E402
from kestrel.kernels.quant.w4a16_glu import w4a16_glu_config, w4a16_glu_gemm  # noqa: E402

DEV = torch.device("cuda")
E, TOPK, H, I = 256, 8, 2304, 1024       # Kimi Linear 48B's MoE
RING = 16                                # routings per graph: 16 x 8 distinct experts


def graph_us(fn, calls: int, replays: int = 20) -> float:
    """Microseconds per call of fn(i) for i in 0..calls-1, captured once in a graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):          # warm (compiles) outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (replays * calls))
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator(DEV).manual_seed(0)
    p13 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device=DEV, generator=gen)
    s13 = torch.randint(118, 124, (E, 2 * I, H // 32), dtype=torch.uint8, device=DEV, generator=gen)
    p2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, device=DEV, generator=gen)
    s2 = torch.randint(118, 124, (E, H, I // 32), dtype=torch.uint8, device=DEV, generator=gen)
    x = torch.randn(1, H, device=DEV, generator=gen).to(torch.bfloat16)
    h = torch.randn(TOPK, I, device=DEV, generator=gen).to(torch.bfloat16)
    ids = torch.zeros(TOPK, dtype=torch.int32, device=DEV)      # every row reads token 0
    offs = []
    for r in range(RING):               # experts 8r .. 8r + 7 (disjoint sets), one row each
        o = torch.zeros(E + 1, dtype=torch.int32)
        counts = torch.zeros(E, dtype=torch.int32)
        counts[8 * r:8 * r + TOPK] = 1
        o[1:] = counts.cumsum(0)
        offs.append(o.to(DEV))
    y13 = torch.empty(TOPK, I, dtype=torch.bfloat16, device=DEV)
    y2 = torch.empty(TOPK, H, dtype=torch.bfloat16, device=DEV)
    b13 = TOPK * (p13[0].numel() + s13[0].numel())
    b2 = TOPK * (p2[0].numel() + s2[0].numel())
    src = torch.empty(RING, b13, dtype=torch.uint8, device=DEV)
    dst = torch.empty(b13, dtype=torch.uint8, device=DEV)
    rows = []

    def row(gemm, cfg, us, nbytes, note=""):
        rows.append({"gemm": gemm, "config": cfg, "us": round(us, 2), "tb_per_s": round(nbytes / us / 1e6, 3),
                     **({"note": note} if note else {})})
        print(f"{gemm:5s} {str(cfg):28s} {us:7.2f} us {nbytes / us / 1e6:6.2f} TB/s {note}", flush=True)

    row("copy", "w13 bytes", graph_us(lambda i: dst.copy_(src[i]), RING), 2 * b13, "read + write")
    row("copy", "w2 bytes", graph_us(lambda i: dst[:b2].copy_(src[i, :b2]), RING), 2 * b2, "read + write")
    host13 = w4a16_glu_config(TOPK, E, I, H)
    ref13 = w4a16_glu_gemm(x, p13, s13, None, True, offs[0], ids, out=y13.clone()).clone()
    grid13 = [host13] + [(1, bn, bk, w, 3) for bn in (16, 32, 64) for bk in (128, 256) for w in (2, 4)
                         if (1, bn, bk, w, 3) != host13]
    for cfg in grid13:
        try:
            got = w4a16_glu_gemm(x, p13, s13, None, True, offs[0], ids, out=y13, config=cfg)
            if not torch.allclose(got.float(), ref13.float(), rtol=1e-2, atol=1e-2):
                print(f"glu {cfg}: output differs, skipped")
                continue
            us = graph_us(lambda i, c=cfg: w4a16_glu_gemm(x, p13, s13, None, True, offs[i], ids, out=y13, config=c),
                          RING)
            row("glu", list(cfg), us, b13, "host" if cfg == host13 else "")
        except Exception as e:          # a config past registers or shared memory
            print(f"glu {cfg}: {type(e).__name__} {str(e).splitlines()[0][:100]}")
    host2 = w4a16_config(TOPK, E, H, I, 32)
    ref2 = w4a16_gemm(h, p2, s2, None, True, offs[0], None, out=y2.clone()).clone()
    grid2 = [(host2, None)] + [((1, bn, bk, w, 3), sk) for bn in (16, 32, 64) for bk in (128, 256) for w in (2, 4)
                               for sk in (1, 2)]
    for cfg, sk in grid2:
        try:
            got = w4a16_gemm(h, p2, s2, None, True, offs[0], None, out=y2, config=cfg, split_k=sk)
            if not torch.allclose(got.float(), ref2.float(), rtol=1e-2, atol=1e-2):
                print(f"w2 {cfg} split {sk}: output differs, skipped")
                continue
            us = graph_us(lambda i, c=cfg, k=sk: w4a16_gemm(h, p2, s2, None, True, offs[i], None, out=y2, config=c,
                                                              split_k=k), RING)
            row("w2", list(cfg) + [sk], us, b2, "host" if sk is None else "")
        except Exception as e:
            print(f"w2 {cfg} split {sk}: {type(e).__name__} {str(e).splitlines()[0][:100]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                       "shape": {"experts": E, "top_k": TOPK, "hidden": H, "moe_intermediate": I, "format": "mxfp4"},
                       "records": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
