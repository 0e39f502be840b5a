"""The command line: `make-checkpoint` then `generate` in fresh processes, and errors a user can cause printed as
one `kestrel: error: ...` line with exit status 2 and no traceback: bad checkpoints, and every bad flag before
any weight is read (shown on a checkpoint whose shard is corrupt: loading it would fail with another error). Also
the tokenizer checks, progress output (a bar on a terminal, one line per stage elsewhere), escaped model text,
make-checkpoint's file modes and `--config-only` folders run with `--load-format random`."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from helpers import REPO, PYTHON, copy_checkpoint, scratch_dir, tiny_checkpoint
from helpers import single_thread  # noqa: F401  (autouse)

from kestrel import LLM, SamplingParams
from kestrel.cli import main, printable

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
    # tokenizer files that are there but incomplete; each with a corrupt shard, so an error about the tokenizer
    # shows it was raised before loading
    out["no_tiktoken_model"] = corrupt_copy(src, "cli-no-tiktoken", remove=("tiktoken.model",))
    out["no_tokenizer"] = corrupt_copy(src, "cli-no-tok", remove=("tiktoken.model", "tokenizer_config.json"))
    hf = corrupt_copy(src, "cli-hf-no-json", remove=("tiktoken.model",))
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}, f)
    out["no_tokenizer_json"] = hf
    return out


def corrupt_copy(src: str, name: str, remove: tuple[str, ...] = ()) -> str:
    """A copy of `src` whose second shard is cut short (loading it fails), without the files in `remove`."""
    path = copy_checkpoint(src, name, num_shards=2)
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1]
    with open(os.path.join(path, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, shard)) - 100)
    for fn in remove:
        os.remove(os.path.join(path, fn))
    return path


@pytest.fixture(scope="module")
def runs():
    """Every subprocess of this module, started together (each pays Python + torch start-up)."""
    out_dir = os.path.join(scratch_dir("cli-ckpt"), "k3-3")
    bad = bad_models()
    procs = {"make": start("make-checkpoint", "--preset", "k3-tiny", "--layers", "3", "--out", out_dir)}
    for name in SUBPROCESS_CASES:
        procs[name] = start("generate", "--model", bad[name], "--max-tokens", "8", "Hello")
    procs["bad_flag"] = start("generate", "--model", bad["truncated_shard"], "--max-model-len", "0", "Hello")
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
    # the streamed text is the API's greedy output (the CLI's default temperature is 0), control characters escaped
    expected = LLM(model=out_dir, dtype="float32", device="cpu").generate(
        "Hello", SamplingParams(temperature=0, max_tokens=8))[0]
    assert out == printable(expected.text) + "\n"
    # stderr is a pipe: no progress bar frames, one line per stage, in order
    assert "\r" not in err and "it/s" not in err and "tensor/s" not in err, err
    stages = ["loading weights:", "building the model:", "planning the cache:"]
    at = [next((i for i, line in enumerate(err.splitlines()) if s in line), -1) for s in stages]
    assert -1 not in at and at == sorted(at), err


SUBPROCESS_CASES = ["nonexistent", "truncated_shard", "no_tiktoken_model"]
ALL_CASES = ["nonexistent", "unsupported_config", "truncated_shard", "config_not_an_object", "no_tiktoken_model",
             "no_tokenizer", "no_tokenizer_json"]


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
              "truncated_shard": "truncated", "config_not_an_object": "JSON object",
              "no_tiktoken_model": "tokenizer_config.json but no tiktoken.model",
              "no_tokenizer": "has no tokenizer", "no_tokenizer_json": "tokenizer_config.json but no tokenizer.json"}
    assert expect[case] in msg, msg
    if case != "truncated_shard":
        assert "truncated" not in err, err                # the error came before any weight was read
        assert len(lines) == 1, err                       # nothing is logged before these errors


def test_incomplete_tokenizer_is_an_error_in_the_api_too(runs):
    from kestrel.errors import CheckpointError
    _, bad, _ = runs
    with pytest.raises(CheckpointError, match="no tiktoken.model") as ei:
        LLM(model=bad["no_tiktoken_model"], dtype="float32", device="cpu")
    assert "\n" not in str(ei.value) and "truncated" not in str(ei.value)


def test_bad_flag_in_a_fresh_process_is_one_line(runs):
    _, _, results = runs
    rc, out, err = results["bad_flag"]
    assert rc == 2 and "Traceback" not in err
    assert err.splitlines() == ["kestrel: error: --max-model-len 0: must be an integer >= 1"], err


ENGINE_FLAG_CASES = [
    (["--max-model-len", "0"], "--max-model-len 0"),
    (["--max-model-len", "-3"], "--max-model-len -3"),
    (["--max-model-len", "4097"], "past this model's limit of 4096"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0.0"),
    (["--gpu-memory-utilization", "1.01"], "--gpu-memory-utilization 1.01"),
    (["--gpu-memory-utilization", "-0.5"], "--gpu-memory-utilization -0.5"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization nan"),
    (["--memory-reserve", "-1"], "--memory-reserve -1.0"),
    (["--memory-reserve", "inf"], "--memory-reserve inf"),
    (["--page-size", "0"], "--page-size 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs 0"),
    (["--max-num-batched-tokens", "-1"], "--max-num-batched-tokens -1"),
    (["--kv-cache-tokens", "0"], "--kv-cache-tokens 0"),
    (["--kv-cache-bytes", "0"], "--kv-cache-bytes 0"),
    (["--kv-cache-tokens", "64", "--kv-cache-bytes", "99999"], "give one of them"),
    (["--seed", "-1"], "--seed -1"),
    (["--modeling", "require"], "--modeling require: no target claims"),   # tiny widths: no target's shape
    (["--device", "cpu", "--max-num-seqs", "100000000"], "need more than this machine's"),
    (["--device", "cpu", "--kv-cache-tokens", "100000000000"], "need more than this machine's"),
]
SAMPLING_FLAG_CASES = [
    (["--temperature", "-0.5"], "temperature"),
    (["--temperature", "nan"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-2"], "top_k"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--min-p", "1.5"], "min_p"),
    (["--seed-sampling", "-1"], "--seed-sampling"),
]


def flag_error(argv: list[str], capsys) -> str:
    capsys.readouterr()
    rc = main(["-q", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("kestrel: error:"), (rc, err)
    assert "truncated" not in err and "Traceback" not in err, err     # no weight was read
    return lines[0]


@pytest.mark.parametrize("flags,word", ENGINE_FLAG_CASES + SAMPLING_FLAG_CASES)
def test_generate_flag_is_checked_before_loading(runs, flags, word, capsys):
    _, bad, _ = runs
    msg = flag_error(["generate", "--model", bad["truncated_shard"], *flags, "Hello"], capsys)
    assert word in msg, msg


@pytest.mark.parametrize("command", [["bench", "throughput"], ["explain"], ["serve", "--port", "0"]])
@pytest.mark.parametrize("flags,word", [ENGINE_FLAG_CASES[0], ENGINE_FLAG_CASES[2], ENGINE_FLAG_CASES[4]])
def test_other_commands_check_engine_flags_before_loading(runs, command, flags, word, capsys):
    _, bad, _ = runs
    msg = flag_error([*command, "--model", bad["truncated_shard"], *flags], capsys)
    assert word in msg, msg


def test_load_format_auto_on_a_config_only_folder_names_random(capsys):
    path = os.path.join(scratch_dir("cli-cfg-only"), "m")
    assert main(["-q", "make-checkpoint", "--preset", "k3-tiny", "--config-only", "--out", path]) == 0
    assert sorted(os.listdir(path)) == ["config.json", "tiktoken.model", "tokenizer_config.json"]
    msg = flag_error(["generate", "--model", path, "Hello"], capsys)
    assert "no *.safetensors" in msg and "--load-format random" in msg
    capsys.readouterr()
    assert main(["-q", "generate", "--model", path, "--load-format", "random", "--max-tokens", "6", "Hello"]) == 0
    out = capsys.readouterr().out
    expected = LLM(model=path, dtype="float32", device="cpu", load_format="random").generate(
        "Hello", SamplingParams(temperature=0, max_tokens=6))[0]
    assert out == printable(expected.text) + "\n" and expected.token_ids


def test_printable_escapes_control_characters():
    text = "red \x1b[31mX\x1b[0m\r\n\tok \x07\x00\x7f\x9b \u202eevil\u2066 caf\u00e9 \U0001f600 \ud800"
    assert printable(text) == ("red \\x1b[31mX\\x1b[0m\\x0d\n\tok \\x07\\x00\\x7f\\x9b \\u202eevil\\u2066 caf\u00e9 "
                               "\U0001f600 \\ud800")
    printable(text).encode("utf-8")                        # no lone surrogate is left to fail the write


def test_progress_bar_only_on_a_terminal(monkeypatch):
    import io
    import sys
    from kestrel.models.kimi.weights import progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress_bar(10, "loading weights") is None
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = progress_bar(10, "loading weights")
    assert bar is not None
    bar.update(10)
    bar.close()


def test_http_client_loggers_are_quiet(capsys):
    import logging
    main(["-q", "make-checkpoint", "--preset", "k3-tiny", "--config-only", "--out",
          os.path.join(scratch_dir("cli-quiet"), "m")])
    for name in ("httpx", "httpcore"):
        assert logging.getLogger(name).getEffectiveLevel() >= logging.WARNING


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_make_checkpoint_files_share_one_mode(umask):
    from kestrel.models.kimi.checkpoint import make_checkpoint
    out = os.path.join(scratch_dir("cli-mode"), "m")
    old = os.umask(umask)
    try:
        make_checkpoint("kimi-linear-tiny", out, layers=1)
    finally:
        os.umask(old)
    modes = {fn: oct(os.stat(os.path.join(out, fn)).st_mode & 0o777) for fn in os.listdir(out)}
    assert any(fn.endswith(".safetensors") for fn in modes) and "config.json" in modes
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


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


def test_bench_report_path_is_checked_before_loading(runs, capsys):
    _, bad, _ = runs
    out = os.path.join(scratch_dir("cli-bench"), "no-such-dir", "report.json")
    msg = flag_error(["bench", "throughput", "--model", bad["truncated_shard"], "--out", out], capsys)
    assert "--out" in msg and "no-such-dir" in msg
