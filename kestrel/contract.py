"""Executable rules of the catalog / target design, read from the code itself (used by tests/test_contract.py).

Each check takes a package name, so a test can point it at a deliberately broken package in a temp directory and
see it fail. A check returns the list of problems found (empty = the rule holds).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil

from kestrel.catalog import all_entries
from kestrel.catalog._op import Arch, missing_members
from kestrel.config import FP8_WEIGHT_READS

# What a target may import: the catalog, the config, and torch for buffers and views (never for math).
TARGET_IMPORTS = ("kestrel.catalog", "kestrel.config", "torch", "__future__", "dataclasses", "typing", "math")
# torch calls that do math: a target must reach these through a catalog entry.
TORCH_MATH = {"matmul", "mm", "bmm", "einsum", "softmax", "sigmoid", "exp", "tanh", "rsqrt", "topk", "sort",
              "addmm", "baddbmm", "conv1d", "linear", "embedding", "logsumexp", "cumsum", "silu", "softplus",
              "scaled_dot_product_attention", "layer_norm", "rms_norm", "log_softmax"}


def check_entries(package: str = "kestrel.catalog") -> list[str]:
    """Every entry has every member of the contract, every cell is run by the cell driver on some arch, and every
    cell names the widths a launch is matched on (`check_target_widths`)."""
    problems = []
    for entry in all_entries(package):
        miss = missing_members(entry)
        if miss:
            problems.append(f"{entry.__module__}.{entry.__name__}: missing {', '.join(miss)}")
            continue
        for i, cell in enumerate(entry.CELLS):
            if not set(cell.archs) & set(entry.ARCHS):
                problems.append(f"{entry.__name__} cell {i} ({cell.why!r}) runs on {cell.archs}, the entry only on "
                                f"{entry.ARCHS}: no test drives it")
            if not cell.why:
                problems.append(f"{entry.__name__} cell {i} does not say which model / deployment needs it")
            try:
                widths = entry.cell_widths(cell.spec)
            except KeyError as e:
                problems.append(f"{entry.__name__} cell {i} ({cell.why!r}) lacks the width {e} a launch is matched on")
                continue
            if set(widths) != set(entry.WIDTHS):
                problems.append(f"{entry.__name__}.cell_widths gives {sorted(widths)}, "
                                f"WIDTHS names {list(entry.WIDTHS)}")
        if not any(Arch.CPU in c.archs for c in entry.CELLS) and Arch.CPU in entry.ARCHS:
            problems.append(f"{entry.__name__}: claims the CPU but has no CPU cell, so CI never runs it")
    return problems


def _imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append(("." * node.level) + (node.module or ""))
    return out


def check_target_source(name: str, source: str) -> list[str]:
    """A target's modules import only the catalog and config (and torch for buffers) and do no math themselves."""
    problems = []
    tree = ast.parse(source)
    for mod in _imports(tree):
        if mod.startswith(".") or not mod.startswith(TARGET_IMPORTS):
            problems.append(f"{name}: imports {mod}: a target imports only kestrel.catalog and kestrel.config "
                            "(a helper two targets need becomes a catalog entry)")
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            problems.append(f"{name} line {node.lineno}: matmul with @ outside a catalog entry")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TORCH_MATH:
            base = node.func.value
            if isinstance(base, ast.Name) and base.id in ("torch", "F", "nn"):
                problems.append(f"{name} line {node.lineno}: {base.id}.{node.func.attr} outside a catalog entry")
            elif isinstance(base, ast.Attribute) and base.attr in ("functional", "nn"):
                problems.append(f"{name} line {node.lineno}: torch.nn.functional.{node.func.attr} outside a catalog entry")
    return problems


def check_targets(package: str = "kestrel.models.kimi.targets") -> list[str]:
    """Targets import only the catalog and config, never another target; folder names match their claims."""
    from kestrel.models.kimi.routing import CRITERIA, folder_parts, load_claim, target_names
    problems = []
    pkg = importlib.import_module(package)
    for name in target_names(package):
        folder = os.path.join(os.path.dirname(pkg.__file__), name)
        for fn in sorted(os.listdir(folder)):
            if fn.endswith(".py"):
                with open(os.path.join(folder, fn)) as f:
                    problems += check_target_source(f"{name}/{fn}", f.read())
        try:
            ckpt, arch, _variant = folder_parts(name)
            claim = load_claim(name, package)
        except (ValueError, ImportError, AttributeError) as e:
            problems.append(f"{name}: {e}")
            continue
        missing = [c for c in CRITERIA if c not in claim]
        if missing:
            problems.append(f"{name}: claim lacks criteria {missing}")
            continue
        model, _, quant = ckpt.rpartition("_")
        if claim["shape fingerprint"].get("arch") != model:
            problems.append(f"{name}: folder says checkpoint {model!r}, claim fingerprint says "
                            f"{claim['shape fingerprint'].get('arch')!r}")
        if str(claim["quant"]).split()[0] != quant:      # "mxfp4 experts": the folder names the format
            problems.append(f"{name}: folder says weights {quant!r}, claim says {claim['quant']!r}")
        if claim["arch"] != arch:
            problems.append(f"{name}: folder says arch {arch!r}, claim says {claim['arch']!r}")
    return problems


