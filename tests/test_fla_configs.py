"""fla-core's kernel configs (kernels/kda/fla_tuning.py, `kestrel bench fla-configs`).

On the CPU: the dump -> load round trip through fla's own CachedAutotuner around a toy Triton kernel (never
launched: its autotuner's cache is filled by hand, as autotuning would), checked with fla's reader in a fresh
process under the environment the loader sets; the loader's refusals; the written JSON against fla's parser. On a
GPU: the command tunes the real KDA prefill (its autotuners benchmark), and a fresh process with its folder runs
the prefill without one autotuner benchmark, its output checked against the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl

from helpers import PYTHON, REPO
from kestrel.kernels.kda import fla_tuning

GPU = "NVIDIA H200"
FOLDER = "NVIDIA_H200"
TOY = "_toy_copy_kernel"
FWD_KERNELS = {"l2norm_fwd_kernel", "chunk_local_cumsum_vector_kernel", "chunk_kda_fwd_kernel_intra_token_parallel",
               "chunk_kda_fwd_kernel_inter_solve_fused", "recompute_w_u_fwd_kda_kernel",
               "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_gla_fwd_kernel_o"}


@triton.jit
def _toy_copy_kernel(x, y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < N), mask=offs < N)


TOY_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w, num_stages=s) for b in (16, 32) for w in (1, 2) for s in (2, 3)]
# (x dtype, N, index of the config the "autotune" chose): the key is N and both pointers' dtypes
TOY_CHOICES = ((torch.bfloat16, 4096, 5), (torch.float32, 128, 2))


def toy_autotuner():
    from fla.ops.utils.cache import fla_cache_autotune
    return fla_cache_autotune(configs=TOY_CONFIGS, key=["N"])(_toy_copy_kernel)


def toy_key(tuner, dtype, n):
    """The key triton's run() (and fla's CachedAutotuner) builds for a launch on x, y of `dtype` with N = n."""
    from fla.ops.utils.cache import AutotuneKey
    x = torch.empty(1, dtype=dtype)
    return AutotuneKey.build(tuner.arg_names, tuner.keys, (x, x, n), {})


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR", "FLA_GPU_NAME")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests"), REPO,
                                                                 os.environ.get("PYTHONPATH", "")]), **extra)
    return env


@pytest.fixture(scope="module")
def fla_cache():
    return pytest.importorskip("fla.ops.utils.cache", reason="fla-core cannot be imported here")


@pytest.fixture(scope="module")
def dumped(fla_cache, tmp_path_factory):
    """A toy CachedAutotuner with two chosen configs (and a plain Triton autotuner beside it), written by the dump's
    writer into root/NVIDIA_H200/."""
    tuner = toy_autotuner()
    for dtype, n, i in TOY_CHOICES:
        tuner.cache[toy_key(tuner, dtype, n).autotune_key] = TOY_CONFIGS[i]
    plain = triton.autotune(configs=TOY_CONFIGS, key=["N"])(_toy_copy_kernel)
    plain.cache[(7, "torch.float32", "torch.float32")] = TOY_CONFIGS[0]
    root = tmp_path_factory.mktemp("fla_configs")
    files = fla_tuning.tuned_kernel_files(GPU, tuners=[tuner, plain])
    paths = fla_tuning.write_kernel_files(root / FOLDER, files)
    return root, paths, fla_tuning.plain_tuned_kernels(tuners=[tuner, plain])


def test_written_json_is_fla_format(dumped, fla_cache):
    root, paths, plain = dumped
    assert [p.name for p in paths] == [f"{TOY}.json"]                 # the plain autotuner writes no file...
    assert plain == [TOY]                                              # ...and is reported instead
    data = json.loads(paths[0].read_text())
    parsed = fla_cache.KernelConfigFile.from_dict(paths[0], data)
    assert parsed is not None and parsed.kernel_name == TOY and len(parsed.autotune_entries) == 2
    import fla
    assert data["fla_version"] == fla.__version__ and data["triton_version"] == triton.__version__
    tuner = toy_autotuner()
    for dtype, n, i in TOY_CHOICES:
        entry = parsed.lookup_exact(toy_key(tuner, dtype, n))
        assert entry is not None and entry["config"] == fla_tuning.config_record(TOY_CONFIGS[i])
        assert set(entry["config"]) == {"kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg"}
    assert data["default_config"] == fla_tuning.config_record(TOY_CONFIGS[TOY_CHOICES[0][2]])


def test_merge_keeps_earlier_entries(dumped, tmp_path, fla_cache):
    """A second dump into the same folder adds its keys to the file; a file of another fla version is replaced."""
    root, paths, _ = dumped
    folder = tmp_path / FOLDER
    folder.mkdir()
    (folder / f"{TOY}.json").write_text(paths[0].read_text())
    tuner = toy_autotuner()
    tuner.cache[toy_key(tuner, torch.float16, 64).autotune_key] = TOY_CONFIGS[7]
    fla_tuning.write_kernel_files(folder, fla_tuning.tuned_kernel_files(GPU, tuners=[tuner]))
    merged = json.loads((folder / f"{TOY}.json").read_text())
    assert len(merged["autotune_entries"]) == 3
    assert merged["default_config"] == fla_tuning.config_record(TOY_CONFIGS[TOY_CHOICES[0][2]])
    old = dict(merged, fla_version="0.0.1")
    (folder / f"{TOY}.json").write_text(json.dumps(old))
    fla_tuning.write_kernel_files(folder, fla_tuning.tuned_kernel_files(GPU, tuners=[tuner]))
    assert len(json.loads((folder / f"{TOY}.json").read_text())["autotune_entries"]) == 1


LOAD_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from kestrel.kernels.kda import fla_tuning
    fla_tuning.prepare_fla_import(root=Path(sys.argv[1]))         # before fla's first import, as the runtime does
    env = {k: os.environ.get(k) for k in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}
    import test_fla_configs as T
    from fla.ops.utils import cache
    tuner = T.toy_autotuner()
    got = {}
    for dtype, n, i in T.TOY_CHOICES + ((T.torch.bfloat16, 8192, None), (T.torch.float16, 4096, None)):
        key = T.toy_key(tuner, dtype, n)
        got[f"{dtype}/{n}"] = cache.load_cached_config(T.TOY, key)
        tuner.maybe_load_cached_config(key=key, nargs={}, runtime_kwargs={})   # what CachedAutotuner.run does first
        cfg = tuner.cache.get(key.autotune_key)
        got[f"{dtype}/{n}/tuner"] = None if cfg is None else fla_tuning.config_record(cfg)
    print(json.dumps({"env": env, "mode": cache.FLA_CACHE_MODE.value, "got": got}))
""")


