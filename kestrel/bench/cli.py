"""`kestrel bench ...`: benchmark drivers. Each prints a table and writes JSON."""

from __future__ import annotations

import argparse
import logging
import os

from kestrel.errors import KestrelError

log = logging.getLogger("kestrel.bench")


def register(subparsers, add_engine_args) -> None:
    b = subparsers.add_parser("bench", help="benchmarks: print a table, write JSON")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    t = bsub.add_parser("throughput", help="N concurrent requests vs the same requests one after another",
                        description="Offline throughput of continuous batching: the same requests served "
                                    "concurrently and one after another, on one engine, in one run.")
    add_engine_args(t)
    t.add_argument("--num-requests", type=int, default=32)
    t.add_argument("--prompt-len", type=int, default=32, help="longest prompt; lengths are uniform in [len/2, len]")
    t.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (eos ignored)")
    t.add_argument("--repeat", type=int, default=1, help="runs per arm (interleaved); each arm reports its median")
    t.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: the tiny models' ops are too small to split, and thread "
                        "hand-offs on a shared CPU cost more than the math; 0: torch's default)")
    t.add_argument("--out", default="bench-throughput.json", help="JSON report path")
    t.set_defaults(func=cmd_throughput)
    from kestrel.bench.fla_configs import register_fla_configs
    from kestrel.bench.kernels import register_kernels
    from kestrel.bench.latency import register_latency
    from kestrel.bench.serve import register_serve
    register_serve(bsub)
    register_latency(bsub, add_engine_args)
    register_kernels(bsub)
    register_fla_configs(bsub)


def cmd_throughput(args: argparse.Namespace) -> int:
    import torch

    from kestrel.bench.throughput import format_table, run_throughput, write_report
    from kestrel.cli import engine_config
    from kestrel.llm import build_engine

    for name in ("num_requests", "prompt_len", "max_tokens", "repeat"):
        if getattr(args, name) < 1:
            raise KestrelError(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads < 0:
        raise KestrelError("--threads must be >= 0")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise KestrelError(f"--out {args.out}: cannot write the report into {out_dir}; choose a writable directory")
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = build_engine(engine_config(args))
    report = run_throughput(engine, args.num_requests, args.prompt_len, args.max_tokens, args.seed, args.repeat)
    report["config"]["weights"] = engine.engine_config.load_format     # "random": seeded random weights
    print(format_table(report))
    write_report(report, args.out)
    log.info("wrote %s", args.out)
    return 0
