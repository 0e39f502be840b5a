"""The JSON every benchmark script writes: {machine, command, records} (see DESIGN.md's benchmark convention)."""

from __future__ import annotations

import json
import os
import sys

import torch


def write_results(records: list[dict], out: str | None) -> None:
    """Write the records with the machine and the command line that produced them (nothing when out is None)."""
    if not out:
        return
    doc = dict(machine=torch.cuda.get_device_name(), command=" ".join([os.path.basename(sys.executable)] + sys.argv),
               records=records)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", out)
