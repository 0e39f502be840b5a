"""The catalog / target contract, checked on the real packages and shown to fail on broken ones."""

import importlib
import sys
import textwrap

import pytest
import torch

from kestrel import contract
from kestrel.catalog import all_entries
from kestrel.config import ModelConfig
from kestrel.models.kimi.checkpoint import preset_config
from kestrel.models.kimi.routing import ModelingContext, NoTarget, explain, route


def test_catalog_entries_follow_the_contract():
    assert all_entries(), "the catalog is empty"
    assert contract.check_entries() == []


def test_targets_follow_the_contract():
    assert contract.check_targets() == []
    import kestrel.catalog._kimi_k3 as k3_forward
    import kestrel.catalog._kimi_linear as kimi_linear_forward
    import kestrel.catalog._layers as shared_layers
    for module in [*contract.iter_target_modules(), shared_layers, kimi_linear_forward, k3_forward]:
        assert contract.check_target_launches(module) == []


@pytest.fixture
def temp_pkg(tmp_path, monkeypatch):
    """Write a throwaway package `brokenpkg` and import it from tmp_path."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(files: dict[str, str]) -> str:
        for rel, text in files.items():
            p = tmp_path / "brokenpkg" / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(textwrap.dedent(text))
        for name in [m for m in sys.modules if m.startswith("brokenpkg")]:
            del sys.modules[name]
        importlib.invalidate_caches()
        return "brokenpkg"
    return write


ENTRY_OK = """
    from kestrel.catalog._op import OpWrapper, Arch, tiny
    class Good(OpWrapper):
        CELLS = (tiny("test", n=4),)
        ARCHS = (Arch.CPU,)
        TOLERANCE = "exact"
        WIDTHS = ("n",)
        @staticmethod
        def widths(x): return {"n": x.shape[-1]}
        @staticmethod
        def raw_call(x): return x
        @staticmethod
        def reference(x): return x
        @staticmethod
        def is_valid(x): return None
        @staticmethod
        def compare(out, ref): assert (out == ref).all()
        @staticmethod
        def make_inputs(spec, device, generator): return {}
"""


def test_entry_lacking_a_member_is_caught(temp_pkg):
    pkg = temp_pkg({"__init__.py": "", "good.py": ENTRY_OK,
                    "bad.py": ENTRY_OK.replace("class Good", "class Bad").replace(
                        "        @staticmethod\n        def reference(x): return x\n", "")})
    problems = contract.check_entries(pkg)
    assert len(problems) == 1 and "Bad" in problems[0] and "reference" in problems[0]


def test_cell_without_the_widths_is_caught(temp_pkg):
    pkg = temp_pkg({"__init__.py": "", "good.py": ENTRY_OK.replace('tiny("test", n=4)', 'tiny("test", m=4)')})
    problems = contract.check_entries(pkg)
    assert len(problems) == 1 and "lacks the width 'n'" in problems[0]


def test_entry_with_an_undriven_cell_is_caught(temp_pkg):
    pkg = temp_pkg({"__init__.py": "", "good.py": ENTRY_OK.replace(
        'CELLS = (tiny("test", n=4),)', 'CELLS = (tiny("test", n=4), gpu("K3 decode", n=7168))').replace(
        "import OpWrapper, Arch, tiny", "import OpWrapper, Arch, tiny, gpu")})
    problems = contract.check_entries(pkg)
    assert len(problems) == 1 and "no test drives it" in problems[0]


FEATURES = """
    CLAIM = {"shape fingerprint": {"arch": "kimi_k3"}, "arch": "sm_90", "quant": "bf16", "kv dtype": "bf16",
             "spec": "none", "layout": "tp1"}
