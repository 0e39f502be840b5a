"""Time the batched device sampler (kestrel.runtime.sampler) at batch 1 and 64 over a 163,840-token vocabulary.

    python benchmarks/sampler_bench.py [--vocab 163840] [--batch 1 64] [--iters 50] [--json out.json]
                                       [--baseline benchmarks/results/h200_sampler.json]

Each kind is timed eagerly (prepare + sample + the one copy of the ids back, wall clock per step) and replayed from
a CUDA graph captured over `Sampler.sample` (GPU time per replay from CUDA events; capture itself proves that the
sampler makes no host sync). Logits are bf16, random normal times 3 (peaked enough that top-p keeps a few hundred
tokens) and, for `top_p_flat`, times 0.3 (a random-weights model: the nucleus is most of the vocabulary). Top-p
rows run through the Triton kernels (kernels/sampling/nucleus.py); the `*_sort` kinds run them through the torch
top-k candidates and the full sort. Next to each graph time: the same record's graph time in `--baseline` (an earlier
run's JSON, when it has one), the copy floor (reading B x V fp32 logits at 4.2 TB/s) and, for the kernels, the
share of rows (over the eager steps) that every rejection round refused: they took the bisection fallback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HBM_BYTES_PER_S = 4.2e12        # the H200's copy bandwidth

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.runtime.sampler import GREEDY, Sampler  # noqa: E402
from kestrel.sampling_params import SamplingParams  # noqa: E402

KINDS = {
    "greedy": (dict(temperature=0.0), 3.0),
    "temperature": (dict(temperature=0.8), 3.0),
    "top_k": (dict(temperature=0.8, top_k=50), 3.0),
    "top_k_top_p": (dict(temperature=0.8, top_k=50, top_p=0.95), 3.0),
    "top_p": (dict(temperature=0.8, top_p=0.95), 3.0),
    "top_p_flat": (dict(temperature=0.8, top_p=0.95), 0.3),
    "top_p_sort": (dict(temperature=0.8, top_p=0.95), 3.0),          # the same rows through the full sort
    "top_p_flat_sort": (dict(temperature=0.8, top_p=0.95), 0.3),
    "min_p": (dict(temperature=0.8, min_p=0.05), 3.0),
    "logprobs_5": (dict(temperature=0.8, top_k=50, logprobs=5), 3.0),
    "bitmask": (dict(temperature=0.8, top_k=50), 3.0),
}


PROFILE = False      # --profile: each kind's graph replays under torch.profiler, device time per kernel


def profile_replays(graph, replays: int = 20) -> dict[str, float]:
    """Device microseconds per replay of each kernel the graph launches (CUPTI traces kernels inside graphs)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            per[e.key[:60]] = round(us / replays, 2)
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def time_kind(kind: str, B: int, V: int, iters: int) -> dict:
    kw, scale = KINDS[kind]
    params = SamplingParams(**kw)
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(B, V, device="cuda", generator=g) * scale).to(torch.bfloat16)
    mask = None
    if kind == "bitmask":
        mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (B, -(-V // 32)), device="cuda", dtype=torch.int32,
                             generator=g)
    sm = Sampler(B, V, torch.device("cuda"), nucleus_kernel=not kind.endswith("_sort"))
    rows = [sm.row(params, s) for s in range(B)]
    top_n = params.logprobs

    refused = []            # per eager step: rows every rejection round refused (the kernels' fallback)

    def step(pos: int):
        flags = sm.prepare(rows, [pos] * B, top_n)
        res = sm.sample(logits, flags, mask)
        if sm.work is not None and flags.paths - {GREEDY}:
            refused.append(sm.work.thr[:B, 0] != -1)
        return res.token_ids.tolist()

    for i in range(5):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(iters):
        step(i)
    eager_ms = (time.perf_counter() - t0) / iters * 1e3

    flags = sm.prepare(rows, [0] * B, top_n)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            sm.sample(logits, flags, mask)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = sm.sample(logits, flags, mask)
    # the graph reads the persistent parameter buffers: a replay after prepare() equals an eager call
    sm.prepare(rows, [7] * B, top_n)
    graph.replay()
    same = res.token_ids.tolist() == sm.sample(logits, flags, mask).token_ids.tolist()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    fallback = round(float(torch.stack(refused[5:]).float().mean()), 4) if refused else None
    kernels = profile_replays(graph) if PROFILE else None
    return {"kind": kind, "kernels_us": kernels, "batch": B, "vocab": V, "eager_ms": round(eager_ms, 4),
            "graph_ms": round(start.elapsed_time(end) / iters, 4), "graph_equals_eager": same,
            "floor_ms": round(B * V * 4 / HBM_BYTES_PER_S * 1e3, 4), "fallback_rows": fallback}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--json", help="also write the records here")
    ap.add_argument("--profile", action="store_true", help="also the device time of each kernel per replay")
    ap.add_argument("--baseline", default=str(Path(__file__).resolve().parent / "results" / "h200_sampler.json"),
                    help="an earlier run's JSON: its graph times are printed beside these")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sampler_bench: needs a CUDA device", file=sys.stderr)
        return 2
    base = {}
    if args.baseline and Path(args.baseline).exists():
        base = {(r["kind"], r["batch"], r["vocab"]): r["graph_ms"]
                for r in json.loads(Path(args.baseline).read_text())["records"]}
    global PROFILE
    PROFILE = args.profile
    records = []
    print(f"{'kind':<16}{'batch':>6}{'eager ms':>10}{'graph ms':>10}{'before':>9}{'floor':>8}{'fallback':>10}"
          "  graph==eager")
    for B in args.batch:
        for kind in args.kinds:
            r = time_kind(kind, B, args.vocab, args.iters)
            r["baseline_graph_ms"] = base.get((kind, B, args.vocab))
            records.append(r)
            before = "-" if r["baseline_graph_ms"] is None else f"{r['baseline_graph_ms']:.3f}"
            fb = "-" if r["fallback_rows"] is None else f"{r['fallback_rows']:.2f}"
            print(f"{kind:<16}{B:>6}{r['eager_ms']:>10.3f}{r['graph_ms']:>10.3f}{before:>9}{r['floor_ms']:>8.3f}"
                  f"{fb:>10}  {r['graph_equals_eager']}")
            for name, us in (r["kernels_us"] or {}).items():
                print(f"    {us:8.2f} us  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": torch.cuda.get_device_name(),
                                               "command": " ".join(sys.argv), "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
