"""Which Triton kernels compile on the serving path after start-up: kl8 (random weights, graphs, the engine's
defaults), then `kestrel bench latency`'s batch-64 rows twice each (greedy, then top-p) with Triton's post-compile
hook recording every compile: the kernel, its specialization, and the row it happened in. The warm-up
(runtime/graphs.py WARMUP_STEPS) should leave nothing to compile here.
    python3 benchmarks/jit_probe.py --out $OUT/jit_probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.h200_fastpath import engine_for, model_dir     # noqa: E402
from kestrel.bench.latency import run_latency                  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="kl8")
    ap.add_argument("--output-len", type=int, default=128)
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
    t0 = time.perf_counter()
    for sampling in ("greedy", "top_p"):
        for rep in (1, 2):
            where["row"] = f"b64 {sampling} #{rep}"
            n0, t1 = len(compiled), time.perf_counter()
            run_latency(engine, 64, 1024, args.output_len, num_iters=1, num_iters_warmup=0, sampling=sampling)
            torch.cuda.synchronize()
            rows.append({"row": where["row"], "s": round(time.perf_counter() - t1, 3), "compiles": len(compiled) - n0})
            print(rows[-1], flush=True)
    for c in compiled:
        print(c["row"], c["t"], c["kernel"], c["constants"][:240], flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "start_s": start_s, "rows": rows, "compiled": compiled}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
