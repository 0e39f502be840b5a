"""Quantized MLA KV cache (FP8 / NVFP4 pages), bf16 KDA state: formats, flags, pools, memory plan, reference path.
The kernels reading and writing the pages are catalog entries driven by test_catalog_cells.py."""

import tempfile

import pytest
import torch

from kestrel.config import EngineConfig, ModelConfig, parse_kv_cache_dtype_layers
from kestrel.errors import ConfigError
from kestrel.models.kimi.checkpoint import make_checkpoint, preset_config, random_reference_model
from kestrel.models.kimi.step import CachePools, StepBatch, page_formats
from kestrel.quant.kv_cache import KvPageFormat
from kestrel.runtime.cache import HybridCache
from kestrel.runtime.memory import cache_formats, plan_cache

from helpers import single_thread  # noqa: F401
from trained_tiny import RECIPES, SESSION_ROOT, synthetic_prompts, trained_checkpoint

K3 = ModelConfig.from_dict(preset_config("k3"))


def _ec(**kw):
    return EngineConfig(model="unused", **kw)


def test_page_rows_and_documented_bounds():
    assert KvPageFormat("bf16", 512, 64).row_bytes == 1152
    assert KvPageFormat("fp8", 512, 64).row_bytes == 656          # 16 scale + 128 k_pe + 512 e4m3
    assert KvPageFormat("nvfp4", 512, 64).row_bytes == 432        # 4 + 128 + 256 + 32 = 420, padded to 16
    g = torch.Generator().manual_seed(0)
    c = torch.randn(64, 512, generator=g) * (torch.rand(512, generator=g) + 0.3)
    pe = torch.randn(64, 64, generator=g)
    fp8 = KvPageFormat("fp8", 512, 64)
    d = fp8.decode(fp8.encode(c, pe))
    s = c.abs().unflatten(-1, (4, 128)).amax(-1).repeat_interleave(128, -1) / 448
    assert ((d[:, :512] - c).abs() <= torch.maximum(c.abs() * 2 ** -4, s * 2 ** -10) + 1e-7).all()
    assert torch.equal(d[:, 512:], pe.to(torch.bfloat16).float())         # k_pe stays bf16
    nv = KvPageFormat("nvfp4", 512, 64)
    d = nv.decode(nv.encode(c, pe))
    block = c.abs().unflatten(-1, (32, 16)).amax(-1).repeat_interleave(16, -1)
    # e2m1: half a step of 1 mantissa bit (2^-2 relative), the block scale's own e4m3 rounding (2^-4), and values
    # under a quarter step of the block's scale (block amax / 6 / 4) may vanish
    assert ((d[:, :512] - c).abs() <= c.abs() * (2 ** -2 + 2 ** -4) * 1.07 + block / 24 + 1e-6).all()
    with pytest.raises(ValueError, match="multiple of 16"):
        KvPageFormat("nvfp4", 40, 8)


def test_kv_cache_dtype_layers_parsed_and_checked():
    assert parse_kv_cache_dtype_layers("91,92:fp8") == {91: "fp8", 92: "fp8"}
    assert parse_kv_cache_dtype_layers("3-11:nvfp4;91,92:fp8") == {**{i: "nvfp4" for i in range(3, 12)},
                                                                   91: "fp8", 92: "fp8"}
    ec = _ec(kv_cache_dtype="nvfp4", kv_cache_dtype_layers="91,92:fp8")
    kinds = ec.mla_cache_dtypes(K3)
    assert kinds[91] == kinds[92] == "fp8" and kinds[3] == "nvfp4" and len(kinds) == 24
    for bad, what in (("91:fp9", "unknown KV cache dtype 'fp9'"), ("91,92", "lacks ':DTYPE'"),
                      ("9-3:fp8", "rising range"), ("91:fp8;91:bf16", "two dtypes"), ("", "no layer group")):
        with pytest.raises(ConfigError, match=what) as e:
            _ec(kv_cache_dtype_layers=bad)
        assert "\n" not in str(e.value)
    for layers, what in (("90:fp8", "layer 90 is a KDA layer"), ("93:fp8", "past the model's 93 layers")):
        with pytest.raises(ConfigError, match=what) as e:
            _ec(kv_cache_dtype_layers=layers).check_model(K3)
        assert "MLA layers (0-based): 3, 7," in str(e.value) and "\n" not in str(e.value)
    for field, value in (("kv_cache_dtype", "fp4"), ("kda_state_dtype", "fp16")):
        with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')} 'fp"):
            _ec(**{field: value})


