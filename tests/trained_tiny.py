"""A tiny Kimi model trained for a few seconds on the CPU, for checks that need a model with realistic confidence.

A random model's next-token distribution is nearly flat (top-2 margins of hundredths of a nat), so any rounding
flips its argmax; a trained LM is sure of most tokens and unsure of some. This module trains a tiny model on a
synthetic language with the same mix: stretches whose next token is fixed by a rule (counting, a fixed successor
table, the second half of a copied span) between segment boundaries and noise, whose ids are drawn from a Zipf law
(so that where the model cannot know the next token it still has a favourite, as an LM does). In its 300 steps the
model learns the counting and successor rules and the Zipf favourites (margins of several nats on rule-bound
tokens, a few tenths elsewhere), not copying (24% top-1 on a copy's second half, the Zipf favourite's share is
18%); on some prompts its greedy output settles into repeating its favourite id, as small LMs do.

The model is a tiny Kimi Linear (or K3) whose layers are all MLA: MLA layers are the ones whose KV cache the
quantized-KV flags change, and the reference KDA recurrence runs token by token, which would make training take
minutes instead of seconds. It trains in fp32 through the reference model's own forward (with autograd) and is
written as an ordinary checkpoint by `make_checkpoint(weights=...)`; the engine loads it like any other.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import random
import time

import torch
import torch.nn.functional as F

from kestrel.config import ModelConfig
from kestrel.models.kimi.checkpoint import make_checkpoint, preset_config, random_reference_model
from kestrel.models.kimi.reference import KimiModel
from kestrel.spec.train import TargetRunner

from helpers import scratch_dir

SESSION_ROOT = scratch_dir("trained")     # removed when the test session ends

# id bands of the synthetic language (ids >= TOKENS_USED only ever appear in random prompts)
COUNT = (0, 64)          # counting: t -> t + 1, wrapping inside the band
CHAIN = (64, 128)        # a fixed random successor permutation of the band
COPY = (128, 256)        # spans of 3-6 ids from this band, written twice
TOKENS_USED = 256

RECIPES = {
    "kimi-linear": dict(preset="kimi-linear-tiny", layers=2, steps=300, batch=8, length=64, lr=3e-3, seed=0),
    "k3": dict(preset="k3-tiny", layers=2, steps=300, batch=8, length=64, lr=3e-3, seed=0),
}


def recipe_config(recipe: dict) -> dict:
    """The preset's config.json cut to `layers` layers, every one of them MLA."""
    raw = preset_config(recipe["preset"], recipe["layers"])
    lin = raw.get("text_config", raw)["linear_attn_config"]
    lin["full_attn_layers"] = list(range(1, recipe["layers"] + 1))
    lin["kda_layers"] = []
    return raw


class Language:
    """The synthetic language of a recipe's seed. A segment is counting (t -> t + 1, wrapping inside its band), a
    walk of a fixed successor permutation, a span of 3-6 ids written twice, or 1-2 noise ids; the kinds are drawn
    with unequal odds, and every free choice (a segment's first id, a span's ids, noise) from a Zipf law over its
    band in a fixed shuffled order, as words are: where the model cannot know the next token it still has a favourite
    (a top-2 margin near log 2 inside a band), not a flat guess over a hundred ids."""

    KINDS = ("count", "chain", "copy", "noise")
    ODDS = (0.35, 0.25, 0.25, 0.15)

    def __init__(self, seed: int):
        rng = random.Random(seed)
        self.successor = list(range(*CHAIN))
        rng.shuffle(self.successor)
        self.bands = {"count": COUNT, "chain": CHAIN, "copy": COPY, "noise": (0, TOKENS_USED)}
        self.order = {}
        for kind, (lo, hi) in self.bands.items():
            ids = list(range(lo, hi))
            rng.shuffle(ids)
            self.order[kind] = ids
        self.zipf = {kind: list(itertools.accumulate(1.0 / (r + 1) for r in range(len(ids))))
                     for kind, ids in self.order.items()}

    def _draw(self, kind: str, rng: random.Random) -> int:
        return rng.choices(self.order[kind], cum_weights=self.zipf[kind])[0]

    def sequence(self, length: int, rng: random.Random) -> list[int]:
        out: list[int] = []
        while len(out) < length:
            kind = rng.choices(self.KINDS, self.ODDS)[0]
            n = rng.randint(4, 10)
            if kind == "count":
                lo, hi = COUNT
                t = self._draw(kind, rng)
                out += [lo + (t - lo + i) % (hi - lo) for i in range(n)]
            elif kind == "chain":
                t = self._draw(kind, rng)
                for _ in range(n):
                    out.append(t)
                    t = self.successor[t - CHAIN[0]]
            elif kind == "copy":
                span = [self._draw(kind, rng) for _ in range(rng.randint(3, 6))]
                out += span + span
            else:
                out += [self._draw(kind, rng) for _ in range(rng.randint(1, 2))]
        return out[:length]


