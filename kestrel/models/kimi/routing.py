"""Choosing a fast path: `route(ctx)` walks the targets' claims one criterion at a time.

A target is a folder `targets/<ckpt>__<arch>__<variant>/` whose `features.py` holds `CLAIM`: what it needs of the
engine's `ModelingContext` (fixed for the engine's life). Each criterion compared is recorded in a `Trace`, so
`kestrel explain` prints why a target was chosen or refused, and `--modeling require` names the first criterion
that missed. Claims look at the checkpoint's widths, never its layer count: a real-width checkpoint with four layers
routes like the full model.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from functools import cached_property

from kestrel.config import ModelConfig
from kestrel.errors import KestrelError

CRITERIA = ("shape fingerprint", "arch", "quant", "kv dtype", "spec", "layout")
MODELING_MODES = ("off", "auto", "require")


@dataclass(frozen=True)
class ModelingContext:
    config: ModelConfig
    arch: str                    # "cpu", "sm_90", ...
    quant: str = "bf16"          # the model dtype: bf16 | fp32 (a quantized checkpoint's format: weight_format)
    kv_cache_dtype: str = "bf16"
    spec: str = "none"           # speculative decoding: none | ngram | dspark
    layout: str = "tp1"          # parallel layout: tp1 | tpN | depN | helixN

    @cached_property
    def weight_format(self) -> str:
        """What the `quant` criterion compares: a quantized checkpoint's stored format (mxfp4, nvfp4, fp8, ...,
        from its quantization config), whatever dtype the engine computes in, with " experts" when only the
        routed experts are stored so (K3's checkpoints: FP4 experts, bf16 trunk); else `quant` (the model dtype).
        Which layers are quantized is judged on the Moonshot names make-checkpoint / kestrel quantize write."""
        q = self.config.quant
        if q is None:
            return self.quant
        from kestrel.models.kimi.weights import expected_tensors, quantized_linears
        table = expected_tensors(self.config)
        names = quantized_linears(self.config, table, first_expert_only=True)
        experts_only = bool(names) and all(table[n].index is not None for n in names)
        return q.weight_format + (" experts" if experts_only else "")

    def fingerprint(self) -> dict:
        """The widths that decide which kernels fit: everything but the layer count."""
        c = self.config
        return {"arch": c.arch, "hidden": c.hidden_size, "heads": c.num_heads, "q_lora": c.q_lora_rank,
                "kv_lora": c.kv_lora_rank, "rope": c.qk_rope_head_dim, "kda_heads": c.kda_num_heads,
                "kda_head_dim": c.kda_head_dim, "experts": c.num_experts, "top_k": c.num_experts_per_tok,
                "latent": c.routed_expert_hidden_size, "act": c.hidden_act}


@dataclass
class Check:
    criterion: str
    wanted: object
    got: object
    ok: bool


@dataclass
class Trace:
    target: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks) and len(self.checks) == len(CRITERIA)

    def first_miss(self) -> Check | None:
        return next((c for c in self.checks if not c.ok), None)

    def lines(self) -> list[str]:
        out = [f"target {self.target}: {'CLAIMS' if self.ok else 'declines'}"]
        for c in self.checks:
            out.append(f"  {'ok  ' if c.ok else 'MISS'} {c.criterion}: wanted {c.wanted}, got {c.got}")
        return out


class NoTarget(KestrelError):
    def __init__(self, traces: list[Trace]):
        self.traces = traces
        if not traces:
            msg = "--modeling require: no fast-path target exists; use --modeling auto or off"
        else:
            best = max(traces, key=lambda t: sum(c.ok for c in t.checks))
            miss = best.first_miss()
            msg = (f"--modeling require: no target claims this engine; closest {best.target} missed "
                   f"'{miss.criterion}' (wanted {miss.wanted}, got {miss.got}); use --modeling auto to fall back "
                   "to the reference implementation")
        super().__init__(msg)


def _matches(wanted: object, got: object) -> bool:
    if isinstance(wanted, (tuple, list, set, frozenset)):
        return got in wanted
    return wanted == got


def check_claim(name: str, claim: dict, ctx: ModelingContext) -> Trace:
    """Compare one target's claim with the context, criterion by criterion (all of them, so `explain` shows every
    one; `first_miss` is the one `require` reports)."""
    trace = Trace(name)
    got = {"shape fingerprint": ctx.fingerprint(), "arch": ctx.arch, "quant": ctx.weight_format,
           "kv dtype": ctx.kv_cache_dtype, "spec": ctx.spec, "layout": ctx.layout}
    for criterion in CRITERIA:
        wanted = claim[criterion]
        if criterion == "shape fingerprint":
            fp = got[criterion]
            diff = {k: fp.get(k) for k, v in wanted.items() if fp.get(k) != v}
            ok = not diff
            trace.checks.append(Check(criterion, {k: wanted[k] for k in diff} or "match", diff or "match", ok))
        else:
            ok = _matches(wanted, got[criterion])
            trace.checks.append(Check(criterion, wanted, got[criterion], ok))
    return trace


def target_names(package: str = "kestrel.models.kimi.targets") -> list[str]:
    pkg = importlib.import_module(package)
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.ispkg and "__" in m.name)


def load_claim(name: str, package: str = "kestrel.models.kimi.targets") -> dict:
    return importlib.import_module(f"{package}.{name}.features").CLAIM


def route(ctx: ModelingContext, modeling: str = "auto",
          package: str = "kestrel.models.kimi.targets") -> tuple[str | None, list[Trace]]:
    """(target name or None for the reference implementation, the traces of every target considered)."""
    if modeling not in MODELING_MODES:
        raise KestrelError(f"--modeling {modeling!r}: use off, auto or require")
    if modeling == "off":
        return None, []
    traces = [check_claim(n, load_claim(n, package), ctx) for n in target_names(package)]
    chosen = next((t.target for t in traces if t.ok), None)
    if chosen is None and modeling == "require":
        raise NoTarget(traces)
    return chosen, traces


def explain(ctx: ModelingContext, modeling: str = "auto") -> str:
    """The text of `kestrel explain`: every target's criteria, then the decision."""
    lines = [f"context: arch={ctx.arch} quant={ctx.weight_format} kv dtype={ctx.kv_cache_dtype} spec={ctx.spec} "
             f"layout={ctx.layout}", f"shape fingerprint: {ctx.fingerprint()}"]
    if modeling == "off":
        return "\n".join(lines + ["--modeling off: the reference implementation, no target is considered"])
    chosen, traces = route(ctx, "auto")
    for t in traces:
        lines += t.lines()
    if chosen:
        lines.append(f"decision: target {chosen}")
    elif modeling == "require":
        lines.append(f"decision: error: {NoTarget(traces)}")
    else:
        lines.append("decision: fallback to the reference implementation (no target claims this context)")
    return "\n".join(lines)


def folder_parts(name: str) -> tuple[str, str, str]:
    """`<ckpt>__<arch>__<variant>` -> its three parts (the contract test checks them against the claim)."""
    parts = name.split("__")
    if len(parts) != 3:
        raise ValueError(f"target folder {name!r} is not <ckpt>__<arch>__<variant>")
    return parts[0], parts[1], parts[2]
