"""Drives every catalog entry's cells: validated raw_call against the fp32 reference, compared by the entry's own
tolerance. On the CPU the Triton kernels run under TRITON_INTERPRET=1 (set in conftest.py) on the tiny cells;
on a GPU every cell whose archs include the device's architecture runs."""

import zlib

import pytest
import torch

from kestrel.catalog import all_entries
from kestrel.catalog._op import current_arch, run_cell

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ARCH = current_arch(DEVICE)


def cells_for(arch):
    """(entry, cell) pairs this architecture certifies; the contract test checks every cell is someone's."""
    for entry in all_entries():
        for i, cell in enumerate(entry.CELLS):
            if arch in cell.archs and arch in entry.ARCHS:
                yield pytest.param(entry, cell, id=f"{entry.name()}[{i}]")


@pytest.mark.parametrize("entry,cell", list(cells_for(ARCH)))
def test_cell(entry, cell, catalog_calls):
    with catalog_calls.watching(entry):
        run_cell(entry, cell, DEVICE, seed=zlib.crc32(cell.why.encode()) % 1000)


def test_run_cell_catches_a_write_into_an_uncloned_weight(monkeypatch):
    """Weights past NO_CLONE_BYTES (a K3 expert stack) are shared by raw_call and the reference instead of copied;
    a raw_call that wrote into one would corrupt the reference, so run_cell refuses it."""
    from kestrel.catalog import _op
    from kestrel.catalog.norm.gated_rmsnorm import GatedRmsNorm

    class WritesItsWeight(GatedRmsNorm):
        @staticmethod
        def raw_call(x, gate, weight, eps, out=None):
            weight.add_(1.0)
            return GatedRmsNorm.raw_call(x, gate, weight, eps, out)

    monkeypatch.setattr(_op, "NO_CLONE_BYTES", 64)
    cell = GatedRmsNorm.CELLS[0]
    run_cell(GatedRmsNorm, cell, DEVICE)
    with pytest.raises(AssertionError, match="raw_call wrote into its input 'weight'"):
        run_cell(WritesItsWeight, cell, DEVICE)