def synthetic_prompts(n: int, length: int, seed: int, recipe: dict) -> list[list[int]]:
    """n prompts drawn from the recipe's language (other draws than training's)."""
    lang, rng = Language(recipe["seed"]), random.Random(10_000 + seed)
    return [lang.sequence(length, rng) for _ in range(n)]


def train(recipe: dict) -> tuple[KimiModel, ModelConfig, dict]:
    """The trained model (fp32) and its config; stats: CPU seconds, the last steps' mean loss."""
    raw = recipe_config(recipe)
    cfg = ModelConfig.from_dict(raw)
    torch.manual_seed(recipe["seed"])
    model = random_reference_model(cfg, torch.float32, torch.device("cpu"), recipe["seed"]).train()
    params = [p for n, p in model.named_parameters() if "e_score_correction_bias" not in n]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=recipe["lr"], weight_decay=0.0)
    steps, B, L = recipe["steps"], recipe["batch"], recipe["length"]
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, recipe["lr"], total_steps=steps, pct_start=0.1)
    lang, rng = Language(recipe["seed"]), random.Random(recipe["seed"])
    forward = KimiModel.forward.__wrapped__        # the forward without its no_grad decorator: trained here
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                       # tiny matmuls: one thread is fastest, and deterministic
    t0, losses = time.process_time(), []
    try:
        for _ in range(steps):
            seqs = [lang.sequence(L, rng) for _ in range(B)]
            runner = TargetRunner(model, cfg, B, L)       # fresh pools: the step's graph writes into them
            logits = forward(model, runner.batch([(b, s, 0) for b, s in enumerate(seqs)], all_logits=True),
                             runner.pools)
            ids = torch.tensor(seqs)
            loss = F.cross_entropy(logits.view(B, L, -1)[:, :-1].reshape(-1, cfg.vocab_size),
                                   ids[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    for p in params:
        p.requires_grad_(False)
    stats = {"cpu_s": time.process_time() - t0, "loss": sum(losses[-20:]) / 20, "first_loss": losses[0]}
    return model.eval(), cfg, stats


def recipe_key(recipe: dict) -> str:
    """A hash of the recipe and of this file (the language and the training loop are part of the recipe)."""
    with open(__file__, "rb") as f:
        source = f.read()
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode() + source).hexdigest()[:16]


def trained_checkpoint(name: str, root: str) -> tuple[str, dict]:
    """Train recipe `name` and write it (bf16) under `root`, in a folder named by the recipe's hash; a folder
    already there (same recipe, same session) is reused. Returns (folder, training stats)."""
    recipe = RECIPES[name]
    out = os.path.join(root, f"trained-{name}-{recipe_key(recipe)}")
    stats_file = os.path.join(out, "training.json")
    if os.path.exists(stats_file):
        with open(stats_file) as f:
            return out, json.load(f)
    model, _, stats = train(recipe)
    make_checkpoint(recipe["preset"], out, config=recipe_config(recipe), weights=model, dtype=torch.bfloat16)
    with open(stats_file, "w") as f:
        json.dump({**stats, "recipe": copy.deepcopy(recipe)}, f)
    return out, stats