def run_load(root, **env) -> dict:
    r = subprocess.run([PYTHON, "-c", LOAD_SCRIPT, str(root)], env=clean_env(**env), cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_round_trip_through_fla(dumped):
    """The loader, run before fla's import in a fresh process, makes fla's own reader and CachedAutotuner return the
    dumped configs: exact keys, a new token count of the same structure (fuzzy), and nothing for another dtype."""
    root, _, _ = dumped
    res = run_load(root, FLA_GPU_NAME=GPU)
    assert res["env"] == {"FLA_CACHE_MODE": "fuzzy", "FLA_CONFIG_DIR": str(root / FOLDER)}
    assert res["mode"] == "fuzzy"
    got = res["got"]
    for dtype, n, i in TOY_CHOICES:
        want = fla_tuning.config_record(TOY_CONFIGS[i])
        assert got[f"{dtype}/{n}"] == want and got[f"{dtype}/{n}/tuner"] == want
    bf16 = fla_tuning.config_record(TOY_CONFIGS[TOY_CHOICES[0][2]])
    assert got["torch.bfloat16/8192"] == bf16 and got["torch.bfloat16/8192/tuner"] == bf16
    assert got["torch.float16/4096"] is None and got["torch.float16/4096/tuner"] is None     # fla autotunes it


def test_sanitize_matches_fla(fla_cache):
    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H200 NVL", "AMD Instinct MI300X", "  --  ",
                 "NVIDIA GeForce RTX 4090 (laptop)"):
        assert fla_tuning.sanitize_gpu_name(name) == fla_cache.sanitize_gpu_name(name)


def test_scan_finds_the_kda_prefill_autotuners(fla_cache):
    """The dump reads the autotuners bound in fla's modules: every kernel chunk_kda's forward launches is found,
    each a CachedAutotuner (so fla reads a file for it)."""
    pytest.importorskip("fla.ops.kda")
    tuners = {getattr(t, "kernel_name", None): t for t in fla_tuning.fla_autotuners()}
    assert FWD_KERNELS <= set(tuners)
    assert all(isinstance(tuners[k], fla_cache.CachedAutotuner) for k in FWD_KERNELS)


# ------------------------------------------------------------------------------------------- the loader's choice

def ship(tmp_path, version="0.6.0", gpu=FOLDER):
    folder = tmp_path / gpu
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "k.json").write_text(json.dumps({"kernel_name": "k", "fla_version": version, "autotune_entries": {}}))
    return folder


