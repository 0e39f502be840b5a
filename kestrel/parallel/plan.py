"""`kestrel plan`: a decode step of a Kimi model on N GPUs under a layout, sized on paper.

The model is a roofline per layer, calibrated on the committed one-H200 records (`benchmarks/results/`):

    layer time = max((weight bytes + KV / state / activation bytes) / (f * HBM), flops / (g * peak))
                 + kernels * t_launch + sum over its collectives of (latency + wire bytes / link bandwidth)
    step time  = sum of the layers + the head (final norm, lm_head) + host(B) (schedule, inputs, sampler, output)

- bytes are what one rank reads in a step: its shard of every dense weight, the routed experts of its share that the
  batch's tokens touch (expected distinct experts: E_local * (1 - (1 - k/E)^tokens)), the MLA latents of the
  requests it attends over its share of the sequence, the KDA states of its heads (read and written, fp32), and
  K3's attention-residual block states the mixes read;
- f (achieved fraction of the HBM bandwidth) and t_launch (per-kernel cost in a CUDA graph: launch gap and the
  latency-bound tail of small kernels) are fitted by least squares on the decode records (graphs, greedy);
  host(B) is linear in the batch, from the records' engine phase times outside the model; g (achieved fraction of
  the bf16 tensor peak) comes from the 8K-token prefill record;
- kernels per layer are those the bf16 sm_90 targets launch (`KERNELS`, checked against the targets' launch log in
  tests/test_plan.py); the layouts add their collectives (`_collectives`), timed with the link as a parameter.

What each layout shards (the `Layout` fields): TP splits attention heads (MLA's latent KV head is replicated, so
every TP rank reads every latent), KDA heads, the dense MLP, shared experts and lm_head by N and the routed experts by
moe-tp x ep; DEP runs attention, the dense MLP and shared experts data-parallel (each rank its B/N requests, full
weights) and the routed experts expert-parallel with a token dispatch and combine (all-to-all); Helix shards the MLA
KV along the sequence (each rank attends every head over 1/N of every request's latents: q / kv projections
replicated, o_proj split by heads), exchanges the partials and their LSEs by one all-to-all, and runs KDA, the
dense MLP and lm_head TP over N and the routed experts as moe-tp x ep.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
from dataclasses import dataclass, field

from kestrel.bench.latency import BF16_FLOPS_PER_S, HBM_BYTES_PER_S, _table   # the records' floors: same figures
from kestrel.errors import KestrelError

NVLINK_GBPS = 450.0                # H200 NVLink 4: 18 links x 25 GB/s per direction
INTER_NODE_GBPS = 50.0             # one 400 Gb/s NIC per GPU between nodes
LINK_LATENCY_US = 10.0             # one NCCL collective inside a node, small message, in a CUDA graph
INTER_LATENCY_US = 25.0
NODE_GPUS = 8
HBM_GIB = 140.0                    # H200: 143,771 MiB
PREFILL_BUDGET = 8192              # the records' max_num_batched_tokens (benchmarks/h200_fastpath.py)

# bytes per weight element of the routed experts (packed codes + their block scales)
EXPERT_BYTES = {"bf16": 2.0, "fp8": 1.0 + 4 / 128, "mxfp8": 1.0 + 1 / 32, "mxfp4": 0.5 + 1 / 32,
                "nvfp4": 0.5 + 1 / 16}
DEFAULT_WEIGHTS = {"k3": "mxfp4", "kimi-linear-48b": "bf16"}       # Moonshot's K3 ships MXFP4 experts
MODELS = {"k3": "k3", "kimi-linear-48b": "kimi-linear-48b", "kimi-linear": "kimi-linear-48b",
          "kl": "kimi-linear-48b"}

# Kernels one decode layer of the bf16 sm_90 targets launches with the fused decode entries (docs/decode_launches.md,
# counted by tests/test_target_launches.py): mixer, FFN, the norms around them; `head`: the step's launches outside
# the layers (before: kv lengths, slots, embedding; after: logits rows, final norm, LM head: one cuBLAS call, whose
# memset before the GEMM is counted with it, like a split-K reduce after one).
KERNELS = {
    "kimi_linear": {"kda": 4, "mla": 7, "dense": 3, "moe": 6, "norms": 2, "head": 8},
    "kimi_k3": {"kda": 4, "mla": 11, "dense": 3, "moe": 9, "norms": 2, "head": 7},
}
MOE_EXPERTS_KERNELS = 6
# The same before the fused decode entries were wired (33 launches per layer), and the committed records measured
# with those targets: calibration counts each record's kernels with the targets that ran it.
KERNELS_UNFUSED = {
    "kimi_linear": {"kda": 11, "mla": 8, "dense": 3, "moe": 10, "norms": 2, "head": 3},
    "kimi_k3": {"kda": 10, "mla": 12, "dense": 3, "moe": 13, "norms": 4, "head": 4},
}
UNFUSED_RECORDS = ("h200_fastpath_kl8.json", "h200_fastpath_kl27.json")


# ------------------------------------------------------------------------------------------------- layouts
_LAYOUT = re.compile(r"^(tp|dep|helix)(\d+)(?:_moetp(\d+)ep(\d+))?$")


@dataclass(frozen=True)
class Layout:
    """How a layout shards one layer over its `size` ranks (one replica; DEP's dp is its attention replicas)."""
    name: str
    kind: str            # tp | dep | helix
    size: int
    moe_tp: int
    moe_ep: int

    @property
    def dp(self) -> int:            # attention data-parallel ranks (each owns batch / dp requests)
        return self.size if self.kind == "dep" else 1

    @property
    def heads_tp(self) -> int:      # MLA query heads split (TP); Helix attends every head on every rank
        return self.size if self.kind == "tp" else 1

    @property
    def kv_cp(self) -> int:         # MLA KV sharded along the sequence
        return self.size if self.kind == "helix" else 1

    @property
    def dense_tp(self) -> int:      # KDA heads, dense MLP, shared experts, o_proj, lm_head
        return 1 if self.kind == "dep" else self.size


def parse_layout(name: str, gpus: int, config) -> Layout:
    """The layout named `name` (tpN, depN, helixN, optionally _moetpAepB) on `gpus` GPUs, checked against the
    model's head and expert counts: one KestrelError line naming the mismatch."""
    m = _LAYOUT.match(name.lower())
    if not m:
        raise KestrelError(f"--layout {name}: unknown; use tpN, depN or helixN, optionally with _moetpAepB "
                           "(e.g. tp8, dep16, helix16_moetp4ep4)")
    kind, size = m.group(1), int(m.group(2))
    if m.group(3):
        moe_tp, ep = int(m.group(3)), int(m.group(4))
    else:
        moe_tp, ep = (1, size) if kind == "dep" else (size, 1)
    if size < 1 or moe_tp < 1 or ep < 1:
        raise KestrelError(f"--layout {name}: sizes must be >= 1")
    if size != gpus:
        raise KestrelError(f"--layout {name} uses {size} GPUs, --gpus says {gpus}: make them agree")
    if moe_tp * ep != size:
        raise KestrelError(f"--layout {name}: moe-tp {moe_tp} x ep {ep} = {moe_tp * ep}, not the layout's {size} ranks")
    if kind == "dep" and moe_tp != 1:
        raise KestrelError(f"--layout {name}: DEP runs the experts expert-parallel over its ranks; moe-tp must be 1 "
                           f"(use dep{size} or a tp / helix layout for moe-tp x ep)")
    lay = Layout(name.lower(), kind, size, moe_tp, ep)
    c = config
    checks = [(c.num_heads, lay.heads_tp if kind == "tp" else (size if kind == "helix" else 1), "MLA heads"),
              (c.kda_num_heads, lay.dense_tp, "KDA heads"), (c.num_experts, ep, "experts"),
              (c.moe_intermediate_size, moe_tp, "the expert width")]
    for count, parts, what in checks:
        if parts > 1 and count % parts:
            raise KestrelError(f"--layout {name}: {what} ({count}) do not split over {parts} ranks; pick a size "
                               f"that divides {count}")
    return lay


# ------------------------------------------------------------------------------------------------- the model
@dataclass
class Link:
    gbps: float = NVLINK_GBPS
    latency_us: float = LINK_LATENCY_US
    inter_gbps: float = INTER_NODE_GBPS
    inter_latency_us: float = INTER_LATENCY_US
    node_gpus: int = NODE_GPUS
    source: str = "NVLink, stated"

    def time_s(self, wire_bytes: float, group: int) -> float:
        """A collective over `group` ranks putting `wire_bytes` on each rank's link; a group larger than a node
        runs at the inter-node link (all its traffic: pessimistic for hierarchical algorithms)."""
        if group <= 1:
            return 0.0
        inter = group > self.node_gpus
        gbps, lat = (self.inter_gbps, self.inter_latency_us) if inter else (self.gbps, self.latency_us)
        return lat * 1e-6 + wire_bytes / (gbps * 1e9)


def fit_link(path: str, link: Link) -> Link:
    """`link` with its in-node latency and bandwidth fitted (least squares, t = latency + wire bytes / bandwidth)
    to the collective records of benchmarks/comm_bench.py (NCCL on the GPUs of one host)."""
    try:
        with open(path) as f:
            recs = [r for r in json.load(f)["records"] if r.get("ms", 0) > 0 and r.get("world", 1) > 1
                    and "add_rmsnorm" not in r.get("entry", "")]          # pure collectives: no norm kernel
    except (OSError, ValueError, KeyError) as e:
        raise KestrelError(f"--comm-records {path}: cannot read collective records ({e})") from None
    pts = [(Collective(r["op"] if r["op"] != "reduce-scatter" else "all-gather", r["bytes"], r["world"]).wire_bytes(),
            r["ms"] * 1e-3) for r in recs]
    if len({x for x, _ in pts}) < 2:
        raise KestrelError(f"--comm-records {path}: needs collectives of at least two sizes")
    mx, mt = sum(x for x, _ in pts) / len(pts), sum(t for _, t in pts) / len(pts)
    slope = sum((x - mx) * (t - mt) for x, t in pts) / sum((x - mx) ** 2 for x, _ in pts)
    if slope <= 0:
        raise KestrelError(f"--comm-records {path}: time does not grow with size; no bandwidth to fit")
    return Link(1 / slope / 1e9, max(mt - slope * mx, 0.0) * 1e6, link.inter_gbps, link.inter_latency_us,
                link.node_gpus, f"fitted to {os.path.basename(path)}")


@dataclass
class Calibration:
    bw_fraction: float           # f: achieved share of HBM_BYTES_PER_S in weight-bound phases
    launch_us: float             # per kernel in a graph
    host_ms0: float              # host(B) = host_ms0 + host_ms_per_seq * B
    host_ms_per_seq: float
    flops_fraction: float        # g: achieved share of BF16_FLOPS_PER_S (8K prefill)
    sources: list[str] = field(default_factory=list)


@dataclass
class Collective:
    op: str                      # all-reduce | all-gather | all-to-all
    nbytes: float                # the tensor on one rank (all-to-all: what it sends)
    group: int

    def wire_bytes(self) -> float:
        share = (self.group - 1) / self.group
        return (2 * share if self.op == "all-reduce" else share) * self.nbytes


@dataclass
class LayerCost:
    kind: str                    # "KDA + dense", "KDA + MoE", "MLA + MoE", "head"
    count: int
    weight_bytes: float
    kv_bytes: float              # MLA latents, KDA states, attention-residual blocks
    flops: float
    kernels: int
    comms: list[Collective]


def load_config(model: str, layers: int | None = None):
    from kestrel.config import ModelConfig
    from kestrel.models.kimi.checkpoint import preset_config
    key = MODELS.get(model.lower())
    if key is None:
        raise KestrelError(f"--model {model}: unknown; use K3 or kimi-linear-48b")
    return key, ModelConfig.from_dict(preset_config(key, layers))


def _params(c) -> dict[str, tuple[float, float]]:
    """(replicated, split) parameter counts of each piece of a layer: split pieces shard over their TP group."""
    h = c.hidden_size
    W, Dk = c.kda_num_heads * c.kda_head_dim, c.kda_head_dim
    kda_split = 4 * W * h + c.kda_num_heads * h + W * Dk + 3 * W * c.conv_kernel_size   # q k v o, b, f_b, conv
    kda_rep = Dk * h                                                                      # f_a
    if c.kda_full_rank_output_gate:
        kda_split += W * h                                                                # g_proj
    else:
        kda_rep, kda_split = kda_rep + Dk * h, kda_split + W * Dk                         # g_a, g_b
    H, qk = c.num_heads, c.qk_head_dim
    if c.q_lora_rank:
        mla_rep, q_split = c.q_lora_rank * h, c.q_lora_rank * H * qk
    else:
        mla_rep, q_split = 0, h * H * qk
    mla_rep += h * c.mla_cache_width                                                      # kv_a (replicated)
    mla_kvb = c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim)
    mla_o = H * c.v_head_dim * h * (2 if c.mla_use_output_gate else 1)                   # o_proj (+ g_proj)
    he = c.routed_expert_hidden_size or h
    shared = c.n_shared_experts * 3 * c.moe_intermediate_size * h
    latent = 2 * h * he if c.routed_expert_hidden_size else 0                             # down / up projections
    return {"kda": (kda_rep, kda_split), "mla_qkv": (mla_rep, q_split + mla_kvb), "mla_o": (0, mla_o),
            "dense": (0, 3 * c.intermediate_size * h), "router": (c.num_experts * h, 0),
            "shared": (0, shared + latent), "expert": (0, 3 * c.moe_intermediate_size * he),
            "lm_head": (0, c.vocab_size * h)}


