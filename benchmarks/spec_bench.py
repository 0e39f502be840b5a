"""Speculative decoding speed on one GPU: plain decode step, draft and verify step times, the acceptance measured,
the end-to-end speedup the policy's formula predicts, and the batch size where the policy turns speculation off.

    python3 benchmarks/spec_bench.py --out $OUT/spec_k3.json            # K3 layers + real-width drafter, H200
    python3 benchmarks/spec_bench.py --quick --out $OUT/spec_k3.json    # the same in under 5 minutes
    python3 benchmarks/spec_bench.py --device cpu --tiny --out spec.json  # tiny model on the CPU (CI)

GPU: two real-width K3 MoE layers (one KDA, one MLA: `h200_fastpath.py --model k3-2l`'s checkpoint, random load,
the bf16 sm_90 target), and a random DSpark drafter at the target's widths (its MLA widths, the target's dense MLP
width, Markov rank 256, reading both target layers; `--draft-layers`), K = 7 (the public recipes) and K = 3. CPU
`--tiny`: the tiny K3 reference model in fp32 and a random tiny drafter (`--drafter DIR` takes another, e.g. one
`kestrel train-drafter` wrote).

Per K and batch size B, B requests of `--context` random prompt tokens are prefilled, then the engine runs plain
decode steps (speculation off for the step) and speculative steps (every request drafts K and verifies K + 1), with
`runner.timed` on (CUDA events; the model and sampling phases together span the device time, since the sampled
ids' copy waits for it); each figure is the median over `--steps` steps after
`--warmup` of each kind. The figures are the policy's own (spec/policy.py):
- `decode_ms`: a plain decode step, model (graph replay) + the drafter's observe + sampling;
- `verify_ms`: a verify step, model (verify graph replay) + observe + acceptance + commit_verify;
- `draft_ms`: the drafter's propose as served: padded to its verify bucket and replayed from the propose CUDA
  graph (block forward over the pages, LM head, Markov loop, draws), timed with CUDA events around the propose call
  (its two input copies and the replay; the host's read of the drafts is not in it); `draft_eager_ms`: the same
  padded propose run eagerly (the propose graphs set aside: what they save), timed the same way;
  `draft_host_ms`: the engine's draft phase on the host (the propose plus waiting for the drafts' copy back);
  `propose_graph_replays`: replays during the timed speculative steps (0: the propose ran eagerly);
- `verify_eager_ms`: the same verify step with the verify graphs set aside (what graphs save);
- `observe_ms`: of decode_ms, the drafter's context write where it runs eagerly (an engine without speculation does
  not pay it); 0 where the step graphs run it inside the replay (`observe_in_graphs`, CUDA): then it is part of
  decode_ms and verify_ms and not timed apart;
- `accept_len`: tokens per verify block (accepted drafts + 1), measured. A random drafter's drafts are almost never
  the target's greedy token, so it is ~1.0: the records give the speedup at the measured acceptance and, from the
  same times, at the public DSpark acceptances (4.7 tokens on code, 2.6 on creative text):
  `speedup(L) = L / L*` with `L* = (draft_ms + verify_ms) / decode_ms` the policy's break-even (`break_even`).
- `policy_off_above_batch`: per acceptance, the largest measured B at which L >= L*(B) (speculation still on),
  or 0 when it is off everywhere measured; the policy turns it off at the next measured batch size.
`--profile` adds `kernels`: device time by kernel of the propose graph alone and of whole speculative steps.
JSON `{machine, command, note, records, policy_off_above_batch}`; each record has the fast-path issue's fields
(model, weights, phase, batch, context, sampling, tokens_per_s = speculative tokens per second at the measured
acceptance, floor_tokens_per_s = the plain decode floor) plus accept_len, draft_ms, verify_ms, decode_ms and the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from kestrel.bench.latency import floor_tokens_per_s, machine_info   # noqa: E402
from kestrel.config import EngineConfig, ModelConfig, SpeculativeConfig  # noqa: E402
from kestrel.llm import build_engine                                  # noqa: E402
from kestrel.sampling_params import SamplingParams                   # noqa: E402
from kestrel.spec.dspark_config import tiny_config                    # noqa: E402
from kestrel.spec.policy import SpecPolicy, size_bucket               # noqa: E402

PUBLIC_ACCEPT = {"code": 4.7, "creative": 2.6}     # DSpark on K3, vLLM's published tokens per step
MARKOV_RANK = 256
NOTE = ("random drafter: its drafts almost never match the target's greedy token, so accept_len is ~1 and "
        "speedup_measured < 1; speedup_at_code / speedup_at_creative apply the policy's formula to the same "
        "measured times at the public DSpark acceptances (4.7 / 2.6 tokens per step). Random weights route the "
        "K + 1 tokens of a block to nearly independent experts, so a verify step reads up to K + 1 times the "
        "experts of a decode step; a trained router's neighbouring tokens share experts more, so verify_ms here "
        "is an upper side of a trained model's")


def target_dir(tiny: bool) -> str:
    if tiny:
        from kestrel.models.kimi.checkpoint import make_checkpoint
        d = tempfile.mkdtemp(prefix="kestrel-spec-tiny-")
        make_checkpoint("k3-tiny", d, seed=0, dtype=torch.float32, with_tokenizer=False)
        return d
    from h200_fastpath import model_dir
    return model_dir("k3-2l")


def write_drafter(config: ModelConfig, block_size: int, layers: int, device: str, dtype: torch.dtype,
                  tiny: bool) -> str:
    """A random drafter folder at the target's widths: real width on the GPU (the target's MLA widths and dense MLP
    width, Markov rank 256), tiny_config's on the CPU. Drawn on `device`, saved through the checkpoint writer."""
    from kestrel.spec.dspark_checkpoint import random_drafter, save_drafter
    dc = tiny_config(config, block_size=block_size, num_layers=layers)
    if not tiny:
        dc = dataclasses.replace(dc, intermediate_size=config.intermediate_size, markov_rank=MARKOV_RANK)
    d = tempfile.mkdtemp(prefix="kestrel-drafter-")
    model = random_drafter(dc, config, dtype, device, seed=0)
    save_drafter(model, d)
    del model
    return d


