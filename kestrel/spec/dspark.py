"""The DSpark drafter (K3's MLA variant), plain torch: the reference the runtime and any fast path are checked against.

What the public implementations (vLLM `models/kimi_k3/nvidia/dspark_mla.py` + `v1/spec_decode/dspark.py`, DeepSpec
`modeling/dspark/`) agree on, and this file computes:
- Context: the target's outputs at `target_layer_ids` (0-based layers) are concatenated per token and projected,
  `c = RMSNorm(context_proj(concat))` (`context_norm`). Context tokens never run through the draft layers: each draft
  layer turns c into its own MLA latent (its `kv_a_proj_with_mqa`, `kv_a_layernorm`, RoPE on k_pe at the token's
  position) and stores it in its pages; the target's cache pools hold these pages under extra layer ids appended
  after the target's layers (one budget, one block table, the same page ids).
- Block: a request whose last token t sits at position p drafts K tokens in one forward over the block
  [t, mask x (K-1)] at positions p .. p+K-1 (embedded with the target's embedding). Each draft layer is
  RMSNorm -> MLA -> residual -> RMSNorm -> dense GLU MLP -> residual; the block's queries see the context latents
  of positions < p and the whole block (non-causal inside the block), then `final_norm` and the target's LM head.
- Markov head: block row k's logits get the low-rank bias w2 (w1[x_{k-1}]) of the token before it (x_{-1} = t), so
  drafting is sequential over the K rows after the one parallel forward: token k is chosen (greedy, or drawn at the
  request's temperature, q recorded) before row k+1's bias is known.
- Confidence: `confidence_head` (a linear map of the row's hidden state and the Markov embedding, DeepSpec's
  AcceptRatePredictor) gives a per-row acceptance logit; vLLM drops it at inference, we return sigmoid of it.
Unlike the NoPE target, the draft layers rotate q_pe / k_pe (vLLM builds them with `use_rope=True`, default rope
type, `is_neox_style=False`: interleaved pairs, fp32 math) with the drafter's `rope_theta`; their q_a / kv_a norms
use the drafter's `rms_norm_eps`, and they have no output gate unless the config asks (vLLM's K3 drafter has none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import ModelConfig
from kestrel.models.kimi.reference import DenseMLP, MlaAttention, _linear, read_row, rms_norm, write_latents
from kestrel.runtime.inputs import PinnedStaging
from kestrel.runtime.sampler import draw, seed_keys, uniforms
from kestrel.sampling_params import GREEDY_BELOW
from kestrel.spec.dspark_config import DSparkConfig
from kestrel.spec.proposer import DraftBlock, DraftInput, Proposer

DRAFT_SEED_SALT = 0x5D5EED   # draft draws use their own stream: the target's acceptance draws must not see them


def matmul_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x [..., n] @ weight [m, n]^T. bf16 operands on CUDA: one GEMM that accumulates and writes fp32 (the
    same products as upcasting first); upcasting the LM head on every draft instead moved ~7 GB a call at K3's
    163,840 x 7168 (the H200 draft step took 16 ms at batch 1). Elsewhere: both upcast to fp32."""
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16:
        return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
    return x.float() @ weight.float().t()


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate the pairs (x[2i], x[2i+1]) of the last dim by positions * theta^(-2i/D); positions broadcast
    against x's leading dims. fp32 math, x's dtype out."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    ang = positions.to(torch.float32).unsqueeze(-1) * inv
    cos, sin = ang.cos(), ang.sin()
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(x.dtype)