def test_cli_refuses_a_bad_override_in_one_line(tmp_path):
    from kestrel.cli import build_parser, engine_config
    args = build_parser().parse_args(["explain", "--model", str(tmp_path), "--kv-cache-dtype-layers", "3:fp7"])
    with pytest.raises(ConfigError, match="unknown KV cache dtype 'fp7'"):
        engine_config(args)


def test_override_applied_to_the_pools_and_kda_state_dtype():
    cfg = ModelConfig.from_dict(preset_config("k3-tiny"))
    assert cfg.mla_layers == [2, 5]
    ec = _ec(kv_cache_dtype_layers="5:fp8", kda_state_dtype="bf16")
    formats, state = cache_formats(cfg, ec, torch.float32)
    cache = HybridCache(cfg, 4, 16, 2, 0, 4, torch.float32, torch.device("cpu"), kv_formats=formats,
                        state_dtype=state, extra_kv_kind=ec.kv_cache_dtype)
    p = cache.pools
    assert p.mla[2].dtype == torch.float32 and p.mla[2].shape[-1] == cfg.mla_cache_width
    assert p.mla[5].dtype == torch.uint8 and p.mla[5].shape[-1] == formats[5].row_bytes
    assert p.page_format(5).kind == "fp8" and p.page_format(2).kind == "fp32"
    assert all(t.dtype == torch.bfloat16 for t in p.recurrent.values())
    assert cache.layout()["mla_format"] == {2: "fp32", 5: "fp8"} and cache.layout()["kda_state_dtype"] == "bfloat16"
    cache.add_layers({cfg.num_layers: "mla"})              # a drafter's layer gets --kv-cache-dtype (auto)
    assert p.page_format(cfg.num_layers).kind == "fp32"


def test_memory_plan_counts_smaller_pages_and_states():
    budget = 8 * 2 ** 30
    plans = {}
    for name, kw in (("bf16", {}), ("fp8", dict(kv_cache_dtype="fp8")), ("nvfp4", dict(kv_cache_dtype="nvfp4")),
                     ("bf16 state", dict(kda_state_dtype="bf16")),
                     ("last two fp8", dict(kv_cache_dtype_layers="91,92:fp8"))):
        ec = _ec(kv_cache_bytes=budget, max_num_seqs=8, page_size=64, **kw)
        plans[name] = plan_cache(K3, ec, torch.bfloat16, torch.device("cpu"), 8192)
    base = plans["bf16"]
    assert base.baseline_pages is None and base.extra_tokens == 0
    for name in ("fp8", "nvfp4", "bf16 state", "last two fp8"):
        p = plans[name]
        assert p.nbytes <= budget and p.num_tokens > base.num_tokens, name
        assert p.baseline_pages * p.page_size <= base.num_tokens and p.extra_tokens > 0
        assert "tokens (" in p.describe() and "against bf16 pages with fp32 KDA state" in p.describe()
    assert plans["nvfp4"].num_tokens > plans["fp8"].num_tokens > plans["last two fp8"].num_tokens
    # the pages alone: bf16 rows 1152 bytes per token and layer, fp8 656
    assert plans["fp8"].bytes_per_page == 24 * 64 * 656 and base.bytes_per_page == 24 * 64 * 1152
    assert base.bytes_per_page / plans["fp8"].bytes_per_page == pytest.approx(1152 / 656)
    assert plans["bf16 state"].bytes_per_slot < base.bytes_per_slot
    print("\n".join(f"{k}: {p.describe()}" for k, p in plans.items()))


