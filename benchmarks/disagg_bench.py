"""Disaggregated serving (1P1D) against aggregated serving, and the state transport's bandwidth.

Two model servers are started at once: a context server and a generation server (on a GPU they share it, each
capped by --gpu-memory-utilization), and a frontend in front of them. Same random prompts (fresh ids per phase, so
no prefix-cache hits), `kestrel bench serve`'s load generator:
1. Aggregated: the load against the context server's own `/v1/completions` (a context server is an ordinary
   server with the hand-off routes added; the generation server sits idle meanwhile).
2. 1P1D: the load against the frontend; the frontend's median TTFT split (route, queue, prefill, transfer, first
   decode) and the hand-off's effective rate (state bytes / transfer time, relay hop included).
Each phase runs a short warm-up first (JIT of mixed steps must not land in the timed run).
3. Transport: a packed state of each `--state-mb` size (and of the size one request's state had in phase 2)
   pulled from a `StateServer` by a `StateClient` in this process over loopback, ZMQ and (where `nixl` imports)
   NIXL, next to memcpy of the same bytes (host to host; on a GPU also device to host and host to device: the
   export and import copies of the host-staged ZMQ path, device -> host -> device) and the checksum's rate.

Every wait has a timeout inside `--budget-s` (the whole run, start-up included); past it, or at SIGTERM, the servers
are stopped and the JSON holds what was measured, with `incomplete` saying why. The JSON is the fast-path schema:
`{machine, command, records}` (a record per phase: `phase` serve / transport, `mode` aggregated / 1p1d).

CPU (a tiny model made here):  python benchmarks/disagg_bench.py --out benchmarks/results/disagg_cpu.json
One H200 (kl8: the real-width 8-layer Kimi Linear 48B, random bf16 weights, two servers sharing the GPU):
    python3 benchmarks/disagg_bench.py --preset h200 --out $OUT/disagg_h200.json
(`bash benchmarks/gpu_run.sh disagg` does that after installing the carried wheels). The model servers need
fastapi, uvicorn and pyzmq there, which the image lacks: `bash benchmarks/serve_wheels.sh` puts their wheels in .whl.
Start-up: both servers build random weights on the GPU and capture decode graphs at once (the fast-path bench's kl8
started in 36 s warm, 156 s with cold Triton caches); if that leaves too little of the budget, `--enforce-eager`
skips the capture (the record's `enforce_eager` says which ran).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)

from h200_fastpath import ROWS as FASTPATH_MODELS, model_dir as fastpath_model_dir  # noqa: E402

SERVER_PACKAGES = ("fastapi", "starlette", "pydantic", "uvicorn", "zmq", "yaml", "httpx")
PRESETS = {
    # one H200: ~25.8 GiB of bf16 weights per server, 0.4 of the card each; decode graphs on (--enforce-eager would
    # save their ~30 s capture per server, at decode rates that are not the served ones); 48 sequences per server
    # so that a state arriving at the generation server while 32 streams run always finds a free slot
    "h200": dict(model="kl8", device="cuda", dtype="bfloat16", load_format="random", modeling="require",
                 gpu_memory_utilization=0.4, max_model_len=2048, max_num_seqs=48, input_len=1024, output_len=128,
                 num_prompts=256, concurrency=32, kv_transport="zmq", state_mb="16,64", repeat=3, budget_s=400.0,
                 keep_logs=True),
}
DEFAULTS = dict(model=None, device="cpu", dtype=None, load_format=None, modeling=None, gpu_memory_utilization=0.4,
                max_model_len=2048, max_num_seqs=None, input_len=128, output_len=16, num_prompts=32, concurrency=8,
                kv_transport="auto", state_mb="16,64", repeat=3, budget_s=900.0, keep_logs=False)
TRANSPORT_S = 30.0
SPLIT = ("route", "queue", "prefill", "transfer", "first_decode", "ttft",
         "route_http", "admit", "export", "relay", "pull", "verify")    # the last six: parts of route and transfer


class BudgetExceeded(Exception):
    pass


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self, reserve: float = 0.0) -> float:
        return self.end - time.monotonic() - reserve

    def check(self, what: str, reserve: float = 0.0) -> float:
        left = self.left(reserve)
        if left <= 0:
            raise BudgetExceeded(f"the --budget-s ran out before {what}")
        return left


# ---- arguments ---------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="a whole configuration (flags given as well override it); h200: kl8 on one H200")
    ap.add_argument("--model", help="checkpoint directory, or a name of benchmarks/h200_fastpath.py's models "
                                    f"({', '.join(sorted(FASTPATH_MODELS))}: a config-only folder made here, for "
                                    "--load-format random); default: a k3-tiny checkpoint made here")
    ap.add_argument("--device", help="cpu | cuda (default cpu)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="the servers' --dtype")
    ap.add_argument("--load-format", choices=["auto", "random"], help="the servers' --load-format")
    ap.add_argument("--modeling", choices=["off", "auto", "require"], help="the servers' --modeling")
    ap.add_argument("--enforce-eager", action="store_true", default=None, help="the servers run without graphs")
    ap.add_argument("--gpu-memory-utilization", type=float, help="per server on a GPU (the two share one)")
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--max-num-seqs", type=int, help="per server (default: the engine's)")
    ap.add_argument("--num-prompts", type=int)
    ap.add_argument("--input-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--concurrency", type=int)
    ap.add_argument("--kv-transport", choices=["auto", "zmq", "nixl"], help="the generation server's")
    ap.add_argument("--state-mb", help="comma-separated state sizes for the transport rows")
    ap.add_argument("--repeat", type=int, help="transport rows: best of N")
    ap.add_argument("--budget-s", type=float, help="the whole run's wall-time limit, server start-up included")
    ap.add_argument("--server-arg", action="append", default=[], help="one more flag for both model servers")
    ap.add_argument("--skip-serve", action="store_true", help="only the transport rows")
    ap.add_argument("--keep-logs", action="store_true", default=None,
                    help="copy the servers' logs next to --out (always done when the run is incomplete)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for k, v in {**DEFAULTS, **PRESETS.get(args.preset, {})}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.enforce_eager, args.keep_logs = bool(args.enforce_eager), bool(args.keep_logs)
    for k in ("num_prompts", "input_len", "output_len", "concurrency", "repeat", "max_model_len"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if args.output_len < 2:
        ap.error("--output-len must be >= 2 (a 1-token request has no decode to hand off)")
    if args.input_len + args.output_len > args.max_model_len:
        ap.error(f"--input-len + --output-len ({args.input_len + args.output_len}) exceed --max-model-len "
                 f"{args.max_model_len}")
    return args


def server_commands(args: argparse.Namespace, model: str, discovery: str) -> dict[str, list[str]]:
    """`kestrel serve` arguments of the context, generation and frontend servers (tests/test_disagg_bench_args.py
    parses them with the real `kestrel serve` parser)."""
    engine = ["--model", model, "--device", args.device, "--max-model-len", str(args.max_model_len),
              "--no-prefix-caching", "--seed", "0"]      # one seed: both servers draw the same random weights
    for flag, value in (("--dtype", args.dtype), ("--load-format", args.load_format), ("--modeling", args.modeling),
                        ("--max-num-seqs", args.max_num_seqs)):
        if value is not None:
            engine += [flag, str(value)]
    if args.device.startswith("cuda"):
        engine += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.enforce_eager:
        engine.append("--enforce-eager")
    common = ["--port", "0", "--no-access-log", "--discovery-dir", discovery]
    return {"context": [*common, *engine, "--role", "context", "--handoff-timeout", "60", *args.server_arg],
            "generation": [*common, *engine, "--role", "generation", "--handoff-timeout", "60",
                           "--kv-transport", args.kv_transport, *args.server_arg],
            "frontend": [*common, "--role", "frontend", "--prefill-timeout", "120"]}


def missing_packages(skip_serve: bool = False) -> list[str]:
    """What this Python lacks for the run: the servers' packages, or only pyzmq for the transport rows alone."""
    import importlib.util
    return [m for m in (("zmq",) if skip_serve else SERVER_PACKAGES) if importlib.util.find_spec(m) is None]