def test_loader_sets_fuzzy_mode_for_a_shipped_gpu(tmp_path):
    folder = ship(tmp_path)
    env, why = fla_tuning.shipped_env({}, GPU, "0.6.0", tmp_path)
    assert env == {"FLA_CONFIG_DIR": str(folder), "FLA_CACHE_MODE": "fuzzy"} and FOLDER in why


@pytest.mark.parametrize("user", [{"FLA_CACHE_MODE": "disabled"}, {"FLA_CACHE_MODE": "strict"},
                                  {"FLA_CONFIG_DIR": "elsewhere"}])
def test_loader_leaves_the_users_settings(tmp_path, user):
    ship(tmp_path)
    env, why = fla_tuning.shipped_env(user, GPU, "0.6.0", tmp_path)
    assert env is None and "user" in why


def test_loader_needs_a_folder_for_this_gpu(tmp_path):
    ship(tmp_path)
    assert fla_tuning.shipped_env({}, "NVIDIA H100 80GB HBM3", "0.6.0", tmp_path)[0] is None
    (tmp_path / "NVIDIA_B200").mkdir()                                  # a folder without files is no folder
    assert fla_tuning.shipped_env({}, "NVIDIA B200", "0.6.0", tmp_path)[0] is None


@pytest.mark.parametrize("installed", ["0.6.1", None])
def test_loader_needs_the_fla_version_the_files_were_tuned_with(tmp_path, installed):
    ship(tmp_path)
    env, why = fla_tuning.shipped_env({}, GPU, installed, tmp_path)
    assert env is None and "0.6.0" in why and str(installed) in why


def test_loader_refuses_mixed_versions(tmp_path):
    folder = ship(tmp_path)
    (folder / "other.json").write_text(json.dumps({"fla_version": "0.5.0"}))
    assert fla_tuning.shipped_env({}, GPU, "0.6.0", tmp_path)[0] is None


@pytest.mark.parametrize("case", ["user", "no folder", "fla imported", "dump"])
def test_prepare_changes_nothing_it_should_not(tmp_path, monkeypatch, case):
    """prepare_fla_import itself: no variable set when the user set one, no folder exists, fla was already imported
    (its mode is settled), or the dump asked fla to keep autotuning."""
    ship(tmp_path, version=fla_version_installed())
    monkeypatch.setattr(fla_tuning, "_prepared", False)
    monkeypatch.setenv("FLA_GPU_NAME", "NVIDIA B200" if case == "no folder" else GPU)
    for var in fla_tuning.USER_VARS:
        monkeypatch.delenv(var, raising=False)
    if case == "user":
        monkeypatch.setenv("FLA_CACHE_MODE", "strict")
    if case == "fla imported":
        monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", object())
    else:
        monkeypatch.delitem(sys.modules, "fla.ops.utils.cache", raising=False)
    before = {v: os.environ.get(v) for v in fla_tuning.USER_VARS}
    fla_tuning.prepare_fla_import(shipped=case != "dump", root=tmp_path)
    assert {v: os.environ.get(v) for v in fla_tuning.USER_VARS} == before
    assert fla_tuning._prepared


def fla_version_installed():
    import importlib.metadata
    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return "0.6.0"


