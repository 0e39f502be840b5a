"""Which Triton kernels compile on the serving path after start-up: kl8 (random weights, graphs, the engine's
defaults), then `kestrel bench latency`'s batch-64 rows twice each (greedy, then top-p) with Triton's post-compile
hook recording every compile: the kernel, its specialization, and the row it happened in. The warm-up
(runtime/graphs.py WARMUP_STEPS) should leave nothing to compile here. Each row also gives its steps' wall times
(the slowest named), and one 8K-token prompt's prefill lists its host-device syncs by call site.
    python3 benchmarks/jit_probe.py --out $OUT/jit_probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.h200_fastpath import engine_for, model_dir     # noqa: E402
from kestrel.bench.latency import _timed_run, run_latency      # noqa: E402
from kestrel.sampling_params import SamplingParams             # noqa: E402


def sync_sites(engine, prompt_len: int) -> dict[str, int]:
    """The Python call sites of the host-device synchronizations in the steps of one `prompt_len`-token prompt
    (torch's sync debug mode warns at each; the innermost frames in kestrel or fla name the site), with counts."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, engine.config.vocab_size, (prompt_len,), generator=gen).tolist()
    sites: dict[str, int] = {}
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        stack = traceback.extract_stack()[:-1]
        frames = [f for f in stack if "/kestrel/" in f.filename or "/fla/" in f.filename] or stack
        key = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))
        sites[key] = sites.get(key, 0) + 1
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode(1)
        try:
            while engine.has_unfinished():
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    engine.release(rid)
    return sites


def prefill_rate(engine, prompt_len: int, runs: int = 5) -> float:
    """Tokens a second of one `prompt_len`-token prompt's prefill (one output token), median wall of `runs`."""
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    walls = sorted(_timed_run(engine, [torch.randint(3, engine.config.vocab_size, (prompt_len,), generator=gen)
                                       .tolist()], params) for _ in range(runs))
    return prompt_len / walls[len(walls) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="kl8")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=8192, help="the prompt whose step's host syncs are listed")
    args = ap.parse_args()
    engine, start_s = engine_for(model_dir(args.model), False, 16384, 64)
    print(f"engine ready in {start_s:.1f} s", flush=True)
    compiled, where = [], {"row": "start"}

    def hook(*_, **kw):
        compiled.append({"row": where["row"], "t": round(time.perf_counter() - t0, 3),
                         "kernel": getattr(kw.get("fn"), "name", None) or str(kw.get("fn"))[:80],
                         "repr": str(kw.get("repr"))[:400],
                         # the compile-time constants: which specialization (block sizes) the warm-up missed
                         "constants": str((kw.get("compile") or {}).get("constants"))[:600]})
    triton.knobs.runtime.jit_post_compile_hook = hook
    rows = []
    # every step's wall time, so a first run slower than the second without a compile shows the step that paid
    step, steps = engine.step, []

    def timed_step():
        t = time.perf_counter()
        try:
            return step()
        finally:
            steps.append(time.perf_counter() - t)
    engine.step = timed_step
    t0 = time.perf_counter()
    for sampling in ("greedy", "top_p"):
        for rep in (1, 2):
            where["row"] = f"b64 {sampling} #{rep}"
            n0, t1 = len(compiled), time.perf_counter()
            steps.clear()
            run_latency(engine, 64, 1024, args.output_len, num_iters=1, num_iters_warmup=0, sampling=sampling)
            torch.cuda.synchronize()
            slow = sorted(range(len(steps)), key=lambda i: -steps[i])[:6]
            rows.append({"row": where["row"], "s": round(time.perf_counter() - t1, 3), "compiles": len(compiled) - n0,
                         "steps": len(steps), "step_s": round(sum(steps), 3),
                         "slowest_steps_ms": [(i, round(1e3 * steps[i], 1)) for i in slow]})
            print(rows[-1], flush=True)
    for c in compiled:
        print(c["row"], c["t"], c["kernel"], c["constants"][:240], flush=True)
    syncs = sync_sites(engine, args.prefill_len)
    for site, n in syncs.items():
        print(f"sync x{n}: {site}", flush=True)
    prefill = prefill_rate(engine, args.prefill_len)
    print(f"prefill of {args.prefill_len} tokens: {prefill:.0f} tok/s (median of 5, after the sync probe's run)",
          flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "start_s": start_s, "rows": rows, "compiled": compiled,
                   "prefill_sync_sites": syncs, "prefill_tokens_per_s": prefill}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
