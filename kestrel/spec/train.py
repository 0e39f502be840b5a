"""`kestrel train-drafter`: distil a tiny DSpark drafter from a tiny target on the CPU, in minutes.

Data: the target's own greedy continuations of random prompts (so a drafted token is right exactly when it is the
token the target would pick), and the target's outputs at the drafter's target layers for every position. Training
follows DeepSpec's recipe at small scale: blocks anchored at every position a of the greedy part of a sequence,
block [x_a, mask x (K-1)] at positions a .. a+K-1 seeing the context of positions < a; row k learns the target's
token at a+k+1 (cross-entropy, Markov head teacher-forced on the true previous token), the confidence head learns
whether row k's argmax is that token (binary cross-entropy). The target's embedding and LM head stay frozen (they
are the target's own at inference).

`TargetRunner` drives the reference target on plain pools (a slot and a run of pages per sequence); it is also what
`measure_acceptance` uses to score a drafter: the mean tokens per step of greedy speculative decoding (accepted
drafts + the target's own token) over new prompts, through the proposer's real observe / propose.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from kestrel.config import ModelConfig
from kestrel.models.kimi.step import CachePools, StepBatch

log = logging.getLogger("kestrel.spec")


class TargetRunner:
    """The reference target over `num_seqs` sequences of at most `max_len` tokens: slot b and pages
    [b * P, (b + 1) * P) belong to sequence b. `extra_mla` adds a drafter's layers to the same pools."""

    def __init__(self, model, config: ModelConfig, num_seqs: int, max_len: int, page_size: int = 16,
                 extra_mla: dict[int, int] | None = None):
        self.model, self.config = model, config
        self.device = model.embed_tokens.device
        dtype = model.embed_tokens.dtype
        per = -(-max_len // page_size)
        self.pools = CachePools.allocate(config, num_seqs * per, page_size, num_seqs, dtype, self.device,
                                         extra_mla=extra_mla)
        self.block_tables = torch.arange(num_seqs * per, dtype=torch.int32, device=self.device).view(num_seqs, per)

    def batch(self, segments: list[tuple[int, list[int], int]], all_logits: bool = False) -> StepBatch:
        """A step over segments (slot, tokens, first position); logits for every row or each segment's last."""
        ids, pos, cu = [], [], [0]
        for _, toks, start in segments:
            ids += toks
            pos += range(start, start + len(toks))
            cu.append(len(ids))
        d = self.device
        slots = [s for s, _, _ in segments]
        rows = list(range(len(ids))) if all_logits else [c - 1 for c in cu[1:]]
        return StepBatch(token_ids=torch.tensor(ids, device=d), positions=torch.tensor(pos, device=d), cu_seqlens=cu,
                         context_lens=[s for _, _, s in segments], slots=torch.tensor(slots, device=d),
                         block_tables=self.block_tables[slots], logits_indices=torch.tensor(rows, device=d),
                         host_slots=slots)

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """prompt + the target's greedy continuation of `new_tokens` tokens, per prompt (prompts in slots 0..)."""
        self.pools.reset_slots(list(range(len(prompts))))
        seqs = [list(p) for p in prompts]
        logits = self.model(self.batch([(b, p, 0) for b, p in enumerate(prompts)]), self.pools)
        for step in range(new_tokens):
            nxt = logits.argmax(-1).tolist()
            for s, t in zip(seqs, nxt):
                s.append(t)
            if step + 1 < new_tokens:
                logits = self.model(self.batch([(b, [s[-1]], len(s) - 1) for b, s in enumerate(seqs)]), self.pools)
        return seqs

    @torch.no_grad()
    def hidden(self, seqs: list[list[int]], layers: tuple[int, ...]) -> tuple[StepBatch, dict[int, torch.Tensor]]:
        """One prefill over whole sequences (slots 0..): the step and the outputs of `layers` for every row."""
        self.pools.reset_slots(list(range(len(seqs))))
        batch = self.batch([(b, s, 0) for b, s in enumerate(seqs)])
        self.model.capture_layers = tuple(layers)
        try:
            self.model(batch, self.pools)
            return batch, dict(self.model.captured_hidden)
        finally:
            self.model.capture_layers = ()


def random_prompts(config: ModelConfig, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (n, length), generator=g).tolist()


@torch.no_grad()
def measure_acceptance(model, config: ModelConfig, proposer, prompts: list[list[int]], new_tokens: int) -> float:
    """Mean tokens per target step of greedy speculative decoding with `proposer` (accepted drafts + 1), over the
    target's greedy continuations of `prompts`: every round proposes for all unfinished sequences in one batch."""
    K = proposer.num_tokens
    P = len(prompts[0])
    L = P + new_tokens
    runner = TargetRunner(model, config, len(prompts), L, extra_mla=proposer.extra_mla)
    seqs = runner.greedy(prompts, new_tokens)
    batch, hidden = runner.hidden(seqs, proposer.capture_layers)
    proposer.observe(batch, hidden, runner.pools)
    from kestrel.spec.proposer import DraftInput
    pos = [P] * len(seqs)          # the first output token (position P) is the target's: blocks start there
    steps = tokens = 0
    while True:
        live = [b for b in range(len(seqs)) if pos[b] + K < L]
        if not live:
            break
        inputs = [DraftInput(token_ids=seqs[b][:pos[b] + 1], position=pos[b], slot=b, seed=b, temperature=0.0)
                  for b in live]
        drafts = proposer.propose(inputs, runner.block_tables, runner.pools).tokens.tolist()
        for b, d in zip(live, drafts):
            n = 0
            while n < K and d[n] == seqs[b][pos[b] + 1 + n]:
                n += 1
            steps += 1
            tokens += n + 1
            pos[b] += n + 1
    return tokens / max(steps, 1)


def make_data(model, config: ModelConfig, layers: tuple[int, ...], num_prompts: int, prompt_len: int,
              new_tokens: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(token ids [N, L], the target's outputs at `layers` [N, L, H] each) of greedy continuations."""
    runner = TargetRunner(model, config, num_prompts, prompt_len + new_tokens)
    seqs = runner.greedy(random_prompts(config, num_prompts, prompt_len, seed), new_tokens)
    _, hidden = runner.hidden(seqs, layers)
    N, L = len(seqs), prompt_len + new_tokens
    return torch.tensor(seqs), [hidden[l].view(N, L, -1).float() for l in layers]


def distill_loss(drafter, embed: torch.Tensor, head: torch.Tensor, ids: torch.Tensor, hidden: list[torch.Tensor],
                 first_anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, top-1 accuracy of the draft rows) over blocks anchored at every a in [first_anchor, L - K - 1]."""
    N, L = ids.shape
    K = drafter.dc.block_size
    anchors = torch.arange(first_anchor, L - K)
    A = anchors.numel()
    pos = torch.arange(L)
    ctx = drafter.context([h.reshape(N * L, -1) for h in hidden])
    lat = [t.view(N, 1, L, -1).expand(N, A, L, -1).reshape(N * A, L, -1)
           for t in drafter.context_latents(ctx, pos.repeat(N))]
    visible = (pos.view(1, 1, L) < anchors.view(1, A, 1)).expand(N, A, L).reshape(N * A, L)
    offs = anchors.view(A, 1) + torch.arange(K)                            # [A, K] block positions
    block = torch.full((N, A, K), drafter.dc.mask_token_id, dtype=torch.long)
    block[:, :, 0] = ids[:, anchors]
    h = drafter.block_hidden(F.embedding(block.view(N * A, K), embed), offs.repeat(N, 1), lat, visible)
    labels = ids[:, offs + 1].reshape(N * A, K)
    prev = ids[:, offs].reshape(N * A, K)
    logits = drafter.step_logits(drafter.base_logits(h, head), prev)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    hit = (logits.argmax(-1) == labels).float()
    conf = drafter.confidence_logit(h, prev)
    if conf is not None:
        loss = loss + 0.1 * F.binary_cross_entropy_with_logits(conf, hit)
    return loss, hit.mean()


def train_drafter(target_dir: str, out: str, steps: int = 300, num_tokens: int = 4, seed: int = 0,
                  num_prompts: int = 64, prompt_len: int = 8, new_tokens: int = 32, batch_size: int = 16,
                  lr: float = 1e-2, draft_layers: int = 1, progress: bool = True) -> dict:
    """Distil a drafter for the target checkpoint `target_dir` into `out`; returns what it measured: the last
    loss and draft-row accuracy, and the greedy acceptance (tokens per step) on the training prompts
    (`accept_len`) and on new prompts (`accept_len_new`). A random tiny target is chaotic (its next token depends
    on the whole prefix in no learnable way: a bigram table of its continuations predicts 4% of held-out tokens),
    so what a drafter this small learns is the target's continuations of the prompts it saw, not the target."""
    from kestrel.models.kimi import load_reference_model
    from kestrel.models.kimi.weights import progress_bar
    from kestrel.spec.dspark import DSparkProposer
    from kestrel.spec.dspark_checkpoint import random_drafter, save_drafter
    from kestrel.spec.dspark_config import tiny_config

    t0 = time.perf_counter()
    config = ModelConfig.from_dir(target_dir)
    target = load_reference_model(target_dir, config, torch.float32, torch.device("cpu"))
    dc = tiny_config(config, block_size=num_tokens, num_layers=draft_layers)
    log.info("train-drafter: target %s (%d layers, hidden %d), drafter of %d layer(s) over target layers %s, K=%d",
             target_dir, config.num_layers, config.hidden_size, dc.num_layers, list(dc.target_layer_ids), num_tokens)
    ids, hidden = make_data(target, config, dc.target_layer_ids, num_prompts, prompt_len, new_tokens, seed)
    log.info("train-drafter: %d greedy continuations of %d tokens in %.1f s", len(ids), new_tokens,
             time.perf_counter() - t0)
    drafter = random_drafter(dc, config, torch.float32, "cpu", seed).train()
    embed, head = target.embed_tokens.detach(), target.head_weight().detach()
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    g = torch.Generator().manual_seed(seed)
    bar = progress_bar(steps, "train-drafter", unit="step") if progress else None
    t1 = time.perf_counter()
    loss = acc = torch.tensor(0.0)
    try:
        for step in range(steps):
            pick = torch.randint(0, len(ids), (batch_size,), generator=g)
            loss, acc = distill_loss(drafter, embed, head, ids[pick], [h[pick] for h in hidden], prompt_len - 1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc.item():.2f}")
    finally:
        if bar is not None:
            bar.close()
    log.info("train-drafter: %d steps in %.1f s, last loss %.3f, draft-row accuracy %.2f", steps,
             time.perf_counter() - t1, loss.item(), acc.item())
    drafter.eval()
    save_drafter(drafter, out)
    proposer = DSparkProposer(drafter, config, num_tokens, target)
    seen = random_prompts(config, num_prompts, prompt_len, seed)[:32]
    accept = measure_acceptance(target, config, proposer, seen, new_tokens)
    accept_new = measure_acceptance(target, config, proposer, random_prompts(config, 16, prompt_len, seed + 1),
                                    new_tokens)
    log.info("train-drafter: wrote %s; greedy acceptance (tokens per step, K=%d): %.2f on the training prompts, "
             "%.2f on new prompts", out, num_tokens, accept, accept_new)
    return {"loss": loss.item(), "accuracy": acc.item(), "accept_len": accept, "accept_len_new": accept_new}


def register(sub, add_engine_args) -> None:
    """`kestrel train-drafter --target DIR --out DIR [--steps N] [--num-speculative-tokens K]`."""
    t = sub.add_parser("train-drafter", help="distil a tiny DSpark drafter from a tiny target on the CPU")
    t.add_argument("--target", required=True, help="the target checkpoint directory (e.g. from make-checkpoint)")
    t.add_argument("--out", required=True, help="where the drafter folder (config.json + model.safetensors) goes")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--num-speculative-tokens", type=int, default=4, help="K, the block the drafter drafts")
    t.add_argument("--num-prompts", type=int, default=64, help="random prompts whose continuations are the data")
    t.add_argument("--new-tokens", type=int, default=32, help="greedy continuation length per prompt")
    t.add_argument("--draft-layers", type=int, default=1)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_train_drafter)


def cmd_train_drafter(args) -> int:
    import os

    from kestrel.errors import CheckpointError, ConfigError
    if not os.path.isdir(args.target):
        raise CheckpointError(f"--target {args.target}: no such directory; make a tiny target with "
                              "`kestrel make-checkpoint --preset k3-tiny --dtype fp32 --out DIR`")
    for flag, v in (("--steps", args.steps), ("--num-speculative-tokens", args.num_speculative_tokens),
                    ("--num-prompts", args.num_prompts), ("--new-tokens", args.new_tokens),
                    ("--draft-layers", args.draft_layers)):
        if v < 1:
            raise ConfigError(f"{flag} {v}: must be >= 1")
    if args.new_tokens <= args.num_speculative_tokens:
        raise ConfigError(f"--new-tokens {args.new_tokens} must exceed --num-speculative-tokens "
                          f"{args.num_speculative_tokens}: a block needs that many continuation tokens to learn from")
    train_drafter(args.target, args.out, steps=args.steps, num_tokens=args.num_speculative_tokens, seed=args.seed,
                  num_prompts=args.num_prompts, new_tokens=args.new_tokens, draft_layers=args.draft_layers,
                  batch_size=min(16, args.num_prompts))
    return 0