def check_target_launches(module) -> list[str]:
    """Every class a target's modeling module calls `.raw_call` on is a catalog entry."""
    problems = []
    entries = set(all_entries())
    src = inspect.getsource(module)
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Attribute) and node.attr == "raw_call" and isinstance(node.value, ast.Name):
            obj = getattr(module, node.value.id, None)
            if obj not in entries:
                problems.append(f"{module.__name__}: {node.value.id}.raw_call is not a catalog entry")
    return problems


def iter_target_modules(package: str = "kestrel.models.kimi.targets"):
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, prefix=package + "."):
        if info.name.endswith(".modeling"):
            yield importlib.import_module(info.name)


# ------------------------------------------------------------------------------------------ launched widths

# Real-width presets, each routed to the target that claims it: the widths a target launches come from its claim.
REAL_PRESETS = ("k3", "kimi-linear-48b")
LAUNCH_LAYERS = 2          # layer 0: KDA + dense MLP; layer 1: MLA + MoE (both kinds of mixer and of FFN)
PAGE_SIZE = 64             # the engine's default page size


def _meta_model(config, dtype, fp8_weight_read: str = "none"):
    """The reference model at `config`'s widths with every parameter on the meta device, in the loader's dtypes;
    the weights a quantized config quantizes are meta `QuantizedWeight`s, as the loader installs them, and so are
    those `fp8_weight_read` converts (FP8 per channel, as kestrel/models/kimi/fp8_read.py stores them)."""
    import torch

    from kestrel.models.kimi.reference import KimiModel
    from kestrel.models.kimi.weights import FP32_PARAMS, expected_tensors, quantized_linears
    from kestrel.quant.tensors import QuantizedWeight
    with torch.device("meta"):
        model = KimiModel(config)
    stored = {p.param: p.quant for p in expected_tensors(config, quantized_linears(config)).values() if p.quant}
    if fp8_weight_read != "none":
        from kestrel.models.kimi.fp8_read import moe_mlp_groups
        stored.update({n: ("fp8", "channel") for g in moe_mlp_groups(config) for n in g if n not in stored})
    for name, p in list(model.named_parameters()):
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        if name in stored:
            delattr(mod, attr)
            layout = config.quant.layout if config.quant else "compressed-tensors"
            mod.add_module(attr, QuantizedWeight(layout, *stored[name], tuple(p.shape), dtype, "meta"))
            continue
        pdtype = torch.float32 if FP32_PARAMS.search(name) else dtype
        setattr(mod, attr, torch.nn.Parameter(torch.empty(p.shape, dtype=pdtype, device="meta"),
                                              requires_grad=False))
    return model.eval()


def claimed_config(preset: str, claim: dict, layers: int = 2):
    """The preset cut to `layers` layers, stored as the claim's `quant` says: "mxfp4 experts" adds the
    `quantization_config` of `make-checkpoint --quant mxfp4` (compressed-tensors), "bf16" none."""
    from kestrel.config import ModelConfig
    from kestrel.models.kimi.checkpoint import preset_config
    from kestrel.quant.formats import FORMATS
    from kestrel.quant.quantize import config_quantization
    raw = preset_config(preset, layers)
    fmt = str(claim["quant"]).split()[0]
    if fmt in FORMATS:
        modules = "experts" if str(claim["quant"]).endswith(" experts") else "all-linear"
        raw["quantization_config"] = config_quantization(ModelConfig.from_dict(raw), fmt, modules)
    return ModelConfig.from_dict(raw)


