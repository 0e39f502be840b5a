"""Offline throughput: N requests served concurrently (continuous batching) against the same N requests served one
after another, on one engine, in one run. The ratio of the two token rates is the figure that counts.

Both arms run the same prompts (random token ids, no shared prefixes) with greedy decoding, `ignore_eos` and a fixed
`max_tokens`, so they do exactly the same model work and must produce the same tokens (checked). The prefix cache
is emptied before each arm, so neither arm reuses the other's prompts.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from kestrel.sampling_params import SamplingParams

TARGET_RATIO = 6.0


@dataclass
class ArmResult:
    name: str
    wall_s: float
    requests: int
    prompt_tokens: int
    output_tokens: int
    steps: int
    output_tok_per_s: float
    requests_per_s: float
    mean_ttft_s: float
    mean_latency_s: float
    step_time_s: dict = field(default_factory=dict)     # engine time per phase (schedule, build, model, sample...)
    runs_wall_s: list = field(default_factory=list)     # every repeat; wall_s is their median
    spec: dict | None = None                            # speculation over this arm (spec_delta), if on


def make_workload(num_requests: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts of random ids, lengths uniform in [prompt_len / 2, prompt_len]."""
    rng = random.Random(seed)
    lo = max(1, prompt_len // 2)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(lo, prompt_len))] for _ in range(num_requests)]


def spec_stats(engine) -> dict | None:
    """The engine's speculation counters (None when it does not speculate)."""
    return engine.stats().get("spec")


def spec_delta(after: dict | None, before: dict | None) -> dict | None:
    """Speculation over a window of a run: counters, acceptance-length histogram and time split of `after` minus
    `before`, and the rates recomputed over the window."""
    if after is None:
        return None
    before = before or {}
    keys = ("verify_blocks", "draft_tokens", "accepted_tokens", "verify_steps", "decode_steps", "draft_s",
            "verify_s", "decode_s")
    d = {k: round(after[k] - before.get(k, 0), 6) for k in keys}
    hb = before.get("accept_len_hist", {})
    d["accept_len_hist"] = {k: v - hb.get(k, 0) for k, v in after["accept_len_hist"].items()}
    d["num_speculative_tokens"] = after["num_speculative_tokens"]
    blocks = d["verify_blocks"]
    d["mean_accept_len"] = (d["accepted_tokens"] + blocks) / blocks if blocks else 0.0
    d["accepted_per_step"] = d["accepted_tokens"] / d["verify_steps"] if d["verify_steps"] else 0.0
    d["acceptance_rate"] = d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0
    return d


def spec_line(d: dict | None) -> str:
    """One line of a benchmark table: acceptance and where the time went."""
    if not d:
        return ""
    hist = " ".join(f"{k}:{v}" for k, v in d["accept_len_hist"].items())
    return (f"speculation (K={d['num_speculative_tokens']}): accept length {d['mean_accept_len']:.2f} tokens/block, "
            f"{d['accepted_per_step']:.2f} accepted tokens/step, {d['verify_blocks']} blocks in {d['verify_steps']} "
            f"verify steps + {d['decode_steps']} plain decode steps; draft {d['draft_s']:.3f} s / verify "
            f"{d['verify_s']:.3f} s / decode {d['decode_s']:.3f} s; histogram {hist}")


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def _phase_times(engine) -> dict:
    return dict(getattr(engine, "timing", {}) or {})


def _delta(after: dict, before: dict) -> dict:
    return {k: round(after[k] - before.get(k, 0.0), 4) for k in after}


def run_arm(engine, name: str, prompts: list[list[int]], params: SamplingParams) -> tuple[ArmResult, list[list[int]]]:
    engine.cache.drop_prefix_cache()
    steps0, t_phase0, spec0 = engine.num_steps, _phase_times(engine), spec_stats(engine)
    t0 = time.perf_counter()
    rids = []
    if name == "concurrent":
        rids = [engine.add_request(p, params) for p in prompts]
        _drain(engine)
    else:
        for p in prompts:
            rids.append(engine.add_request(p, params))
            _drain(engine)
    wall = time.perf_counter() - t0
    outs = [engine.final_output(r) for r in rids]
    for r in rids:
        engine.release(r)
    n_out = sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics.first_token - o.metrics.arrival for o in outs]
    lat = [o.metrics.finished - o.metrics.arrival for o in outs]
    res = ArmResult(name=name, wall_s=wall, requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
                    output_tokens=n_out, steps=engine.num_steps - steps0, output_tok_per_s=n_out / wall,
                    requests_per_s=len(prompts) / wall, mean_ttft_s=statistics.fmean(ttft),
                    mean_latency_s=statistics.fmean(lat), step_time_s=_delta(_phase_times(engine), t_phase0),
                    runs_wall_s=[wall], spec=spec_delta(spec_stats(engine), spec0))
    return res, [o.token_ids for o in outs]


