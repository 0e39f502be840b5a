"""What the benchmark scripts share: the JSON every one writes ({machine, command, records}, see DESIGN.md's
benchmark convention) and the CUDA-event timing of one call."""

from __future__ import annotations

import json
import os
import sys

import torch


def write_results(records: list[dict], out: str | None) -> None:
    """Write the records with the machine and the command line that produced them (nothing when out is None)."""
    if not out:
        return
    doc = dict(machine=torch.cuda.get_device_name(), command=" ".join([os.path.basename(sys.executable)] + sys.argv),
               records=records)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", out)


def median_ms(fn, reps: int, warmup: int = 0) -> float:
    """Median of `reps` CUDA-event timings of fn() in milliseconds, after `warmup` untimed calls (compiles, caches);
    each timing waits for its own end event, so no call overlaps the next one's start."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]
