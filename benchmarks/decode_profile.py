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
from kestrel.bench.latency import machine_info, run_latency     # noqa: E402


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
    ap.add_argument("--quant", help="store the routed experts in this format (h200_fastpath's --quant: k3-4l needs it)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    batches = args.batch or [1, 64]
    engine, start_s = engine_for(model_dir(args.model, args.quant), False, 16384, max(batches))
    print(f"[{args.model}] engine ready in {start_s:.1f} s (capture {engine.runner.capture_s:.1f} s)", flush=True)
    results = []
    for b in batches:
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
    with open(args.out, "w") as f:
        json.dump({"machine": machine_info(torch.device("cuda")), "command": " ".join(sys.argv),
                   "start_s": start_s, "capture_s": engine.runner.capture_s, "profiles": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
