"""StepBatch semantics of the reference model, on kimi-linear-tiny and k3-tiny (fp32):
- one step that mixes prefill chunks and decode tokens of several requests gives each request the logits it gets
  alone;
- a prompt prefilled in chunks of odd sizes gives the logits of a one-shot prefill;
- a KDA snapshot taken after a segment restores the state a request had there (prefix caching)."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import PagedRequests, load_model, prefill_all_logits, rel_err, tiny_checkpoint
from helpers import single_thread  # noqa: F401  (autouse)

PRESETS = ["kimi-linear-tiny", "k3-tiny"]
TOL = 1e-5


@pytest.fixture(scope="session", params=PRESETS)
def tiny(request):
    config, model = load_model(tiny_checkpoint(request.param))
    return request.param, config, model


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mixed_prefill_and_decode_step_equals_each_request_alone(tiny):
    name, config, model = tiny
    lengths = [23, 15, 12, 9, 6]
    prompt_lens = [14, 8, 7, 5, 1]        # beyond its prompt a request decodes one token per step
    seqs = [random_ids(n, config.vocab_size, 100 + r) for r, n in enumerate(lengths)]
    alone = [prefill_all_logits(model, config, s, seed=200 + r) for r, s in enumerate(seqs)]

    # a seeded schedule: each step takes a random subset of the unfinished requests in random order; a request
    # still in its prompt brings a chunk of 1..7 tokens, a request past it one decode token
    rng = random.Random(7)
    cache = PagedRequests(config, len(seqs), max(lengths), page_size=4, seed=300)
    done = [0] * len(seqs)
    steps = decode_rows = chunk_rows = mixed_steps = 0
    while any(done[r] < len(s) for r, s in enumerate(seqs)):
        live = [r for r, s in enumerate(seqs) if done[r] < len(s)]
        rng.shuffle(live)
        pick = live[:rng.randint(1, len(live))]
        segments = []
        for r in pick:
            n = min(rng.randint(1, 7), prompt_lens[r] - done[r]) if done[r] < prompt_lens[r] else 1
            segments.append((r, seqs[r], done[r], done[r] + n))
        kinds = {b - a == 1 for _, _, a, b in segments}
        mixed_steps += len(kinds) == 2
        logits = model(cache.batch(segments), cache.pools)
        row = 0
        for r, _, a, b in segments:
            got, want = logits[row:row + b - a], alone[r][a:b]
            err = rel_err(got, want)
            assert err < TOL, f"{name} step {steps}: request {r} positions {a}..{b - 1} differ by {err:.2e}"
            row += b - a
            decode_rows += (b - a == 1)
            chunk_rows += (b - a > 1)
            done[r] = b
        steps += 1
    assert mixed_steps >= 3 and decode_rows >= 20 and chunk_rows >= 5, (mixed_steps, decode_rows, chunk_rows)


@pytest.mark.parametrize("chunks", [(7, 5, 11), (1, 9, 3)])
def test_chunked_prefill_equals_one_shot(tiny, chunks):
    name, config, model = tiny
    n = sum(chunks)
    ids = random_ids(n, config.vocab_size, 400 + chunks[0])
    one_shot = prefill_all_logits(model, config, ids, seed=401)
    cache = PagedRequests(config, 1, n, page_size=4, seed=402)
    parts, a = [], 0
    for size in chunks:
        parts.append(model(cache.batch([(0, ids, a, a + size)]), cache.pools))
        a += size
    err = rel_err(torch.cat(parts), one_shot)
    assert err < TOL, f"{name}: chunked prefill {chunks} differs from one-shot by {err:.2e}"


def test_logits_indices_select_rows(tiny):
    """logits_indices picks rows of the flat batch; the other rows still update the cache."""
    name, config, model = tiny
    seqs = [random_ids(10, config.vocab_size, 500), random_ids(6, config.vocab_size, 501)]
    cache = PagedRequests(config, 2, 10, seed=502)
    batch = cache.batch([(0, seqs[0], 0, 10), (1, seqs[1], 0, 6)])
    batch.logits_indices = torch.tensor([9, 15])
    last = model(batch, cache.pools)
    assert last.shape == (2, config.vocab_size)
    full = [prefill_all_logits(model, config, s, seed=503) for s in seqs]
    assert rel_err(last[0], full[0][9]) < TOL and rel_err(last[1], full[1][5]) < TOL


def test_kda_snapshot_restores_prefix_state(tiny):
    """Request A's prompt is split at a page boundary with a snapshot of its KDA state into a spare slot. A new
    request B with the same first page then starts from that snapshot and A's first page (no recompute) and must
    get the logits of its own cold prefill."""
    name, config, model = tiny
    page = 4
    prefix = random_ids(8, config.vocab_size, 600)                      # two full pages
    a_ids = prefix + random_ids(5, config.vocab_size, 601)
    b_ids = prefix + random_ids(7, config.vocab_size, 602)
    cache = PagedRequests(config, 2, 16, page_size=page, seed=603)
    snap = cache.spare_slots[0]
    # segment 0 = A's first 8 tokens (snapshot after it), segment 1 = the rest of A's prompt
    batch = cache.batch([(0, a_ids, 0, 8), (0, a_ids, 8, len(a_ids))], snapshots=[(0, snap)])
    model(batch, cache.pools)
    # B reuses A's two prefix pages and the snapshot state
    cache.tables[1, :2] = cache.tables[0, :2]
    for pool in list(cache.pools.conv.values()) + list(cache.pools.recurrent.values()):
        pool[cache.slots[1]] = pool[snap]
    out = model(cache.batch([(1, b_ids, 8, len(b_ids))]), cache.pools)
    cold = prefill_all_logits(model, config, b_ids, seed=604)
    assert rel_err(out, cold[8:]) < TOL
    # and the snapshot is not simply A's final state
    a_final = cache.pools.recurrent[config.kda_layers[0]][cache.slots[0]]
    assert not torch.allclose(a_final, cache.pools.recurrent[config.kda_layers[0]][snap])