"""


def test_target_importing_another_target_is_caught(temp_pkg):
    pkg = temp_pkg({
        "__init__.py": "",
        "kimi_k3_bf16__sm_90__a/__init__.py": "", "kimi_k3_bf16__sm_90__a/features.py": FEATURES,
        "kimi_k3_bf16__sm_90__a/modeling.py": "from kestrel.catalog.norm import add_rmsnorm\n",
        "kimi_k3_bf16__sm_90__b/__init__.py": "", "kimi_k3_bf16__sm_90__b/features.py": FEATURES,
        "kimi_k3_bf16__sm_90__b/modeling.py":
            "from brokenpkg.kimi_k3_bf16__sm_90__a import modeling\nimport torch\ny = torch.matmul(1, 2)\n",
    })
    problems = contract.check_targets(pkg)
    assert any("__b/modeling.py: imports brokenpkg" in p for p in problems)
    assert any("torch.matmul outside a catalog entry" in p for p in problems)
    assert not any("__a/" in p for p in problems)


def test_target_folder_must_match_its_claim(temp_pkg):
    pkg = temp_pkg({"__init__.py": "", "kimi_linear_bf16__sm_90__x/__init__.py": "",
                    "kimi_linear_bf16__sm_90__x/features.py": FEATURES})
    problems = contract.check_targets(pkg)
    assert any("folder says checkpoint 'kimi_linear'" in p for p in problems)


def _ctx(preset, arch="cpu", quant="fp32", layers=None):
    return ModelingContext(config=ModelConfig.from_dict(preset_config(preset, layers)), arch=arch, quant=quant,
                           kv_cache_dtype=quant)


def test_real_width_checkpoints_with_few_layers_route_like_the_full_model():
    for preset, target in (("k3", "kimi_k3_bf16__sm_90__default"),
                           ("kimi-linear-48b", "kimi_linear_bf16__sm_90__default")):
        for layers in (4, None):
            chosen, _ = route(_ctx(preset, "sm_90", "bf16", layers), "require")
            assert chosen == target


def test_explain_on_cpu_prints_every_criterion_and_the_fallback():
    text = explain(_ctx("k3-tiny"))
    for criterion in ("shape fingerprint", "arch", "quant", "kv dtype", "spec", "layout"):
        assert f" {criterion}:" in text
    assert "fallback to the reference implementation" in text


def test_require_names_the_missed_criterion():
    with pytest.raises(NoTarget, match="missed 'arch'"):
        route(_ctx("k3", "cpu", "bf16", 4), "require")
    with pytest.raises(NoTarget, match="missed 'shape fingerprint'"):
        route(_ctx("k3-tiny"), "require")


def test_modeling_off_never_builds_a_target(monkeypatch):
    import kestrel.models.kimi.routing as routing
    monkeypatch.setattr(routing, "load_claim", lambda *a, **k: pytest.fail("off must not look at targets"))
    assert route(_ctx("k3", "sm_90", "bf16", 4), "off") == (None, [])


def test_call_fixture_fails_a_test_that_skips_the_comparison():
    from kestrel.catalog._op import CallLog
    from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm
    log = CallLog()
    with log.watching(AddRmsNorm):
        x = torch.randn(2, 8)
        AddRmsNorm.raw_call(x, None, torch.ones(8), 1e-5)
        AddRmsNorm.reference(x, None, torch.ones(8), 1e-5)
    assert log.missing() == ["compare"]


# ---------------------------------------------------------------------------------------------------------------
# launched widths: every (entry, widths) a target launches at its claimed widths is one of the entry's cells

def test_targets_launch_only_certified_widths():
    assert contract.check_target_widths() == []


def test_launch_log_records_widths_and_keeps_in_place_results():
    """raw_call answers with the reference on the meta device; a pool the reference updates in place comes back as
    the caller's own tensor, new results as CPU tensors of the reference's shape and dtype; raw_call is restored."""
    from kestrel.catalog._op import LaunchLog
    from kestrel.catalog.kda.conv import ShortConv
    from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm
    raw = ShortConv.__dict__["raw_call"]
    x = torch.randn(5, 36864, dtype=torch.bfloat16)
    weight = torch.randn(36864, 4, dtype=torch.bfloat16, device="meta")
    pool = torch.randn(3, 36864, 3, dtype=torch.bfloat16)
    log = LaunchLog()
    with log.recording([ShortConv, AddRmsNorm]):
        y, state = ShortConv.raw_call(x, weight, pool, torch.tensor([0, 2, 5], dtype=torch.int32),
                                      torch.tensor([2, 0], dtype=torch.int32))
        AddRmsNorm.raw_call(y[:, :7168], None, torch.ones(7168, device="meta"), 1e-5)
    assert ShortConv.__dict__["raw_call"] is raw
    assert state is pool and y.device.type == "cpu" and y.shape == x.shape and y.dtype == torch.bfloat16
    assert log.uncertified() == []
    widths = sorted((e.name(), tuple(w.items())) for e, w, _ in log.launches.values())
    assert widths == [("kda.conv.ShortConv", (("C", 36864), ("K", 4), ("dtype", torch.bfloat16), ("parts", 1))),
                      ("norm.add_rmsnorm.AddRmsNorm", (("N", 7168), ("residual", False), ("dtype", torch.bfloat16)))]


def test_cells_at_a_width_the_model_does_not_have_are_caught(monkeypatch):
    """Issue 8's case: K3's KDA recurrence certified at 64 heads while the K3 target launches 96."""
    from kestrel.catalog.kda.recurrent import KdaRecurrent
    sixty_four = tuple(type(c)(c.why.replace("H=96", "H=64"), {**c.spec, "H": 64} if c.spec["H"] == 96 else c.spec,
                               c.archs) for c in KdaRecurrent.CELLS)
    monkeypatch.setattr(KdaRecurrent, "CELLS", sixty_four)
    problems = contract.check_target_widths(presets=("k3",))
    assert any(p.startswith("kimi_k3_bf16__sm_90__default at k3's widths: kda.recurrent.KdaRecurrent launched")
               and "H=96, D=128, dtype=bfloat16" in p and "no cell certifies it" in p for p in problems), problems
    assert "kimi_linear_bf16__sm_90__default: no real-width preset (k3) routes to it" in problems


BROKEN_TARGET = """
    import torch
    from kestrel.catalog.gemm.linear import Linear
    from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm

    class Target:
        def __init__(self, model, config):
            self.w = model.get_parameter("layers.0.self_attn.q_proj.weight").detach()      # [12288, 7168]
            self.norm = model.get_parameter("layers.0.input_layernorm").detach()

        def __call__(self, batch, pools):
            x = torch.zeros(batch.token_ids.shape[0], 7168, dtype=torch.bfloat16)
            x, _ = AddRmsNorm.raw_call(x, None, self.norm, 1e-5)         # certified
            return Linear.raw_call(x[:, :7040], self.w[:, :7040])        # K=7040: no model has it

    def build(model, config):
        return Target(model, config)
"""


def test_target_launching_an_uncertified_width_is_caught(temp_pkg):
    from kestrel.models.kimi.targets.kimi_k3_bf16__sm_90__default.features import CLAIM
    pkg = temp_pkg({"__init__.py": "", "kimi_k3_bf16__sm_90__x/__init__.py": "",
                    "kimi_k3_bf16__sm_90__x/features.py": f"CLAIM = {CLAIM!r}\n",
                    "kimi_k3_bf16__sm_90__x/modeling.py": BROKEN_TARGET})
    problems = contract.check_target_widths(pkg)
    assert len(problems) == 1, problems
    assert problems[0].startswith("kimi_k3_bf16__sm_90__x at k3's widths: gemm.linear.Linear launched 4x at "
                                  "K=7040, N=12288, dtype=bfloat16: no cell certifies it")
