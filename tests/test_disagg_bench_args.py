"""benchmarks/disagg_bench.py's argument handling, without starting anything: every `kestrel serve` flag the
bench passes (the H200 preset and the CPU default) parses with the real server parser and passes its checks, and
the preset is what the H200 run needs (kl8 built from a config-only folder with random weights, two servers
sharing the card, input 1024 / output 128 at concurrency 32, ZMQ)."""

from __future__ import annotations

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import disagg_bench as B  # noqa: E402
from kestrel.cli import build_parser, engine_config  # noqa: E402
from kestrel.serve.cli import check_flags  # noqa: E402


def _serve_args(argv: list[str]):
    args = build_parser().parse_args(["serve", *argv])       # an unknown flag exits here (SystemExit 2)
    check_flags(args)
    return args


@pytest.mark.parametrize("argv", [["--preset", "h200"], [], ["--preset", "h200", "--enforce-eager",
                                                             "--num-prompts", "64"]])
def test_every_server_flag_the_bench_passes_exists(argv, tmp_path):
    args = B.parse_args(argv)
    model = B.fastpath_model_dir(args.model) if args.model in B.FASTPATH_MODELS else str(tmp_path)
    cmds = B.server_commands(args, model, str(tmp_path / "discovery"))
    assert set(cmds) == {"context", "generation", "frontend"}
    for role, cmd in cmds.items():
        parsed = _serve_args(cmd)
        assert parsed.role == role and parsed.port == 0 and parsed.discovery_dir == str(tmp_path / "discovery")
        if role == "frontend":
            assert parsed.prefill_timeout == 120
            continue
        ec = engine_config(parsed)          # every engine value checked, nothing loaded
        assert ec.model == model and ec.max_model_len == args.max_model_len and not ec.enable_prefix_caching
        assert ec.enforce_eager == ("--enforce-eager" in argv)
    assert cmds["context"][cmds["context"].index("--model"):] [:2] == cmds["generation"][
        cmds["generation"].index("--model"):][:2]


def test_the_h200_preset():
    args = B.parse_args(["--preset", "h200", "--concurrency", "16"])
    assert (args.input_len, args.output_len, args.concurrency, args.kv_transport) == (1024, 128, 16, "zmq")
    assert args.num_prompts >= 200 and args.budget_s <= 420 and args.device == "cuda"
    gen = _serve_args(B.server_commands(args, "m", "d")["generation"])
    assert (gen.load_format, gen.dtype, gen.modeling, gen.kv_transport) == ("random", "bfloat16", "require", "zmq")
    assert 2 * gen.gpu_memory_utilization <= 0.85 and gen.max_num_seqs > args.concurrency
    folder = B.fastpath_model_dir(args.model)        # the fast-path bench's kl8: config.json only
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    assert os.listdir(folder) == ["config.json"] and cfg["num_hidden_layers"] == 8 and cfg["hidden_size"] == 2304


@pytest.mark.parametrize("argv, why", [(["--output-len", "1"], "--output-len must be >= 2"),
                                       (["--input-len", "2000", "--output-len", "100"], "exceed --max-model-len"),
                                       (["--preset", "a100"], "invalid choice")])
def test_bad_bench_arguments_are_refused(argv, why, capsys):
    with pytest.raises(SystemExit):
        B.parse_args(argv)
    assert why in capsys.readouterr().err


def test_the_budget_bounds_every_wait():
    d = B.Deadline(-1)
    with pytest.raises(B.BudgetExceeded, match="ran out before the frontend"):
        d.check("the frontend")
