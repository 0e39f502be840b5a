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
    import kestrel.catalog._layers as shared_layers
    for module in [*contract.iter_target_modules(), shared_layers]:
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
