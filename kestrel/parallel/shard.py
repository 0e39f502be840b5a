"""Which slice of each checkpoint tensor a rank holds, by the tensor's (canonical, Moonshot-layout) name.

`shard_for(name, config, mapping)` answers a `Shard` (split dimension, parts, this rank's part) or None
(replicated); `local_expert` maps a routed expert to this rank's stacked index, or None when another rank holds it.
The loader reads only the answered slice from the safetensors file (`get_slice`), quantized forms included: a
packed or scale tensor splits along the same dimension as its weight when its extent there divides, and is
replicated where it is 1 (a per-row or per-tensor scale).

The rules, per layout (see mapping.py):
- KDA layers (tp and helix): q / k / v / g / f_b / g_b projections, the short-conv weights, A_log, dt_bias, b_proj
  split by head (dim 0); o_proj by its input (dim 1); f_a / g_a (rank D) and o_norm (per head dim) replicated.
- MLA layers, tp: q_proj / q_b_proj, kv_b_proj, g_proj split by head (dim 0), o_proj by its input (dim 1); the
  latent projections (q_a, kv_a and their norms) replicated. Helix: only g_proj and o_proj split (the ranks
  hold all heads' queries and up-projections, and each the heads it merges).
- Dense MLPs and shared experts: gate / up split (dim 0), down by its input (dim 1), over the tp ranks.
- Routed experts: whole experts over the ep ranks, each expert's intermediate over the moe_tp ranks (w1 / w3
  dim 0, w2 dim 1). Router, K3's latent down / up projections and norm, embeddings, LM head, norms: replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kestrel.parallel.mapping import Mapping


@dataclass(frozen=True)
class Shard:
    dim: int
    parts: int
    index: int

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The rank's part of a tensor of `shape`: split along `dim` where that extent divides, whole where it is 1
        or the tensor has no such dimension (a scalar or per-row scale)."""
        if self.dim >= len(shape) or shape[self.dim] == 1:
            return tuple(shape)
        if shape[self.dim] % self.parts:
            raise ValueError(f"extent {shape[self.dim]} of dim {self.dim} does not split in {self.parts}")
        return tuple(n // self.parts if d == self.dim else n for d, n in enumerate(shape))

    def slices(self, shape: tuple[int, ...]) -> tuple[slice, ...]:
        local = self.local_shape(shape)
        return tuple(slice(self.index * l, (self.index + 1) * l) if l != n else slice(None)
                     for n, l in zip(shape, local))


_NAME = re.compile(r"^layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)\.(.+)$")
_KDA_HEAD_SPLIT = {"q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "g_b_proj", "b_proj", "q_conv1d",
                   "k_conv1d", "v_conv1d", "A_log", "dt_bias"}
_MLA_HEAD_SPLIT = {"q_proj", "q_b_proj", "kv_b_proj", "g_proj"}


def shard_for(name: str, config, mapping: Mapping) -> Shard | None:
    """The split of checkpoint tensor `name` on this rank (None: the rank holds it whole)."""
    if not mapping.parallel:
        return None
    m = _NAME.match(name)
    if m is None:
        return None
    i, part, rest = int(m.group(1)), m.group(2), m.group(3)
    module = rest.split(".")[0]
    tp = Shard(0, mapping.tp, mapping.tp_rank) if mapping.tp > 1 else None
    tp_in = Shard(1, mapping.tp, mapping.tp_rank) if mapping.tp > 1 else None
    if part == "self_attn":
        if config.layer_kinds[i] == "kda":
            return tp if module in _KDA_HEAD_SPLIT else tp_in if module == "o_proj" else None
        if module == "o_proj":
            return tp_in
        if mapping.helix > 1:
            return tp if module == "g_proj" else None
        return tp if module in _MLA_HEAD_SPLIT else None
    if part == "mlp" or rest.startswith("shared_experts."):
        proj = rest.split(".")[-2]
        return tp if proj in ("gate_proj", "up_proj") else tp_in if proj == "down_proj" else None
    if rest.startswith("experts.") and mapping.moe_tp > 1:
        w = rest.split(".")[2]
        return Shard(0 if w in ("w1", "w3") else 1, mapping.moe_tp, mapping.moe_tp_rank)
    return None


def local_expert(e: int, num_experts: int, mapping: Mapping) -> int | None:
    r = mapping.experts(num_experts)
    return e - r.start if e in r else None
