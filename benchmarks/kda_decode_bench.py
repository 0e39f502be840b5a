"""KdaDecode on the GPU: time a layer's fused decode kernel at decode batches and compare its state traffic with
the copy bandwidth, measured in the same run (a device copy of as many bytes) and against the 4.2 TB/s nominal.

Run on the H200 from the repo root:
    PYTHONPATH=$PWD python3 benchmarks/kda_decode_bench.py [--json PATH] [--sweep]
Each shape: inputs from KdaDecode.make_inputs (fresh random rows, distinct random slots), one check of the kernel's
output and pools against the entry's reference, then the median of --reps CUDA-event timings of one launch. Bytes
counted: the fp32 state read and written (2 B H D^2 4), the conv state read and written, the rows and y.
--sweep also times other block / warp / prefetch configs of the same kernel (kestrel.kernels.kda.decode), so the
default in `launch_config` can be re-picked from one run. Prints a table; --json writes {machine, command, records}.
"""

from __future__ import annotations

import argparse
import sys

import torch
from _results import median_ms, write_results

from kestrel.catalog.kda.decode import KdaDecode
from kestrel.kernels.kda.decode import kda_decode, launch_config

NOMINAL_TBS = 4.2
SHAPES = [  # (batch, heads, gate form, why)
    (1, 32, "kimi", "Kimi Linear 48B tp1 bs1"),
    (8, 32, "kimi", "Kimi Linear 48B tp1 bs8"),
    (64, 32, "kimi", "Kimi Linear 48B tp1 bs64"),
    (1, 96, "k3", "K3 tp1 bs1"),
    (16, 96, "k3", "K3 tp1 bs16"),
    (64, 96, "k3", "K3 tp1 bs64"),
]
SWEEP = [dict(block_v=bv, num_warps=w, prefetch=p)
         for bv, w, p in ((16, 2, False), (16, 2, True), (32, 2, False), (32, 4, False), (32, 4, True),
                          (32, 8, True), (64, 4, False), (64, 8, False), (64, 8, True))]


def median_us(fn, reps: int) -> float:
    return 1e3 * median_ms(fn, reps)


def traffic_bytes(inp: dict) -> int:
    B, H, D = inp["slots"].numel(), inp["A_log"].numel(), inp["norm_weight"].numel()
    rows = sum(inp[n].numel() * inp[n].element_size() for n in ("mixed", "f", "b", "gate"))
    conv = inp["conv_state"][0].numel() * inp["conv_state"].element_size()
    return 2 * B * H * D * D * 4 + 2 * B * conv + rows + inp["gate"].numel() * inp["gate"].element_size()


def check(inp: dict, config: dict) -> None:
    """The kernel with `config` against the entry's reference, on copies of the pools (raises on a mismatch)."""
    got = kda_decode(**{**inp, "conv_state": inp["conv_state"].clone(), "rec_state": inp["rec_state"].clone()},
                     config=config)
    ref = KdaDecode.reference(**{**inp, "conv_state": inp["conv_state"].clone(),
                                 "rec_state": inp["rec_state"].clone()})
    KdaDecode.compare(got, ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time the other configs in SWEEP")
    ap.add_argument("--json", default=None, help="JSON path (default: print only)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kda_decode_bench needs a CUDA GPU")
    dev = torch.device("cuda")
    records = []
    print(f"{'shape':<26} {'config':<22} {'us':>8} {'GB/s':>7} {'of copy':>8} {'of 4.2T':>8} {'copy us':>8}")
    for B, H, gate, why in SHAPES:
        spec = dict(B=B, H=H, D=128, gate=gate, dtype=torch.bfloat16)
        inp = KdaDecode.make_inputs(spec, dev, torch.Generator().manual_seed(B * 1000 + H))
        nbytes = traffic_bytes(inp)
        src = torch.empty(nbytes // 8, dtype=torch.float32, device=dev)
        dst = torch.empty_like(src)
        copy_us = median_us(lambda: dst.copy_(src), args.reps)      # reads and writes nbytes / 2 each
        default = launch_config(128)
        configs = [default] + ([c for c in SWEEP if c != default] if args.sweep else [])
        for cfg in configs:
            check(inp, cfg)
            kda_decode(**inp, config=cfg)                           # warm-up (compiles)
            us = median_us(lambda: kda_decode(**inp, config=cfg), args.reps)
            gbs = nbytes / us / 1e3
            name = f"BV{cfg['block_v']} w{cfg['num_warps']}{' pf' if cfg['prefetch'] else ''}"
            name += " (default)" if cfg == default else ""
            records.append(dict(kernel="kda_decode", why=why, batch=B, heads=H, head_dim=128, gate=gate,
                                dtype="bf16", config=cfg, default=cfg == default, us=us, bytes=nbytes,
                                gb_per_s=gbs, of_copy=copy_us / us, of_nominal=gbs / (NOMINAL_TBS * 1e3),
                                copy_us=copy_us))
            print(f"{why:<26} {name:<22} {us:8.1f} {gbs:7.0f} {copy_us / us:8.2f} "
                  f"{gbs / (NOMINAL_TBS * 1e3):8.2f} {copy_us:8.1f}", flush=True)
    write_results(records, args.json)


if __name__ == "__main__":
    main()