def layer_costs(c, arch: str, lay: Layout, batch: int, context: int, expert_bytes: float,
                kv_bytes_per_elt: float = 2.0, kernels: dict | None = None) -> list[LayerCost]:
    """One rank's reads, flops, kernels and collectives per decode step, per kind of layer (and the head).
    `kernels`: the launch table (default: today's targets, KERNELS)."""
    P = _params(c)
    k_tab = (kernels or KERNELS)[arch]
    h, E, k = c.hidden_size, max(c.num_experts, 1), c.num_experts_per_tok
    B = batch
    req = math.ceil(B / lay.dp)                        # requests whose attention this rank computes
    ctx = math.ceil(context / lay.kv_cp)               # their cached tokens on this rank
    tp = lay.dense_tp
    mla_qkv_split = lay.heads_tp                       # Helix replicates q / kv projections, TP splits them
    he = c.routed_expert_hidden_size or h
    tokens_moe = B                                     # every token of the batch may route to this rank's experts
    touched = (E / lay.moe_ep) * (1 - (1 - k / E) ** tokens_moe)
    elt = 2.0                                          # bf16 trunk

    def w(piece, split_by):
        rep, split = P[piece]
        return (rep + split / split_by) * elt

    kda_w = w("kda", tp)
    kda_state = req * (c.kda_num_heads / tp) * (c.kda_head_dim ** 2 * 4 * 2 + 3 * c.kda_head_dim * 3 * 2 * 2)
    kda_fl = 2 * (kda_w / elt) * req + 6 * req * (c.kda_num_heads / tp) * c.kda_head_dim ** 2
    mla_w = w("mla_qkv", mla_qkv_split) + w("mla_o", tp)
    heads_att = c.num_heads / lay.heads_tp
    mla_kv = req * ctx * c.mla_cache_width * kv_bytes_per_elt
    mla_fl = 2 * (mla_w / elt) * req + 2 * req * heads_att * ctx * (c.mla_cache_width + c.kv_lora_rank)
    dense_w = w("dense", tp)
    moe_w = w("router", 1) + w("shared", tp) + touched * P["expert"][1] / lay.moe_tp * expert_bytes
    moe_fl = 2 * (w("router", 1) + w("shared", tp)) / elt * req + 2 * B * k / lay.moe_ep * P["expert"][1] / lay.moe_tp
    dense_fl = 2 * dense_w / elt * req
    act = 2 * req * h * 2                              # the residual read and written twice per layer

    def attn_res(i):                                   # K3: the mixes read every finished block's state
        if not c.attn_res_block_size:
            return 0.0
        return 2 * (i // c.attn_res_block_size + 1) * req * h * 2

    def comms(mixer: str, ffn: str) -> list[Collective]:
        out = []
        hid = B * h * 2
        if lay.kind == "tp" and lay.size > 1:
            out += [Collective("all-reduce", hid, lay.size), Collective("all-reduce", hid, lay.size)]
        elif lay.kind == "helix":
            if mixer == "mla":        # every head's partial over 1/N of the KV, and its LSE, to the head's owner
                out.append(Collective("all-to-all", B * c.num_heads * (c.kv_lora_rank * 2 + 4), lay.size))
            out += [Collective("all-reduce", hid, lay.size), Collective("all-reduce", hid, lay.size)]
        elif lay.kind == "dep" and ffn == "moe" and lay.moe_ep > 1:
            rows = req * k * he * 2                    # dispatch this rank's tokens' top-k rows, combine them back
            out += [Collective("all-to-all", rows, lay.moe_ep), Collective("all-to-all", rows, lay.moe_ep)]
        return out

    groups: dict[tuple[str, str], list[int]] = {}
    for i in range(c.num_layers):
        groups.setdefault(("mla" if c.layer_kinds[i] == "mla" else "kda",
                           "moe" if c.is_moe_layer(i) else "dense"), []).append(i)
    rows = []
    for (mixer, ffn), idx in sorted(groups.items(), key=lambda kv: kv[1][0]):
        n = len(idx)
        mixer_w, mixer_kv, mixer_fl = (mla_w, mla_kv, mla_fl) if mixer == "mla" else (kda_w, kda_state, kda_fl)
        ffn_w, ffn_fl = (moe_w, moe_fl) if ffn == "moe" else (dense_w, dense_fl)
        kernels = k_tab[mixer] + k_tab[ffn] + k_tab["norms"] + (1 if mixer == "mla" and lay.kind == "helix" else 0)
        rows.append(LayerCost(f"{mixer.upper()} + {'MoE' if ffn == 'moe' else 'dense'}", n, mixer_w + ffn_w,
                              mixer_kv + act + sum(attn_res(i) for i in idx) / n, mixer_fl + ffn_fl, kernels,
                              comms(mixer, ffn)))
    head_split = 1 if lay.kind == "dep" else lay.size
    head_comms = [Collective("all-gather", req * c.vocab_size * 4, head_split)] if head_split > 1 else []
    rows.append(LayerCost("head", 1, w("lm_head", head_split) + req * h * elt, 0.0,
                          2 * P["lm_head"][1] / head_split * req, k_tab["head"], head_comms))
    return rows


def layer_time_s(row: LayerCost, cal: Calibration, link: Link) -> dict[str, float]:
    bw = cal.bw_fraction * HBM_BYTES_PER_S
    t = {"weights": row.weight_bytes / bw, "kv": row.kv_bytes / bw,
         "compute": row.flops / (cal.flops_fraction * BF16_FLOPS_PER_S), "launch": row.kernels * cal.launch_us * 1e-6,
         "comm": sum(link.time_s(x.wire_bytes(), x.group) for x in row.comms)}
    t["total"] = max(t["weights"] + t["kv"], t["compute"]) + t["launch"] + t["comm"]
    return t


def memory_per_rank(c, lay: Layout, batch: int, context: int, expert_bytes: float) -> dict[str, float]:
    """Bytes one rank holds: its weights (every local expert) and the cache of its requests at `context`."""
    P = _params(c)
    tp = lay.dense_tp
    n_moe = sum(c.is_moe_layer(i) for i in range(c.num_layers))
    n_mla, n_kda = len(c.mla_layers), len(c.kda_layers)

    def w(piece, split):
        rep, s = P[piece]
        return (rep + s / split) * 2.0

    weights = (n_kda * w("kda", tp) + n_mla * (w("mla_qkv", lay.heads_tp) + w("mla_o", tp))
               + (c.num_layers - n_moe) * w("dense", tp)
               + n_moe * (w("router", 1) + w("shared", tp)
                          + c.num_experts / lay.moe_ep * P["expert"][1] / lay.moe_tp * expert_bytes)
               + 2 * w("lm_head", 1 if lay.kind == "dep" else lay.size))                  # lm_head + embedding
    req = math.ceil(batch / lay.dp)
    kv = n_mla * req * math.ceil(context / lay.kv_cp) * c.mla_cache_width * 2
    state = n_kda * req * (c.kda_num_heads / tp) * c.kda_head_dim ** 2 * 4
    return {"weights": weights, "kv": kv, "state": state}


# ------------------------------------------------------------------------------------------------- calibration
def results_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "benchmarks", "results")