def _prefill_logits(model, cfg, kind, T=40, seed=1):
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(seed))
    pools = CachePools.allocate(cfg, 8, 16, 2, torch.bfloat16, "cpu",
                                kv_formats=page_formats(cfg, torch.bfloat16, {i: kind for i in cfg.mla_layers}))
    batch = StepBatch(token_ids=ids, positions=torch.arange(T), cu_seqlens=[0, T], context_lens=[0],
                      slots=torch.tensor([0]), block_tables=torch.arange(8, dtype=torch.int32)[None],
                      logits_indices=torch.arange(T))
    return model(batch, pools)


def test_reference_logits_with_quantized_kv_stay_close():
    """Same tokens, one prefill: FP8 / NVFP4 pages move the tiny model's logits by a bounded fraction of their
    spread (measured 7.5% and 19%; a wrong scale or layout moves them by ~100%)."""
    cfg = ModelConfig.from_dict(preset_config("kimi-linear-tiny"))
    model = random_reference_model(cfg, torch.bfloat16, torch.device("cpu"), 3)
    ref = _prefill_logits(model, cfg, "bf16")
    spread = (ref - ref.mean(-1, keepdim=True)).norm()
    err = {}
    for kind in ("fp8", "nvfp4"):
        e = _prefill_logits(model, cfg, kind) - ref
        err[kind] = float((e - e.mean(-1, keepdim=True)).norm() / spread)
    assert err["fp8"] < 0.15 and err["nvfp4"] < 0.35 and err["fp8"] < err["nvfp4"], err


def test_greedy_with_fp8_kv_against_bf16_kv():
    """32 greedy tokens of a random tiny model (bf16, reference path, CPU) with FP8 KV against bf16 KV over 10 seeds.
    Found: equal on 3 of 10 seeds (kimi-linear-tiny), not the 9 the issue asks for: the random model's next-token
    distribution is nearly flat (top-1 logprob about -4.3 over 1024 ids, top-2 margins 0.005-0.14 nats), and FP8's
    2^-4 relative rounding moves its logits by ~7.5% of their spread (test above), so about 2.5% of teacher-forced
    argmaxes flip. What holds and is checked: FP8 never diverges where bf16 was confident (top-2 margin >= 0.25).
    The issue's 9 of 10 is checked on a trained tiny model, whose margins are a real LM's (test below)."""
    d = tempfile.mkdtemp()
    make_checkpoint("kimi-linear-tiny", d, seed=0, dtype=torch.bfloat16, config_only=True)
    from kestrel import LLM, SamplingParams
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    equal = 0
    for seed in range(10):
        out = {}
        for kv in ("bf16", "fp8"):
            llm = LLM(d, dtype="bfloat16", device="cpu", load_format="random", seed=seed, kv_cache_dtype=kv,
                      kv_cache_tokens=2048, max_num_seqs=2)
            prompt = torch.randint(0, 1024, (24,), generator=torch.Generator().manual_seed(seed)).tolist()
            out[kv] = llm.generate(prompt, params)[0]
        a, b = out["bf16"], out["fp8"]
        assert len(b.token_ids) == 32
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if first is None:
            equal += 1
            continue
        top = a.logprobs[first][1]
        assert top[0][1] - top[1][1] < 0.25, f"seed {seed}: FP8 diverged at token {first} where bf16 was sure"
    print(f"FP8 KV greedy equal to bf16 KV for 32 tokens on {equal}/10 seeds")


def _greedy(folder: str, kv: str, prompts: list[list[int]], tokens: int = 32):
    from kestrel import LLM, SamplingParams
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=2)
    llm = LLM(folder, dtype="bfloat16", device="cpu", kv_cache_dtype=kv, kv_cache_tokens=4096,
              max_num_seqs=len(prompts))
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == tokens for o in outs)
    return outs


def _against_bf16(base, outs) -> list[dict]:
    """Per prompt: `first`, the first token where greedy output `outs` differs from bf16 pages' `base` (None:
    equal); `margins`, bf16's top-2 logprob margin per token; `moves`, how much the other pages changed the top-2
    margin of each token up to `first`."""
    runs = []
    for a, b in zip(base, outs):
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        margin = [top[0][1] - top[1][1] for _, top in a.logprobs]
        other = [top[0][1] - top[1][1] for _, top in b.logprobs]
        upto = len(margin) if first is None else first + 1
        runs.append({"first": first, "margins": margin,
                     "moves": [abs(x - y) for x, y in zip(margin[:upto], other[:upto])]})
    return runs


