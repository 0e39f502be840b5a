"""The catalog contract: what every kernel entry a fast path launches must carry.

An entry is a stateless class deriving from `OpWrapper`:
- `raw_call(**inputs)`: the hot path; every input explicit, may write into `out=`.
- `reference(**inputs)`: same signature and results (shapes, dtypes, in-place updates), plain torch, fp32 math
  (TF32 off) rounded once to the result's dtype.
- `is_valid(**inputs) -> str | None`: why the kernel would answer silently wrong for these inputs (layout, alignment,
  dtype, aliasing), or None. Never on the hot path: `validating(entry)` runs it before `raw_call` in tests.
- `compare(out, ref) -> None`: raises AssertionError past the tolerance; `TOLERANCE` says how it was derived.
- `make_inputs(spec, device, generator) -> dict`: fresh random inputs (never zeros) for one cell.
- `CELLS`: the shapes and dtypes the models really run, each `Cell(why, spec, archs)`.
- `ARCHS`: the architectures the kernel runs on.
- `WIDTHS` and `widths(**inputs) -> dict`: the spec keys a model's widths fix (hidden sizes, head counts, expert
  counts, dtypes, modes) and their values for one launch; token counts, batch sizes and context lengths are not
  widths, they change every step. `cell_widths(spec)` gives the same keys for a cell (by default the spec's own
  values), so a launch is certified when some cell's widths equal it (`LaunchLog`, the contract check).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch


class Arch:
    CPU = "cpu"          # Triton interpreter (TRITON_INTERPRET=1) or plain torch
    SM90 = "sm_90"       # Hopper: H100 / H200
    SM100 = "sm_100"     # Blackwell
    ALL = (CPU, SM90, SM100)


def current_arch(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type != "cuda":
        return Arch.CPU
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@dataclass(frozen=True)
class Cell:
    """One certified shape. `why` names the model and deployment that runs it; `archs` where the test runs it
    (tiny cells on the CPU interpreter, real widths only on GPUs)."""
    why: str
    spec: dict = field(default_factory=dict)
    archs: tuple[str, ...] = (Arch.SM90, Arch.SM100)


def tiny(why: str, **spec: Any) -> Cell:
    """A cell small enough for the Triton interpreter on the CPU; it runs on GPUs too."""
    return Cell(why, spec, archs=Arch.ALL)


def gpu(why: str, **spec: Any) -> Cell:
    return Cell(why, spec, archs=(Arch.SM90, Arch.SM100))


class InvalidInput(AssertionError):
    """`is_valid` refused the inputs: the kernel would have answered silently wrong."""


class OpWrapper:
    """Base of catalog entries. Subclasses define the members below; the contract test checks they all exist."""
    CELLS: ClassVar[tuple[Cell, ...]] = ()
    ARCHS: ClassVar[tuple[str, ...]] = ()
    TOLERANCE: ClassVar[str] = ""        # the one-line derivation of `compare`'s bound
    WIDTHS: ClassVar[tuple[str, ...]] = ()   # the spec keys a model's widths fix (not token counts)

    REQUIRED = ("raw_call", "reference", "is_valid", "compare", "make_inputs", "widths")

    @classmethod
    def name(cls) -> str:
        return f"{cls.__module__.split('catalog.', 1)[-1]}.{cls.__name__}"

    @classmethod
    def cell_widths(cls, spec: dict) -> dict:
        """The WIDTHS of a cell; entries whose call shows a width the spec derives (3*H*D channels) override."""
        return {k: spec[k] for k in cls.WIDTHS}


def missing_members(entry: type) -> list[str]:
    """Members of the contract that `entry` lacks."""
    missing = [m for m in OpWrapper.REQUIRED if not callable(getattr(entry, m, None))]
    for m in ("CELLS", "ARCHS", "TOLERANCE", "WIDTHS"):
        if not getattr(entry, m, None):
            missing.append(m)
    return missing


def overlaps(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two tensors share bytes (same storage and intersecting spans): `is_valid`'s aliasing check."""
    if a is None or b is None or a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        lo = t.data_ptr()
        return lo, lo + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float, what: str = "") -> None:
    """Elementwise |out - ref| <= atol + rtol * |ref|, reported with the worst element."""
    if out.shape != ref.shape:
        raise AssertionError(f"{what} shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o, r = out.detach().float().cpu(), ref.detach().float().cpu()
    if not torch.isfinite(o).all():
        raise AssertionError(f"{what} has non-finite values")
    err = (o - r).abs()
    bound = atol + rtol * r.abs()
    bad = err > bound
    if bad.any():
        i = int((err - bound).flatten().argmax())
        raise AssertionError(f"{what} {int(bad.sum())}/{o.numel()} elements off; worst at flat {i}: "
                             f"{o.flatten()[i].item():.6g} vs {r.flatten()[i].item():.6g} (rtol={rtol}, atol={atol})")


@contextlib.contextmanager
def validating(entry: type):
    """Within the block, `entry.raw_call` runs `entry.is_valid` first and raises `InvalidInput` on a refusal."""
    raw = entry.__dict__["raw_call"]
    fn = raw.__func__ if isinstance(raw, staticmethod) else raw

    def checked(*args: Any, **kwargs: Any) -> Any:
        why = entry.is_valid(*args, **kwargs)
        if why:
            raise InvalidInput(f"{entry.name()}: {why}")
        return fn(*args, **kwargs)

    setattr(entry, "raw_call", staticmethod(checked))
    try:
        yield entry
    finally:
        setattr(entry, "raw_call", raw)


class CallLog:
    """Counts which contract members ran, so a test that skipped the comparison fails (see tests/conftest.py)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    @contextlib.contextmanager
    def watching(self, entry: type):
        saved = {m: entry.__dict__[m] for m in ("raw_call", "reference", "compare") if m in entry.__dict__}
        for m, raw in saved.items():
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            setattr(entry, m, staticmethod(self._counted(m, fn)))
        try:
            yield entry
        finally:
            for m, raw in saved.items():
                setattr(entry, m, raw)

    def _counted(self, member: str, fn: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls[member] = self.calls.get(member, 0) + 1
            return fn(*args, **kwargs)
        return wrapped

    def missing(self) -> list[str]:
        return [m for m in ("raw_call", "reference", "compare") if not self.calls.get(m)]


NO_CLONE_BYTES = 1 << 30     # inputs this large (weights: a K3 expert stack is 39 GB) are not copied for the
                             # reference; run_cell checks instead that raw_call left them unchanged


def _fingerprint(t: torch.Tensor) -> tuple[float, float]:
    """The sum and the sum of squares, a chunk at a time (an fp32 copy of a 39 GB stack would not fit beside it)."""
    flat = t.reshape(-1)
    total = torch.zeros(2, dtype=torch.float64, device=t.device)
    for i in range(0, flat.numel(), 1 << 26):
        c = flat[i:i + (1 << 26)].double()
        total += torch.stack([c.sum(), (c * c).sum()])
    return tuple(total.tolist())


def run_cell(entry: type, cell: Cell, device: torch.device | str, seed: int = 0) -> None:
    """The one way a test drives a cell: fresh inputs, validated raw_call, fp32 reference, compare."""
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    inputs = entry.make_inputs(cell.spec, device, gen)

    def big(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and v.numel() * v.element_size() >= NO_CLONE_BYTES

    ref_inputs = {k: (v.clone() if isinstance(v, torch.Tensor) and not big(v) else v) for k, v in inputs.items()}
    before = {k: _fingerprint(v) for k, v in inputs.items() if big(v)}
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with validating(entry):
            out = entry.raw_call(**inputs)
        for k, fp in before.items():
            if _fingerprint(inputs[k]) != fp:
                raise AssertionError(f"{entry.name()}: raw_call wrote into its input {k!r}")
        ref = entry.reference(**ref_inputs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    entry.compare(out, ref)


def certifying_cells(entry: type, widths: dict) -> list[Cell]:
    """The cells of `entry` whose widths are `widths`."""
    return [c for c in entry.CELLS if entry.cell_widths(c.spec) == widths]


class LaunchLog:
    """Within `recording(entries)`, each entry's `raw_call` records the launch's widths and answers with its
    `reference` run on the meta device instead of the kernel: a target's forward runs at real widths (weights on
    the meta device, activations of a few tokens on the CPU) with no GPU and no weights, and every launch it makes
    is logged. Floating tensors go to the meta device for the reference; integer tensors (lengths, slots, ids,
    block tables) stay where they are, so the reference's host-side loops still run. Results come back as CPU
    zeros of the reference's shape and dtype (values never decide a width), or as the caller's own tensor where
    the reference updated an input in place (state pools, caches, residuals)."""

    def __init__(self) -> None:
        self.launches: dict[tuple, tuple[type, dict, int]] = {}   # (entry, widths) -> (entry, widths, count)

    @contextlib.contextmanager
    def recording(self, entries):
        saved = {e: e.__dict__["raw_call"] for e in entries}
        for e in entries:
            setattr(e, "raw_call", staticmethod(self._recorder(e)))
        try:
            yield self
        finally:
            for e, raw in saved.items():
                setattr(e, "raw_call", raw)

    def _recorder(self, entry: type) -> Callable:
        params = inspect.signature(entry.reference).parameters

        def launch(*args: Any, **kwargs: Any) -> Any:
            widths = entry.widths(*args, **kwargs)
            key = (entry, tuple(sorted(widths.items(), key=lambda kv: kv[0])))
            _, _, n = self.launches.get(key, (entry, widths, 0))
            self.launches[key] = (entry, widths, n + 1)
            inputs = dict(zip(params, args), **kwargs)
            originals: dict[int, torch.Tensor] = {}
            out = entry.reference(**{k: _to_meta(v, originals) for k, v in inputs.items()})
            return _from_meta(out, originals)
        return launch

    def uncertified(self) -> list[str]:
        """One line per (entry, widths) launched that no cell of the entry certifies, naming the nearest cell."""
        problems = []
        for entry, widths, n in self.launches.values():
            if certifying_cells(entry, widths):
                continue
            near = max(entry.CELLS, key=lambda c: sum(entry.cell_widths(c.spec).get(k) == v
                                                      for k, v in widths.items()))
            diff = {k: entry.cell_widths(near.spec).get(k) for k, v in widths.items()
                    if entry.cell_widths(near.spec).get(k) != v}
            problems.append(f"{entry.name()} launched {n}x at {_fmt(widths)}: no cell certifies it "
                            f"(nearest {near.why!r} has {_fmt(diff)})")
        return problems


def _fmt(widths: dict) -> str:
    return ", ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in widths.items())


def _to_meta(v: Any, originals: dict[int, torch.Tensor]) -> Any:
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        m = v if v.is_meta else v.to("meta")
        originals[id(m)] = v
        return m
    if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
        return type(v)(_to_meta(x, originals) for x in v)
    return v


def _from_meta(out: Any, originals: dict[int, torch.Tensor]) -> Any:
    if isinstance(out, torch.Tensor):
        if id(out) in originals:
            return originals[id(out)]
        return torch.zeros(out.shape, dtype=out.dtype) if out.is_meta else out
    if isinstance(out, tuple):
        vals = [_from_meta(x, originals) for x in out]
        return type(out)(*vals) if hasattr(out, "_fields") else tuple(vals)
    return out
