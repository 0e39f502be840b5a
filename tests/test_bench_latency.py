"""`kestrel bench latency` and `kestrel bench kernels` on the CPU: the drivers run on the tiny demo model / tiny
cells, print their table and write the JSON report's shape (`machine`, `command`, `records`); the floor model
reproduces the HBM floors measured for the real-width checkpoints."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from test_runtime_helpers import make_engine, tiny_checkpoint

from kestrel.bench.kernels import bytes_moved, flops_of, register_kernels, run_kernels
from kestrel.bench.latency import floor_tokens_per_s, register_latency, run_latency
from kestrel.cli import add_engine_args
from kestrel.config import ModelConfig
from kestrel.models.kimi.checkpoint import preset_config


def _parser():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    register_latency(sub, add_engine_args)
    register_kernels(sub)
    return ap


def test_latency_report_on_the_tiny_model():
    engine = make_engine("k3-tiny", max_num_seqs=4, kv_cache_tokens=1024, enable_prefix_caching=False)
    report = run_latency(engine, batch_size=2, input_len=8, output_len=4, num_iters=2, num_iters_warmup=1)
    assert set(report) >= {"machine", "command", "records"}
    decode, prefill = report["records"]
    for r in (decode, prefill):
        assert r["model"] and r["weights"] == "float32" and r["batch"] == 2 and r["sampling"] == "greedy"
        assert r["tokens_per_s"] > 0 and r["floor_tokens_per_s"] > 0
    assert decode["phase"] == "decode" and decode["context"] == 8
    assert prefill["phase"] == "prefill" and prefill["prompt_len"] == 8
    runs = report["runs"]
    assert len(runs["full_s"]) == len(runs["one_token_s"]) == 2
    assert all(f > o for f, o in zip(runs["full_s"], runs["one_token_s"]))       # 4 tokens take longer than 1
    assert decode["tokens_per_s"] == pytest.approx(2 * 3 / (sum(runs["full_s"]) / 2 - sum(runs["one_token_s"]) / 2),
                                                   rel=1e-3)
    assert engine.runner.timed and engine.timing["model"] > 0
    assert engine.timing["model_device"] == 0.0            # device time: CUDA events, none on the CPU
    assert not engine.has_unfinished() and not engine.requests


def test_latency_command_writes_json(tmp_path, capsys):
    out = tmp_path / "lat.json"
    args = _parser().parse_args(["latency", "--model", tiny_checkpoint("kimi-linear-tiny"), "--device", "cpu",
                                 "--dtype", "float32", "--kv-cache-tokens", "512", "--batch-size", "3",
                                 "--input-len", "6", "--output-len", "3", "--num-iters", "1",
                                 "--num-iters-warmup", "0", "--sampling", "top_p", "--model-name", "tiny",
                                 "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert [r["phase"] for r in report["records"]] == ["decode", "prefill"]
    assert all(r["model"] == "tiny" and r["sampling"] == "top_p" and r["batch"] == 3 for r in report["records"])
    table = capsys.readouterr().out
    assert "decode" in table and "prefill" in table and "floor" in table


def test_floor_matches_the_real_width_checkpoints():
    """The 8-layer real-width Kimi Linear checkpoint's floors as measured against (issue 9): ~1,790 tok/s at batch
    1 and ~10,900 at batch 64 (1K context), ~400K tok/s for an 8K prefill."""
    c = ModelConfig.from_dict(preset_config("kimi-linear-48b", layers=8))
    assert floor_tokens_per_s(c, "decode", 1, 1024 + 64, 1) == pytest.approx(1790, rel=0.05)
    assert floor_tokens_per_s(c, "decode", 64, 1024 + 64, 1) == pytest.approx(10900, rel=0.05)
    assert floor_tokens_per_s(c, "prefill", 1, 0, 8192) == pytest.approx(400e3, rel=0.1)
    # more context, more bytes: a slower floor; a bigger batch amortizes the weights
    assert floor_tokens_per_s(c, "decode", 8, 65536, 1) < floor_tokens_per_s(c, "decode", 8, 1024, 1)
    assert floor_tokens_per_s(c, "decode", 8, 1024, 1) > floor_tokens_per_s(c, "decode", 1, 1024, 1)


def test_kernel_bytes_and_flops_count_touched_pools():
    x, w = torch.randn(5, 64), torch.randn(96, 64)
    assert flops_of("Linear", {"x": x, "weight": w}) == 2 * 5 * 64 * 96
    assert bytes_moved({"x": x, "weight": w}, torch.empty(5, 96)) == 4 * (5 * 64 + 96 * 64 + 5 * 96)
    state = torch.zeros(10, 2, 16, 16)
    inputs = {"state": state, "slots": torch.tensor([3, 7], dtype=torch.int32)}
    assert bytes_moved(inputs, (state,)) == 2 * 2 * 2 * 16 * 16 * 4 + 2 * 4     # two slots, in and out


def test_kernels_command_on_tiny_cells(tmp_path, capsys):
    report = run_kernels(torch.device("cpu"), names=["Linear", "HeadBmm"], reps=1)
    recs = report["records"]
    assert recs and {r["entry"] for r in recs} == {"Linear", "HeadBmm"}
    for r in recs:
        assert r["time_us"] > 0 and r["floor_us"] > 0 and r["baseline"].startswith("cuBLAS") and r["baseline_us"] > 0
    out = tmp_path / "k.json"
    args = _parser().parse_args(["kernels", "--device", "cpu", "--entry", "Linear", "--reps", "1", "--out", str(out)])
    assert args.func(args) == 0
    saved = json.loads(out.read_text())
    assert set(saved) == {"machine", "command", "records"} and saved["records"][0]["entry"] == "Linear"
    assert "Linear" in capsys.readouterr().out