def run_throughput(engine, num_requests: int = 32, prompt_len: int = 32, max_tokens: int = 64, seed: int = 0,
                   repeat: int = 1) -> dict:
    """Both arms, `repeat` times each (interleaved); each arm reports its median run. Returns the JSON report."""
    prompts = make_workload(num_requests, prompt_len, engine.config.vocab_size, seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # warm-up: first-call costs (allocator, lazy init) belong to neither arm
    rid = engine.add_request(prompts[0][:8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    _drain(engine)
    engine.release(rid)
    runs: dict[str, list[ArmResult]] = {"sequential": [], "concurrent": []}
    tokens: dict[str, list] = {}
    for _ in range(max(1, repeat)):
        for name in ("sequential", "concurrent"):
            res, toks = run_arm(engine, name, prompts, params)
            runs[name].append(res)
            tokens.setdefault(name, toks)
    arms = {}
    for name, rs in runs.items():
        best = sorted(rs, key=lambda r: r.wall_s)[len(rs) // 2]      # the median run
        best.runs_wall_s = [round(r.wall_s, 4) for r in rs]
        arms[name] = best
    ratio = arms["concurrent"].output_tok_per_s / arms["sequential"].output_tok_per_s
    return {
        "benchmark": "throughput",
        "config": {"num_requests": num_requests, "prompt_len": prompt_len, "max_tokens": max_tokens, "seed": seed,
                   "repeat": repeat, "model": engine.engine_config.model, "arch": engine.config.arch,
                   "device": str(engine.device), "dtype": str(engine.cache.dtype).replace("torch.", ""),
                   "page_size": engine.cache.page_size, "max_num_seqs": engine.scheduler.max_num_seqs,
                   "max_num_batched_tokens": engine.scheduler.budget,
                   "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                   "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()},
        "arms": {k: asdict(v) for k, v in arms.items()},
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "target_met": ratio >= TARGET_RATIO,
        "outputs_match": tokens["sequential"] == tokens["concurrent"],
    }


def format_table(report: dict) -> str:
    arms = report["arms"]
    cols = ["arm", "wall s", "out tok", "tok/s", "req/s", "steps", "TTFT s", "latency s", "model s", "other s"]
    rows = []
    for name in ("sequential", "concurrent"):
        a = arms[name]
        model_s = a["step_time_s"].get("model", 0.0)
        rows.append([name, f"{a['wall_s']:.2f}", str(a["output_tokens"]), f"{a['output_tok_per_s']:.1f}",
                     f"{a['requests_per_s']:.2f}", str(a["steps"]), f"{a['mean_ttft_s']:.3f}",
                     f"{a['mean_latency_s']:.3f}", f"{model_s:.2f}", f"{a['wall_s'] - model_s:.2f}"])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths)))
    c = report["config"]
    out = [f"throughput: {c['num_requests']} requests, prompts <= {c['prompt_len']} tokens, {c['max_tokens']} new "
           f"tokens each, {c['arch']} on {c['device']} ({c['dtype']}, {c['torch_threads']} threads)",
           line(cols), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    for name in ("sequential", "concurrent"):
        if arms[name].get("spec"):
            out.append(f"{name} {spec_line(arms[name]['spec'])}")
    out.append(f"concurrent / sequential = {report['ratio']:.2f}x (target >= {report['target_ratio']:.0f}x: "
               f"{'met' if report['target_met'] else 'NOT met'}); outputs match: {report['outputs_match']}")
    return "\n".join(out)


def write_report(report: dict, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