# ---- transport rows ----------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best(fn, repeat: int, device: str = "cpu") -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def transport_rows(sizes_mb: list[float], repeat: int, device: str, deadline: Deadline) -> list[dict]:
    from kestrel.disagg.transport import StateClient, StateServer, StateStore, nixl_api
    from kestrel.runtime.handoff import PackedState, checksum
    rows = []
    for mb in sizes_mb:
        deadline.check(f"the {mb:g} MB transport row")
        n = int(mb * 2 ** 20)
        host = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.empty_like(host)
        man = {"num_tokens": 0, "page_size": 0, "num_pages": 0, "entries": []}
        row = {"phase": "transport", "state_mb": round(mb, 3),
               "memcpy_h2h_GBps": n / _best(lambda: dst.copy_(host), repeat) / 1e9,
               "checksum_host_GBps": n / _best(lambda: checksum(host, man), repeat) / 1e9}
        store = StateStore(hold=600)
        srv = StateServer(store, {}).start()
        try:
            store.put("s", PackedState(man, host, ""))
            cl = StateClient(timeout=30, pin_memory=device.startswith("cuda"))
            row["zmq_GBps"] = n / _best(lambda: cl.pull(srv.address, "s", "zmq"), repeat) / 1e9
            if nixl_api() is not None:
                row["nixl_dram_GBps"] = n / _best(lambda: cl.pull(srv.address, "s", "nixl"), repeat) / 1e9
            if device.startswith("cuda"):
                dev = host.to(device)
                pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                row["memcpy_d2h_GBps"] = n / _best(lambda: pinned.copy_(dev), repeat, device) / 1e9
                row["memcpy_h2d_GBps"] = n / _best(lambda: dev.copy_(pinned), repeat, device) / 1e9
                dev2 = torch.empty_like(dev)
                row["memcpy_d2d_GBps"] = n / _best(lambda: dev2.copy_(dev), repeat, device) / 1e9
                row["checksum_device_GBps"] = n / _best(lambda: checksum(dev, man), repeat, device) / 1e9
                if nixl_api() is not None:
                    store.put("d", PackedState(man, dev, ""))
                    row["nixl_vram_GBps"] = n / _best(lambda: cl.pull(srv.address, "d", "nixl", device=device),
                                                      repeat, device) / 1e9
        finally:
            srv.stop()
        rows.append(row)
    return rows