def test_bench_command_needs_a_gpu(tmp_path, capsys):
    from kestrel.cli import main
    assert main(["-q", "bench", "fla-configs", "--out", str(tmp_path), "--device", "cpu"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_prefill_layouts_fit_the_budget():
    from kestrel.bench.fla_configs import prefill_layouts
    for budget in (1, 2, 33, 2048, 8192):
        layouts = prefill_layouts(budget)
        assert layouts[0] == [budget] and all(sum(s) == budget and min(s) >= 1 for s in layouts)
    assert len(prefill_layouts(2048)) == 3


def test_dump_plumbing_on_cpu(tmp_path, monkeypatch, fla_cache):
    """`dump_fla_configs` end to end with the prefill replaced by a stand-in that fills a toy autotuner (bound in a
    module under fla., as fla's own are) with one choice per head count: every model shape runs, each choice lands
    in the GPU's folder, and a shape seen twice (a --model folder of a preset's widths) runs once."""
    import types

    from kestrel.bench import fla_configs
    from kestrel.catalog.kda.chunk_fla import KdaChunkFla
    from kestrel.models.kimi.checkpoint import preset_config
    toy = toy_autotuner()
    module = types.ModuleType("fla.kestrel_toy")
    module.kernel = toy
    monkeypatch.setitem(sys.modules, "fla.kestrel_toy", module)
    calls = []

    def stand_in(q, k, v, g, beta, state, cu_seqlens, slots, out=None):
        calls.append((q.shape[1], cu_seqlens.numel() - 1))
        toy.cache[toy_key(toy, q.dtype, q.shape[1]).autotune_key] = TOY_CONFIGS[q.shape[1] % len(TOY_CONFIGS)]

    monkeypatch.setattr(KdaChunkFla, "raw_call", staticmethod(stand_in))
    monkeypatch.setattr(KdaChunkFla, "is_valid", staticmethod(lambda **kw: None))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(fla_tuning, "gpu_name", lambda device=None: GPU)
    model = tmp_path / "kl"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(preset_config("kimi-linear-48b")))
    shapes = fla_configs.head_shapes([str(model)], ["kimi-linear-48b", "k3"])
    assert [s[1:] for s in shapes] == [(32, 128), (96, 128)]
    folder, paths, plain, records = fla_configs.dump_fla_configs(torch.device("cpu"), str(tmp_path / "out"), shapes,
                                                                 [64])
    assert folder == str(tmp_path / "out" / FOLDER) and [p.name for p in paths] == [f"{TOY}.json"] and plain == []
    assert calls == [(32, 1), (32, 2), (32, 17), (96, 1), (96, 2), (96, 17)]
    assert [r["first"] for r in records] == [True, False, False, True, False, False]
    entries = json.loads(paths[0].read_text())["autotune_entries"].values()
    assert {e["autotune_key"][0]: e["config"]["kwargs"]["BLOCK"] for e in entries} == {
        32: TOY_CONFIGS[32 % 8].kwargs["BLOCK"], 96: TOY_CONFIGS[96 % 8].kwargs["BLOCK"]}


# ---------------------------------------------------------------------------------------------------------- GPU

COUNT_BENCHES = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch
    import triton.runtime.autotuner as at
    from kestrel.kernels.kda import fla_tuning
    benches = [0]
    bench = at.Autotuner._bench
    def counting(self, *a, **k):                 # one call per config an autotuner benchmarks
        benches[0] += 1
        return bench(self, *a, **k)
    at.Autotuner._bench = counting
""")
DUMP_RUN = COUNT_BENCHES + textwrap.dedent("""
    from kestrel.cli import main
    rc = main(["bench", "fla-configs", "--preset", "kimi-linear-48b", "--max-num-batched-tokens", "256",
               "--out", sys.argv[1]])
    print(json.dumps({"rc": rc, "benches": benches[0]}))
""")
SHIPPED_RUN = COUNT_BENCHES + textwrap.dedent("""
    fla_tuning.prepare_fla_import(torch.device("cuda"), root=Path(sys.argv[1]))
    from kestrel.catalog.kda._common import make_kda_inputs
    from kestrel.catalog.kda.chunk_fla import KdaChunkFla
    inputs = make_kda_inputs({"H": 32, "D": 128, "dtype": torch.bfloat16, "lens": [200, 56]}, "cuda",
                             torch.Generator().manual_seed(1))
    ref = KdaChunkFla.reference(**{k: v.clone() for k, v in inputs.items()})
    KdaChunkFla.compare(KdaChunkFla.raw_call(**inputs), ref)
    print(json.dumps({"benches": benches[0], "mode": os.environ.get("FLA_CACHE_MODE")}))
""")


def run_json(script: str, *args, env) -> dict:
    r = subprocess.run([PYTHON, "-c", script, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(540)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dump_then_start_without_autotuning(tmp_path, fla_cache):
    """The command tunes Kimi Linear's KDA shape (benchmarking configs) and writes the forward kernels' files; a
    fresh process with them runs the prefill with no autotuner benchmark, and its output matches the reference.
    FLA_CACHE_RESULTS=0: Triton's on-disk autotune cache would hide the difference."""
    env = clean_env(FLA_CACHE_RESULTS="0")
    dump = run_json(DUMP_RUN, str(tmp_path), env=env)
    assert dump["rc"] == 0 and dump["benches"] > 0
    folder = tmp_path / fla_tuning.sanitize_gpu_name(torch.cuda.get_device_name())
    assert FWD_KERNELS <= {p.stem for p in folder.glob("*.json")}
    for p in folder.glob("*.json"):
        assert fla_cache.KernelConfigFile.from_dict(p, json.loads(p.read_text())) is not None
    assert run_json(SHIPPED_RUN, str(tmp_path), env=env) == {"benches": 0, "mode": "fuzzy"}
