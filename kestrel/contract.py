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

# What a target may import: the catalog, the config, and torch for buffers and views (never for math).
TARGET_IMPORTS = ("kestrel.catalog", "kestrel.config", "torch", "__future__", "dataclasses", "typing", "math")
# torch calls that do math: a target must reach these through a catalog entry.
TORCH_MATH = {"matmul", "mm", "bmm", "einsum", "softmax", "sigmoid", "exp", "tanh", "rsqrt", "topk", "sort",
              "addmm", "baddbmm", "conv1d", "linear", "embedding", "logsumexp", "cumsum", "silu", "softplus",
              "scaled_dot_product_attention", "layer_norm", "rms_norm", "log_softmax"}


def check_entries(package: str = "kestrel.catalog") -> list[str]:
    """Every entry has every member of the contract, and every cell is run by the cell driver on some arch."""
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
        if claim["quant"] != quant:
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