# ---- servers -----------------------------------------------------------------------------------------------------
class Server:
    """One `kestrel serve` process, its output in a log file; started without waiting."""

    def __init__(self, name: str, args: list[str], logdir: str):
        self.name = name
        self.log_path = os.path.join(logdir, f"{name}.log")
        self._log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
            env.setdefault(k, "0" if k == "NCCL_NVLS_ENABLE" else "1")   # no NVLink multicast on shared hosts
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", *args], cwd=REPO, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.url = None
        self.start_s = None

    def tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def ready(self) -> bool:
        """Whether the server listens (and a model server has published itself); raises if it exited."""
        if self.url is None:
            text = self.tail(10 ** 7)
            m = re.search(r"serving \S+ at (http://[^\s/]+)/v1", text)
            if m and (self.name == "frontend" or "published in" in text):
                self.url, self.start_s = m.group(1), time.monotonic() - self.started
            elif self.proc.poll() is not None:
                raise RuntimeError(f"the {self.name} server exited with {self.proc.returncode}:\n{self.tail()}")
        return self.url is not None


def wait_all(servers: list[Server], deadline: Deadline) -> None:
    """Every server ready (each one's start-up time taken when it became ready), within the budget."""
    while not all([s.ready() for s in servers]):
        if deadline.left() <= 0:
            late = [s for s in servers if s.url is None]
            raise BudgetExceeded("the budget ran out before these servers were ready: " + "; ".join(
                f"{s.name} (log tail: {s.tail(1500)})" for s in late))
        time.sleep(0.25)


def stop_all(servers: list[Server]) -> None:
    for s in servers:               # all at once: each gets SIGTERM before anyone waits
        if s.proc.poll() is None:
            s.proc.terminate()
    for s in servers:
        try:
            s.proc.wait(20)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait(10)
        s._log.close()


# ---- serving -----------------------------------------------------------------------------------------------------
def _load(url: str, args, seed: int, num: int, output_len: int, vocab: int, deadline: Deadline) -> dict:
    from kestrel.bench.serve import random_specs, run_benchmark
    specs = random_specs(num, args.input_len, output_len, vocab, seed=seed)
    left = deadline.check(f"a load of {num} prompts on {url}")
    per_request = max(min(120.0, left), 1.0)
    try:
        summary, _ = asyncio.run(asyncio.wait_for(run_benchmark(url, specs, args.concurrency, timeout=per_request),
                                                  left))
    except asyncio.TimeoutError:
        raise BudgetExceeded(f"the --budget-s ran out during a load of {num} prompts on {url}") from None
    if summary["errors"]:
        print(f"{summary['errors']} of {num} requests on {url} failed: {summary['error_messages']}", flush=True)
    if not summary["completed"]:
        raise RuntimeError(f"every request of a load on {url} failed: {summary['error_messages']}")
    return summary


