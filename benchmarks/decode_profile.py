"""Where a decode step's time goes on the GPU: kernel time per step by kernel, next to the step's wall time.

    python3 benchmarks/decode_profile.py --model kl8 --batch 1 --batch 64 --out $OUT/profile_kl8.json

The engine is the one `h200_fastpath.py` measures (random real-width weights, the bf16 sm_90 target, decode graphs).
For each batch size, two `run_latency` runs under torch.profiler (CUDA activity: CUPTI also records the kernels a
graph replay launches): one of `--steps` + 1 new tokens and one of 1; their kernel times differ by the decode steps
alone, so per kernel name (time in the long run - time in the short one) / steps is its time per decode step. The
table prints the kernels by time per step, their share, and the sum against the step's wall time (the gap is host
time the GPU waits for: launch, schedule, sampling on the host, the one copy of the ids).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.h200_fastpath import engine_for, model_dir      # noqa: E402
from kestrel.bench.latency import _timed_run, machine_info, run_latency, sampling_params     # noqa: E402


def one_token_run(engine, prompt_len: int):
    """A function that runs one request of a fresh random prompt for one token: the prefill row's run
    (run_latency's `t_one`); the prompt is drawn now, outside what is timed."""
    import random
    rng = random.Random(1)
    engine.cache.drop_prefix_cache()
    prompt = [rng.randrange(3, engine.config.vocab_size) for _ in range(prompt_len)]
    return lambda: _timed_run(engine, [prompt], sampling_params("greedy", 1, 0))


def kernel_times(fn) -> tuple[dict, float]:
    """({kernel name: (total us, count)}, wall seconds) of `fn()` under the profiler."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    out: dict = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rec = out[e.name]
            rec[0] += e.time_range.elapsed_us()     # a device event's range is the kernel's run
            rec[1] += 1
    return dict(out), wall


def idle_gaps(kernels: list[tuple[float, float]], t0: float, t1: float, least_us: float) -> list[tuple[float, float]]:
    """The spans of [t0, t1] (us) in which no kernel ran, at least `least_us` long, from kernel (start, end) spans."""
    gaps, busy_to = [], t0
    for s, e in sorted(kernels):
        if s - busy_to >= least_us:
            gaps.append((busy_to, s))
        busy_to = max(busy_to, e)
    if t1 - busy_to >= least_us:
        gaps.append((busy_to, t1))
    return gaps


class _Span:
    """A host event of a Chrome trace (python function, op, runtime call) with its parent by containment."""
    __slots__ = ("name", "start", "end", "parent", "children")

    def __init__(self, name: str, start: float, end: float):
        self.name, self.start, self.end, self.parent, self.children = name, start, end, None, []


def trace_spans(trace: dict, tid: int | None = None) -> tuple[list[tuple[float, float, str]], list[_Span]]:
    """(device activity spans (start, end, name), host spans nested by containment per thread) of a Chrome trace
    (torch.profiler's export: kernels, copies and sets on the device; python functions, ops and runtime calls on
    the host), us; host spans of thread `tid` only when it has any (the engine's: not the compile pool's)."""
    dev, by_tid = [], collections.defaultdict(list)
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, ts, dur = ev.get("cat", ""), float(ev["ts"]), float(ev["dur"])
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            dev.append((ts, ts + dur, ev.get("name", "?")))
        elif cat in ("python_function", "cpu_op", "cuda_runtime", "cuda_driver", "user_annotation"):
            by_tid[(ev.get("pid"), ev.get("tid"))].append(_Span(ev.get("name", "?"), ts, ts + dur))
    host = []
    mine = [k for k in by_tid if k[1] == tid]
    for spans in ([by_tid[k] for k in mine] if mine else by_tid.values()):
        spans.sort(key=lambda x: (x.start, -x.end))
        stack: list[_Span] = []
        for x in spans:
            while stack and stack[-1].end < x.end:
                stack.pop()
            if stack:
                x.parent = stack[-1]
                stack[-1].children.append(x)
            stack.append(x)
        host += spans
    return dev, host


def _site(x) -> str:
    """The innermost Python frame of our code (kestrel/ or benchmarks/) at a host span: itself or its nearest such
    ancestor (python function spans are named by their file, line and function)."""
    while x is not None:
        for root in ("kestrel/", "benchmarks/"):
            if root in x.name:
                return root + x.name.split(root, 1)[1]
        x = x.parent
    return "?"


def _overlap(gaps: list[tuple[float, float]], ends: list[float], s: float, e: float) -> float:
    import bisect
    i, tot = bisect.bisect_right(ends, s), 0.0
    while i < len(gaps) and gaps[i][0] < e:
        tot += min(gaps[i][1], e) - max(gaps[i][0], s)
        i += 1
    return tot


def charge_gaps(gaps: list[tuple[float, float]], host: list[_Span]) -> dict[str, float]:
    """us of the idle spans `gaps` (sorted, disjoint) charged to the host spans running then, each span its self
    time inside them (its overlap less its children's): "name @ innermost frame of ours"."""
    ends = [g[1] for g in gaps]
    out: dict = collections.defaultdict(float)
    for x in host:
        t = _overlap(gaps, ends, x.start, x.end) - sum(_overlap(gaps, ends, c.start, c.end) for c in x.children)
        if t > 0:
            site = _site(x)
            out[x.name if site in x.name else f"{x.name} @ {site}"] += t
    return out


def gap_report(fn, least_us: float = 20.0, top: int = 15) -> dict:
    """Where the device waits in `fn()`: its wall time, kernel time, and the spans with no device activity (at least
    `least_us`), each charged to the host code running then (self time of the host spans overlapping it, named by
    their innermost frame of kestrel/ or benchmarks/; Python stacks on), read from the profiler's Chrome trace.
    Python tracing slows the host, so the spans are longer than in a plain run: read them for where, not how long."""
    import tempfile
    import threading
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as r:
            dev, host = trace_spans(json.load(r), threading.get_native_id())
    t0 = min(x.start for x in host)
    t1 = max(x.end for x in host)
    gaps = idle_gaps([(a, b) for a, b, _ in dev], t0, t1, least_us)
    charged = charge_gaps(gaps, host)
    by_site: dict = collections.defaultdict(float)
    for k, v in charged.items():
        by_site[k.rsplit(" @ ", 1)[-1]] += v
    first = min((s for s, _, _ in dev), default=t1)
    largest = []
    by_end, by_start = sorted(dev, key=lambda d: d[1]), sorted(dev)
    for gs, ge in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:     # what the host ran in each of the longest
        c = charge_gaps([(gs, ge)], host)
        before = [d[2] for d in by_end if d[1] <= gs][-1:] or ["(start)"]
        after = [d[2] for d in by_start if d[0] >= ge][:1] or ["(end)"]
        largest.append({"at_ms": round((gs - t0) / 1e3, 3), "ms": round((ge - gs) / 1e3, 3),
                        "between": f"{before[0][:50]} -> {after[0][:50]}",
                        "host": [f"{round(v / 1e3, 3)} {k}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])[:4]]})
    return {"longest": largest, "wall_ms": (t1 - t0) / 1e3, "kernel_ms": sum(e - s for s, e, _ in dev) / 1e3,
            "idle_ms": sum(e - s for s, e in gaps) / 1e3, "idle_spans": len(gaps),
            "before_first_kernel_ms": (first - t0) / 1e3,
            "idle_by_host_site_ms": [{"site": k, "ms": round(v / 1e3, 3)}
                                     for k, v in sorted(charged.items(), key=lambda kv: -kv[1])[:top]],
            "idle_by_site_ms": [{"site": k, "ms": round(v / 1e3, 3)}
                                for k, v in sorted(by_site.items(), key=lambda kv: -kv[1])[:top]]}


def profile_batch(engine, batch: int, input_len: int, steps: int) -> dict:
    run_latency(engine, batch, input_len, steps + 1, num_iters=1, num_iters_warmup=0)      # warm
    long_k, long_wall = kernel_times(lambda: run_latency(engine, batch, input_len, steps + 1, num_iters=1,
                                                         num_iters_warmup=0))
    short_k, short_wall = kernel_times(lambda: run_latency(engine, batch, input_len, 2, num_iters=1,
                                                           num_iters_warmup=0))
    # run_latency runs (O tokens) then (1 token); the difference of the two calls is (steps + 1 - 2) decode steps
    n = steps - 1
    rows = []
    for name in set(long_k) | set(short_k):
        us = long_k.get(name, [0, 0])[0] - short_k.get(name, [0, 0])[0]
        cnt = long_k.get(name, [0, 0])[1] - short_k.get(name, [0, 0])[1]
        if us > 0 or cnt > 0:
            rows.append({"kernel": name[:120], "us_per_step": us / n, "launches_per_step": cnt / n})
    rows.sort(key=lambda r: -r["us_per_step"])
    gpu_us = sum(r["us_per_step"] for r in rows)
    wall_us = 1e6 * (long_wall - short_wall) / n
    return {"batch": batch, "input_len": input_len, "steps": n, "wall_us_per_step": wall_us,
            "kernel_us_per_step": gpu_us, "launches_per_step": sum(r["launches_per_step"] for r in rows),
            "kernels": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="kl8")
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prefill", type=int, default=0, help="also the kernels of one prefill of this many tokens")
    ap.add_argument("--prefill-only", action="store_true", help="no decode batches: the prefill alone")
    ap.add_argument("--gaps", action="store_true",
                    help="with --prefill: also where the device waits in one prefill (host code charged per idle span)")
    ap.add_argument("--quant", help="store the routed experts in this format (h200_fastpath's --quant: k3-4l needs it)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    batches = args.batch or [1, 64]
    engine, start_s = engine_for(model_dir(args.model, args.quant), False, 16384, max(batches))
    print(f"[{args.model}] engine ready in {start_s:.1f} s (capture {engine.runner.capture_s:.1f} s)", flush=True)
    results = []
    for b in [] if args.prefill_only else batches:
        r = profile_batch(engine, b, args.input_len, args.steps)
        results.append(r)
        print(f"\n[{args.model} batch {b}] wall {r['wall_us_per_step']:.0f} us/step, kernels "
              f"{r['kernel_us_per_step']:.0f} us/step ({r['launches_per_step']:.0f} launches)")
        for k in r["kernels"][:args.top]:
            print(f"  {k['us_per_step']:8.1f} us {100 * k['us_per_step'] / r['kernel_us_per_step']:5.1f}% "
                  f"x{k['launches_per_step']:5.1f}  {k['kernel'][:90]}")
    if args.prefill:
        run_latency(engine, 1, args.prefill, 2, num_iters=1, num_iters_warmup=0)
        ks, wall = kernel_times(lambda: run_latency(engine, 1, args.prefill, 2, num_iters=1, num_iters_warmup=0))
        rows = sorted(({"kernel": k[:120], "us": v[0], "launches": v[1]} for k, v in ks.items()),
                      key=lambda r: -r["us"])
        total = sum(r["us"] for r in rows)
        # run_latency ran the prompt twice (2 tokens, then 1): halve
        print(f"\n[{args.model} prefill {args.prefill}] wall {1e3 * wall / 2:.1f} ms, kernels {total / 2e3:.1f} ms")
        for k in rows[:args.top]:
            print(f"  {k['us'] / 2e3:8.2f} ms {100 * k['us'] / total:5.1f}% x{k['launches'] / 2:6.1f}  {k['kernel'][:90]}")
        results.append({"prefill": args.prefill, "wall_ms": 1e3 * wall / 2, "kernel_ms": total / 2e3,
                        "kernels": [dict(r, us=r["us"] / 2, launches=r["launches"] / 2) for r in rows]})
        if args.gaps:        # one run of the prompt alone (1 token): the 8K row's own measurement
            plain = one_token_run(engine, args.prefill)()
            g = gap_report(one_token_run(engine, args.prefill))
            g["plain_wall_ms"] = 1e3 * plain
            print(f"\n[{args.model} prefill {args.prefill}, one run] wall {g['wall_ms']:.1f} ms, kernels "
                  f"{g['kernel_ms']:.1f} ms, device idle {g['idle_ms']:.1f} ms in {g['idle_spans']} spans "
                  f"({g['before_first_kernel_ms']:.2f} ms before the first kernel)")
            print(f"  (the same run without the profiler: {g['plain_wall_ms']:.1f} ms)")
            for r in g["idle_by_host_site_ms"] + [{"site": "-- by site --", "ms": 0.0}] + g["idle_by_site_ms"]:
                print(f"  {r['ms']:8.3f} ms  {r['site'][:150]}")
            for r in g["longest"]:
                print(f"  span at {r['at_ms']:.2f} ms, {r['ms']:.3f} ms, {r['between']}: "
                      + " | ".join(h[:100] for h in r["host"]))
            results.append({"prefill_gaps": args.prefill, **g})
    with open(args.out, "w") as f:
        json.dump({"machine": machine_info(torch.device("cuda")), "command": " ".join(sys.argv),
                   "start_s": start_s, "capture_s": engine.runner.capture_s, "profiles": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
