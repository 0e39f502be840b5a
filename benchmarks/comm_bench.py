"""Times every collective catalog cell on the GPUs of one host under torchrun: NCCL's time at the sizes the layouts
move, the figure a custom one-shot all-reduce would have to beat, and the link numbers `kestrel plan --comm-records`
fits its latency and bandwidth to.

    torchrun --nproc-per-node 8 benchmarks/comm_bench.py --out $OUT/comm_h200x8.json
    TRITON_INTERPRET=1 torchrun --standalone --nproc-per-node 2 benchmarks/comm_bench.py --device cpu --out x.json

Each cell runs on the world group: inputs from the entry's make_inputs, 5 warm-up calls, then `--iters` calls
timed with CUDA events after a barrier; the record is the median over calls of the slowest rank's time. Bus
bandwidth follows nccl-tests: all-reduce moves 2(N-1)/N of the tensor per rank, the others (N-1)/N. Rank 0 prints
the table and writes `{machine, command, records}`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kestrel.bench.latency import _table, machine_info                 # noqa: E402
from kestrel.catalog import all_entries                                # noqa: E402
from kestrel.catalog._op import Arch                                   # noqa: E402
from kestrel.catalog.comm._group import cell_group                     # noqa: E402

OPS = {"AllReduce": "all-reduce", "AllReduceAddRmsNorm": "all-reduce", "AllGather": "all-gather",
       "ReduceScatter": "reduce-scatter", "AllToAll": "all-to-all"}


def wire_share(op: str, n: int) -> float:
    return (2 if op == "all-reduce" else 1) * (n - 1) / n


def time_cell(entry, cell, iters: int, gen_seed: int, device: str) -> tuple[float, int]:
    """(median ms of the slowest rank, bytes of the tensor one rank sends or reduces)."""
    gen = torch.Generator().manual_seed(gen_seed)
    inputs = entry.make_inputs(cell.spec, device, gen)
    x = inputs["x"]
    nbytes = x.numel() * x.element_size()
    if entry.__name__ == "AllGather":
        nbytes *= dist.get_world_size()                 # nccl-tests size the gather by its output
    for _ in range(5):
        entry.raw_call(**inputs)
    times = []
    for _ in range(iters):
        dist.barrier()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            entry.raw_call(**inputs)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:                                           # a smoke run on gloo CPU ranks
            t0 = time.perf_counter()
            entry.raw_call(**inputs)
            ms = 1e3 * (time.perf_counter() - t0)
        t = torch.tensor([ms], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times), nbytes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo, the tiny cells only")
    args = ap.parse_args()
    group = cell_group(args.device)                     # joins torchrun's world group (on this rank's GPU)
    n = group.size()
    records = []
    for entry in all_entries():
        if not entry.__module__.startswith("kestrel.catalog.comm."):
            continue
        for i, cell in enumerate(entry.CELLS):
            if args.device == "cpu" and Arch.CPU not in cell.archs:
                continue
            ms, nbytes = time_cell(entry, cell, args.iters, 1000 + i, args.device)
            op = OPS[entry.__name__]
            records.append({"entry": entry.name(), "why": cell.why, "op": op, "world": n, "bytes": nbytes,
                            "dtype": str(cell.spec["dtype"]).replace("torch.", ""), "ms": ms,
                            "bus_gb_s": nbytes * wire_share(op, n) / (ms * 1e-3) / 1e9})
    if dist.get_rank() == 0:
        print(_table(["entry", "world", "MB", "ms", "bus GB/s", "why"],
                     [[r["entry"], str(r["world"]), f"{r['bytes'] / 1e6:.2f}", f"{r['ms']:.4f}",
                       f"{r['bus_gb_s']:.1f}", r["why"][:60]] for r in records]))
        doc = {"machine": {**machine_info(torch.device(args.device)), "world": n}, "command": " ".join(sys.argv),
               "records": records}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