@pytest.mark.parametrize("name", ["kimi-linear", "k3"])
def test_greedy_of_a_trained_tiny_model_with_quantized_kv(name):
    """The issue's check: 32 greedy tokens with FP8 KV equal bf16 KV's on at least 9 of 10 seeds, on a tiny model
    (Kimi Linear or K3 widths, 2 MLA layers: every KV read is quantized) trained for ~20 CPU seconds on a synthetic
    language (tests/trained_tiny.py), so that its margins are a trained LM's: several nats on rule-bound tokens, a
    few tenths where it only has a favourite (and, as small LMs do, greedy falls into repeating its favourite on
    some prompts). Seeds 0-6 prompt with the language, 7-9 with random ids of the whole vocabulary.
    Measured (Kimi Linear / K3): FP8 equal on 10 / 10 of 10 seeds; NVFP4 (informational) on 9 / 10 of 10, its one
    flip at the first token of a random prompt where bf16's margin is 0.018 nats. FP8 pages move a token's top-2
    margin by 0.010 / 0.005 nats (median), 0.055 / 0.043 (99th percentile), 0.08 / 0.11 (max); NVFP4 pages by 0.02,
    0.42 / 0.12, 0.9 / 0.5. bf16's margins are below FP8's 99th-percentile move on one token of the 320 (a random
    prompt's first): that is why FP8 holds here and not on a flat random model (margins 0.005-0.14, test above).
    Other training seeds (recipe seed 1-3 / 1-2): FP8 10 of 10 on every one, NVFP4 10, 8, 10 / 10, 10; the largest
    FP8 move seen there is 1.7 nats once, on a sure token (margin 3.0 -> 4.7, a sharp attention score tipped), so
    the margin at a flip, not the mean move, is what counts. Also checked: neither format diverges where bf16 was
    confident (FP8 0.25, NVFP4 0.6 nats), and the model learned (loss halved, median margin on the language's
    prompts over a nat)."""
    folder, stats = trained_checkpoint(name, SESSION_ROOT)
    assert stats["loss"] < 0.5 * stats["first_loss"], stats
    prompts = synthetic_prompts(7, 24, 0, RECIPES[name])
    prompts += [torch.randint(0, 1024, (24,), generator=torch.Generator().manual_seed(s)).tolist() for s in (7, 8, 9)]
    report = [f"{name}: trained in {stats['cpu_s']:.1f} CPU s, loss {stats['first_loss']:.2f} -> {stats['loss']:.2f}"]
    base = _greedy(folder, "bf16", prompts)
    margins = [top[0][1] - top[1][1] for o in base for _, top in o.logprobs]
    language = sorted(margins[:7 * 32])
    assert language[len(language) // 2] > 1.0, "the trained model is not confident: training failed"
    equal = {}
    for kind, sure in (("fp8", 0.25), ("nvfp4", 0.6)):
        runs = _against_bf16(base, _greedy(folder, kind, prompts))
        equal[kind] = sum(r["first"] is None for r in runs)
        for seed, r in enumerate(runs):
            if r["first"] is not None:
                m = r["margins"][r["first"]]
                report.append(f"{kind} seed {seed}: differs from token {r['first']}, bf16 margin there {m:.3f}")
                assert m < sure, f"{kind} seed {seed}: diverged at token {r['first']} where bf16 was sure ({m:.2f})"
        moves = sorted(m for r in runs for m in r["moves"])
        typical = moves[int(0.99 * len(moves))]
        report.append(f"{kind} KV greedy equal to bf16 KV for 32 tokens on {equal[kind]}/10 seeds; top-2 margins "
                      f"moved by {moves[len(moves) // 2]:.3f} (median), {typical:.3f} (99th percentile), "
                      f"{moves[-1]:.3f} (max); bf16 margins below the 99th percentile move on "
                      f"{sum(m < typical for m in margins)} of {len(margins)} tokens (smallest {min(margins):.3f})")
    print("\n".join(report))
    assert equal["fp8"] >= 9, report


def test_router_sees_the_cache_formats():
    """The sm_90 targets read bf16, FP8 and NVFP4 pages (any per-layer mix) and fp32 KDA states only: quantized
    pages route to the target, a bf16 state falls back to the reference (auto) or fails `require`, naming the kv
    dtype criterion."""
    from kestrel.llm import modeling_context, route_modeling
    from kestrel.models.kimi.routing import NoTarget
    cfg = ModelConfig.from_dict(preset_config("kimi-linear-48b"))
    ctx = modeling_context(cfg, torch.device("cpu"), torch.bfloat16, _ec())
    assert ctx.kv_cache_dtype == "bf16"
    target = "kimi_linear_bf16__sm_90__default"
    assert route_modeling(type(ctx)(config=cfg, arch="sm_90", quant="bf16", kv_cache_dtype="bf16"), "auto") == target
    for kw, kv, claimed in ((dict(kv_cache_dtype="fp8"), "fp8", True),
                            (dict(kv_cache_dtype="nvfp4"), "nvfp4", True),
                            (dict(kv_cache_dtype_layers="26:nvfp4"), "bf16+nvfp4", True),
                            (dict(kv_cache_dtype="fp8", kv_cache_dtype_layers="3:bf16;26:nvfp4"), "bf16+fp8+nvfp4",
                             True),
                            (dict(kda_state_dtype="bf16"), "bf16+kda-bf16", False),
                            (dict(kv_cache_dtype="fp8", kda_state_dtype="bf16"), "fp8+kda-bf16", False)):
        ctx = modeling_context(cfg, torch.device("cpu"), torch.bfloat16, _ec(**kw))
        assert ctx.kv_cache_dtype == kv
        ctx = type(ctx)(config=cfg, arch="sm_90", quant="bf16", kv_cache_dtype=kv)
        if claimed:
            assert route_modeling(ctx, "require") == target, kv
            continue
        assert route_modeling(ctx, "auto") is None
        with pytest.raises(NoTarget, match="kv dtype"):
            route_modeling(ctx, "require")


def test_bf16_kda_state_runs_the_reference_end_to_end():
    """--kda-state-dtype bf16 on the reference path: the state pools are bf16, the math fp32; a K3-shaped tiny model
    (FP8 pages, one NVFP4 layer) decodes, and its prefill logits stay near the fp32-state ones."""
    cfg = ModelConfig.from_dict(preset_config("k3-tiny"))
    model = random_reference_model(cfg, torch.bfloat16, torch.device("cpu"), 5)
    T = 24
    ids = torch.randint(0, cfg.vocab_size, (T + 1,), generator=torch.Generator().manual_seed(2))
    logits = {}
    for state in ("fp32", "bf16"):
        ec = _ec(kv_cache_dtype="fp8", kv_cache_dtype_layers="5:nvfp4", kda_state_dtype=state)
        formats, state_dtype = cache_formats(cfg, ec, torch.bfloat16)
        pools = CachePools.allocate(cfg, 4, 16, 2, torch.bfloat16, "cpu", kv_formats=formats, state_dtype=state_dtype)
        bt = torch.arange(4, dtype=torch.int32)[None]
        pre = StepBatch(token_ids=ids[:T], positions=torch.arange(T), cu_seqlens=[0, T], context_lens=[0],
                        slots=torch.tensor([0]), block_tables=bt, logits_indices=torch.arange(T))
        dec = StepBatch(token_ids=ids[T:], positions=torch.tensor([T]), cu_seqlens=[0, 1], context_lens=[T],
                        slots=torch.tensor([0]), block_tables=bt, logits_indices=torch.tensor([0]))
        logits[state] = torch.cat([model(pre, pools), model(dec, pools)])
        assert all(t.dtype == state_dtype for t in pools.recurrent.values())
        assert pools.mla[5].shape[-1] == formats[5].row_bytes != pools.mla[2].shape[-1]
    ref = logits["fp32"]
    err = (logits["bf16"] - ref).norm() / (ref - ref.mean(-1, keepdim=True)).norm()
    assert torch.isfinite(logits["bf16"]).all() and err < 0.05, float(err)
