"""fla-core's kernel configs: the ones Kestrel ships per GPU (read), and the ones fla's autotuners chose (written).

fla-core's Triton kernels autotune on their first call for each key (head count, head dims, dtypes...): on a cold
H200 that is a large part of start-up, and it happens in the warm-up before serving. fla 0.6 can read the chosen
configs from files instead (`fla/ops/utils/cache.py`): `FLA_CONFIG_DIR` holds one `{kernel_name}.json` per kernel
(`autotune_entries`: {md5 of the key: {autotune_key, config}}, and an optional `default_config`), and
`FLA_CACHE_MODE` says how to look them up. FLA_CACHE_MODE is read once, when fla is imported, so
`prepare_fla_import` must run before the first import of fla in the process (`fla_chunk.import_chunk_kda` calls it).

Reading. Unless the user set FLA_CACHE_MODE or FLA_CONFIG_DIR, a process whose GPU has a folder under
`fla_configs/` (named by fla's own rule for GPU names) points FLA_CONFIG_DIR at it with FLA_CACHE_MODE=fuzzy: an
exact key match first, then an entry of the same structure with other numbers, else fla autotunes as before. fla
also autotunes when a file is missing, unreadable or malformed, or when a kernel's early pruning refuses the stored
config; a stored config it accepts is launched as is, so the folder is used only when every file was written by
the fla-core version installed (each file records it): another version may have other kernels or parameters.

Writing. `tuned_kernel_files` collects what the autotuners of fla's imported modules chose during this process
(`kestrel bench fla-configs` runs the KDA prefill at the targets' shapes first) and `write_kernel_files` merges
them into a folder in fla's format. Only fla's `CachedAutotuner` kernels read such files; plain Triton autotuners
are reported by `plain_tuned_kernels` (they tune at start-up whatever is shipped).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import sys
from pathlib import Path

import torch

log = logging.getLogger("kestrel.kernels")

CONFIG_ROOT = Path(__file__).with_name("fla_configs")
FLA_DISTRIBUTION = "fla-core"
USER_VARS = ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")
MODE = "fuzzy"

_prepared = False


def sanitize_gpu_name(name: str) -> str:
    """fla's folder name for a GPU (`fla.ops.utils.cache.sanitize_gpu_name`), restated here because fla cannot be
    imported before its environment is set: runs of anything but letters and digits become one '_'."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu"


def gpu_name(device=None) -> str:
    """The name fla would use: FLA_GPU_NAME when set, else the CUDA device's name, else 'cpu'."""
    if "FLA_GPU_NAME" in os.environ:
        return os.environ["FLA_GPU_NAME"]
    if torch.cuda.is_available():
        cuda = device is not None and torch.device(device).type == "cuda"
        return torch.cuda.get_device_name(device if cuda else None)
    return "cpu"


def _tuned_versions(folder: Path) -> set:
    versions = set()
    for f in folder.glob("*.json"):
        try:
            versions.add(json.loads(f.read_text()).get("fla_version"))
        except (OSError, ValueError, AttributeError):
            versions.add(None)          # fla skips such a file with a warning; it proves no version
    return versions


def shipped_folder(gpu: str, root: Path = CONFIG_ROOT) -> Path | None:
    """The folder of config files shipped for GPU `gpu`, or None when there is none (or it holds no file)."""
    folder = root / sanitize_gpu_name(gpu)
    return folder if folder.is_dir() and any(folder.glob("*.json")) else None


def shipped_env(environ, gpu: str, fla_version: str | None, root: Path = CONFIG_ROOT) -> tuple[dict | None, str]:
    """(the variables to set before importing fla, or None; why, in words) for a process on GPU `gpu` with
    fla-core `fla_version` installed. Pure: reads only `environ` and the folder under `root`."""
    if any(v in environ for v in USER_VARS):
        return None, "FLA_CACHE_MODE / FLA_CONFIG_DIR set by the user"
    folder = shipped_folder(gpu, root)
    if folder is None:
        return None, f"no fla kernel configs shipped for {sanitize_gpu_name(gpu)}"
    tuned = _tuned_versions(folder)
    if tuned != {fla_version}:
        found = ", ".join(sorted(str(v) for v in tuned))
        return None, (f"fla kernel configs in {folder} were tuned with fla-core {found}, installed: {fla_version}; "
                      "fla autotunes instead (kestrel bench fla-configs writes new ones)")
    return {"FLA_CONFIG_DIR": str(folder), "FLA_CACHE_MODE": MODE}, \
        f"fla-core: pre-tuned kernel configs for {folder.name} from {folder} (FLA_CACHE_MODE={MODE}; " \
        "set FLA_CACHE_MODE=disabled to autotune)"