def build(path: str, drafter: str, k: int, args):
    cuda = args.device == "cuda"
    max_len = args.context + (args.warmup + args.steps) * (k + 1) * 3 + 2 * k + 16
    spec = {"method": "dspark", "model": drafter, "num_speculative_tokens": k, "enforce": True}
    # pools for exactly the requests measured: the rest of the card stays free for the eager drafter's activations
    kw = dict(kv_cache_tokens=max(args.batches) * (max_len + 16) + 64)
    if cuda:   # the allocator cap: two K3 MoE layers + embeddings + the drafter are ~118 GiB of bf16 weights
        kw["gpu_memory_utilization"] = 0.95
    ec = EngineConfig(model=path, dtype="bfloat16" if cuda else "float32", device=args.device,
                      load_format="random" if cuda else "auto", modeling="require" if cuda else "off",
                      max_num_seqs=max(args.batches), max_num_batched_tokens=max(4096, max(args.batches) * (k + 1)),
                      max_model_len=max_len, enable_prefix_caching=False, speculative_config=spec, **kw)
    t0 = time.perf_counter()
    engine = build_engine(ec)
    _sync(engine)
    return engine, time.perf_counter() - t0, max_len


def with_k(engine, k: int):
    """The engine over the same model and cache (no second weight load) with K = k: a fresh proposer (the same
    drafter folder), policy, input buffers and graphs (captured again, for blocks of k + 1)."""
    from kestrel.runtime.engine import Engine
    from kestrel.spec import make_proposer
    spec = dataclasses.replace(engine.engine_config.speculative_config, num_speculative_tokens=k)
    ec = dataclasses.replace(engine.engine_config, speculative_config=spec)
    model, cache, config = engine.model, engine.cache, engine.config
    engine.runner.graphs.clear()
    engine.runner.verify_graphs.clear()
    engine.proposer.graphs.clear()
    del engine
    gc.collect()
    if cache.device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    proposer = make_proposer(spec, config, cache.device, cache.dtype)
    proposer.share_target(model)
    engine = Engine(config, ec, model, cache, None, proposer)
    _sync(engine)
    return engine, time.perf_counter() - t0


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _steps(engine, n: int, speculate: bool) -> list[dict]:
    """n engine steps, each with speculation on (every decoding request verifies K drafts) or off; per step the
    wall time, the policy's times (model + sampling / acceptance, draft) and the tokens emitted."""
    sched, eng_policy, proposer = engine.scheduler, engine.policy, engine.proposer
    sched.draft_len = eng_policy.draft_len if speculate else None
    observe, spent = proposer.observe, []
    propose, drafts = proposer.propose, []
    cuda = engine.device.type == "cuda"

    def timed_propose(*a):            # device time of the propose (CUDA events), host time on the CPU
        if cuda:
            ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev[0].record()
            block = propose(*a)
            ev[1].record()
            drafts.append(ev)
        else:
            t0 = time.perf_counter()
            block = propose(*a)
            drafts.append(time.perf_counter() - t0)
        return block
    proposer.propose = timed_propose

    def timed_observe(*a):            # the drafter's context write, inside the model phase of every step
        _sync(engine)
        t0 = time.perf_counter()
        observe(*a)
        _sync(engine)
        spent.append(time.perf_counter() - t0)
    proposer.observe = timed_observe
    out = []
    for _ in range(n):
        t0, st0 = dict(engine.timing), engine.spec_stats.as_dict()
        _sync(engine)
        w0 = time.perf_counter()
        emitted = sum(len(o.delta_token_ids) for o in engine.step())
        _sync(engine)
        wall = time.perf_counter() - w0
        d = {k: engine.timing[k] - t0.get(k, 0.0) for k in engine.timing}
        st = engine.spec_stats.as_dict()
        draft = sum(e[0].elapsed_time(e[1]) / 1e3 for e in drafts) if cuda else sum(drafts)
        out.append({"wall": wall, "model": d["model"] + d["sample"], "draft": draft,
                    "draft_host": d.get("draft", 0.0), "emitted": emitted,
                    "blocks": st["verify_blocks"] - st0["verify_blocks"],
                    "accepted": st["accepted_tokens"] - st0["accepted_tokens"], "observe": sum(spent)})
        spent.clear()
        drafts.clear()
    sched.draft_len = eng_policy.draft_len
    proposer.observe = observe
    del proposer.propose              # the class's method again
    return out


