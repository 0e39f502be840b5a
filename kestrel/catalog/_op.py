"""The catalog contract: what every kernel entry a fast path launches must carry.

An entry is a stateless class deriving from `OpWrapper`:
- `raw_call(**inputs)`: the hot path; every input explicit, may write into `out=`.
- `reference(**inputs)`: same signature, plain torch, fp32 math (TF32 off).
- `is_valid(**inputs) -> str | None`: why the kernel would answer silently wrong for these inputs (layout, alignment,
  dtype, aliasing), or None. Never on the hot path: `validating(entry)` runs it before `raw_call` in tests.
- `compare(out, ref) -> None`: raises AssertionError past the tolerance; `TOLERANCE` says how it was derived.
- `make_inputs(spec, device, generator) -> dict`: fresh random inputs (never zeros) for one cell.
- `CELLS`: the shapes and dtypes the models really run, each `Cell(why, spec, archs)`.
- `ARCHS`: the architectures the kernel runs on.
"""

from __future__ import annotations

import contextlib
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

    REQUIRED = ("raw_call", "reference", "is_valid", "compare", "make_inputs")

    @classmethod
    def name(cls) -> str:
        return f"{cls.__module__.split('catalog.', 1)[-1]}.{cls.__name__}"


def missing_members(entry: type) -> list[str]:
    """Members of the contract that `entry` lacks."""
    missing = [m for m in OpWrapper.REQUIRED if not callable(getattr(entry, m, None))]
    for m in ("CELLS", "ARCHS", "TOLERANCE"):
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


def run_cell(entry: type, cell: Cell, device: torch.device | str, seed: int = 0) -> None:
    """The one way a test drives a cell: fresh inputs, validated raw_call, fp32 reference, compare."""
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    inputs = entry.make_inputs(cell.spec, device, gen)
    ref_inputs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with validating(entry):
            out = entry.raw_call(**inputs)
        ref = entry.reference(**ref_inputs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    entry.compare(out, ref)
