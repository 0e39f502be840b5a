"""The command line: `make-checkpoint` then `generate` in fresh processes, and errors a user can cause printed as
one `kestrel: error: ...` line with exit status 2 and no traceback."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from helpers import REPO, PYTHON, copy_checkpoint, scratch_dir, tiny_checkpoint
from helpers import single_thread  # noqa: F401  (autouse)

from kestrel import LLM, SamplingParams
from kestrel.cli import main

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "KESTREL_CACHE": scratch_dir("kestrel-cache")}


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-m", "kestrel.cli", *args], cwd=REPO, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(p: subprocess.Popen) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=240)
    return p.returncode, out, err


def bad_models() -> dict[str, str]:
    src = tiny_checkpoint("k3-tiny")
    out = {"nonexistent": os.path.join(scratch_dir("gone"), "no-such-model")}

    def gelu(raw):
        raw["text_config"]["hidden_act"] = "gelu"
        return raw

    out["unsupported_config"] = copy_checkpoint(src, "cli-gelu", config_edit=gelu, num_shards=1)
    trunc = copy_checkpoint(src, "cli-trunc", num_shards=2)
    shard = sorted(f for f in os.listdir(trunc) if f.endswith(".safetensors"))[1]
    with open(os.path.join(trunc, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(trunc, shard)) - 100)
    out["truncated_shard"] = trunc
    listcfg = copy_checkpoint(src, "cli-list", num_shards=1)
    with open(os.path.join(listcfg, "config.json"), "w") as f:
        json.dump([1, 2, 3], f)
    out["config_not_an_object"] = listcfg
    return out


@pytest.fixture(scope="module")
def runs():
    """Every subprocess of this module, started together (each pays Python + torch start-up)."""
    out_dir = os.path.join(scratch_dir("cli-ckpt"), "k3-3")
    bad = bad_models()
    procs = {"make": start("make-checkpoint", "--preset", "k3-tiny", "--layers", "3", "--out", out_dir)}
    for name in SUBPROCESS_CASES:
        procs[name] = start("generate", "--model", bad[name], "--max-tokens", "8", "Hello")
    results = {name: finish(p) for name, p in procs.items()}
    return out_dir, bad, results


def test_make_checkpoint_then_generate(runs):
    out_dir, _, results = runs
    rc, out, err = results["make"]
    assert rc == 0, err
    assert "Traceback" not in err
    with open(os.path.join(out_dir, "config.json")) as f:
        raw = json.load(f)
    assert raw["text_config"]["num_hidden_layers"] == 3
    assert os.path.isfile(os.path.join(out_dir, "model.safetensors.index.json"))

    rc, out, err = finish(start("generate", "--model", out_dir, "--max-tokens", "8", "Hello"))
    assert rc == 0, err
    assert "Traceback" not in err
    assert out.strip(), "generate printed no text"
    # the streamed text is the API's greedy output (the CLI's default temperature is 0)
    expected = LLM(model=out_dir, dtype="float32", device="cpu").generate(
        "Hello", SamplingParams(temperature=0, max_tokens=8))[0]
    assert out == expected.text + "\n"


SUBPROCESS_CASES = ["nonexistent", "truncated_shard"]
ALL_CASES = ["nonexistent", "unsupported_config", "truncated_shard", "config_not_an_object"]


@pytest.mark.parametrize("case", ALL_CASES)
def test_bad_model_is_one_error_line_exit_2(runs, case, capsys):
    """Two cases in a fresh process; all four through main() in this process (an exception other than a
    KestrelError would escape main() and fail the test, so no traceback is printed either way)."""
    _, bad, results = runs
    if case in SUBPROCESS_CASES:
        rc, out, err = results[case]
    else:
        capsys.readouterr()
        rc = main(["generate", "--model", bad[case], "--max-tokens", "8", "Hello"])
        out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("kestrel: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    msg = errors[0]
    expect = {"nonexistent": bad["nonexistent"], "unsupported_config": "hidden_act",
              "truncated_shard": "truncated", "config_not_an_object": "JSON object"}[case]
    assert expect in msg, msg
    if case in ("nonexistent", "unsupported_config", "config_not_an_object"):
        assert len(lines) == 1, err                       # nothing is logged before these errors


def test_request_errors_in_process(capsys):
    """Bad request flags through main(): exit 2, one error line."""
    model = tiny_checkpoint("k3-tiny")
    cases = [
        (["generate", "--model", model, "--max-tokens", "0", "Hello"], "max_tokens"),
        (["generate", "--model", model, "--temperature", "-1", "Hello"], "temperature"),
        (["generate", "--model", model, "--max-model-len", "4", "--max-tokens", "2",
          "a long prompt of many words that is longer than four tokens"], "maximum context is 4"),
        (["generate", "--model", model, "--page-size", "0", "Hello"], "--page-size"),
    ]
    for argv, word in cases:
        assert main(["-q", *argv]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("kestrel: error:")]
        assert len(errors) == 1 and word in errors[0], err
        assert "Traceback" not in err


def test_make_checkpoint_errors_in_process(capsys):
    a_file = os.path.join(scratch_dir("cli-out"), "not-a-dir")
    with open(a_file, "w") as f:
        f.write("x")
    for argv, word in [
        (["make-checkpoint", "--preset", "k3-tiny", "--layers", "2", "--out", a_file], "--out"),
        (["make-checkpoint", "--preset", "k3-tiny", "--layers", "0", "--out", a_file + "-2"], "--layers 0"),
    ]:
        assert main(["-q", *argv]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("kestrel: error:")]
        assert len(errors) == 1 and word in errors[0], err
    assert not os.path.exists(a_file + "-2")