def _record_model(name: str) -> tuple[str, int | None]:
    m = re.match(r"^(kimi-linear-48b|k3)(?:-(\d+)l)?$", name)
    if not m:
        raise KestrelError(f"record model {name!r}: not a preset this plan knows")
    return m.group(1), int(m.group(2)) if m.group(2) else None


def decode_records(folder: str | None = None) -> list[dict]:
    """The one-GPU decode records the model is built from (graphs, greedy), each with its host time per step."""
    folder = folder or results_dir()
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "h200_fastpath_*.json"))):
        with open(path) as f:
            doc = json.load(f)
        for r in doc["records"]:
            if r["phase"] != "decode" or r.get("mode") != "graphs" or r["sampling"] != "greedy":
                continue
            if r.get("async_scheduling"):
                continue        # the model adds host time to device time: a step that overlaps them is no data for it
            # a row's runs: same mode, batch and sampling, and the first timed run the record names
            run = next((x["runs"] for x in doc.get("runs", []) if (x["mode"], x["batch"], x["sampling"]) ==
                        ("graphs", r["batch"], "greedy") and abs(x["runs"]["full_s"][0] - r["first_run_s"]) < 1e-3),
                       None)
            if run is None:
                continue
            iters = len(run["full_s"])
            chunks = math.ceil(r["batch"] * r["context"] / PREFILL_BUDGET)
            steps = iters * (2 * chunks + r["output_len"] - 1)      # full run (prefill + decodes) + 1-token run
            ph = run["engine_phase_s"]
            # "sample" is left out: it waits for the device (the one copy of the ids), so it is model time
            host = sum(ph.get(k, 0.0) for k in ("schedule", "build", "output")) / steps
            rec = {**r, "host_ms": 1e3 * host, "source": os.path.basename(path)}
            if r["first_run_s"] > 1.1 * r["steady_run_s"]:
                # JIT inside the first timed run (the record's rate is a median over it): the model is of steady
                # steps, so take the last run's, (full - one token) / (new tokens - 1) as the benchmark defines it
                rec["step_ms"] = 1e3 * (run["full_s"][-1] - run["one_token_s"][-1]) / (r["output_len"] - 1)
            out.append(rec)
    if not out:
        raise KestrelError(f"no H200 decode records (h200_fastpath_*.json) in {folder}: pass --records DIR")
    return out


