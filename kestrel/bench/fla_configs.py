"""`kestrel bench fla-configs`: tune fla-core's KDA prefill kernels on this GPU at the shapes the targets run, and
write what fla's autotuners chose as fla config files, OUT/<GPU name as fla writes it>/<kernel>.json.

Kestrel ships such a folder per GPU under `kestrel/kernels/kda/fla_configs/` (`kernels/kda/fla_tuning.py` points
fla at it before fla is imported), so start-up launches the stored configs instead of autotuning. The shapes: each
model's KDA heads x head dim (Kimi Linear 48B: 32 x 128, K3: 96 x 128) in bf16 with the fp32 recurrent state the
targets keep (a bf16 state runs the reference), and the chunked-prefill steps the scheduler makes under each
`--max-num-batched-tokens`: one full chunk, two halves, and a chunk beside decode rows (fla's keys hold head counts,
dims and dtypes, no token count but the l2norm kernel's bucket of 64K tokens, so these cover the keys serving
meets). Files already in the folder from the same fla-core version are merged, so runs for several models or
budgets add up.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from kestrel.errors import KestrelError

log = logging.getLogger("kestrel.bench")

DEFAULT_PRESETS = ("kimi-linear-48b", "k3")
DEFAULT_BUDGETS = (2048, 8192)


def prefill_layouts(budget: int) -> list[list[int]]:
    """Segment lengths of chunked-prefill steps within `budget` tokens: one chunk, two halves, 16 decode rows
    beside a chunk (the shapes of runtime/graphs.py's warm-up)."""
    layouts = [[budget]]
    if budget >= 2:
        layouts.append([budget // 2, budget - budget // 2])
    if budget > 32:
        layouts.append([1] * 16 + [budget - 16])
    return layouts


def head_shapes(models: list[str], presets: list[str]) -> list[tuple[str, int, int]]:
    """(label, KDA heads, head dim) of each model folder and preset, without repeats of a shape."""
    from kestrel.config import ModelConfig
    from kestrel.models.kimi.checkpoint import preset_config
    configs = [(m, ModelConfig.from_dir(m)) for m in models]
    configs += [(p, ModelConfig.from_dict(preset_config(p))) for p in presets]
    shapes, seen = [], set()
    for label, c in configs:
        if not c.kda_num_heads:
            raise KestrelError(f"{label}: the model has no KDA layers; fla's configs are for its KDA prefill")
        if (c.kda_num_heads, c.kda_head_dim) not in seen:
            seen.add((c.kda_num_heads, c.kda_head_dim))
            shapes.append((label, c.kda_num_heads, c.kda_head_dim))
    return shapes


def run_shapes(device: torch.device, shapes, budgets) -> list[dict]:
    """Run the fla KDA prefill entry at every shape (autotuning each new key); one record per call."""
    from kestrel.catalog.kda._common import make_kda_inputs
    from kestrel.catalog.kda.chunk_fla import KdaChunkFla
    records = []
    for label, H, D in shapes:
        first = True                        # the shape's first call is the one that autotunes
        for budget in budgets:
            layouts = prefill_layouts(budget)
            base = make_kda_inputs({"H": H, "D": D, "dtype": torch.bfloat16, "lens": [budget],
                                    "pool": max(len(s) for s in layouts) + 1},
                                   device, torch.Generator().manual_seed(0))
            for lens in layouts:
                cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
                slots = torch.arange(len(lens), dtype=torch.int32, device=device)
                inputs = {**base, "cu_seqlens": cu, "slots": slots}
                why = KdaChunkFla.is_valid(**inputs)
                if why:
                    raise KestrelError(f"{label}: fla's KDA prefill refuses {H} heads x {D}: {why}")
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                KdaChunkFla.raw_call(**inputs)
                torch.cuda.synchronize(device)
                rec = {"model": label, "H": H, "D": D, "segments": len(lens), "tokens": budget,
                       "seconds": time.perf_counter() - t0, "first": first}
                log.info("%s: %d heads x %d, %d tokens in %d segments: %.2f s%s", label, H, D, budget, len(lens),
                         rec["seconds"], " (autotuning)" if first else "")
                records.append(rec)
                first = False
            del base
    return records


def dump_fla_configs(device: torch.device, out: str, shapes, budgets) -> tuple[str, list, list, list]:
    """Tune at `shapes` and write the configs into out/<gpu>/. Returns (folder, paths written, plain-autotuner
    kernels that tuned, which fla cannot read configs for, run_shapes' records)."""
    from kestrel.kernels.kda import fla_tuning
    from kestrel.kernels.kda.fla_chunk import import_chunk_kda
    if os.environ.get("FLA_CACHE_MODE", "disabled") != "disabled":
        raise KestrelError(f"FLA_CACHE_MODE={os.environ['FLA_CACHE_MODE']}: fla would load stored configs instead "
                           "of tuning; unset it to write new ones")
    fla_tuning.prepare_fla_import(device, shipped=False)
    import_chunk_kda(device)
    import fla.ops.utils.cache as fla_cache
    if fla_cache.FLA_CACHE_MODE is not fla_cache.FlaCacheMode.DISABLED:
        raise KestrelError("fla was imported with its config cache on before the dump could turn it off; run "
                           "`kestrel bench fla-configs` in a fresh process without FLA_CACHE_MODE")
    records = run_shapes(device, shapes, budgets)
    gpu = fla_tuning.gpu_name(device)          # the name the loader will look up (FLA_GPU_NAME overrides)
    folder = os.path.join(out, fla_tuning.sanitize_gpu_name(gpu))
    files = fla_tuning.tuned_kernel_files(gpu)
    if not files:
        raise KestrelError("no fla autotuner chose a config in this run: nothing to write")
    paths = fla_tuning.write_kernel_files(folder, files)
    return folder, paths, fla_tuning.plain_tuned_kernels(), records


def register_fla_configs(bsub) -> None:
    p = bsub.add_parser("fla-configs", help="tune fla-core's KDA prefill on this GPU and write its kernel configs",
                        description="Run the fla KDA prefill at the targets' shapes so fla autotunes, then write "
                                    "every autotuner's choice in fla's config format into OUT/<GPU>/ (commit the "
                                    "folder under kestrel/kernels/kda/fla_configs/ to ship it).")
    p.add_argument("--out", required=True, help="folder; the files go to OUT/<GPU name>/ (merged with files there)")
    p.add_argument("--model", action="append", default=[], help="checkpoint folder whose KDA heads x head dim to "
                                                                "tune (repeatable; config.json is enough)")
    p.add_argument("--preset", action="append", default=[], choices=DEFAULT_PRESETS,
                   help="a preset's KDA shape (repeatable); with neither --model nor --preset: "
                        + " and ".join(DEFAULT_PRESETS))
    p.add_argument("--max-num-batched-tokens", type=int, action="append", default=[], dest="budgets",
                   help="a prefill chunk budget to run (repeatable; default %s)" % ", ".join(map(str, DEFAULT_BUDGETS)))
    p.add_argument("--device", default="cuda", help="cuda | cuda:N")
    p.set_defaults(func=cmd_fla_configs)


def cmd_fla_configs(args) -> int:
    from kestrel.kernels.kda.fla_chunk import FLA_HINT, fla_available
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise KestrelError(f"--device {args.device}: fla's configs are tuned on a CUDA GPU; run this on one")
    if not fla_available():
        raise KestrelError(FLA_HINT)
    budgets = args.budgets or list(DEFAULT_BUDGETS)
    if min(budgets) < 1:
        raise KestrelError("--max-num-batched-tokens must be >= 1")
    presets = args.preset or ([] if args.model else list(DEFAULT_PRESETS))
    t0 = time.perf_counter()
    folder, paths, plain, records = dump_fla_configs(device, args.out, head_shapes(args.model, presets), budgets)
    for path in paths:
        log.info("wrote %s", path)
    if plain:
        log.warning("these fla kernels tuned under Triton's own autotuner, which reads no fla config file (they "
                    "still tune at start-up): %s", ", ".join(plain))
    firsts = ", ".join(f"{r['H']} x {r['D']} {r['seconds']:.1f} s" for r in records if r["first"])
    rest = max([r["seconds"] for r in records if not r["first"]] or [0.0])
    print(f"{len(paths)} fla kernel config files in {folder} ({time.perf_counter() - t0:.0f} s); first call of each "
          f"shape (autotunes): {firsts}; slowest later call {rest:.2f} s")
    return 0
