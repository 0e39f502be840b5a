"""Where a cold start's time goes: builds one engine of h200_fastpath.py's models (random weights, max_num_seqs 1 by
default) under cProfile and prints the functions with the most time, and what the real (not dry) passes still spent
in Triton: compiles (disk-cache loads included) and launcher builds, by kernel.
    python3 benchmarks/startup_profile.py --model kl8 [--seqs 1] [--top 40] [--no-precompile]
cProfile slows Python-heavy code (by up to 2x); read the shares, not the seconds."""
from __future__ import annotations

import argparse
import cProfile
import collections
import logging
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="kl8")
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--no-precompile", action="store_true")
    args = ap.parse_args()
    if args.no_precompile:
        os.environ["KESTREL_PRECOMPILE"] = "0"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch
    import triton
    from triton.compiler import compiler as tc

    from benchmarks.h200_fastpath import engine_for, model_dir

    spent = collections.defaultdict(lambda: [0, 0.0])      # (what, kernel) -> [count, seconds]
    compile_fn = tc.compile

    def timed_compile(src, *a, **k):
        t0 = time.perf_counter()
        try:
            return compile_fn(src, *a, **k)
        finally:
            e = spent[("compile", getattr(getattr(src, "fn", None), "__name__", "?"))]
            e[0] += 1
            e[1] += time.perf_counter() - t0
    import triton.compiler as tcm       # what JITFunction binds as its compile
    tc.compile = tcm.compile = triton.compile = timed_compile
    init = tc.CompiledKernel._init_handles

    def timed_init(self):
        fresh = self.module is None
        t0 = time.perf_counter()
        try:
            return init(self)
        finally:
            if fresh:
                e = spent[("load+launcher", self.name)]
                e[0] += 1
                e[1] += time.perf_counter() - t0
    tc.CompiledKernel._init_handles = timed_init

    path = model_dir(args.model)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    engine, start_s = engine_for(path, False, 16384, args.seqs)
    prof.disable()
    print(f"engine ready in {start_s:.1f} s ({time.perf_counter() - t0:.1f} s under cProfile), capture "
          f"{engine.runner.capture_s:.1f} s", flush=True)
    totals = collections.defaultdict(lambda: [0, 0.0])
    for (what, _), (n, s) in spent.items():
        totals[what][0] += n
        totals[what][1] += s
    for what, (n, s) in totals.items():
        print(f"{what}: {n} calls, {s:.1f} s")
    for (what, name), (n, s) in sorted(spent.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"  {what:<14} {name:<48} {n:>4} {s:7.2f} s")
    for key in ("cumulative", "tottime"):
        print(f"---- by {key}")
        pstats.Stats(prof).sort_stats(key).print_stats(args.top)
    del engine
    torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