class _Vector(nn.Module):
    """A matrix parameter under `.weight` (checkpoint names end in `.weight`)."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))


class MarkovHead(nn.Module):
    """Low-rank transition bias: row k's logits + markov_w2 @ markov_w1[x_{k-1}] (w1, w2 both [V, rank])."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1, self.markov_w2 = _Vector(vocab, rank), _Vector(vocab, rank)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return F.embedding(prev, self.markov_w1.weight)

    def bias(self, e: torch.Tensor) -> torch.Tensor:
        return matmul_fp32(e, self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    def __init__(self, n_in: int):
        super().__init__()
        self.proj = nn.Linear(n_in, 1)


class DSparkLayer(nn.Module):
    def __init__(self, lc: ModelConfig):
        super().__init__()
        self.self_attn = MlaAttention(lc)
        self.self_attn.lowrank_eps = lc.rms_norm_eps     # vLLM's K3 drafter builds q_a / kv_a norms with it
        self.mlp = DenseMLP(lc, lc.hidden_size, lc.intermediate_size)
        self.input_layernorm = nn.Parameter(torch.ones(lc.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(lc.hidden_size))


class DSparkDrafter(nn.Module):
    """The drafter's own weights (the embedding and LM head are the target's, passed to `logits` / `embed`)."""

    def __init__(self, dc: DSparkConfig, target: ModelConfig):
        super().__init__()
        self.dc, self.lc = dc, dc.layer_config(target)
        H = dc.hidden_size
        self.context_proj = _linear(dc.target_hidden_size * len(dc.target_layer_ids), H)
        self.context_norm = nn.Parameter(torch.ones(H))
        self.layers = nn.ModuleList(DSparkLayer(self.lc) for _ in range(dc.num_layers))
        self.final_norm = nn.Parameter(torch.ones(H))
        if dc.markov_rank:
            self.markov_head = MarkovHead(dc.vocab_size, dc.markov_rank)
        if dc.enable_confidence_head:
            with_markov = dc.confidence_head_with_markov and dc.markov_rank
            self.confidence_head = ConfidenceHead(H + (dc.markov_rank if with_markov else 0))

    # ---- context: target hidden states -> each draft layer's latents ------------------------------------------
    def context(self, hidden: list[torch.Tensor]) -> torch.Tensor:
        """[T, H] projected context of tokens whose target outputs at `target_layer_ids` are `hidden` ([T, H_t] each)."""
        x = torch.cat(hidden, dim=-1).to(self.context_proj.weight.dtype)
        return rms_norm(self.context_proj(x), self.context_norm, self.dc.rms_norm_eps)

    def latent(self, layer: DSparkLayer, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A draft layer's cache entry of tokens x [N, H] at positions [N]: [normalized c_kv | RoPE(k_pe)]."""
        lat = layer.self_attn.latent(x)
        L = self.dc.kv_lora_rank
        return torch.cat([lat[:, :L], rope(lat[:, L:], positions, self.dc.rope_theta)], dim=-1)

    def context_latents(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        return [self.latent(layer, ctx, positions) for layer in self.layers]

    # ---- the block ---------------------------------------------------------------------------------------------
    def block_hidden(self, x: torch.Tensor, positions: torch.Tensor, ctx: list[torch.Tensor],
                     visible: torch.Tensor) -> torch.Tensor:
        """x [R, K, H] embedded blocks at positions [R, K]; ctx[l] [R, S, W] the context latents of draft layer l
        and visible [R, S] which of them a block sees. Returns the final-normed hidden states [R, K, H]."""
        dc, lc = self.dc, self.lc
        R, K, H = x.shape
        flat_pos = positions.reshape(-1)
        vis = torch.cat([visible, torch.ones(R, K, dtype=torch.bool, device=x.device)], dim=1)
        h = x
        for layer, c in zip(self.layers, ctx):
            hn = rms_norm(h, layer.input_layernorm, dc.rms_norm_eps).reshape(R * K, H)
            q = layer.self_attn.query(hn)                                      # [R*K, heads, nope + rope]
            q = torch.cat([q[..., :lc.qk_nope_head_dim],
                           rope(q[..., lc.qk_nope_head_dim:], flat_pos.unsqueeze(-1), dc.rope_theta)], dim=-1)
            own = self.latent(layer, hn, flat_pos).view(R, K, -1)
            keys = torch.cat([c.to(own.dtype), own], dim=1)                    # [R, S + K, W]
            o = layer.self_attn.attend_absorbed(q.view(R, K, lc.num_heads, -1), keys, vis)
            h = h + layer.self_attn.output(o.reshape(R * K, lc.num_heads, -1), hn).view(R, K, H)
            h = h + layer.mlp(rms_norm(h, layer.post_attention_layernorm, dc.rms_norm_eps))
        return rms_norm(h, self.final_norm, dc.rms_norm_eps)

    def block_hidden_paged(self, x: torch.Tensor, positions: torch.Tensor, pages: list[torch.Tensor],
                           tables: torch.Tensor) -> torch.Tensor:
        """block_hidden over the drafter's pages instead of gathered context: x [R, K, H] at positions [R, K]
        (each row p..p+K-1, p its request's position), pages[l] draft layer l's page pool, tables [R, max pages]
        the requests' block-table rows. Each layer writes the block's own latents at p..p+K-1 into its pages (the
        verify step's observe rewrites those positions with the context latents before any later block reads
        them), then the absorbed MLA decode entry attends every block row to positions < p + K: the context and
        the whole block, the reference's visibility. Fixed shapes per (R, K), no host sync, no per-request loop."""
        from kestrel.catalog._step_plan import num_splits_for
        from kestrel.catalog.attention.mla_cache_write import MlaCacheWrite
        from kestrel.catalog.attention.mla_decode import MlaDecode
        dc, lc = self.dc, self.lc
        R, K, H = x.shape
        L = dc.kv_lora_rank
        flat_pos = positions.reshape(-1)
        # a block the scheduler cut short (fewer drafts than K: the budget) has pages up to its own last position
        # only: block rows past the request's pages are neither written (position -1: skipped) nor read (kv_lens
        # capped), so no write lands outside the request's pages (their drafts are dropped anyway)
        ps = pages[0].shape[1] if pages else 1
        capacity = (tables >= 0).sum(1, keepdim=True).to(positions.dtype) * ps      # a request's pages: a row prefix
        write_pos = torch.where(positions < capacity, positions, -1).reshape(-1)
        kv_lens = torch.minimum(positions[:, :1] + K, capacity).expand(R, K).reshape(-1).to(torch.int32)
        req_idx = torch.div(torch.arange(R * K, dtype=torch.int32, device=x.device), K, rounding_mode="floor")
        # the host knows the positions only as tensors here: the split count follows the drafter's own cap
        splits = num_splits_for(tables.shape[1] * pages[0].shape[1]) if pages else 1
        h = x
        for layer, pool in zip(self.layers, pages):
            attn = layer.self_attn
            hn = rms_norm(h, layer.input_layernorm, dc.rms_norm_eps).reshape(R * K, H)
            q = attn.query(hn)
            q = torch.cat([q[..., :lc.qk_nope_head_dim],
                           rope(q[..., lc.qk_nope_head_dim:], flat_pos.unsqueeze(-1), dc.rope_theta)], dim=-1)
            own = self.latent(layer, hn, flat_pos).to(pool.dtype)
            MlaCacheWrite.raw_call(own[:, :L].contiguous(), own[:, L:].contiguous(), pool, tables, req_idx, write_pos)
            w_uk, w_uv = attn.up_weights()
            q_abs = torch.cat([torch.einsum("thn,hnl->thl", q[..., :lc.qk_nope_head_dim], w_uk.to(q.dtype)),
                               q[..., lc.qk_nope_head_dim:]], dim=-1).to(pool.dtype).contiguous()
            o_lat, _ = MlaDecode.raw_call(q_abs, pool, tables, req_idx, kv_lens, lc.softmax_scale, L, splits)
            o = torch.einsum("thl,hvl->thv", o_lat.to(w_uv.dtype), w_uv).to(hn.dtype)
            h = h + attn.output(o, hn).view(R, K, H)
            h = h + layer.mlp(rms_norm(h, layer.post_attention_layernorm, dc.rms_norm_eps))
        return rms_norm(h, self.final_norm, dc.rms_norm_eps)

    def base_logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """fp32 logits through the target's LM head `head` [V, H]."""
        return matmul_fp32(h, head)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor | None:
        """fp32 Markov bias [..., V] of the tokens `prev` before block rows; None without a Markov head."""
        if not hasattr(self, "markov_head"):
            return None
        return self.markov_head.bias(self.markov_head.embed(prev))

    def step_logits(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """base logits of block rows plus the Markov bias of the tokens before them (same leading shape)."""
        bias = self.markov_bias(prev)
        return base if bias is None else base + bias

    def confidence_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        if not hasattr(self, "confidence_head"):
            return None
        feats = h
        if self.dc.confidence_head_with_markov and hasattr(self, "markov_head"):
            feats = torch.cat([h, self.markov_head.embed(prev).to(h.dtype)], dim=-1)
        return self.confidence_head.proj(feats).squeeze(-1).float()

    def draft(self, base: torch.Tensor, h: torch.Tensor, first_prev: torch.Tensor, temperature: torch.Tensor,
              u: torch.Tensor, out: tuple | None = None,
              fused: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The Markov head token by token over base [R, K, V]: row k's token is argmax (temperature < 1e-5) or
        drawn with uniform u[:, k] from softmax(logits / T). Returns tokens [R, K], q [R, K, V] (one-hot on greedy
        rows) and the confidence [R, K] (sigmoid) or None; `out` (tokens, q, confidence or None): tensors of those
        shapes to write instead (a graph's static outputs). Greedy or drawn is chosen per row on the device
        (torch.where): no host branch, no sync, shapes fixed by (R, K, V). `fused`: each step's softmax, argmax, draw
        and q in the catalog's `spec.draft_step.DraftStep` (three launches split over the vocabulary; this loop's
        torch ops are its reference) instead of ~50 launches with one CTA a row in the softmax."""
        R, K, V = base.shape
        if out is None:
            with_conf = hasattr(self, "confidence_head")
            out = (torch.empty(R, K, dtype=torch.long, device=base.device),
                   torch.empty(R, K, V, dtype=torch.float32, device=base.device),
                   torch.empty(R, K, dtype=torch.float32, device=base.device) if with_conf else None)
        tokens, probs, conf = out
        prev = first_prev
        if fused:
            from kestrel.catalog.spec.draft_step import DraftStep
            temps = temperature.float().contiguous()
        else:
            greedy = (temperature < GREEDY_BELOW).unsqueeze(-1)
            scale = torch.where(greedy, 1.0, temperature.unsqueeze(-1))
        for k in range(K):
            if fused:
                DraftStep.raw_call(base[:, k], self.markov_bias(prev), temps, u[:, k], tokens[:, k], probs[:, k])
                tok = tokens[:, k]
            else:
                logits = self.step_logits(base[:, k], prev)
                q = torch.softmax(logits / scale, dim=-1)
                tok = torch.where(greedy.squeeze(-1), logits.argmax(-1), draw(q, u[:, k]))
                one_hot = torch.zeros_like(q).scatter_(1, tok.unsqueeze(1), 1.0)
                torch.where(greedy, one_hot, q, out=probs[:, k])
                tokens[:, k] = tok
            prev = tok
        if conf is not None:     # every row's confidence at once: row k reads h[:, k] and the token before it
            prevs = torch.cat([first_prev.unsqueeze(1), tokens[:, :-1]], dim=1)
            torch.sigmoid(self.confidence_logit(h, prevs), out=conf)
        return tokens, probs, conf


class DSparkProposer(Proposer):
    """The runtime's view of a DSpark drafter (kestrel/spec/proposer.py). Needs the target's embedding and LM head:
    `share_target(model)` (any object with `embed_tokens` [V, H] and `head_weight()` [V, H], e.g. the reference
    KimiModel), or `target=` at load."""

    method = "dspark"
    reads_history = False        # the block starts from the last token; the context is in the drafter's pages

    def __init__(self, drafter: DSparkDrafter, target_config: ModelConfig, num_tokens: int, target=None,
                 paged: bool | None = None):
        dc = drafter.dc
        # the block over the pages (catalog entries: MlaCacheWrite + MlaDecode) where their kernels compile (CUDA),
        # else the reference's gathered context; `paged` forces either (the tests compare them on the CPU)
        self.paged = paged
        self.drafter, self.dc = drafter, dc
        self.num_tokens = num_tokens
        self.capture_layers = tuple(dc.target_layer_ids)
        first = target_config.num_layers
        self.extra_layers = tuple(range(first, first + dc.num_layers))
        # for the memory plan and the cache: plan_cache(extra_mla=...), HybridCache(extra_mla=...)
        self.extra_mla: dict[int, int] = {i: dc.mla_cache_width for i in self.extra_layers}
        self.embed = self.head = None
        self.buckets: list[int] = []             # padded propose (pad_to): none until the runner sets it up
        self._table_src = None
        self.graphs: dict[int, object] = {}
        self.replays = 0                         # propose graph replays
        if target is not None:
            self.share_target(target)

    @property
    def observe_capturable(self) -> bool:
        """Whether observe may run inside a step's CUDA graph: its paged write (MlaCacheWrite over the step's
        device index tensors) is fixed-shape per static batch and never syncs; the reference scatter is not."""
        return self.paged is not False

    def share_target(self, target) -> None:
        self.embed, self.head = target.embed_tokens, target.head_weight()

    @torch.no_grad()
    def observe(self, batch, hidden: dict[int, torch.Tensor], pools) -> None:
        """Write the context latents of every row of the step at its position into the drafter's pages."""
        ctx = self.drafter.context([hidden[l] for l in self.capture_layers])
        paged = self.paged if self.paged is not None else ctx.is_cuda
        L = self.dc.kv_lora_rank
        for i, lat in zip(self.extra_layers, self.drafter.context_latents(ctx, batch.positions)):
            if paged and batch.req_idx is not None:     # one kernel, no host sync (the reference's scatter has one)
                from kestrel.catalog.attention.mla_cache_write import MlaCacheWrite
                lat = lat.to(pools.mla[i].dtype)
                MlaCacheWrite.raw_call(lat[:, :L].contiguous(), lat[:, L:].contiguous(), pools.mla[i],
                                       batch.block_tables, batch.req_idx, batch.positions)
            else:
                write_latents(pools.mla[i], batch, lat)

    @torch.no_grad()
    def propose(self, inputs: list[DraftInput], block_tables: torch.Tensor, pools) -> DraftBlock:
        """K draft tokens per request from its last token and the drafter's pages of positions < position.
        `block_tables` is indexed by each input's slot. With `pad_to` done and the block over the pages, a batch
        that fits a bucket runs padded on the static buffers (a CUDA graph replay where one was captured): then the
        block's tensors are views of those buffers, valid until the next propose."""
        self._check_target()
        K, R = self.num_tokens, len(inputs)
        if K > self.dc.block_size:
            raise ValueError(f"{K} draft tokens asked of a drafter trained for blocks of {self.dc.block_size}")
        # q only when a row samples: the inputs' temperatures are host data (reading the drawn q would sync)
        sampled = any(inp.temperature >= GREEDY_BELOW for inp in inputs)
        device = self.embed.device
        paged = self.paged if self.paged is not None else device.type == "cuda"
        n = self.bucket_for(R) if paged and R and block_tables is self._table_src else None
        if n is not None:
            self._fill(inputs, n)
            graph = self.graphs.get(n)
            if graph is not None:
                graph.replay()
                self.replays += 1
            else:
                self.run_padded(n, pools)
            tokens, probs, conf = self._out
            return DraftBlock(tokens=tokens[:R], probs=probs[:R] if sampled else None,
                              confidence=conf[:R] if conf is not None else None)
        lens = [inp.position for inp in inputs]
        last = torch.tensor([inp.token_ids[-1] for inp in inputs], dtype=torch.long, device=device)
        temps = torch.tensor([float(inp.temperature) for inp in inputs], device=device)
        keys = torch.tensor([seed_keys(inp.seed ^ DRAFT_SEED_SALT) for inp in inputs], dtype=torch.long,
                            device=device).view(-1, 2)
        if paged and R:
            slots = torch.tensor([inp.slot for inp in inputs], dtype=torch.long, device=block_tables.device)
            pos0 = torch.tensor(lens, dtype=torch.long, device=device)
            tokens, probs, conf = self._draft_paged(last, pos0, block_tables.index_select(0, slots), pools, temps,
                                                    keys)
            return DraftBlock(tokens=tokens, probs=probs if sampled else None, confidence=conf)
        block = torch.full((R, K), self.dc.mask_token_id, dtype=torch.long, device=device)
        block[:, 0] = last
        pos = torch.tensor(lens, device=device).unsqueeze(1) + torch.arange(K, device=device)
        x = F.embedding(block, self.embed)
        S = max(lens) if lens else 0
        ctx = []
        for i in self.extra_layers:
            pages = pools.mla[i]
            rows = [F.pad(read_row(pages, block_tables[inp.slot], n), (0, 0, 0, S - n))
                    for inp, n in zip(inputs, lens)]
            ctx.append(torch.stack(rows) if rows else pages.new_zeros(0, S, pages.shape[-1]))
        visible = torch.arange(S, device=device).unsqueeze(0) < torch.tensor(lens, device=device).unsqueeze(1)
        h = self.drafter.block_hidden(x, pos, ctx, visible)
        base = self.drafter.base_logits(h, self.head)
        u = uniforms(keys[:, :1], keys[:, 1:], pos + 1)
        tokens, probs, conf = self.drafter.draft(base, h, last, temps, u)
        return DraftBlock(tokens=tokens, probs=probs if sampled else None, confidence=conf)

    def _draft_paged(self, last: torch.Tensor, pos0: torch.Tensor, tables: torch.Tensor, pools,
                     temps: torch.Tensor, keys: torch.Tensor, out: tuple | None = None):
        """The whole propose on the device for R requests: last [R] tokens at positions pos0 [R], their block-table
        rows tables [R, P], temperatures [R], seed keys [R, 2] (the salted draft stream): the block over the pages,
        the LM head, the Markov loop and the draws. Fixed shapes per (R, K), no host sync: what a graph captures."""
        K, R = self.num_tokens, last.shape[0]
        block = torch.full((R, K), self.dc.mask_token_id, dtype=torch.long, device=last.device)
        block[:, 0] = last
        pos = pos0.unsqueeze(1) + torch.arange(K, device=last.device)
        h = self.drafter.block_hidden_paged(F.embedding(block, self.embed), pos,
                                            [pools.mla[i] for i in self.extra_layers], tables)
        base = self.drafter.base_logits(h, self.head)
        u = uniforms(keys[:, :1], keys[:, 1:], pos + 1)
        return self.drafter.draft(base, h, last, temps, u, out, fused=True)

    # ---- padded propose: static buffers per bucket (CUDA graphs) -----------------------------------------------
    def pad_to(self, buckets: list[int], block_tables: torch.Tensor, scratch_row: int) -> None:
        """Run proposes of up to buckets[-1] requests over `block_tables` (the cache's device table) padded to the
        smallest bucket that holds them, on static buffers: one [5, D] int64 copy (last token, position, table row,
        seed keys) and one [D] fp32 copy (temperatures) per step; padding rows are greedy, token 0 at position 0 on
        `scratch_row` (a row that names only the scratch page), so their writes never reach a request's pages.
        Their outputs: tokens [D, K], q [D, K, V] fp32, confidence [D, K], allocated at the first padded run (the
        runner's capture on CUDA, so the graphs' measured memory includes them)."""
        paged = self.paged if self.paged is not None else block_tables.device.type == "cuda"
        if not paged or not buckets:      # the gathered reference block reads the context per request: no padding
            return
        D, dev = buckets[-1], block_tables.device
        self.buckets, self.scratch_row, self._table_src = sorted(buckets), scratch_row, block_tables
        self._ids = torch.zeros(5, D, dtype=torch.long, device=dev)
        self._temps = torch.zeros(D, dtype=torch.float32, device=dev)
        self._tables = torch.full((D, block_tables.shape[1]), -1, dtype=torch.int32, device=dev)
        self._stage_ids = PinnedStaging(dev, torch.long, 5 * D)
        self._stage_temps = PinnedStaging(dev, torch.float32, D)
        self._out = None
        self.graphs: dict[int, object] = {}      # bucket -> its CUDA graph (ModelRunner.capture fills it)
        self.replays = 0

    def bucket_for(self, num_reqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_reqs), None)

    def _fill(self, inputs: list[DraftInput], n: int) -> None:
        """The static inputs of bucket n: the requests' rows, then padding rows (greedy, token 0, position 0, the
        scratch row); two host-to-device copies."""
        pad = n - len(inputs)
        D = self._ids.shape[1]
        keys = [seed_keys(inp.seed ^ DRAFT_SEED_SALT) for inp in inputs]
        host = self._stage_ids.take(5 * D).view(5, D)
        host[:, n:] = 0
        host[:, :n] = torch.tensor([[inp.token_ids[-1] for inp in inputs] + [0] * pad,
                                    [inp.position for inp in inputs] + [0] * pad,
                                    [inp.slot for inp in inputs] + [self.scratch_row] * pad,
                                    [k[0] for k in keys] + [0] * pad, [k[1] for k in keys] + [0] * pad],
                                   dtype=torch.long)
        self._ids.copy_(host, non_blocking=True)
        self._stage_ids.done()
        temps = self._stage_temps.take(D)
        temps.zero_()
        temps[:len(inputs)] = torch.tensor([float(inp.temperature) for inp in inputs], dtype=torch.float32)
        self._temps.copy_(temps, non_blocking=True)
        self._stage_temps.done()

    def fill_padding(self, n: int) -> None:
        """Every row of bucket n a padding row (the capture's inputs)."""
        self._fill([], n)

    def _check_target(self) -> None:
        if self.embed is None:
            raise RuntimeError("DSparkProposer.propose before share_target(model): the drafter reads the target's "
                               "embedding and LM head")

    @torch.no_grad()
    def run_padded(self, n: int, pools) -> None:
        """The padded propose of bucket n over the static buffers into the static outputs (what its graph holds)."""
        self._check_target()
        if self._out is None:
            D, K, V = self._ids.shape[1], self.num_tokens, self.head.shape[0]
            dev = self._ids.device
            self._out = (torch.zeros(D, K, dtype=torch.long, device=dev),
                         torch.zeros(D, K, V, dtype=torch.float32, device=dev),
                         torch.zeros(D, K, dtype=torch.float32, device=dev)
                         if hasattr(self.drafter, "confidence_head") else None)
        ids = self._ids[:, :n]
        tables = torch.index_select(self._table_src, 0, ids[2], out=self._tables[:n])
        out = tuple(t[:n] if t is not None else None for t in self._out)
        self._draft_paged(ids[0], ids[1], tables, pools, self._temps[:n], ids[3:5].t(), out)


def load_dspark_proposer(model_dir: str, target_config: ModelConfig, device, dtype: torch.dtype,
                         num_tokens: int, target=None) -> DSparkProposer:
    """The DSpark proposer of the drafter folder `model_dir` (config.json + safetensors) for a target of
    `target_config`, K = `num_tokens` (at most the drafter's block_size). `target` (optional): the target model
    whose embedding and LM head the drafter shares; else call `share_target` before the first propose."""
    from kestrel.errors import ConfigError
    from kestrel.spec.dspark_checkpoint import load_drafter
    from kestrel.spec.dspark_config import DSparkConfig

    dc = DSparkConfig.from_dir(model_dir)
    dc.check_target(target_config, f"{model_dir}/config.json")
    if not 1 <= num_tokens <= dc.block_size:
        raise ConfigError(f"num_speculative_tokens {num_tokens}: the drafter in {model_dir} drafts blocks of at most "
                          f"{dc.block_size}; ask for 1..{dc.block_size}")
    drafter = load_drafter(model_dir, dc, target_config, dtype, torch.device(device))
    return DSparkProposer(drafter, target_config, num_tokens, target)
