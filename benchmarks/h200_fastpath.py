"""The fast-path issue's speed table on one GPU, in one process per model: random real-width weights built on the
device (`--load-format random`), the bf16 sm_90 target (`--modeling require`), `kestrel bench latency`'s driver for
every row, and the same rows with `--enforce-eager` as the in-run baseline where asked. The graph rows run with
the engine's default async scheduling (on with graphs: each decode step launched before the previous step's ids are
read); `--compare-async` runs the decode rows once more with it off on the same engine (mode `graphs-sync`), the
in-run baseline of the overlap, and `--no-async-scheduling` turns it off for the `graphs` rows too. Each record
says `async_scheduling`.

    python3 benchmarks/h200_fastpath.py --model kl8 --out $OUT/fastpath_kl8.json
    python3 benchmarks/h200_fastpath.py --model kl8 --compare-async --out $OUT/fastpath_kl8_async.json
    python3 benchmarks/h200_fastpath.py --model kl27 --out $OUT/fastpath_kl27.json
    python3 benchmarks/h200_fastpath.py --model k3-2l --out $OUT/fastpath_k3.json
    python3 benchmarks/h200_fastpath.py --model k3-4l --quant mxfp4 --out $OUT/fastpath_k3_mxfp4.json
    python3 benchmarks/h200_fastpath.py --model kl27 --quant nvfp4 --out $OUT/fastpath_kl27_nvfp4.json

Models: `kl8` (the 8-layer real-width Kimi Linear 48B of the issue: MLA at layers 4 and 8), `kl27` (the whole 48B),
`k3-2l` (two real-width K3 MoE layers: one KDA, one MLA), `k3-4l` (four: three KDA, one MLA; FP4 experts only, a
bf16 one does not fit). `--quant FMT` stores the routed experts in FMT (make-checkpoint --quant's config: the
quantized sm_90 target then claims it). Each row is one `run_latency` call (decode rate =
(t(O) - t(1)) / (O - 1), prefill rate from the 1-token run); the JSON is `{machine, command, records}` with the
fast-path issue's record fields plus `start_s` (engine start, graphs included), `first_run_s` / `steady_run_s`
(the first timed run of a row against the median of the later ones) and `first_short_run_s` (a short run of the
row's shapes before any timing: JIT on the serving path shows there), and what the cache plan holds:
`kv_cache_tokens`, `kda_slots`, `requests_8k_fit` (8K-context requests the planned pages and slots take at once)
and `requests_8k_by_memory` (the same bytes without the `max_num_seqs` cap on slots).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kestrel.bench.latency import machine_info, run_latency          # noqa: E402
from kestrel.config import EngineConfig                               # noqa: E402
from kestrel.llm import build_engine                                  # noqa: E402
from kestrel.models.kimi.checkpoint import preset_config              # noqa: E402

# (batch, input_len, output_len, sampling, eager baseline too)
ROWS = {
    "kl8": [(1, 1024, 128, "greedy", True), (64, 1024, 128, "greedy", False), (64, 1024, 128, "top_p", False),
            (1, 1024, 128, "top_p", False), (1, 8192, 2, "greedy", False)],
    "kl27": [(1, 1024, 128, "greedy", False)],
    "k3-2l": [(1, 1024, 64, "greedy", False), (8, 1024, 64, "greedy", False), (64, 1024, 64, "greedy", False)],
    "k3-4l": [(1, 1024, 64, "greedy", False), (8, 1024, 64, "greedy", False), (64, 1024, 64, "greedy", False)],
}
LAYERS = {"k3-2l": 2, "k3-4l": 4}


def model_dir(name: str, quant: str | None = None) -> str:
    if name.startswith("kl"):
        cfg = preset_config("kimi-linear-48b", None if name == "kl27" else 8)
    else:   # MoE layers of K3: KDA, then MLA last (no dense first layer)
        n = LAYERS[name]
        cfg = preset_config("k3", n)
        text = cfg.get("text_config", cfg)
        text["first_k_dense_replace"] = 0
        text["linear_attn_config"]["full_attn_layers"] = [n]
        text["linear_attn_config"]["kda_layers"] = list(range(1, n))
    if quant:
        from kestrel.config import ModelConfig
        from kestrel.quant.quantize import config_quantization
        cfg["quantization_config"] = config_quantization(ModelConfig.from_dict(cfg), quant, "experts")
    d = tempfile.mkdtemp(prefix=f"kestrel-{name}-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def engine_for(path: str, eager: bool, max_len: int, seqs: int, async_scheduling: bool | None = None):
    ec = EngineConfig(model=path, dtype="bfloat16", device="cuda", load_format="random", modeling="require",
                      max_num_seqs=seqs, max_num_batched_tokens=8192, max_model_len=max_len,
                      enable_prefix_caching=False, enforce_eager=eager, gpu_memory_utilization=0.92,
                      async_scheduling=async_scheduling)
    t0 = time.perf_counter()
    engine = build_engine(ec)
    torch.cuda.synchronize()
    return engine, time.perf_counter() - t0


def run(name: str, out: str, iters: int, only_eager: bool, quant: str | None = None,
        async_scheduling: bool | None = None, compare_async: bool = False, skip_eager: bool = False,
        batches: list[int] | None = None) -> dict:
    path = model_dir(name, quant)
    rows = [r for r in ROWS[name] if batches is None or r[0] in batches]
    records, extra = [], []
    modes = ["eager"] if only_eager else ["graphs"] + (["graphs-sync"] if compare_async else []) + \
        ([] if skip_eager else ["eager"])
    engine = start_s = None
    for mode in modes:
        eager = mode == "eager"
        todo = [r for r in rows if (not eager or r[4]) and (mode != "graphs-sync" or r[2] > 2)]
        if not todo:
            continue
        if mode == "graphs-sync":       # the same engine and graphs, async scheduling off between runs (drained)
            engine.async_scheduling = False
        else:
            engine, start_s = engine_for(path, eager, 16384, max(r[0] for r in rows), async_scheduling)
        print(f"[{name} {mode}] engine ready in {start_s:.1f} s (capture {engine.runner.capture_s:.1f} s, "
              f"{len(engine.runner.graphs)} graphs)", flush=True)
        for batch, inp, outl, sampling, _ in todo:
            t0 = time.perf_counter()            # the first run after start-up: JIT on the serving path shows here
            run_latency(engine, batch, inp, min(outl, 4) if outl > 2 else 2, num_iters=1, num_iters_warmup=0,
                        sampling=sampling)
            first_s = time.perf_counter() - t0
            rep = run_latency(engine, batch, inp, outl, num_iters=iters, num_iters_warmup=0, sampling=sampling,
                              model_name={"kl8": "kimi-linear-48b-8l", "kl27": "kimi-linear-48b",
                                          "k3-2l": "k3-2l", "k3-4l": "k3-4l"}[name],
                              weights=f"{quant}-experts-random" if quant else "bf16-random")
            full = rep["runs"]["full_s"]
            for r in rep["records"]:
                if outl == 2 and r["phase"] == "decode":
                    continue          # the 8K row measures prefill
                if outl != 2 and r["phase"] == "prefill" and batch == 1 and inp == 1024 and sampling == "top_p":
                    continue
                r.update(mode=mode, async_scheduling=engine.async_scheduling, start_s=round(start_s, 1),
                         capture_s=round(engine.runner.capture_s, 1),
                         first_short_run_s=round(first_s, 4), first_run_s=round(full[0], 4),
                         steady_run_s=round(statistics.median(full[1:] or full), 4))
                plan = getattr(engine, "cache_plan", None)
                if plan is not None:        # the quantized issue's K3 record: how many 8K-context requests fit
                    r.update(kv_cache_tokens=plan.num_tokens, kda_slots=plan.num_slots,
                             requests_8k_fit=min(plan.num_slots, plan.num_pages // -(-8192 // plan.page_size)),
                             requests_8k_by_memory=plan.requests_by_memory(8192))
                if name in LAYERS and r["phase"] == "decode":
                    r["step_ms_per_layer"] = r["step_ms"] / LAYERS[name]
                    r["floor_step_ms_per_layer"] = 1e3 * batch / r["floor_tokens_per_s"] / LAYERS[name]
                records.append(r)
                print(json.dumps(r), flush=True)
            extra.append({"mode": mode, "batch": batch, "sampling": sampling, "runs": rep["runs"]})
        if mode == "graphs" and "graphs-sync" in modes:
            continue                    # kept for the graphs-sync rows
        del engine
        gc.collect()              # the runner's graphs and the cache hold each other: free them before the next
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
    report = {"machine": machine_info(torch.device("cuda")), "command": " ".join(sys.argv), "records": records,
              "runs": extra}
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(ROWS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--only-eager", action="store_true")
    ap.add_argument("--skip-eager", action="store_true", help="graphs rows only (no eager engine)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="only the rows of these batch sizes")
    ap.add_argument("--quant", choices=["mxfp4", "nvfp4"], default=None, help="FP4 routed experts")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="the graph rows' async scheduling (default: the engine's, on with graphs)")
    ap.add_argument("--compare-async", action="store_true",
                    help="also run the decode rows with graphs and async scheduling off (mode graphs-sync)")
    ap.add_argument("--w4a16-path", choices=["auto", "tc", "gemv", "split"], default=None,
                    help="the W4A16 decode path at a few rows per expert (kernels/quant/w4a16.DECODE_PATH)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.w4a16_path:
        from kestrel.kernels.quant import w4a16
        w4a16.DECODE_PATH = args.w4a16_path
    rep = run(args.model, args.out, args.iters, args.only_eager, args.quant, args.async_scheduling,
              args.compare_async, args.skip_eager, args.batches)
    print(f"{'model':<20} {'mode':<11} {'phase':<8} {'batch':>5} {'sampling':<7} {'tok/s':>10} {'floor':>10} "
          f"{'ratio':>6} {'first/steady':>12}")
    for r in rep["records"]:
        print(f"{r['model']:<20} {r['mode']:<11} {r['phase']:<8} {r['batch']:>5} {r['sampling']:<7} "
              f"{r['tokens_per_s']:>10.0f} {r['floor_tokens_per_s']:>10.0f} {r['ratio_to_floor']:>6.2f} "
              f"{r['first_run_s'] / max(r['steady_run_s'], 1e-9):>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
