"""`kestrel train-drafter`: a drafter distilled from a tiny target on the CPU reaches a greedy acceptance length
above 1, measured by greedy speculative decoding through the proposer's observe / propose; an untrained drafter
scores lower."""

from __future__ import annotations

import subprocess

import pytest
import torch

from helpers import PYTHON, REPO, scratch_dir, single_thread, tiny_checkpoint  # noqa: F401
from kestrel.models.kimi import load_reference_model
from kestrel.config import ModelConfig
from kestrel.spec.dspark import DSparkProposer, load_dspark_proposer
from kestrel.spec.dspark_checkpoint import random_drafter
from kestrel.spec.dspark_config import tiny_config
from kestrel.spec.train import measure_acceptance, random_prompts, train_drafter

K, PROMPTS, NEW = 4, 12, 20


def test_trained_drafter_is_accepted_and_an_untrained_one_is_not():
    target_dir = tiny_checkpoint("k3-tiny")
    out = scratch_dir("trained-drafter")
    got = train_drafter(target_dir, out, steps=60, num_tokens=K, num_prompts=PROMPTS, new_tokens=NEW,
                        batch_size=6, progress=False)
    config = ModelConfig.from_dir(target_dir)
    target = load_reference_model(target_dir, config, torch.float32, torch.device("cpu"))
    # the folder it wrote loads through the runtime's entry point and scores what training reported
    trained = load_dspark_proposer(out, config, "cpu", torch.float32, K, target=target)
    prompts = random_prompts(config, PROMPTS, 8, seed=0)          # the training prompts (train_drafter's seed 0)
    accept = measure_acceptance(target, config, trained, prompts, NEW)
    assert accept == pytest.approx(got["accept_len"], abs=1e-6)
    untrained = DSparkProposer(random_drafter(tiny_config(config, block_size=K), config, seed=0), config, K, target)
    base = measure_acceptance(target, config, untrained, prompts, NEW)
    assert accept > 2.0, got
    print(f"accept_len trained {accept:.2f}, untrained {base:.2f}, new prompts {got['accept_len_new']:.2f}")
    assert base < 1.2 and accept > base + 0.8, (accept, base)


def test_cli_refuses_bad_flags_in_one_line():
    r = subprocess.run([PYTHON, "-m", "kestrel.cli", "train-drafter", "--target", tiny_checkpoint("k3-tiny"),
                        "--out", scratch_dir("x"), "--steps", "0"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "kestrel: error: --steps 0: must be >= 1"