def _prefill_flops_fraction(folder: str) -> float:
    """g from the longest single-prompt prefill record: its flops (weights + causal attention) over its time."""
    best = None
    for path in sorted(glob.glob(os.path.join(folder, "h200_fastpath_*.json"))):
        with open(path) as f:
            for r in json.load(f)["records"]:
                if r["phase"] == "prefill" and r["batch"] == 1 and r.get("mode") == "graphs":
                    if best is None or r["prompt_len"] > best["prompt_len"]:
                        best = r
    if best is None:
        return 0.35
    preset, layers = _record_model(best["model"])
    _, c = load_config(preset, layers)
    P = _params(c)
    T = best["prompt_len"]
    n_moe = sum(c.is_moe_layer(i) for i in range(c.num_layers))
    per_tok = 2 * (len(c.kda_layers) * sum(P["kda"]) + len(c.mla_layers) * (sum(P["mla_qkv"]) + sum(P["mla_o"]))
                   + (c.num_layers - n_moe) * sum(P["dense"])
                   + n_moe * (sum(P["router"]) + sum(P["shared"]) + c.num_experts_per_tok * P["expert"][1]))
    attn = len(c.mla_layers) * 2 * c.num_heads * (c.qk_head_dim + c.v_head_dim) * T * (T + 1) / 2
    kda = len(c.kda_layers) * 6 * c.kda_num_heads * c.kda_head_dim ** 2 * T
    return (per_tok * T + attn + kda) / (T / best["tokens_per_s"]) / BF16_FLOPS_PER_S


