"""What two servers must agree on before a request's state can move between them, and the comparison.

The layout is plain data (it goes into the discovery YAML and over the transport's handshake): the page size,
every MLA layer with its KV dtype and width (the drafter's appended layers are more entries), every KDA layer with
its conv and recurrent state dtypes and shapes, the model's fingerprint and the parallel layout. `first_difference`
walks two layouts in a fixed order and names the first field that differs, so a refusal says what to fix.
"""

from __future__ import annotations

import torch

from kestrel.errors import KestrelError


class LayoutMismatch(KestrelError):
    """Two servers' cache layouts differ: the message names the first difference."""


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def cache_layout(cache, model_config=None, parallel: dict | None = None) -> dict:
    """The layout of a HybridCache's pools, layer by layer (every key of every pool, extra layers included)."""
    p = cache.pools
    out = {
        "page_size": p.page_size,
        "mla_layers": sorted(int(i) for i in p.mla),
        # the page format (bf16 / fp8 / nvfp4 rows: quantized pages are uint8 bytes), else the pages' dtype
        "kv_dtypes": {int(i): (p.page_format(i).kind if p.page_format(i) is not None else _dt(t))
                      for i, t in sorted(p.mla.items())},
        "mla_width": {int(i): int(t.shape[-1]) for i, t in sorted(p.mla.items())},
        "kda_layers": sorted(int(i) for i in p.conv),
        "kda_state_dtypes": {int(i): [_dt(p.conv[i]), _dt(p.recurrent[i])] for i in sorted(p.conv)},
        "kda_state_shapes": {int(i): [list(p.conv[i].shape[1:]), list(p.recurrent[i].shape[1:])]
                             for i in sorted(p.conv)},
        "parallel": parallel or {"tp": 1, "dp": 1, "ep": 1, "cp": 1},
    }
    if model_config is not None:
        c = model_config
        out["model"] = {"num_layers": c.num_layers, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size}
    return out


ORDER = ("model", "page_size", "mla_layers", "kv_dtypes", "mla_width", "kda_layers", "kda_state_dtypes",
         "kda_state_shapes", "parallel")


def _norm(v):
    """YAML / JSON turn int keys into strings: compare with string keys throughout."""
    if isinstance(v, dict):
        return {str(k): _norm(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    return v


def first_difference(a: dict, b: dict, names: tuple[str, str] = ("context", "generation")) -> str | None:
    """None when the layouts match, else one line naming the first field (and layer) that differs."""
    a, b = _norm(a), _norm(b)
    for key in ORDER + tuple(sorted((set(a) | set(b)) - set(ORDER))):
        x, y = a.get(key), b.get(key)
        if x == y:
            continue
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y), key=lambda s: (len(s), s)):
                if x.get(k) != y.get(k):
                    return (f"{key}[{k}]: {names[0]} has {_show(x.get(k))}, {names[1]} has {_show(y.get(k))}")
        if isinstance(x, list) and isinstance(y, list):
            extra = [v for v in x if v not in y][:1] or [v for v in y if v not in x][:1]
            if extra:
                who = names[0] if extra[0] in x else names[1]
                return f"{key}: {x} vs {y} (layer {extra[0]} only on the {who} side)"
        return f"{key}: {names[0]} has {_show(x)}, {names[1]} has {_show(y)}"
    return None


def _show(v) -> str:
    return "nothing" if v is None else str(v)


def check_match(a: dict, b: dict, names: tuple[str, str] = ("context", "generation")) -> None:
    why = first_difference(a, b, names)
    if why is not None:
        raise LayoutMismatch(f"cache layouts differ: {why}; start both servers with the same model, --dtype, "
                             "--page-size, drafter and parallel layout")


def check_own(layout: dict) -> None:
    """A one-sided launch (no peer known yet) checks what it can alone: every layer has its dtype and shapes."""
    for key in ("mla_layers", "kda_layers"):
        if not isinstance(layout.get(key), list):
            raise LayoutMismatch(f"the cache layout has no {key}")
    missing = [i for i in layout["mla_layers"] if str(i) not in _norm(layout["kv_dtypes"])]
    missing += [i for i in layout["kda_layers"] if str(i) not in _norm(layout["kda_state_dtypes"])]
    if missing:
        raise LayoutMismatch(f"the cache layout names no dtype for layer {missing[0]}")