def prepare_fla_import(device=None, shipped: bool = True, root: Path = CONFIG_ROOT) -> None:
    """Before the process's first import of fla: point fla at the configs shipped for this GPU (see the module
    docstring). Only the first call decides; `shipped=False` (the dump tool) keeps fla autotuning."""
    global _prepared
    if _prepared:
        return
    _prepared = True
    if not shipped:
        return
    if "fla.ops.utils.cache" in sys.modules:          # imported before us: its FLA_CACHE_MODE is settled
        log.debug("fla was imported before Kestrel could set FLA_CACHE_MODE; shipped configs not used")
        return
    try:
        version = importlib.metadata.version(FLA_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = None
    gpu = gpu_name(device)
    env, why = shipped_env(os.environ, gpu, version, root)
    if env is None:
        (log.debug if shipped_folder(gpu, root) is None else log.info)(why)      # no folder: most GPUs, no news
        return
    os.environ.update(env)
    log.info(why)


# ---------------------------------------------------------------------------------------------------- writing

def _autotuner_of(obj, depth: int = 4):
    """The Triton Autotuner inside `obj` (directly or under heuristics wrappers, through `.fn`), or None."""
    from triton.runtime.autotuner import Autotuner
    for _ in range(depth):
        if isinstance(obj, Autotuner):
            return obj
        try:
            obj = getattr(obj, "fn", None)
        except Exception:           # a module attribute with an odd __getattr__ is no kernel
            return None
        if obj is None:
            return None
    return None


def fla_autotuners() -> list:
    """Every distinct Triton autotuner bound in fla's imported modules, in module order."""
    seen, found = set(), []
    for name, module in sorted(list(sys.modules.items()), key=lambda item: item[0]):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for value in list(vars(module).values()):
            tuner = _autotuner_of(value)
            if tuner is not None and id(tuner) not in seen:
                seen.add(id(tuner))
                found.append(tuner)
    return found


def config_record(cfg) -> dict:
    """A triton.Config as fla's files hold it (what CachedAutotuner.maybe_load_cached_config reads back)."""
    rec = {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
           "num_ctas": cfg.num_ctas, "maxnreg": cfg.maxnreg}
    if getattr(cfg, "ir_override", None) is not None:
        rec["ir_override"] = cfg.ir_override
    return rec


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def kernel_entries(tuner) -> dict:
    """{key hash: {autotune_key, config}} for one autotuner's chosen configs, fla's hash of each key (an md5 of its
    canonical JSON). Configs with a pre_hook (which a file cannot hold) and keys JSON cannot hold are left out."""
    from fla.ops.utils.cache import AutotuneKey
    entries = {}
    for key, cfg in tuner.cache.items():
        key = AutotuneKey.normalize_autotune_key(list(key))
        if getattr(cfg, "pre_hook", None) is not None or not _jsonable(key):
            log.warning("fla kernel %s: config for key %s cannot be written to a file; left out",
                        getattr(tuner, "kernel_name", "?"), key)
            continue
        entries[AutotuneKey.key_hash(key)] = {"autotune_key": key, "config": config_record(cfg)}
    return entries


def tuned_kernel_files(gpu: str, tuners=None) -> dict[str, dict]:
    """{kernel name: file contents} for every fla CachedAutotuner that chose a config in this process (kernels of
    one name in two modules share a file, as fla looks files up by name)."""
    import triton

    import fla
    from fla.ops.utils.cache import CachedAutotuner
    files: dict[str, dict] = {}
    for tuner in fla_autotuners() if tuners is None else tuners:
        if not isinstance(tuner, CachedAutotuner) or not tuner.cache:
            continue
        f = files.setdefault(tuner.kernel_name, {
            "kernel_name": tuner.kernel_name, "gpu": gpu, "fla_version": fla.__version__,
            "triton_version": triton.__version__, "autotune_entries": {}})
        f["autotune_entries"].update(kernel_entries(tuner))
    for f in files.values():
        if f["autotune_entries"]:
            f["default_config"] = next(iter(f["autotune_entries"].values()))["config"]
    return {name: f for name, f in files.items() if f["autotune_entries"]}


def plain_tuned_kernels(tuners=None) -> list[str]:
    """Names of fla kernels under plain Triton autotuners that tuned in this process: fla reads no file for them."""
    from fla.ops.utils.cache import CachedAutotuner
    return sorted({getattr(t.base_fn, "__name__", "?") for t in (fla_autotuners() if tuners is None else tuners)
                   if not isinstance(t, CachedAutotuner) and t.cache})


def write_kernel_files(folder: Path, files: dict[str, dict]) -> list[Path]:
    """Write `files` into `folder` (created), merged with the files already there from the same fla-core version
    (new entries win on the same key; the first default_config stays). Returns the paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, new in files.items():
        path = folder / f"{name}.json"
        merged = dict(new)
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and old.get("fla_version") == new["fla_version"] \
                and isinstance(old.get("autotune_entries"), dict):
            merged["autotune_entries"] = {**old["autotune_entries"], **new["autotune_entries"]}
            merged["default_config"] = old.get("default_config") or new.get("default_config")
        elif old is not None:
            log.info("%s: written by another fla-core version (%s); replaced", path,
                     old.get("fla_version") if isinstance(old, dict) else "unreadable")
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(merged, indent=2) + "\n")
        os.replace(tmp, path)
        written.append(path)
    return written
