"""`kestrel plan`: the performance model reproduces the one-H200 records it was calibrated on, its kernel table is
the targets' launches, each layout shards what it says, and user mistakes are one-line errors."""

from __future__ import annotations

import glob
import json
import os

import pytest

from kestrel.errors import KestrelError
from kestrel.parallel import plan as P

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")


def _records():
    """(model, layers, batch, context, step_ms, source) of the committed decode records (graphs, greedy), as
    `plan.decode_records` reads them (a record whose first run compiled kernels counts its steady run)."""
    out = []
    for r in P.decode_records(RESULTS):
        layers = 8 if r["model"].endswith("-8l") else None
        out.append((r["model"], layers, r["batch"], r["context"] + r["output_len"] // 2, r["step_ms"], r["source"]))
    return out


@pytest.fixture(scope="module")
def cal():
    return P.calibrate(RESULTS)


def test_records_include_the_three_the_model_is_built_from():
    got = {(m, b) for m, _, b, _, _, _ in _records()}
    assert {("kimi-linear-48b-8l", 1), ("kimi-linear-48b-8l", 64), ("kimi-linear-48b", 1)} <= got


@pytest.mark.parametrize("rec", _records(), ids=lambda r: f"{r[0]}-b{r[2]}")
def test_one_gpu_tp1_reproduces_the_record_within_16_percent(rec, cal):
    """Two fitted constants (bandwidth fraction, cost per launch) and the records' host times over six records: the
    worst fit is kl8 batch 1 with the fused entries, 15.1% low, since the 27-layer fused record joined the fit (the
    model has no per-step device overhead beyond launches)."""
    model, layers, batch, context, step_ms, source = rec
    table = P.KERNELS_UNFUSED if source in P.UNFUSED_RECORDS else None       # the targets that measured it
    p = P.plan("kimi-linear-48b", 1, "tp1", batch, context, layers=layers, cal=cal, kernels=table)
    assert abs(p.step_s * 1e3 / step_ms - 1) < 0.16, (p.step_s * 1e3, step_ms)
    assert p.per_gpu == pytest.approx(batch / p.step_s) and p.per_user == pytest.approx(1 / p.step_s)
    assert all(not x.comms for x, _ in p.rows), "one GPU has no collectives"


def test_calibration_is_physical(cal):
    assert 0.3 < cal.bw_fraction <= 1.0
    assert 0.5 < cal.launch_us < 20
    assert 0.05 < cal.flops_fraction <= 1.0
    assert cal.host_ms0 > 0 and cal.host_ms_per_seq >= 0


def _rows(p):
    return {x.kind: (x, t) for x, t in p.rows}


def test_tp_splits_experts_and_heads_but_every_rank_reads_every_latent(cal):
    one = _rows(P.plan("K3", 1, "tp1", 64, 8192, cal=cal))
    tp8 = _rows(P.plan("K3", 8, "tp8", 64, 8192, cal=cal))
    assert tp8["MLA + MoE"][0].kv_bytes == pytest.approx(one["MLA + MoE"][0].kv_bytes, rel=0.05)
    assert tp8["KDA + MoE"][0].weight_bytes < one["KDA + MoE"][0].weight_bytes / 7
    ops = [(c.op, c.group) for c in tp8["KDA + MoE"][0].comms]
    assert ops == [("all-reduce", 8), ("all-reduce", 8)]
    assert tp8["KDA + MoE"][0].comms[0].nbytes == 64 * 7168 * 2


def test_helix_shards_the_kv_along_the_sequence_and_exchanges_partials(cal):
    tp = _rows(P.plan("K3", 16, "tp16", 64, 65536, cal=cal))
    hx = _rows(P.plan("K3", 16, "helix16_moetp4ep4", 64, 65536, cal=cal))
    mla_kv = 64 * 65536 * 576 * 2                          # one MLA layer: every request's latents
    assert tp["MLA + MoE"][0].kv_bytes > mla_kv
    assert hx["MLA + MoE"][0].kv_bytes < mla_kv / 16 * 1.5
    a2a = [c for c in hx["MLA + MoE"][0].comms if c.op == "all-to-all"]
    assert len(a2a) == 1 and a2a[0].nbytes == 64 * 96 * (512 * 2 + 4)
    assert not any(c.op == "all-to-all" for c in hx["KDA + MoE"][0].comms)


def test_dep_dispatches_its_tokens_top_k_latent_rows(cal):
    p = P.plan("K3", 16, "dep16", 256, 8192, cal=cal)
    moe = _rows(p)["KDA + MoE"][0]
    assert [c.op for c in moe.comms] == ["all-to-all", "all-to-all"]
    assert moe.comms[0].nbytes == (256 // 16) * 16 * 3584 * 2
    assert _rows(p)["KDA + dense"][0].comms == []
    assert p.memory["weights"] > P.plan("K3", 16, "tp16", 256, 8192, cal=cal).memory["weights"]


def test_faster_links_never_slow_a_step(cal):
    slow = P.plan("K3", 16, "helix16_moetp4ep4", 64, cal=cal, link=P.Link(gbps=100, inter_gbps=25))
    fast = P.plan("K3", 16, "helix16_moetp4ep4", 64, cal=cal, link=P.Link(gbps=900, inter_gbps=400))
    assert fast.step_s < slow.step_s


@pytest.mark.parametrize("model,gpus,layout,words", [
    ("K3", 16, "pp16", "unknown"), ("K3", 8, "tp16", "uses 16 GPUs, --gpus says 8"),
    ("K3", 7, "tp7", "MLA heads (96) do not split over 7"), ("K3", 16, "helix16_moetp4ep2", "moe-tp 4 x ep 2"),
    ("kimi-linear-48b", 3, "dep3", "experts (256) do not split over 3"), ("K4", 1, "tp1", "--model K4"),
    ("K3", 16, "dep16_moetp2ep8", "moe-tp must be 1")])
def test_user_mistakes_are_one_line_errors(model, gpus, layout, words, cal):
    with pytest.raises(KestrelError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        P.plan(model, gpus, layout, cal=cal)
    assert "\n" not in str(e.value)


def test_kernel_table_is_what_the_targets_launch():
    """KERNELS against the launches tests/test_target_launches.py counts for one decode step of each bf16 target at
    real widths (5 layers: KDA + dense, KDA + MoE, MLA + MoE), per layer kind and outside the layers."""
    from test_target_launches import _layer_name, decode_launches
    for target, arch in (("kimi_linear_bf16__sm_90__default", "kimi_linear"),
                         ("kimi_k3_bf16__sm_90__default", "kimi_k3")):
        config, counter = decode_launches(target, 5)
        k = P.KERNELS[arch]
        want = {"kda+dense": k["kda"] + k["dense"], "kda+moe": k["kda"] + k["moe"], "mla+moe": k["mla"] + k["moe"]}
        for i in range(config.num_layers):
            assert counter.counts[i] == want[_layer_name(config, i)] + k["norms"], (target, i, counter.what[i])
        assert counter.counts["pre"] + counter.counts["post"] == k["head"], target


def test_cli_prints_the_table_and_its_assumptions(capsys):
    from kestrel.cli import main
    assert main(["plan", "--model", "K3", "--gpus", "16", "--layout", "helix16_moetp4ep4", "--batch", "32"]) == 0
    out = capsys.readouterr().out
    for words in ("MLA + MoE", "comm ms", "tok/s per GPU", "tok/s per user", "memory per rank", "assumptions:",
                  "450 GB/s"):
        assert words in out
    assert main(["plan", "--model", "K3", "--gpus", "8", "--layout", "dep16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kestrel: error: --layout dep16 uses 16 GPUs") and "\n" not in err


def test_link_fitted_to_collective_records(tmp_path, cal):
    """--comm-records: latency and bandwidth recovered from records of a known link (t = 12 us + wire / 300 GB/s)."""
    recs = []
    for op, n, size in (("all-reduce", 8, 1e6), ("all-reduce", 8, 1e8), ("all-to-all", 8, 4e7), ("all-gather", 8, 2e6)):
        wire = P.Collective(op, size, n).wire_bytes()
        recs.append({"op": op, "world": n, "bytes": size, "ms": 1e3 * (12e-6 + wire / 300e9)})
    path = tmp_path / "comm.json"
    path.write_text(json.dumps({"machine": {}, "command": "", "records": recs}))
    link = P.fit_link(str(path), P.Link())
    assert link.gbps == pytest.approx(300, rel=1e-6) and link.latency_us == pytest.approx(12, rel=1e-6)
    path.write_text("{}")
    with pytest.raises(KestrelError, match="cannot read collective records"):
        P.fit_link(str(path), P.Link())
