"""Disaggregated serving against aggregated serving, and the state transport's bandwidth.

1. Transport: a packed state of each `--state-mb` size pulled from a context-side `StateServer` by a
   `StateClient` in this process over loopback, ZMQ and (where `nixl` imports) NIXL, next to a plain memcpy of
   the same bytes (host to host; on a GPU also device to host and host to device, the export and import copies of
   the host-staged path, and NIXL device to device), and the checksum's rate. Best of `--repeat`.
2. Serving: `kestrel bench serve`'s load generator against one aggregated server (`--role both`), then against a
   frontend in front of one context and one generation server (1P1D), same random prompts: throughput and TTFT
   percentiles, and the frontend's median TTFT split (queue, prefill, transfer, first decode).

CPU (tiny model made here):   python benchmarks/disagg_bench.py --out benchmarks/results/disagg_cpu.json
One H200, the two servers sharing it (each gets part of the memory):
    python benchmarks/disagg_bench.py --model DIR --device cuda --gpu-memory-utilization 0.4 \\
        --input-len 1024 --output-len 128 --num-prompts 200 --concurrency 32 --state-mb 64,512 \\
        --out benchmarks/results/disagg_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kestrel.bench.serve import format_table, random_specs, run_benchmark  # noqa: E402
from kestrel.disagg.transport import StateClient, StateServer, StateStore, nixl_api  # noqa: E402
from kestrel.runtime.handoff import PackedState, checksum  # noqa: E402


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


def transport_bench(sizes_mb: list[int], repeat: int, device: str) -> list[dict]:
    rows = []
    for mb in sizes_mb:
        n = mb << 20
        host = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.empty_like(host)
        man = {"num_tokens": 0, "page_size": 0, "num_pages": 0, "entries": []}
        row = {"state_mb": mb, "memcpy_h2h_GBps": n / _best(lambda: dst.copy_(host), repeat) / 1e9,
               "checksum_host_GBps": n / _best(lambda: checksum(host, man), repeat) / 1e9}
        store = StateStore(hold=600)
        srv = StateServer(store, {}).start()
        try:
            store.put("s", PackedState(man, host, ""))
            cl = StateClient(timeout=120)
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


class Server:
    def __init__(self, name: str, args: list[str], logdir: str):
        self.log_path = os.path.join(logdir, f"{name}.log")
        self._log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", "--port", "0",
                                      "--no-access-log", *args], env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.url = None

    def wait(self, timeout: float = 1800) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = open(self.log_path).read()
            m = re.search(r"serving \S+ at (http://[^\s/]+)/v1", text)
            if m:
                self.url = m.group(1)
                return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{text[-3000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"server did not start:\n{open(self.log_path).read()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def serve_bench(args, model: str, logdir: str) -> dict:
    import httpx
    engine = ["--model", model, "--device", args.device, "--max-model-len", str(args.max_model_len),
              *(["--gpu-memory-utilization", str(args.gpu_memory_utilization)] if args.device.startswith("cuda")
                else []), *args.server_arg]
    out = {}

    def bench(url: str) -> dict:
        vocab = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["vocab_size"]
        specs = random_specs(args.num_prompts, args.input_len, args.output_len, vocab, seed=0)
        summary, _ = asyncio.run(run_benchmark(url, specs, args.concurrency))
        return summary

    agg = Server("agg", engine, logdir)
    try:
        out["aggregated"] = bench(agg.wait())
    finally:
        agg.stop()
    disc = os.path.join(logdir, "discovery")
    d = ["--discovery-dir", disc]
    procs = [Server("context", [*engine, "--role", "context", *d], logdir),
             Server("generation", [*engine, "--role", "generation", *d, "--kv-transport", args.kv_transport],
                    logdir)]
    try:
        for p in procs:
            p.wait()
        front = Server("frontend", ["--role", "frontend", *d], logdir)
        procs.append(front)
        url = front.wait()
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health").json()["generation"] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        out["disaggregated_1p1d"] = bench(url)
        recs = httpx.get(f"{url}/disagg/timings").json()
        out["ttft_split_median_ms"] = {k: 1e3 * statistics.median(r[k] for r in recs if r.get(k) is not None)
                                       for k in ("route", "queue", "prefill", "transfer", "first_decode", "ttft")
                                       if any(r.get(k) is not None for r in recs)}
        out["transport_used"] = sorted({r.get("transport") for r in recs})
    finally:
        for p in reversed(procs):
            p.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a k3-tiny checkpoint made here)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                    help="per server on a GPU: the context and generation servers share one")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-transport", default="auto", choices=["auto", "zmq", "nixl"])
    ap.add_argument("--state-mb", default="16,64", help="comma-separated state sizes for the transport rows")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--server-arg", action="append", default=[], help="one more flag for every model server")
    ap.add_argument("--skip-serve", action="store_true", help="only the transport rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kestrel-disagg-bench-")
    model = args.model
    if model is None:
        from kestrel.models.kimi.checkpoint import make_checkpoint
        model = os.path.join(tmp, "tiny")
        make_checkpoint("k3-tiny", model, dtype=torch.float32)
    result = {"machine": torch.cuda.get_device_name() if args.device.startswith("cuda") else
              f"cpu {platform.processor() or platform.machine()} x{os.cpu_count()}",
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "nixl": nixl_api() is not None}
    result["transport"] = transport_bench([int(s) for s in args.state_mb.split(",")], args.repeat, args.device)
    print(f"{'state MB':>9} " + " ".join(f"{k:>20}" for k in result["transport"][0] if k != "state_mb"))
    for row in result["transport"]:
        print(f"{row['state_mb']:>9} " + " ".join(f"{v:>17.2f} GB/s"[-20:] for k, v in row.items()
                                                  if k != "state_mb"))
    if not args.skip_serve:
        result["serve"] = serve_bench(args, model, tmp)
        for name in ("aggregated", "disaggregated_1p1d"):
            print(format_table(result["serve"][name], title=name))
        print("1P1D median TTFT split (ms):", json.dumps(
            {k: round(v, 2) for k, v in result["serve"]["ttft_split_median_ms"].items()}))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", args.out)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
