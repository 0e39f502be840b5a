"""Host time of one long prefill step (one prompt of `--prompt-len` random ids, max_tokens=1), phase by phase.

On an H200 an 8K-token prefill of the 8-layer Kimi Linear runs its forward with the host ahead of the GPU, so what
adds to the wall time is the host work before the first kernel (add_request, scheduling, the KDA slot reset, the
step's inputs and the target's StepPlan) and after the last (sampling, detokenizing, the output). That host code
is the same on any device, so this measures it on a tiny random model (CPU by default; `--device cuda` works
too, with the model of `--preset`): engine start, then per run a fresh prompt (no prefix-cache hit) and, with
prefix caching on, the same prompt once more (a hit: all but the last page restored).

Phases (ms, perf_counter): `add_request`; `schedule` (admission: slot reset, prefix lookup and hashing, pages);
`build` (the block-table flush and the step's inputs: `Engine._build_batch`, `StepInputs.fill`); `plan` (the sm_90
targets' `StepPlan` for the same batch, built here apart from the forward since the reference model builds none);
`forward` (the model: device compute on the CPU, left out of the host sums; `--forward stub` skips it); `sample` (sampling and the pages'
commit); `output` (append, stop checks, detokenize, the RequestOutput); `other` (the rest of `Engine.step`);
`host` (everything but the forward). cProfile runs over everything but the forward and prints the top functions.

    python benchmarks/prefill_host_profile.py                       # prefix caching on and off, 8192 tokens
    python benchmarks/prefill_host_profile.py --json out.json --runs 5 --prefix-caching off
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kestrel.catalog._step_plan import StepPlan                      # noqa: E402
from kestrel.config import EngineConfig                              # noqa: E402
from kestrel.llm import build_engine                                 # noqa: E402
from kestrel.models.kimi.checkpoint import preset_config             # noqa: E402
from kestrel.sampling_params import SamplingParams                   # noqa: E402

PHASES = ["add_request", "schedule", "build", "plan", "forward", "sample", "output", "other", "host"]


def model_dir(preset: str, layers: int | None, max_len: int) -> str:
    cfg = preset_config(preset, layers)
    text = cfg.get("text_config", cfg)
    text["model_max_length"] = max(text.get("model_max_length", 0), max_len)
    d = tempfile.mkdtemp(prefix="kestrel-prefill-host-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


class Probe:
    """Wraps the engine's runner: times the forward apart (with the profiler off during it) and builds the
    target's StepPlan for the batch first, timed as its own phase."""

    def __init__(self, engine, profiler: cProfile.Profile | None, stub: bool = False):
        self.engine, self.runner, self.profiler, self.stub = engine, engine.runner, profiler, stub
        self.plan_s = self.forward_s = 0.0
        self.profiling = False      # whether the profiler is on for this run (then it is paused over the forward)
        self.counter: OpCounter | None = None
        engine.runner = self

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def __call__(self, batch):
        t0 = time.perf_counter()
        if self.counter is not None:
            self.counter.phase = "plan"
        StepPlan(batch, self.engine.cache.page_size)
        if self.counter is not None:
            self.counter.phase = None       # the forward's ops are not counted
        t1 = time.perf_counter()
        if self.profiling:
            self.profiler.disable()
        try:
            if self.stub:       # zero logits of the right shape: the host phases without the model's compute
                out = torch.zeros(batch.logits_indices.shape[0], self.engine.config.vocab_size,
                                  device=batch.token_ids.device)
            else:
                out = self.runner(batch)
            if out.device.type == "cuda":
                torch.cuda.synchronize(out.device)
        finally:
            if self.profiling:
                self.profiler.enable()
        self.plan_s += t1 - t0
        self.forward_s += time.perf_counter() - t1
        return out


class OpCounter(TorchDispatchMode):
    """Counts the torch ops each host phase runs, views left out: on a GPU each is a kernel launch or a copy, some
    microseconds of host time apiece (on the CPU they are the work itself, so the phase's time there says less)."""

    WRAPPED = {"add_request": ("add_request",), "schedule": ("scheduler.schedule",),
               "build": ("_build_batch", "cache.flush_block_tables"), "sample": ("_sample",), "output": ("_append",)}

    def __init__(self):
        super().__init__()
        self.phase: str | None = None
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        rets = func._schema.returns
        view = bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write
        if self.phase is not None and not view:
            self.counts[self.phase] = self.counts.get(self.phase, 0) + 1
        return func(*args, **(kwargs or {}))

    def install(self, engine) -> list:
        """Label the engine's phases (instance attributes over its methods; `uninstall` removes them)."""
        done = []
        for phase, names in self.WRAPPED.items():
            for name in names:
                owner_name, _, attr = name.rpartition(".")
                owner = getattr(engine, owner_name) if owner_name else engine
                setattr(owner, attr, self._labelled(getattr(owner, attr), phase))
                done.append((owner, attr))
        return done

    def _labelled(self, fn, phase):
        def call(*a, **k):
            outer, self.phase = self.phase, phase
            try:
                return fn(*a, **k)
            finally:
                self.phase = outer
        return call


def count_ops(engine, probe: "Probe", prompt: list[int]) -> dict:
    """One run of `prompt` with every phase's torch ops counted."""
    counter = OpCounter()
    done = counter.install(engine)
    probe.counter = counter
    try:
        with counter:
            one_run(engine, probe, prompt, None)
    finally:
        probe.counter = None
        for owner, attr in done:
            delattr(owner, attr)
    return counter.counts