def measure(engine, batch: int, k: int, args, max_len: int) -> dict:
    rng = random.Random(batch * 131 + k)
    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=max_len - args.context - 1, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request([rng.randrange(3, vocab) for _ in range(args.context)], params)
            for _ in range(batch)]
    engine.runner.timed = False
    while engine.scheduler.waiting or not all(r.is_decoding for r in engine.scheduler.running):
        engine.step()                                        # the prefills
    engine.runner.timed = True
    runner = engine.runner
    _steps(engine, args.warmup, False)
    _steps(engine, args.warmup, True)
    proposer = engine.proposer
    replays0, propose0 = runner.verify_replays, proposer.replays
    dec = _steps(engine, args.steps, False)
    ver = _steps(engine, args.steps, True)
    replayed, proposed = runner.verify_replays - replays0, proposer.replays - propose0
    saved, runner.verify_graphs = runner.verify_graphs, {}
    eager = _steps(engine, max(3, args.steps // 4), True) if saved else []
    runner.verify_graphs = saved
    saved, proposer.graphs = proposer.graphs, {}
    draft_eager = _steps(engine, max(3, args.steps // 4), True) if saved else []
    proposer.graphs = saved
    kernels = (profile_kernels(engine, batch, max(3, args.steps // 4))
               if args.profile and engine.device.type == "cuda" else None)
    for r in rids:
        engine.abort(r)
        engine.release(r)
    engine.runner.timed = False

    def med(rows, key):
        return statistics.median(r[key] for r in rows)
    blocks = sum(r["blocks"] for r in ver)
    accept_len = (sum(r["accepted"] for r in ver) + blocks) / max(1, blocks)
    decode_s, verify_s, draft_s = med(dec, "model"), med(ver, "model"), med(ver, "draft")
    policy = SpecPolicy(SpeculativeConfig("dspark", k))          # the policy's own break-even from these times
    policy.record_step(False, batch, decode_s)
    policy.record_step(True, batch, verify_s, draft_s)
    star = policy.break_even(size_bucket(batch))
    spec_tok_s = sum(r["emitted"] for r in ver) / sum(r["wall"] for r in ver)
    plain_tok_s = sum(r["emitted"] for r in dec) / sum(r["wall"] for r in dec)
    c = engine.config
    elt = torch.empty((), dtype=engine.cache.dtype).element_size()
    ctx = args.context + args.steps * (k + 1)       # about the middle of the timed steps
    rec = {"model": args.model_name, "weights": args.weights, "phase": "decode", "batch": batch,
           "context": args.context, "sampling": "greedy", "num_speculative_tokens": k,
           "tokens_per_s": spec_tok_s, "plain_tokens_per_s": plain_tok_s,
           "floor_tokens_per_s": floor_tokens_per_s(c, "decode", batch, ctx, 1, elt),
           "accept_len": accept_len, "decode_ms": 1e3 * decode_s, "verify_ms": 1e3 * verify_s,
           "draft_ms": 1e3 * draft_s, "draft_eager_ms": 1e3 * med(draft_eager, "draft") if draft_eager else None,
           "draft_host_ms": 1e3 * med(ver, "draft_host"),
           "verify_eager_ms": 1e3 * med(eager, "model") if eager else None,
           "observe_ms": 1e3 * med(dec, "observe"),
           "decode_step_ms": 1e3 * med(dec, "wall"), "spec_step_ms": 1e3 * med(ver, "wall"),
           "verify_over_decode": verify_s / decode_s, "break_even": star,
           "speedup_measured": spec_tok_s / plain_tok_s, "speedup_predicted": accept_len / star,
           **{f"speedup_at_{name}": L / star for name, L in PUBLIC_ACCEPT.items()},
           "verify_graph_replays": replayed, "propose_graph_replays": proposed, "verify_steps": len(ver)}
    rec["ratio_to_floor"] = rec["tokens_per_s"] / rec["floor_tokens_per_s"]
    rec = {key: round(v, 4) if isinstance(v, float) else v for key, v in rec.items()}
    if kernels is not None:
        rec["kernels"] = kernels
    return rec


def profile_kernels(engine, batch: int, steps: int, top: int = 15) -> dict:
    """--profile: device microseconds by kernel (CUPTI sees the kernels of graph replays) of the batch's propose
    graph replayed alone (per replay) and of whole speculative steps (per step: propose, verify, acceptance,
    commit), with each side's total and launch count."""
    from decode_profile import kernel_times
    proposer = engine.proposer
    n = proposer.bucket_for(batch) if getattr(proposer, "buckets", None) else None
    graph = proposer.graphs.get(n) if n is not None else None

    def table(fn, per: int) -> dict:
        ks, _ = kernel_times(fn)
        rows = sorted(((name[:100], us / per, cnt / per) for name, (us, cnt) in ks.items()), key=lambda r: -r[1])
        return {"us": round(sum(r[1] for r in rows), 1), "launches": round(sum(r[2] for r in rows), 1),
                "top": [{"kernel": k, "us": round(us, 1), "launches": round(c, 1)} for k, us, c in rows[:top]]}
    out = {}
    if graph is not None:
        out["propose"] = table(lambda: [graph.replay() for _ in range(10)], 10)
    out["spec_step"] = table(lambda: _steps(engine, steps, True), steps)
    return out


def policy_off(records: list[dict]) -> dict:
    """Per K and acceptance (measured, public code / creative): the largest measured batch with L >= L*(B) (the
    policy speculates there), 0 when it is off at every measured batch."""
    out = {}
    for k in sorted({r["num_speculative_tokens"] for r in records}):
        rows = sorted((r for r in records if r["num_speculative_tokens"] == k), key=lambda r: r["batch"])
        accepts = {"measured": statistics.fmean(r["accept_len"] for r in rows), **PUBLIC_ACCEPT}
        out[f"K{k}"] = {name: max([r["batch"] for r in rows if L >= r["break_even"]], default=0)
                        for name, L in accepts.items()}
    return out


def run(args) -> dict:
    cuda = args.device == "cuda"
    path = target_dir(args.tiny)
    config = ModelConfig.from_dir(path)
    records = []
    drafter = args.drafter or write_drafter(config, max(args.k), args.draft_layers, args.device,
                                            torch.bfloat16 if cuda else torch.float32, args.tiny)
    engine = None
    for k in args.k:
        if engine is None:      # max_len of the largest K: the cache serves every K after it
            engine, start_s, max_len = build(path, drafter, max(args.k), args)
        if engine.proposer.num_tokens != k:
            engine, start_s = with_k(engine, k)
        runner = engine.runner
        print(f"[K {k}] engine ready in {start_s:.1f} s: {len(runner.graphs)} decode + {len(runner.verify_graphs)} "
              f"verify + {len(engine.proposer.graphs)} propose graphs in {runner.capture_s:.1f} s, "
              f"{runner.graph_bytes / 2 ** 20:.0f} MiB", flush=True)
        for b in args.batches:
            rec = measure(engine, b, k, args, max_len)
            rec.update(start_s=round(start_s, 1), capture_s=round(runner.capture_s, 1),
                       graph_mib=round(runner.graph_bytes / 2 ** 20, 1))
            records.append(rec)
            print(json.dumps(rec), flush=True)
        del runner
    report = {"machine": machine_info(torch.device(args.device)), "command": " ".join(sys.argv), "note": NOTE,
              "records": records, "policy_off_above_batch": policy_off(records)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny K3 reference model (CPU CI)")
    ap.add_argument("--quick", action="store_true", help="fewer steps and batch sizes (H200: under 5 minutes)")
    ap.add_argument("--k", type=int, nargs="+", default=None, help="draft tokens per step (default 7 3)")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--context", type=int, default=None, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=None, help="timed steps of each kind")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--drafter", default=None, help="a DSpark drafter folder instead of a random one")
    ap.add_argument("--profile", action="store_true", help="also device time by kernel: propose graph, spec step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu" and not args.tiny:
        ap.error("--device cpu runs the tiny model only: add --tiny")
    if args.tiny:
        d = dict(k=[3], batches=[1, 4], context=24, steps=4, warmup=1)
    elif args.quick:
        d = dict(k=[7, 3], batches=[1, 8, 32], context=1024, steps=12, warmup=3)
    else:
        d = dict(k=[7, 3], batches=[1, 2, 4, 8, 16, 32, 64], context=1024, steps=40, warmup=5)
    for key, v in d.items():
        if getattr(args, key) is None:
            setattr(args, key, v)
    args.model_name = "k3-tiny" if args.tiny else "k3-2l"
    args.weights = "fp32-random" if args.tiny else "bf16-random"
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("spec_bench: no CUDA device; run with --device cpu --tiny", file=sys.stderr)
        return 2
    rep = run(args)
    print(f"{'K':>2} {'batch':>5} {'accept':>6} {'decode ms':>9} {'draft ms':>8} {'d eager':>8} {'verify ms':>9} "
          f"{'eager ms':>8} {'L*':>5} {'x meas':>6} {'x code':>6} {'x crea':>6}")

    def ms(v):
        return f"{v:8.2f}" if v is not None else f"{'-':>8}"
    for r in rep["records"]:
        print(f"{r['num_speculative_tokens']:>2} {r['batch']:>5} {r['accept_len']:>6.2f} {r['decode_ms']:>9.2f} "
              f"{r['draft_ms']:>8.2f} {ms(r['draft_eager_ms'])} {r['verify_ms']:>9.2f} {ms(r['verify_eager_ms'])} "
              f"{r['break_even']:>5.2f} "
              f"{r['speedup_measured']:>6.2f} {r['speedup_at_code']:>6.2f} {r['speedup_at_creative']:>6.2f}")
    print("policy: speculation on up to batch", json.dumps(rep["policy_off_above_batch"]))
    for r in rep["records"]:
        for part, t in r.get("kernels", {}).items():
            print(f"\n[K {r['num_speculative_tokens']} batch {r['batch']}] {part}: {t['us']:.0f} us of kernels, "
                  f"{t['launches']:.0f} launches")
            for k in t["top"]:
                print(f"  {k['us']:8.1f} us x{k['launches']:5.1f}  {k['kernel'][:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
