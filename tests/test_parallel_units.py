"""Several ranks without starting any: flags and layouts (one-line errors before any weight is read), the sharded
loader (each rank reads only its slice, quantized forms too), the deployment profiles. (Helix's log-sum-exp merge
against unsharded attention: tests/test_helix_merge.py.)"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from helpers import single_thread, tiny_checkpoint  # noqa: F401
from kestrel.cli import main
from kestrel.config import EngineConfig, ModelConfig
from kestrel.errors import ConfigError
from kestrel.llm import LLM, setup_engine
from kestrel.models.kimi import load_reference_model
from kestrel.models.kimi import weights as weights_mod
from kestrel.models.kimi.reference import weight
from kestrel.parallel.launch import init_group
from kestrel.parallel.mapping import Mapping


def mapping(rank: int = 0, **flags) -> Mapping:
    return Mapping.from_engine_config(EngineConfig(model="x", **flags), rank)


# ---- layouts and flags ----------------------------------------------------------------------------------------

def test_layout_names_and_coordinates():
    assert mapping().name == "tp1" and not mapping().parallel
    m = mapping(3, tensor_parallel_size=4)
    assert (m.name, m.tp_rank, m.moe_tp, m.ep) == ("tp4", 3, 4, 1)
    m = mapping(1, tensor_parallel_size=2, enable_expert_parallel=True)
    assert (m.name, m.ep, m.ep_rank, list(m.experts(8))) == ("tp2_moetp1ep2", 2, 1, [4, 5, 6, 7])
    m = mapping(1, data_parallel_size=2, enable_expert_parallel=True)
    assert (m.name, m.tp, m.dp_rank, m.dispatch, m.leader) == ("dep2", 1, 1, True, True)
    m = mapping(5, helix_size=8, enable_expert_parallel=True, moe_tp_size=2)
    assert (m.name, m.tp, m.world_size, m.ep, m.ep_rank, m.moe_tp_rank) == ("helix8_moetp2ep4", 8, 8, 4, 2, 1)
    assert EngineConfig(model="x", helix_size=4).world_size == 4


@pytest.mark.parametrize("flags, words", [
    (dict(tensor_parallel_size=3), "--tensor-parallel-size 3 does not divide the 4 MLA attention heads"),
    (dict(helix_size=3), "--helix-size 3 does not divide the 4 KDA heads"),
    (dict(tensor_parallel_size=2, enable_expert_parallel=True, moe_tp_size=1, page_size=8), None),
    (dict(helix_size=4, page_size=6), "--helix-size 4 does not divide the 6 tokens of a page"),
    (dict(data_parallel_size=16, enable_expert_parallel=True), "expert parallelism over 16 does not divide the 8"),
    (dict(tensor_parallel_size=2, moe_tp_size=4), "--moe-tp-size 4 does not divide the 2 ranks"),
    (dict(tensor_parallel_size=4, moe_tp_size=2), "add --enable-expert-parallel"),
    (dict(tensor_parallel_size=2, data_parallel_size=2), "not built; use one of them"),
    (dict(helix_size=2, tensor_parallel_size=4), "Helix runs over the whole tensor-parallel group"),
    (dict(tensor_parallel_size=0), "--tensor-parallel-size 0: must be an integer >= 1"),
    (dict(node_rank=1), "--node-rank 1: must be an integer >= 0 and <= 0"),
])
def test_layouts_that_do_not_split_fail_in_one_line_before_loading(flags, words):
    path = tiny_checkpoint("kimi-linear-tiny")
    if words is None:         # the control: this one is fine
        assert setup_engine(EngineConfig(model=path, device="cpu", **flags)).mapping.name == "tp2_moetp1ep2"
        return
    with pytest.raises(ConfigError) as e:
        setup_engine(EngineConfig(model=path, device="cpu", **flags))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_cli_bad_layout_is_one_line_and_starts_no_rank(capsys):
    code = main(["generate", "--model", tiny_checkpoint("k3-tiny"), "--device", "cpu", "-tp", "3", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == ("kestrel: error: --tensor-parallel-size 3 does not divide the 4 MLA attention heads of "
                       "this model; use a divisor of 4")
    assert not any("started rank" in ln for ln in err)


def test_port_in_use_is_refused_before_any_rank_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^--master-port {port}: 127.0.0.1:{port} is in use"):
            LLM(tiny_checkpoint("kimi-linear-tiny"), device="cpu", tensor_parallel_size=2, master_port=port)


def test_world_size_mismatch_under_torchrun(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="WORLD_SIZE is 4 but the layout needs 2 ranks"):
        init_group(EngineConfig(model="x", tensor_parallel_size=2), "cpu")
    monkeypatch.delenv("RANK")
    with pytest.raises(ConfigError, match="this process is not one"):
        init_group(EngineConfig(model="x", tensor_parallel_size=2), "cpu")


def test_helix_requires_reference_modeling():
    path = tiny_checkpoint("kimi-linear-tiny")
    from kestrel.models.kimi.routing import NoTarget
    with pytest.raises((NoTarget, ConfigError)):
        setup_engine(EngineConfig(model=path, device="cpu", helix_size=2, modeling="require"))


# ---- sharded loading -------------------------------------------------------------------------------------------

def dense(p) -> torch.Tensor:
    return weight(p).float()


def expected_parts(full, part, m: Mapping, c: ModelConfig) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, the rank's tensor, the slice of the one-rank model it must equal) for a few tensors of each kind."""
    tp, r = m.tp, m.tp_rank
    out = []

    def rows(t, n):
        return t[r * (t.shape[0] // n):(r + 1) * (t.shape[0] // n)]

    def cols(t, n):
        return t[:, r * (t.shape[1] // n):(r + 1) * (t.shape[1] // n)]

    kda = next(i for i, k in enumerate(c.layer_kinds) if k == "kda")
    mla = next(i for i, k in enumerate(c.layer_kinds) if k == "mla")
    fa, pa = full.layers[kda].self_attn, part.layers[kda].self_attn
    for n in ("q_proj", "k_proj", "b_proj"):
        out.append((f"kda.{n}", dense(getattr(pa, n).weight), rows(dense(getattr(fa, n).weight), tp)))
    out.append(("kda.A_log", pa.A_log, rows(fa.A_log, tp)))
    out.append(("kda.q_conv1d", pa.q_conv1d, rows(fa.q_conv1d, tp)))
    out.append(("kda.o_proj", dense(pa.o_proj.weight), cols(dense(fa.o_proj.weight), tp)))
    out.append(("kda.f_a_proj", dense(pa.f_a_proj.weight), dense(fa.f_a_proj.weight)))
    fm, pm = full.layers[mla].self_attn, part.layers[mla].self_attn
    out.append(("mla.kv_b_proj", dense(pm.kv_b_proj.weight), rows(dense(fm.kv_b_proj.weight), tp)))
    out.append(("mla.o_proj", dense(pm.o_proj.weight), cols(dense(fm.o_proj.weight), tp)))
    out.append(("mla.kv_a", dense(pm.kv_a_proj_with_mqa.weight), dense(fm.kv_a_proj_with_mqa.weight)))
    fd, pd = full.layers[0].mlp, part.layers[0].mlp
    out.append(("mlp.gate_proj", dense(pd.gate_proj.weight), rows(dense(fd.gate_proj.weight), tp)))
    out.append(("mlp.down_proj", dense(pd.down_proj.weight), cols(dense(fd.down_proj.weight), tp)))
    fe, pe = full.layers[1].block_sparse_moe, part.layers[1].block_sparse_moe
    I, mt, q = c.moe_intermediate_size, m.moe_tp, m.moe_tp_rank
    for j, e in enumerate(m.experts(c.num_experts)):
        w13 = weight(fe.experts.w13, e).float()
        want = torch.cat([w13[q * I // mt:(q + 1) * I // mt], w13[I + q * I // mt:I + (q + 1) * I // mt]])
        out.append((f"expert {e} w13", weight(pe.experts.w13, j).float(), want))
        w2 = weight(fe.experts.w2, e).float()
        out.append((f"expert {e} w2", weight(pe.experts.w2, j).float(), w2[:, q * I // mt:(q + 1) * I // mt]))
    out.append(("router", dense(pe.gate.weight), dense(fe.gate.weight)))
    return out


@pytest.fixture(scope="module")
def nvfp4_checkpoint():
    from helpers import scratch_dir
    from kestrel.quant.quantize import quantize_checkpoint
    out = os.path.join(scratch_dir("par-nvfp4"), "q")
    quantize_checkpoint(tiny_checkpoint("kimi-linear-tiny"), out, "nvfp4", "all-linear", "modelopt")
    return out


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "nvfp4"])
@pytest.mark.parametrize("flags", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, moe_tp_size=1,
                                                                      enable_expert_parallel=True)],
                         ids=["tp2", "tp2_ep2"])
def test_each_rank_reads_only_its_slice(monkeypatch, nvfp4_checkpoint, quantized, flags):
    path = nvfp4_checkpoint if quantized else tiny_checkpoint("kimi-linear-tiny")
    c = ModelConfig.from_dir(path)
    full = load_reference_model(path, c, torch.float32, torch.device("cpu"))
    reads: dict[str, object] = {}
    real = weights_mod.iter_checkpoint

    def watched(p):
        for name, load, shape in real(p):
            def recording(slices=None, name=name, load=load):
                reads[name] = slices
                return load(slices)
            yield name, recording, shape

    monkeypatch.setattr(weights_mod, "iter_checkpoint", watched)
    for rank in (0, 1):
        m = mapping(rank, **flags)
        reads.clear()
        part = load_reference_model(path, c, torch.float32, torch.device("cpu"), m)
        for name, got, want in expected_parts(full, part, m, c):
            assert torch.equal(got, want), name
        names = [n for n, _, _ in real(path)]
        table = weights_mod.expected_tensors(c, weights_mod.quantized_modules(c, names), m)
        for name, place in table.items():
            ckpt = "model." + name if not name.startswith("lm_head") else name
            if not place.held:
                assert ckpt not in reads, f"{name} belongs to another rank but was read"
            elif place.shard is not None and place.local_shape != place.shape:
                assert reads[ckpt] is not None, f"{name} was read whole"
        assert sum(p.numel() for p in part.parameters()) < sum(p.numel() for p in full.parameters())


def test_quantized_block_that_does_not_split_is_one_line(nvfp4_checkpoint):
    c = ModelConfig.from_dir(nvfp4_checkpoint)
    with pytest.raises(ConfigError, match="does not split over 4 ranks along dim 1"):
        weights_mod.expected_tensors(c, weights_mod.quantized_modules(
            c, [n for n, _, _ in weights_mod.iter_checkpoint(nvfp4_checkpoint)]),
            mapping(0, tensor_parallel_size=4, moe_tp_size=4))


# ---- deployment profiles -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("target, preset", [("kimi_k3_bf16__sm_90__default", "k3"),
                                            ("kimi_linear_bf16__sm_90__default", "kimi-linear-48b")])
def test_deployment_profiles_split_the_real_model(target, preset):
    import importlib
    from kestrel.models.kimi.checkpoint import preset_config
    profiles = importlib.import_module(f"kestrel.models.kimi.targets.{target}.features").PROFILES
    config = ModelConfig.from_dict(preset_config(preset))
    shapes = ["tp{}", "dep{}", "helix{}"]
    want = {"tp1"} | {s.format(w) for s in shapes for w in (2, 4, 8, 16)} | {
        "helix2_moetp1ep2", "helix4_moetp2ep2", "helix8_moetp2ep4", "helix16_moetp4ep4"}
    assert set(profiles) == want
    for name, flags in profiles.items():
        ec = EngineConfig(model="x", **flags)
        m = Mapping.from_engine_config(ec)
        assert m.name == name
        m.validate(config, ec.page_size)          # K3: 96 heads, 896 experts; Kimi Linear: 32 heads, 256 experts
