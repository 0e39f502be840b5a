"""`kestrel bench throughput` in a reduced form: both arms run, the JSON has them, concurrency wins."""

from __future__ import annotations

import json

from test_runtime_helpers import tiny_checkpoint

from kestrel.bench.throughput import format_table
from kestrel.cli import main


def test_bench_throughput_reduced(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["-q", "bench", "throughput", "--model", tiny_checkpoint("k3-tiny"), "--device", "cpu",
               "--dtype", "float32", "--num-requests", "8", "--prompt-len", "12", "--max-tokens", "8",
               "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    arms = report["arms"]
    assert set(arms) == {"sequential", "concurrent"}
    for a in arms.values():
        assert a["requests"] == 8 and a["output_tokens"] == 64 and a["wall_s"] > 0
        assert a["step_time_s"]["model"] > 0
    assert arms["sequential"]["steps"] == 64                 # one request at a time: one token per step
    assert arms["concurrent"]["steps"] == 8                  # all eight together: one step per token position
    assert report["outputs_match"] is True
    assert report["ratio"] > 1.0
    assert abs(report["ratio"] - arms["concurrent"]["output_tok_per_s"] / arms["sequential"]["output_tok_per_s"]) < 1e-9
    printed = capsys.readouterr().out
    assert "concurrent / sequential" in printed and printed.strip().endswith("outputs match: True")
    assert format_table(report).splitlines()[0] in printed


def test_bench_rejects_bad_arguments(capsys):
    rc = main(["-q", "bench", "throughput", "--model", tiny_checkpoint("k3-tiny"), "--num-requests", "0"])
    assert rc == 2
    assert "--num-requests must be >= 1" in capsys.readouterr().err


def test_bench_subcommand_registers():
    from kestrel.bench.cli import cmd_throughput
    from kestrel.cli import build_parser
    args = build_parser().parse_args(["bench", "throughput", "--num-requests", "3", "--out", "x.json"])
    assert args.func is cmd_throughput and args.num_requests == 3 and args.threads == 1
    assert args.max_tokens == 64 and args.prompt_len == 32        # the defaults the target ratio is stated for
