"""`Mapping`: which part of the model and of the requests one rank holds, for the layouts Kestrel runs.

Layouts (world = tp x dp ranks; the MoE group is always the whole world):
- **tp N**: attention heads (MLA and KDA) split over N ranks, o_proj row-parallel and all-reduced; dense MLPs and
  shared experts split by TP; routed experts split by TP (each expert's intermediate dimension, moe_tp = N) or by
  EP with `--enable-expert-parallel` (whole experts, ep = N), or both (`--moe-tp-size`).
- **dep N** (`--data-parallel-size N --enable-expert-parallel`): attention data-parallel (each rank the whole
  attention, its own requests and cache), routed experts expert-parallel over all N ranks with the tokens of every
  rank dispatched to the experts' ranks and combined back.
- **helix N** (`--helix-size N`): MLA attention with the KV cache sharded along the sequence (token t on rank
  t mod N), every rank attending all heads over its share, partial outputs and log-sum-exps exchanged by one
  all-to-all over heads and merged exactly; KDA layers tensor-parallel over the same N ranks; FFN as moe_tp x ep.

Embedding and LM head are replicated on every rank (each rank computes the whole logits; a vocab-parallel head
would save memory on K3, 2.3 GB in bf16, at the cost of an all-gather per step).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from kestrel.errors import ConfigError


@dataclass(frozen=True)
class Mapping:
    world_size: int = 1
    rank: int = 0
    tp: int = 1            # attention tensor-parallel ranks (= helix when helix > 1)
    dp: int = 1            # attention data-parallel ranks (each owns its requests)
    helix: int = 1         # MLA KV sequence shards (1: no Helix)
    ep: int = 1            # expert-parallel ranks (whole experts)
    moe_tp: int = 1        # ranks sharing each expert's intermediate dimension
    local_rank: int = 0    # rank on its host (the CUDA device index)

    @classmethod
    def from_engine_config(cls, ec, rank: int = 0, local_rank: int = 0) -> "Mapping":
        """The mapping of `EngineConfig` flags; a combination Kestrel does not run is a one-line ConfigError."""
        dp, helix = ec.data_parallel_size, ec.helix_size
        tp = ec.tensor_parallel_size
        if helix > 1:
            if tp not in (1, helix):
                raise ConfigError(f"--helix-size {helix} with --tensor-parallel-size {tp}: Helix runs over the whole "
                                  f"tensor-parallel group; give --tensor-parallel-size {helix} or leave it out")
            tp = helix
        world = tp * dp
        if dp > 1 and tp > 1:
            raise ConfigError(f"--data-parallel-size {dp} with --tensor-parallel-size {tp}: attention tensor "
                              "parallelism inside data-parallel groups is not built; use one of them")
        if dp > 1 and helix > 1:
            raise ConfigError("--helix-size with --data-parallel-size: Helix runs with one data-parallel group")
        moe_tp = ec.moe_tp_size
        if moe_tp is None:
            moe_tp = 1 if ec.enable_expert_parallel else (tp if dp == 1 else 1)
        if moe_tp > world or world % moe_tp:
            raise ConfigError(f"--moe-tp-size {moe_tp} does not divide the {world} ranks; use a divisor of {world}")
        if dp > 1 and not ec.enable_expert_parallel:
            ep = 1
            if ec.moe_tp_size not in (None, 1):
                raise ConfigError("--moe-tp-size with --data-parallel-size needs --enable-expert-parallel (the "
                                  "experts are split over the data-parallel ranks)")
        else:
            ep = world // moe_tp
            if ep > 1 and not ec.enable_expert_parallel:
                raise ConfigError(f"--moe-tp-size {moe_tp} over {world} ranks splits whole experts over "
                                  f"{ep} ranks; add --enable-expert-parallel (or give --moe-tp-size {world})")
        return cls(world_size=world, rank=rank, tp=tp, dp=dp, helix=helix, ep=ep, moe_tp=moe_tp,
                   local_rank=local_rank)

    # ---- coordinates -----------------------------------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp if self.ep > 1 else 0

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    @property
    def moe_parallel(self) -> bool:
        """Routed experts split over ranks (their outputs are reduced over the world)."""
        return self.ep * self.moe_tp > 1

    @property
    def dispatch(self) -> bool:
        """Tokens differ per rank (DEP) and travel to the experts' ranks and back."""
        return self.dp > 1 and self.moe_parallel

    @property
    def leader(self) -> bool:
        """The rank that schedules its attention group's requests and samples (tp rank 0)."""
        return self.tp_rank == 0

    @property
    def name(self) -> str:
        """The layout as the routing context and the deployment profiles spell it: tp1, tp2, dep4, helix2,
        helix4_moetp2ep2, tp2_ep2."""
        if self.helix > 1:
            return f"helix{self.helix}" + (f"_moetp{self.moe_tp}ep{self.ep}" if self.ep > 1 else "")
        if self.dp > 1:
            return f"dep{self.dp}" if self.ep > 1 else f"dp{self.dp}"
        return f"tp{self.tp}" + (f"_moetp{self.moe_tp}ep{self.ep}" if self.ep > 1 else "")

    def experts(self, num_experts: int) -> range:
        """The routed experts this rank holds (contiguous, num_experts / ep of them)."""
        n = num_experts // self.ep
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    def validate(self, config, page_size: int) -> None:
        """Whether the model splits as the layout asks: one-line ConfigErrors, before any weight is read."""
        c = config

        def need(value: int, parts: int, what: str, flag: str) -> None:
            if parts > 1 and value % parts:
                raise ConfigError(f"{flag} {parts} does not divide the {value} {what} of this model; use a "
                                  f"divisor of {value}")

        tp_flag = "--helix-size" if self.helix > 1 else "--tensor-parallel-size"
        if self.helix == 1:
            need(c.num_heads, self.tp, "MLA attention heads", tp_flag)
        need(c.kda_num_heads, self.tp, "KDA heads", tp_flag)
        need(c.intermediate_size, self.tp, "dense MLP channels", tp_flag)
        if c.n_shared_experts:
            need(c.moe_intermediate_size * c.n_shared_experts, self.tp, "shared-expert channels", tp_flag)
        if self.helix > 1:
            need(c.num_heads, self.helix, "MLA attention heads (Helix exchanges them all-to-all)", "--helix-size")
            need(page_size, self.helix, "tokens of a page (Helix spreads each page over its ranks)", "--helix-size")
        if c.num_experts:
            need(c.num_experts, self.ep, "routed experts", "expert parallelism over")
            need(c.moe_intermediate_size, self.moe_tp, "channels of each routed expert", "--moe-tp-size")


def env_rank() -> tuple[int, int, int] | None:
    """(rank, local rank, world size) when started by torchrun (or our own launcher), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise ConfigError("RANK / LOCAL_RANK / WORLD_SIZE are not integers; start the ranks with torchrun or "
                          "let kestrel spawn them")


def check_world(mapping_world: int, env_world: int) -> None:
    if env_world != mapping_world:
        raise ConfigError(f"WORLD_SIZE is {env_world} but the layout needs {mapping_world} ranks "
                          "(--tensor-parallel-size x --data-parallel-size); start that many ranks")


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def check_port_free(addr: str, port: int) -> None:
    """The rendezvous port must be free before the ranks start: a clash would hang or fail deep in the group."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr if addr not in ("localhost",) else "127.0.0.1", port))
        except OSError as e:
            raise ConfigError(f"--master-port {port}: {addr}:{port} is in use ({e.strerror}); pick a free port or "
                              "leave --master-port out") from None