def launch_steps(config, max_new: int = 20, kv: str = "bf16"):
    """(name, StepBatch, CachePools) for the step shapes a server runs: decode, speculative verify (both segments
    verify blocks, committed after the step by `check_target_widths`), a fresh
    prefill longer than a verify block, a chunk continuing a cached prompt mixed with decodes and a snapshot.
    Activations stay a few tokens long, so the steps run on the CPU at real widths. `kv`: every MLA layer's page
    format (bf16 | fp8 | nvfp4)."""
    import torch

    from kestrel.models.kimi.step import CachePools, StepBatch, page_formats
    shapes = {"decode": [(5, 1), (70, 1), (0, 1)], "verify": [(9, 4), (30, 4)], "prefill": [(0, max_new)],
              "chunked prefill + decode": [(64, 12), (3, 1)]}
    max_len = max(c + n for segs in shapes.values() for c, n in segs)
    pages_per_req = -(-max_len // PAGE_SIZE)
    formats = page_formats(config, torch.bfloat16, {i: kv for i in config.mla_layers})
    out = []
    for name, segs in shapes.items():
        B = len(segs)
        pools = CachePools.allocate(config, B * pages_per_req + 1, PAGE_SIZE, B + 1, torch.bfloat16, "cpu",
                                    layers=list(range(config.num_layers)), kv_formats=formats)
        cu, positions = [0], []
        for c, n in segs:
            cu.append(cu[-1] + n)
            positions += range(c, c + n)
        tables = torch.arange(B * pages_per_req, dtype=torch.int32).view(B, pages_per_req)
        snaps = [(0, B)] if name.startswith("chunked") else []
        batch = StepBatch(token_ids=torch.zeros(cu[-1], dtype=torch.int64), positions=torch.tensor(positions),
                          cu_seqlens=cu, context_lens=[c for c, _ in segs], slots=torch.arange(B),
                          block_tables=tables, logits_indices=torch.tensor([e - 1 for e in cu[1:]]),
                          snapshots=snaps, host_slots=list(range(B)),
                          verify_segments=tuple(range(B)) if name == "verify" else ())
        out.append((name, batch, pools))
    return out


def check_target_widths(package: str = "kestrel.models.kimi.targets", presets=REAL_PRESETS) -> list[str]:
    """Every (entry, widths) a target launches at its claimed widths is one of that entry's cells.

    Each real-width preset (cut to LAUNCH_LAYERS layers: the widths, not the depth, decide the launches) is routed
    at every target's arch / quant (a quantized claim's preset carries that quantization_config, `claimed_config`);
    the chosen target is built on meta-device weights (quantized ones as meta `QuantizedWeight`s) and run over
    `launch_steps` with the catalog's raw_calls recording (`LaunchLog`), once per `--fp8-weight-read` value (the
    engine flag that stores the MoE blocks' bf16 projections FP8 whatever target runs them) over bf16 pages, and
    once more per quantized page format the claim's `kv dtype` names (a per-layer mix launches what its formats
    launch one by one). A target no preset
    routes to is a problem too: its claim names widths no model has."""
    import torch

    from kestrel.catalog._op import LaunchLog
    from kestrel.models.kimi.routing import ModelingContext, load_claim, route, target_names
    problems, reached = [], set()
    entries = all_entries()
    for name in target_names(package):
        claim = load_claim(name, package)
        for preset in presets:
            config = claimed_config(preset, claim, LAUNCH_LAYERS)
            spec = claim["spec"] if isinstance(claim["spec"], str) else claim["spec"][-1]   # a claimed method
            kvs = [claim["kv dtype"]] if isinstance(claim["kv dtype"], str) else list(claim["kv dtype"])
            ctx = ModelingContext(config=config, arch=claim["arch"], quant=claim["quant"],
                                  kv_cache_dtype=kvs[0], spec=spec, layout=claim["layout"])
            chosen, _ = route(ctx, "auto", package)
            if chosen != name:
                continue
            reached.add(name)
            seen = set()        # an uncertified launch the flag does not change is reported once
            pages = [kv for kv in ("fp8", "nvfp4") if kv in kvs]       # the quantized single-format claims
            runs = [(read, "bf16") for read in FP8_WEIGHT_READS] + [("none", kv) for kv in pages]
            for read, kv in runs:
                target = importlib.import_module(f"{package}.{name}.modeling").build(
                    _meta_model(config, torch.bfloat16, read), config)
                log = LaunchLog()
                with log.recording(entries):
                    for _step_name, batch, pools in launch_steps(config, kv=kv):
                        target(batch, pools)
                        if batch.verify_segments and getattr(target, "supports_verify", False):
                            # the replay of the accepted tokens: 2 of one block, all of the other
                            target.commit_verify([2, batch.seq_len(1)], pools)
                at = f"{preset}'s widths" + (f" with --fp8-weight-read {read}" if read != "none" else "") + \
                    (f" over {kv} pages" if kv != "bf16" else "")
                if not log.launches:
                    problems.append(f"{name}: launched no catalog entry at {at}")
                problems += [f"{name} at {at}: {p}" for p in log.uncertified() if p not in seen]
                seen.update(log.uncertified())
    for name in target_names(package):
        if name not in reached:
            problems.append(f"{name}: no real-width preset ({', '.join(presets)}) routes to it")
    return problems