def _record(summary: dict, args, mode: str, model_name: str, **extra) -> dict:
    return {"model": model_name, "weights": f"{args.dtype or 'auto'}-{args.load_format or 'auto'}", "phase": "serve",
            "mode": mode, "batch": args.concurrency, "sampling": "greedy", "input_len": args.input_len,
            "output_len": args.output_len, "num_prompts": args.num_prompts, "enforce_eager": args.enforce_eager,
            "tokens_per_s": summary["output_throughput"], "total_tokens_per_s": summary["total_token_throughput"],
            "request_throughput": summary["request_throughput"], "completed": summary["completed"],
            "errors": summary["errors"], "error_messages": summary["error_messages"],
            "duration_s": summary["duration_s"], **{k: summary[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")},
            **extra}


def serve_phases(args, model: str, model_name: str, logdir: str, deadline: Deadline, result: dict) -> None:
    import httpx
    cmds = server_commands(args, model, os.path.join(logdir, "discovery"))
    servers = [Server(name, cmds[name], logdir) for name in ("context", "generation", "frontend")]
    ctx, gen, front = servers
    result["servers"] = {s.name: {"command": "kestrel serve " + " ".join(cmds[s.name])} for s in servers}
    result["_logs"] = {s.name: s.log_path for s in servers}
    try:
        wait_all(servers, deadline)
        for s in servers:
            result["servers"][s.name]["start_s"] = round(s.start_s, 1)
            print(f"[{s.name}] ready at {s.url} after {s.start_s:.1f} s", flush=True)
        vocab = httpx.get(f"{ctx.url}/v1/models", timeout=30).json()["data"][0]["vocab_size"]
        warm = dict(num=args.concurrency, output_len=min(8, args.output_len), vocab=vocab, deadline=deadline)
        start = {"context_start_s": round(ctx.start_s, 1), "generation_start_s": round(gen.start_s, 1)}

        _load(ctx.url, args, seed=1, **warm)
        agg = _load(ctx.url, args, seed=2, num=args.num_prompts, output_len=args.output_len, vocab=vocab,
                    deadline=deadline)
        result["records"].append(_record(agg, args, "aggregated", model_name, start_s=start["context_start_s"]))
        print(f"[aggregated] {agg['output_throughput']:.1f} out tok/s, TTFT p50 {agg['ttft_ms']['p50']:.1f} ms",
              flush=True)

        while True:         # the frontend has read both servers' discovery files
            deadline.check("the frontend found both servers")
            h = httpx.get(f"{front.url}/health", timeout=10).json()
            if h["context"] >= 1 and h["generation"] >= 1:
                break
            time.sleep(0.2)
        _load(front.url, args, seed=3, **warm)
        n0 = len(httpx.get(f"{front.url}/disagg/timings", timeout=30).json())
        dis = _load(front.url, args, seed=4, num=args.num_prompts, output_len=args.output_len, vocab=vocab,
                    deadline=deadline)
        recs = httpx.get(f"{front.url}/disagg/timings", timeout=30).json()[n0:]
        split = {k: round(1e3 * statistics.median(r[k] for r in recs if r.get(k) is not None), 2)
                 for k in SPLIT if any(r.get(k) is not None for r in recs)}
        rates = [r["nbytes"] / r["transfer"] / 1e9 for r in recs if r.get("transfer") and r.get("nbytes")]
        state_mb = statistics.median(r["nbytes"] for r in recs) / 2 ** 20 if recs else None
        result["records"].append(_record(
            dis, args, "1p1d", model_name, **start, kv_transport=sorted({str(r.get("transport")) for r in recs}),
            ttft_split_median_ms=split, state_mb_median=state_mb,
            handoff_effective_GBps_median=statistics.median(rates) if rates else None,
            vs_aggregated={"tokens_per_s": dis["output_throughput"] / max(agg["output_throughput"], 1e-9),
                           "ttft_p50": (dis["ttft_ms"]["p50"] or 0) / max(agg["ttft_ms"]["p50"] or 0, 1e-9)}))
        print(f"[1p1d] {dis['output_throughput']:.1f} out tok/s, TTFT p50 {dis['ttft_ms']['p50']:.1f} ms; split "
              f"{json.dumps(split)}", flush=True)
    finally:
        stop_all(servers)


# ---- output ------------------------------------------------------------------------------------------------------
def print_tables(result: dict) -> None:
    serve = [r for r in result["records"] if r["phase"] == "serve"]
    if serve:
        print(f"\n{'mode':<11} {'out tok/s':>10} {'req/s':>7} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} "
              f"{'errors':>6} {'start s':>8}")
        for r in serve:
            print(f"{r['mode']:<11} {r['tokens_per_s']:>10.1f} {r['request_throughput']:>7.2f} "
                  f"{r['ttft_ms']['p50'] or 0:>9.1f} {r['ttft_ms']['p90'] or 0:>9.1f} {r['tpot_ms']['p50'] or 0:>9.2f} "
                  f"{r['errors']:>6} {r.get('start_s', r.get('generation_start_s', 0)):>8}")
        for r in serve:
            if r["mode"] == "1p1d":
                mb, rate = r["state_mb_median"] or 0.0, r["handoff_effective_GBps_median"] or 0.0
                print("1P1D median TTFT split (ms):", json.dumps(r["ttft_split_median_ms"]),
                      f"| state {mb:.3g} MB per request, hand-off {rate:.3g} GB/s (relay hop included; the transport "
                      "rows below: the bare pull and the copies)")
    rows = [r for r in result["records"] if r["phase"] == "transport"]
    if rows:
        keys = [k for k in rows[0] if k.endswith("GBps")]
        print(f"\n{'state MB':>9} " + " ".join(f"{k[:-5]:>14}" for k in keys) + "   (GB/s)")
        for row in rows:
            print(f"{row['state_mb']:>9.3g} " + " ".join(f"{row.get(k, float('nan')):>14.2f}" for k in keys))
    if result.get("incomplete"):
        print("\nINCOMPLETE:", result["incomplete"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = missing_packages(args.skip_serve)
    if missing:
        print(f"disagg_bench: the run needs {', '.join(missing)} (import names) and this Python lacks them; "
              "carry their wheels (bash benchmarks/serve_wheels.sh, README: device) or pip install kestrel's deps",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # a timeout's SIGTERM still stops the servers
    deadline = Deadline(args.budget_s)
    tmp = tempfile.mkdtemp(prefix="kestrel-disagg-bench-")
    model, model_name = args.model, args.model
    if model is None:
        from kestrel.models.kimi.checkpoint import make_checkpoint
        model, model_name = os.path.join(tmp, "tiny"), "k3-tiny"
        make_checkpoint("k3-tiny", model, dtype=torch.float32)
    elif model in FASTPATH_MODELS and not os.path.isdir(model):
        model_name = {"kl8": "kimi-linear-48b-8l", "kl27": "kimi-linear-48b"}.get(model, model)
        model = fastpath_model_dir(model)           # config.json only: the servers need --load-format random
    result = {"machine": None, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "config": {k: v for k, v in vars(args).items()}, "records": []}
    sizes = [float(s) for s in args.state_mb.split(",") if s]
    failed = []
    try:
        if not args.skip_serve:     # the transport rows keep TRANSPORT_S of the budget
            try:
                serve_phases(args, model, model_name, tmp, Deadline(deadline.left(TRANSPORT_S)), result)
            except Exception as e:  # whatever broke, the servers are stopped and the JSON says what was measured
                failed.append(f"serving: {type(e).__name__}: {e}")
            mb = next((r["state_mb_median"] for r in result["records"] if r.get("state_mb_median")), None)
            if mb:
                sizes.append(mb)        # one request's state, as phase 2 moved it
        try:
            result["records"] += transport_rows(sizes, args.repeat, args.device, deadline)
        except Exception as e:
            failed.append(f"transport: {type(e).__name__}: {e}")
    except SystemExit as e:
        failed.append(f"stopped by a signal (exit {e.code})")
    finally:
        if failed:
            result["incomplete"] = " | ".join(failed)
        from kestrel.bench.latency import machine_info
        result["machine"] = machine_info(torch.device(args.device if args.device != "cuda" else "cuda:0"))
        print_tables(result)
        logs = result.pop("_logs", {})
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            print("wrote", args.out)
            for name, path in logs.items() if result.get("incomplete") or args.keep_logs else ():
                if os.path.exists(path):
                    shutil.copy(path, os.path.join(os.path.dirname(os.path.abspath(args.out)), f"disagg_{name}.log"))
        shutil.rmtree(tmp, ignore_errors=True)
        if model != args.model and model.startswith(tempfile.gettempdir()) and not model.startswith(tmp):
            shutil.rmtree(model, ignore_errors=True)
    return 1 if result.get("incomplete") else 0


if __name__ == "__main__":
    sys.exit(main())
