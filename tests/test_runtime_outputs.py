"""A request's outputs: deltas only, O(1) per token however long the output grows; the text and stop-string state
that lives on the Request."""

from __future__ import annotations

import tracemalloc

import torch

from test_runtime_helpers import tiny_checkpoint

from kestrel.config import EngineConfig, ModelConfig
from kestrel.runtime.cache import HybridCache
from kestrel.runtime.engine import Engine
from kestrel.runtime.request import Prefix, TextState
from kestrel.sampling_params import SamplingParams
from kestrel.tokenizer import load_tokenizer


class _Pieces:
    """A detokenizer whose token t decodes to PIECES[t]."""
    PIECES = ["", "ab", "c", "S", "TO", "P", "x", "STOP"]

    def add(self, ids):
        return "".join(self.PIECES[i] for i in ids)

    def flush(self):
        return ""


def _feed(ts: TextState, tokens: list[int]) -> tuple[list[str], bool]:
    deltas = []
    for i, t in enumerate(tokens):
        d, stopped = ts.add(t, final=i == len(tokens) - 1)
        deltas.append(d)
        if stopped:
            return deltas, True
    return deltas, False


def test_stop_string_across_tokens_is_cut_and_never_streamed():
    ts = TextState(_Pieces(), ["STOP"])
    deltas, stopped = _feed(ts, [1, 2, 3, 4, 5, 6])
    assert stopped and ts.text() == "abc" and "".join(deltas) == "abc"
    assert all("S" not in d for d in deltas)
    assert len(ts.pending) == 0


def test_text_is_held_back_only_as_long_as_a_stop_could_start():
    ts = TextState(_Pieces(), ["STOP", "xx"])
    deltas, stopped = _feed(ts, [1, 1, 3, 4, 6, 2, 2])
    assert not stopped and "".join(deltas) == ts.text() == "ababSTOxcc"
    assert len(ts.pending) == 0                        # the final token flushed everything
    ts = TextState(_Pieces(), ["TOP", "ST"])           # the earliest stop in the text wins, not the first listed
    _, stopped = _feed(ts, [1, 7])
    assert stopped and ts.text() == "ab"


def test_prefix_view_behaves_as_the_list_it_shows():
    items = [1, 2, 3, 4]
    v = Prefix(items, 3)
    items.append(5)
    assert len(v) == 3 and list(v) == [1, 2, 3] and v == [1, 2, 3] and v[-1] == 3 and v[1:] == [2, 3]
    assert v != [1, 2, 3, 4] and v == Prefix(items, 3)


def _engine(max_len: int) -> Engine:
    path = tiny_checkpoint("kimi-linear-tiny")
    config = ModelConfig.from_dir(path)
    ec = EngineConfig(model=path, page_size=16, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=max_len,
                      enable_prefix_caching=False)
    pages = -(-max_len // 16)
    cache = HybridCache(config, pages, 16, 2, 0, pages, torch.float32, torch.device("cpu"), False)
    vocab = config.vocab_size

    def model(batch, pools):           # a token that depends on the position: varied text, no math
        rows = batch.positions[batch.logits_indices]
        logits = torch.zeros(rows.numel(), vocab)
        logits[torch.arange(rows.numel()), 40 + rows % 200] = 1.0
        return logits

    return Engine(config, ec, model, cache, load_tokenizer(path))


def test_each_token_costs_the_same_however_long_the_output():
    """Python memory an output keeps alive is O(1) per token: the last 200 tokens of a 2,000-token output cost no
    more than the first 200 (an output copying the whole output so far costs 10x more there)."""
    n = 2000
    engine = _engine(n + 64)
    rid = engine.add_request(list(range(50, 60)), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                                 stop=["never-seen-stop-string"]))
    kept, cost = [], []
    tracemalloc.start()
    try:
        while engine.has_unfinished():
            before = tracemalloc.get_traced_memory()[0]
            kept += engine.step()
            cost.append(tracemalloc.get_traced_memory()[0] - before)
    finally:
        tracemalloc.stop()
    final = kept[-1]
    assert final.finished and len(final.token_ids) == n and final.request_id == rid
    assert "".join(o.delta_text for o in kept) == final.text and len(final.text) >= n // 2
    assert sum((o.delta_token_ids for o in kept), []) == list(final.token_ids)
    early, late = sum(cost[100:300]) / 200, sum(cost[-210:-10]) / 200
    assert late < 1.5 * early + 64, f"per-token memory grows with the output: {early:.0f} B early, {late:.0f} B late"
    mid = kept[n // 2]
    assert len(mid.token_ids) == n // 2 + 1 and mid.token_ids[-1] == mid.delta_token_ids[0]
    assert mid.text == final.text[:len(mid.text)] and not mid.finished


def test_the_engine_applies_a_token_bitmask_hook():
    engine = _engine(256)
    words = -(-engine.config.vocab_size // 32)
    seen = []

    def only_77(reqs):                  # allow token 77 alone, for every request of the step
        seen.append(len(reqs))
        mask = torch.zeros(len(reqs), words, dtype=torch.int32)
        mask[:, 77 // 32] = 1 << (77 % 32)
        return mask

    engine.token_bitmask = only_77
    rids = [engine.add_request(list(range(50, 60)), SamplingParams(max_tokens=6, ignore_eos=True, **kw))
            for kw in (dict(temperature=0), dict(temperature=1.5, seed=1), dict(temperature=0.9, top_p=0.5, seed=2))]
    while engine.has_unfinished():
        engine.step()
    assert all(engine.final_output(r).token_ids == [77] * 6 for r in rids)
    assert max(seen) == 2                # the hook sees each step's sampled requests (max_num_seqs = 2)