def one_run(engine, probe: Probe, prompt: list[int], profiler: cProfile.Profile | None) -> dict:
    """One request to its end (max_tokens=1: one prefill step, a longer prompt than the budget in several)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    tm0 = dict(engine.timing)
    probe.plan_s = probe.forward_s = 0.0
    probe.profiling = profiler is not None
    if profiler is not None:
        profiler.enable()
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    t1 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    t2 = time.perf_counter()
    if profiler is not None:
        profiler.disable()
    probe.profiling = False
    assert len(engine.final_output(rid).token_ids) == 1
    engine.release(rid)
    d = {k: engine.timing[k] - tm0[k] for k in ("schedule", "build", "model", "sample", "output")}
    ms = {"add_request": t1 - t0, "schedule": d["schedule"], "build": d["build"], "plan": probe.plan_s,
          "forward": probe.forward_s, "sample": d["sample"], "output": d["output"]}
    # engine.timing's "model" span holds our plan and forward; the rest of step() is "other"
    ms["other"] = (t2 - t1) - sum(d.values())
    ms["host"] = (t2 - t0) - probe.forward_s
    return {k: round(1e3 * v, 3) for k, v in ms.items()}


def run_case(args, prefix_caching: bool) -> dict:
    path = model_dir(args.preset, args.layers, args.prompt_len + 64)
    ec = EngineConfig(model=path, device=args.device, dtype="auto", load_format="random",
                      max_model_len=args.prompt_len + 64, max_num_seqs=4, max_num_batched_tokens=args.budget,
                      kv_cache_tokens=4 * (args.prompt_len + 64) if args.device == "cpu" else None,
                      enable_prefix_caching=prefix_caching, modeling="auto")
    t0 = time.perf_counter()
    engine = build_engine(ec)
    start_s = time.perf_counter() - t0
    profiler = cProfile.Profile() if args.profile else None
    probe = Probe(engine, profiler, args.forward == "stub")
    rng = random.Random(args.seed)
    vocab = engine.config.vocab_size

    def fresh() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(args.prompt_len)]

    one_run(engine, probe, fresh(), None)        # warm-up (first-call costs out of the table)
    if prefix_caching:
        engine.cache.drop_prefix_cache()
    rows = {"fresh": [], "prefix_hit": []} if prefix_caching else {"fresh": []}
    for _ in range(args.runs):
        p = fresh()
        rows["fresh"].append(one_run(engine, probe, p, profiler if args.profile else None))
        if prefix_caching:
            rows["prefix_hit"].append(one_run(engine, probe, p, None))
            engine.cache.drop_prefix_cache()
    p = fresh()
    ops = {"fresh": count_ops(engine, probe, p)}
    if prefix_caching:
        ops["prefix_hit"] = count_ops(engine, probe, p)
    out = {"prefix_caching": prefix_caching, "start_s": round(start_s, 2), "cases": {}}
    for name, runs in rows.items():
        med = {k: round(statistics.median(r[k] for r in runs), 3) for k in PHASES}
        out["cases"][name] = {"median_ms": med, "runs_ms": runs, "torch_ops": ops[name]}
    if profiler is not None:
        out["profile"] = top_functions(profiler, args.top, args.runs)
    return out


def top_functions(profiler: cProfile.Profile, n: int, runs: int) -> list[dict]:
    """The `n` functions of most own time (us per run), with their cumulative time: pstats' table rounds to ms."""
    rows = []
    for (fn, line, name), (_, calls, tt, ct, _) in pstats.Stats(profiler).stats.items():
        where = f"{os.path.relpath(fn) if fn.startswith(os.getcwd()) else os.path.basename(fn)}:{line}({name})"
        rows.append({"function": where, "calls": calls // runs, "own_us": round(1e6 * tt / runs, 1),
                     "cum_us": round(1e6 * ct / runs, 1)})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:n]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--preset", default="kimi-linear-tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--forward", choices=["model", "stub"], default="model",
                    help="stub: skip the model (zero logits); the host phases are the same, the runs much faster "
                         "on the CPU (the tiny model's 8K forward takes ~25 s there)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-caching", choices=["on", "off", "both"], default="both")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="no cProfile (its overhead out)")
    ap.add_argument("--top", type=int, default=25, help="cProfile rows printed")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: host ops do not contend with other work on a small machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.prefix_caching]
    # the timed numbers come from runs without the profiler when it is on (its overhead inflates Python code)
    report = {"prompt_len": args.prompt_len, "device": args.device, "preset": args.preset, "runs": args.runs,
              "results": []}
    for pc in modes:
        timed = run_case(argparse.Namespace(**{**vars(args), "profile": False}), pc)
        if args.profile:
            timed["profile"] = run_case(args, pc)["profile"]
        report["results"].append(timed)
    print(f"{'prefix cache':<13} {'case':<11} " + " ".join(f"{p:>11}" for p in PHASES))
    for res in report["results"]:
        for name, case in res["cases"].items():
            m = case["median_ms"]
            print(f"{'on' if res['prefix_caching'] else 'off':<13} {name:<11} " +
                  " ".join(f"{m[p]:>11.3f}" for p in PHASES))
    print("\ntorch ops per phase (views left out; on a GPU each a launch or copy)")
    for res in report["results"]:
        for name, case in res["cases"].items():
            ops = case["torch_ops"]
            print(f"{'on' if res['prefix_caching'] else 'off':<13} {name:<11} " +
                  " ".join(f"{p}={ops[p]}" for p in PHASES if p in ops))
    if args.profile:
        for res in report["results"]:
            print(f"\ncProfile, prefix caching {'on' if res['prefix_caching'] else 'off'}, per fresh run "
                  "(forward excluded; its overhead inflates Python-heavy rows)")
            print(f"{'own us':>9} {'cum us':>9} {'calls':>6}  function")
            for r in res["profile"]:
                print(f"{r['own_us']:>9.1f} {r['cum_us']:>9.1f} {r['calls']:>6}  {r['function']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
