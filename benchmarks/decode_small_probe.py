"""The small launches of a batch-1 Kimi Linear decode step, timed as the decode graphs run them: inside a CUDA graph,
back to back, each call on its own copy of the weights / cache (a ring larger than the 50 MB L2, as in a real step
whose layers evict each other). Per call in us, median of the replays:
- the projection GEMMs at M = 1 and 8 as cuBLAS gets them today (x @ W^T) against the transposed problem
  (W @ x^T: cuBLAS's GEMV kernels for one column) and, at M = 1, the GEMV of kestrel/kernels/gemm/gemv.py over
  its configs, at Kimi Linear 48B's o_proj, joined KDA / MLA input projections, dense and shared-expert downs;
- the router's logits (bf16 x bf16 -> fp32): cuBLAS against `router_logits_small`;
- the absorbed MLA decode at batch 1, 32 heads, 1K / 4K context: split counts x tile configs.
    python3 benchmarks/decode_small_probe.py --json $OUT/decode_small_probe.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kestrel.kernels.attention.mla_decode as md          # noqa: E402
from benchmarks._results import write_results              # noqa: E402
from kestrel.kernels.gemm.gemv import gemv, gemv_config  # noqa: E402
from kestrel.kernels.moe.router import router_logits_small  # noqa: E402

DEV = torch.device("cuda")
RING_BYTES = 96 * 2 ** 20
# (BN, BK, num_warps) of the batch-1 GEMV (kestrel/kernels/gemm/gemv.py)
GEMV_CONFIGS = [(8, 512, 4), (8, 256, 4), (4, 512, 4), (16, 256, 4), (16, 512, 8), (4, 1024, 4), (2, 1024, 4),
                (32, 256, 8)]


def graph_us(calls, replays: int = 20) -> float:
    """Median us per call of `calls` (a list of thunks) captured back to back in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    times.sort()
    return times[len(times) // 2]


def ring(make, nbytes: int):
    return [make() for _ in range(max(2, -(-RING_BYTES // nbytes)))]


def gemms(rows: list):
    for name, N, K in (("o_proj", 2304, 4096), ("kda qkv", 12576, 2304), ("dense down", 2304, 9216),
                       ("mla in", 6720, 2304), ("shared down", 2304, 1024), ("f_b", 4096, 128),
                       ("router", 256, 2304)):
        ws = ring(lambda: torch.randn(N, K, device=DEV).to(torch.bfloat16), N * K * 2)
        for M in (1, 8):
            x = torch.randn(M, K, device=DEV).to(torch.bfloat16)
            gb = N * K * 2 / 1e9
            variants = {}
            if name == "router":
                variants["cublas x@W^T fp32 out"] = [lambda w=w: torch.mm(x, w.t(), out_dtype=torch.float32)
                                                     for w in ws]
                variants["router_logits_small"] = [lambda w=w: router_logits_small(x, w) for w in ws]
                ref = torch.mm(x.float(), ws[0].float().t())
                err = (router_logits_small(x, ws[0]) - ref).abs().max().item()
                print(f"  router_logits_small vs fp32 GEMM: max |diff| {err:.2e}", flush=True)
            else:
                variants["cublas x@W^T"] = [lambda w=w: torch.mm(x, w.t()) for w in ws]
                if M <= 2 or name != "kda qkv":
                    variants["cublas (W@x^T)^T"] = [lambda w=w: torch.mm(w, x.t()).t() for w in ws]
                if M == 1:
                    ref = torch.mm(x.float(), ws[0].float().t())
                    for cfg in GEMV_CONFIGS:
                        if K % cfg[1]:
                            continue
                        err = (gemv(x, ws[0], config=cfg).float() - ref).abs().max().item()
                        variants[f"gemv {cfg}{' (default)' if cfg == gemv_config(N, K) else ''} d{err:.0e}"] = \
                            [lambda w=w, c=cfg: gemv(x, w, config=c) for w in ws]
            for v, calls in variants.items():
                us = graph_us(calls)
                rows.append(dict(section="gemm", name=name, M=M, N=N, K=K, variant=v, us=round(us, 2),
                                 tbs=round(gb / us * 1e6 / 1e3, 2)))
                print(f"{name:12s} M={M:<3d} {v:26s} {us:8.2f} us  {gb / us * 1e3:6.2f} TB/s", flush=True)


def mla(rows: list):
    H, L, R, page = 32, 512, 64, 64
    real = md._config
    for ctx in (1024, 4096):
        pages = ctx // page
        nbytes = ctx * (L + R) * 2
        caches = ring(lambda: torch.randn(pages, page, L + R, device=DEV).to(torch.bfloat16), nbytes)
        q = torch.randn(1, H, L + R, device=DEV).to(torch.bfloat16)
        bt = torch.arange(pages, device=DEV, dtype=torch.int32).view(1, -1)
        req = torch.zeros(1, dtype=torch.int32, device=DEV)
        lens = torch.full((1,), ctx, dtype=torch.int32, device=DEV)
        ref = md.mla_decode(q, caches[0], bt, req, lens, 0.07, L, 1)[0].float()
        for splits in (8, 16, 32):
            for bh, bn, warps, stages in ((16, 128, 4, 2), (16, 64, 4, 2), (16, 32, 4, 2), (32, 64, 8, 3),
                                          (16, 64, 4, 3)):
                cfg = dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=warps, num_stages=stages)
                md._config = lambda *_, c=cfg: c
                try:
                    err = (md.mla_decode(q, caches[0], bt, req, lens, 0.07, L, splits)[0].float() - ref).abs().max()
                    us = graph_us([lambda c=c: md.mla_decode(q, c, bt, req, lens, 0.07, L, splits) for c in caches])
                except Exception as e:      # a tile past shared memory: reported, not fatal
                    print(f"mla ctx {ctx} splits {splits} {cfg}: {str(e).splitlines()[0][:100]}", flush=True)
                    continue
                finally:
                    md._config = real
                rows.append(dict(section="mla_decode", context=ctx, heads=H, splits=splits, config=cfg,
                                 us=round(us, 2), max_diff=float(err), today=splits == 8 and cfg == real(
                                     DEV, 1, H, splits, torch.bfloat16, False)))
                print(f"mla ctx {ctx:5d} splits {splits:3d} {str(cfg):70s} {us:7.2f} us (diff {err:.1e})", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows: list[dict] = []
    gemms(rows)
    mla(rows)
    write_results(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
