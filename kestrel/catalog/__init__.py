"""Every kernel a fast path launches, one entry per file, by category (see `_op.py` for the contract)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from kestrel.catalog._op import OpWrapper

CATEGORIES = ("gemm", "norm", "attention", "kda", "moe", "quant", "comm", "spec", "embedding")


def all_entries(package: str = __name__) -> list[type]:
    """Every `OpWrapper` subclass defined in a module under the catalog package, in a stable order."""
    root = importlib.import_module(package)
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
        if info.name.rsplit(".", 1)[-1].startswith("_"):
            continue
        mod = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, OpWrapper) and obj is not OpWrapper and obj.__module__ == mod.__name__:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]