def calibrate(folder: str | None = None) -> Calibration:
    """Fit f and t_launch to the decode records (least squares on relative error), host(B) to their host times."""
    folder = folder or results_dir()
    recs = decode_records(folder)
    rows = []
    for r in recs:
        preset, layers = _record_model(r["model"])
        key, c = load_config(preset, layers)
        lay = parse_layout("tp1", 1, c)
        table = KERNELS_UNFUSED if r["source"] in UNFUSED_RECORDS else KERNELS
        costs = layer_costs(c, c.arch, lay, r["batch"], r["context"] + r["output_len"] // 2, 2.0, kernels=table)
        mem_s = sum(x.count * (x.weight_bytes + x.kv_bytes) for x in costs) / HBM_BYTES_PER_S
        kernels = sum(x.count * x.kernels for x in costs)
        y = r["step_ms"] * 1e-3 - r["host_ms"] * 1e-3
        rows.append((mem_s / y, kernels * 1e-6 / y))          # (mem/f + kernels*t) / y = 1: relative error
    a11 = sum(x * x for x, _ in rows)
    a12 = sum(x * z for x, z in rows)
    a22 = sum(z * z for _, z in rows)
    b1 = sum(x for x, _ in rows)
    b2 = sum(z for _, z in rows)
    det = a11 * a22 - a12 * a12
    inv_f, launch_us = (a22 * b1 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det
    if 0 < inv_f < 1:
        # more than the copy bandwidth is not physical (the byte count is uniform routing's, and a step's host
        # work partly overlaps the device's): hold f at 1 and fit the launch cost alone
        inv_f = 1.0
        launch_us = sum(z * (1 - x) for x, z in rows) / a22
    if inv_f <= 0 or launch_us <= 0:
        raise KestrelError(f"the records in {folder} give no physical fit (1/f={inv_f:.3g}, launch={launch_us:.3g} us)")
    bs = [r["batch"] for r in recs]
    hs = [r["host_ms"] for r in recs]
    mb, mh = sum(bs) / len(bs), sum(hs) / len(hs)
    var = sum((b - mb) ** 2 for b in bs)
    slope = sum((b - mb) * (hh - mh) for b, hh in zip(bs, hs)) / var if var else 0.0
    return Calibration(1.0 / inv_f, launch_us, mh - slope * mb, slope, _prefill_flops_fraction(folder),
                       [f"{r['source']}: {r['model']} b{r['batch']} {r['step_ms']:.2f} ms" for r in recs])


# ------------------------------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    model: str
    layout: Layout
    batch: int
    context: int
    weights: str
    rows: list[tuple[LayerCost, dict[str, float]]]
    host_s: float
    step_s: float
    memory: dict[str, float]
    cal: Calibration
    link: Link

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def per_gpu(self) -> float:
        return self.tokens_per_s / self.layout.size

    @property
    def per_user(self) -> float:
        return 1.0 / self.step_s


def plan(model: str, gpus: int, layout: str, batch: int = 64, context: int = 8192, weights: str | None = None,
         link: Link | None = None, cal: Calibration | None = None, layers: int | None = None,
         records: str | None = None, kernels: dict | None = None) -> Plan:
    key, c = load_config(model, layers)
    if batch < 1 or context < 1 or gpus < 1:
        raise KestrelError("--batch, --context and --gpus must be >= 1")
    weights = weights or DEFAULT_WEIGHTS[key]
    if weights not in EXPERT_BYTES:
        raise KestrelError(f"--weights {weights}: use one of {', '.join(EXPERT_BYTES)}")
    lay = parse_layout(layout, gpus, c)
    if lay.dp > batch:
        raise KestrelError(f"--batch {batch}: {lay.name} has {lay.dp} data-parallel ranks; give each a request")
    cal = cal or calibrate(records)
    link = link or Link()
    costs = layer_costs(c, c.arch, lay, batch, context, EXPERT_BYTES[weights], kernels=kernels)
    rows = [(x, layer_time_s(x, cal, link)) for x in costs]
    host = (cal.host_ms0 + cal.host_ms_per_seq * math.ceil(batch / lay.dp)) * 1e-3
    step = sum(x.count * t["total"] for x, t in rows) + host
    return Plan(key, lay, batch, context, weights, rows, host, step,
                memory_per_rank(c, lay, batch, context, EXPERT_BYTES[weights]), cal, link)


def format_plan(p: Plan) -> str:
    L = p.layout
    lines = [f"kestrel plan: {p.model} on {L.size} GPU(s), layout {L.name} (attention dp {L.dp}, heads tp "
             f"{L.heads_tp}, KV cp {L.kv_cp}, dense tp {L.dense_tp}, moe-tp {L.moe_tp} x ep {L.moe_ep}), "
             f"batch {p.batch} (global), context {p.context}, routed experts {p.weights}", ""]
    cols = ["layer", "n", "weights ms", "KV+state ms", "compute ms", "launch ms", "comm ms", "per layer ms",
            "all ms"]
    table = []
    for x, t in p.rows:
        table.append([x.kind, str(x.count), f"{1e3 * t['weights']:.4f}", f"{1e3 * t['kv']:.4f}",
                      f"{1e3 * t['compute']:.4f}", f"{1e3 * t['launch']:.4f}", f"{1e3 * t['comm']:.4f}",
                      f"{1e3 * t['total']:.4f}", f"{1e3 * x.count * t['total']:.3f}"])
    table.append(["host + sampler", "1", "", "", "", "", "", "", f"{1e3 * p.host_s:.3f}"])
    lines.append(_table(cols, table))
    moved = [[x.kind, f"{x.weight_bytes / 1e6:.1f}", f"{x.kv_bytes / 1e6:.1f}", f"{x.flops / 1e9:.2f}",
              str(x.kernels), ", ".join(f"{c.op} {c.nbytes / 1e6:.2f} MB over {c.group}" for c in x.comms) or "-"]
             for x, _ in p.rows]
    lines += ["", "what one rank reads and moves per layer:",
              _table(["layer", "weights MB", "KV+state MB", "GFLOP", "kernels", "collectives"], moved)]
    gib = 2 ** 30
    m = p.memory
    total = m["weights"] + m["kv"] + m["state"]
    lines += ["", f"step {1e3 * p.step_s:.3f} ms: {p.tokens_per_s:,.0f} tok/s in all, {p.per_gpu:,.0f} tok/s per GPU, "
                  f"{p.per_user:,.1f} tok/s per user",
              f"memory per rank: weights {m['weights'] / gib:.1f} GiB, MLA KV {m['kv'] / gib:.1f} GiB, KDA state "
              f"{m['state'] / gib:.1f} GiB = {total / gib:.1f} GiB of {HBM_GIB:.0f} GiB"
              + ("" if total <= 0.9 * HBM_GIB * gib else "  -> DOES NOT FIT (90% of HBM)"), ""]
    c, k = p.cal, p.link
    lines += ["assumptions:",
              f"- calibrated on {'; '.join(c.sources)}: achieved HBM bandwidth f = {c.bw_fraction:.2f} x "
              f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s, {c.launch_us:.2f} us per kernel in a CUDA graph, host + sampler "
              f"{c.host_ms0:.3f} + {c.host_ms_per_seq:.4f} ms per request and step (greedy), tensor cores at "
              f"g = {c.flops_fraction:.2f} x {BF16_FLOPS_PER_S / 1e12:.0f} TFLOP/s (8K prefill record)",
              f"- links: {k.gbps:.0f} GB/s per direction and {k.latency_us:.0f} us per collective inside a node of "
              f"{k.node_gpus} GPUs ({k.source}); a group spanning nodes runs all its traffic at {k.inter_gbps:.0f} GB/s, "
              f"{k.inter_latency_us:.0f} us; ring costs (all-reduce 2(N-1)/N of the tensor, gather / all-to-all "
              "(N-1)/N); no overlap of communication with compute",
              "- bf16 trunk and KV cache; routed experts read at their packed size with the same f (weight-only "
              "GEMMs assumed as efficient as bf16 ones); experts touched = E/ep x (1 - (1 - k/E)^B), uniform routing",
              "- one decode token per request per step, every request at the given context; the DP ranks of DEP "
              "own batch / N requests each and dispatch their tokens' top-k rows (K3: the 3584 latent) both ways",
              "- kernels per layer: the bf16 sm_90 targets' decode launches; collectives add their latency, not a "
              "kernel cost"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- the command
def register(sub, add_engine_args=None) -> None:
    p = sub.add_parser("plan", help="size a multi-GPU deployment on paper: per-step decode time, tokens/s per "
                                    "GPU and per user",
                       description="A roofline of one decode step per layer, calibrated on the committed H200 "
                                   "records (benchmarks/results), with the links as parameters.")
    p.add_argument("--model", required=True, help="K3 or kimi-linear-48b")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--layout", required=True, help="tpN, depN, helixN, optionally _moetpAepB (helix16_moetp4ep4)")
    p.add_argument("--batch", type=int, default=64, help="concurrent requests in all (default 64)")
    p.add_argument("--context", type=int, default=8192, help="cached tokens per request (default 8192)")
    p.add_argument("--weights", default=None, choices=sorted(EXPERT_BYTES),
                   help="routed experts' format (default: K3 mxfp4, Kimi Linear bf16)")
    p.add_argument("--layers", type=int, default=None, help="keep the widths, use N layers")
    p.add_argument("--link-gbps", type=float, default=NVLINK_GBPS, help="GB/s per direction inside a node (450)")
    p.add_argument("--link-latency-us", type=float, default=LINK_LATENCY_US)
    p.add_argument("--node-gpus", type=int, default=NODE_GPUS, help="GPUs per NVLink domain (8)")
    p.add_argument("--inter-node-gbps", type=float, default=INTER_NODE_GBPS, help="GB/s per GPU between nodes (50)")
    p.add_argument("--inter-node-latency-us", type=float, default=INTER_LATENCY_US)
    p.add_argument("--records", default=None, help="folder of the H200 records (default benchmarks/results)")
    p.add_argument("--comm-records", default=None,
                   help="JSON of benchmarks/comm_bench.py: fit the in-node link latency and bandwidth to it")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.link_gbps <= 0 or args.inter_node_gbps <= 0 or args.node_gpus < 1:
        raise KestrelError("--link-gbps, --inter-node-gbps must be > 0 and --node-gpus >= 1")
    link = Link(args.link_gbps, args.link_latency_us, args.inter_node_gbps, args.inter_node_latency_us,
                args.node_gpus)
    if args.comm_records:
        link = fit_link(args.comm_records, link)
    p = plan(args.model, args.gpus, args.layout, args.batch, args.context, args.weights, link,
             layers=args.layers, records=args.records)
    print(format_plan(p))
    return 0
