"""The objective, in one place: the set-diffusion NELBO of an order schedule or the plain
causal-LM loss (docs/method.md §4), for training (:mod:`setdiff_dist.train.loop`, through
megatron's schedules in :mod:`setdiff_dist.model.pipeline`), evaluation (``setdiff-eval ppl``
and the demo's bound: :meth:`Objective.evaluate`; the trainer's validation calls
:meth:`Objective.step` through its pipelined, data-parallel loop) and the per-token
log-likelihoods that benchmarks score (:func:`token_scores`, lm-evaluation-harness).

:class:`Objective` turns a loader :class:`~setdiff_dist.data.loader.Batch` into model inputs and a
loss *sum* with its number of target tokens (the trainer normalizes over the global batch).
Every order scores the same positions: the first token of each sequence is clean context,
revealed first and never predicted, as the reference code keeps a BOS clean (docs/method.md
§4); the causal LM cannot predict it either, so both score positions ``1..L-1`` (less padding
and prompt context), and their bounds compare like for like."""

from __future__ import annotations

import torch

from setdiff_dist.diffusion import make_schedule, nelbo, sample_orders
from setdiff_dist.diffusion.kinds import order_of
from setdiff_dist.model.forward import (
    causal_lm_inputs,
    causal_lm_nll,
    set_diffusion_inputs,
    set_diffusion_nll,
    vocab_parallel_nll,
)


def first_clean(context: torch.Tensor) -> torch.Tensor:
    """``context`` with every sequence's first position in it (clean, never predicted)."""
    out = context.clone()
    out[:, 0] = True
    return out


class Objective:
    def __init__(self, cfg, seed: int, stream: int = 0, evaluation: bool = False):
        """``evaluation``: the likelihood bound (the unclipped diffusion-time range)."""
        self.order = order_of(cfg.order)
        self.backend = cfg.model.attention_backend
        self.seq_len = cfg.data.seq_len
        self.seed, self.stream = seed, stream
        self.schedule = None if self.order.causal_lm else self.order.schedule(
            cfg.order, self.seq_len, evaluation=evaluation)
        # stratified diffusion times over the global batch (training only: the bound's
        # estimate stays one independent draw per sequence)
        self.strata = cfg.data.global_batch_size if (
            cfg.order.stratified_times and not evaluation and self.schedule is not None
            and not self.schedule.singleton) else None
        # order.training_loss=masked_mean: a loss per sequence (its masked tokens' mean), the
        # global batch's normalizer the number of sequences (training only: the bound stays)
        self.per_sequence = (cfg.order.training_loss == "masked_mean" and not evaluation
                             and not self.order.causal_lm)

    @property
    def model_seq_len(self) -> int:
        """Tokens per sequence in the model (the p2p message length with pipelining; megatron's
        schedule divides it by the context-parallel size itself)."""
        return self.order.model_len(self.seq_len)

    def target_mask(self, batch) -> torch.Tensor:
        """Which tokens carry loss (known before the forward, for the global normalizer)."""
        keep = ~(batch.padding | first_clean(batch.context))
        if self.order.causal_lm:
            return keep[:, 1:]  # the output at l - 1 predicts token l
        if self.per_sequence:  # (one per sequence that has a token to predict)
            return keep.any(dim=1, keepdim=True)
        return keep

    def step(self, module, batch):
        """``(model output, terms_fn)``; ``terms_fn(logits) -> (loss sum, target tokens)``."""
        tokens = batch.tokens
        if self.order.causal_lm:
            return causal_lm_step(module, tokens, self.target_mask(batch))
        sample = sample_orders(self.schedule, self.seq_len, batch.indices, self.seed,
                               context=first_clean(batch.context), padding=batch.padding,
                               stream=self.stream, strata=self.strata)
        if self.per_sequence:
            sample = masked_mean_weights(sample)
        return nelbo_step(module, tokens, sample, self.backend, self.per_sequence)

    def evaluate(self, module, batches, device) -> tuple[float, float]:
        """``(loss sum, target tokens)`` of ``module`` over the loader batches ``batches``,
        forward only, on ``device``: the evaluation loop of ``setdiff-eval ppl`` and the demo
        (the trainer's validation adds pipelining and the data-parallel sum)."""
        total = tokens = 0.0
        with torch.no_grad():
            for batch in batches:
                out, terms = self.step(module, batch.to(device))
                s, n = terms(out)
                total, tokens = total + float(s), tokens + float(n)
        return total, tokens


def masked_mean_weights(sample):
    """``sample`` with the reference's MDLM / BD3LM training weights (``order.training_loss=
    masked_mean``): each predicted (masked) token ``1 / (its sequence's masked tokens)``, so
    that a sequence's weighted sum is its unweighted mean -log p over its masked tokens (0 for
    a sequence with none, which still counts in the mean over sequences, as the reference's).
    The counts are over the whole sequence (every context-parallel rank samples all of it)."""
    import dataclasses

    predicted = sample.loss_weight > 0
    count = predicted.sum(dim=1, keepdim=True).clamp_min(1).to(torch.float32)
    weight = torch.where(predicted, 1.0 / count, torch.zeros_like(count))
    return dataclasses.replace(sample, loss_weight=weight)


def nelbo_step(module, tokens: torch.Tensor, sample, backend: str, per_sequence: bool = False):
    """The set-diffusion forward of ``tokens [b, L]`` under the orders ``sample``:
    ``(model output, terms_fn)`` with ``terms_fn(logits) -> (NELBO sum, target tokens)``;
    ``per_sequence`` (``sample`` weighted by :func:`masked_mean_weights`): ``(the sum of the
    sequences' mean losses, sequences with a target)``."""
    inp = set_diffusion_inputs(tokens, sample, module.mask_id, backend)
    out = module(inp.tokens, inp.positions, inp.attention_mask, inp.logits_from)

    def terms(logits):
        bound = nelbo(set_diffusion_nll(logits, tokens, inp), sample.to(tokens.device),
                      inp.scored(tokens.shape[1]))
        if per_sequence:
            return bound.total, sample.targets.any(dim=1).sum().to(bound.total.dtype)
        return bound.total, bound.tokens

    return out, terms


def causal_lm_step(module, tokens: torch.Tensor, mask: torch.Tensor):
    """The causal LM's forward of ``tokens [b, L]``: ``(model output, terms_fn)`` with
    ``terms_fn(logits) -> (next-token loss sum over mask [b, L-1], target tokens)``; under
    context parallelism, of this rank's positions (the group's sums are the sequence's)."""
    inp = causal_lm_inputs(tokens)
    out = module(inp.tokens, inp.positions, inp.attention_mask)
    mask = mask.to(tokens.device)
    if inp.context is not None:  # (position l - 1 predicts token l)
        mask = mask & inp.scored(tokens.shape[1])[:, :-1]

    def terms(logits):
        nll = causal_lm_nll(logits, tokens, inp)
        return torch.where(mask, nll, 0.0).sum(), mask.sum().to(nll.dtype)

    return out, terms


def token_scores(module, causal_lm: bool, tokens: torch.Tensor, context: torch.Tensor,
                 padding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position ``(log p(x_l | x_<l), whether x_l is the most likely token)``, ``[b, L]``
    each, for the positions that are neither ``context`` nor ``padding`` (elsewhere 0 and True):
    what a log-likelihood benchmark scores (lm-evaluation-harness's ``loglikelihood``).

    ``causal_lm``: the causal LM's exact next-token log-probabilities. Otherwise the
    set-diffusion model's log-probabilities under the autoregressive order (docs/method.md §4):
    the context clean, then one position at a time, left to right; one forward of ``[clean ;
    noisy]`` under the set-causal mask gives them all. That is the exact likelihood of the
    model decoding autoregressively (``W=1``), and a lower bound on what other orders could
    give; results say which. ``module`` is the inference model (any tensor-parallel size)."""
    B, L = tokens.shape
    context = first_clean(context)
    with torch.no_grad():
        logits, targets = _next_token_logits(module, causal_lm, tokens, context, padding)
        logp = -vocab_parallel_nll(logits, targets)
        greedy = _is_argmax(logits, targets)
    if causal_lm:  # (position 0 is context: never scored)
        logp = torch.cat([logp.new_zeros(B, 1), logp], 1)
        greedy = torch.cat([greedy.new_ones(B, 1), greedy], 1)
    scored = ~(context | padding)
    return torch.where(scored, logp, 0.0), greedy | ~scored


def _next_token_logits(module, causal_lm: bool, tokens, context, padding):
    """The scoring forward of :func:`token_scores` and :func:`token_logprobs`: ``(logits [s,
    b, V], targets [b, s])``, row ``s`` predicting ``targets[:, s]`` (the causal LM has no
    row for position 0; the set-diffusion model, under the autoregressive order, has one that
    ``context`` leaves unscored)."""
    if causal_lm:
        inp = causal_lm_inputs(tokens)
        return module(inp.tokens, inp.positions, None)[:-1], tokens[:, 1:]  # l - 1 predicts l
    B, L = tokens.shape
    sample = sample_orders(make_schedule("autoregressive", L), L, range(B), 0, context=context,
                           padding=padding)
    inp = set_diffusion_inputs(tokens, sample, module.mask_id, "sdpa")
    return module(inp.tokens, inp.positions, inp.attention_mask, inp.logits_from), tokens


def token_logprobs(module, causal_lm: bool, ids: list, k: int = 1, vocab: int = None) -> list:
    """For each position ``j >= 1`` of the sequence ``ids``: ``(log p(x_j | x_<j), [(token,
    log p)] of the k most likely tokens)``, as :func:`token_scores` scores them (the causal
    LM's, or the set-diffusion model's under the autoregressive order: position 0 is context);
    what OpenAI's completions return for ``echo`` and ``logprobs``. At tensor-parallel size > 1
    every rank of the group calls it (the normaliser is reduced and each rank's top ``k``
    gathered over the group: the vocabulary is never gathered); ``vocab``: the tokenizer's (the
    top tokens are real tokens, never [MASK] or padding)."""
    from setdiff_dist.parallel import megatron_groups

    L = len(ids)
    device = getattr(module, "device", None)  # (the lean model's; a torch module's weights')
    if not isinstance(device, torch.device):
        device = next(module.parameters()).device
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    none = torch.zeros(1, L, dtype=torch.bool)
    with torch.no_grad():
        logits, targets = _next_token_logits(module, causal_lm, tokens, first_clean(none), none)
        first = 0 if causal_lm else 1  # (position 0 is context: no log-probability)
        logits, targets = logits[first:], targets[:, first:]
        own = (-vocab_parallel_nll(logits, targets))[0]
        raw = logits[:, 0].float()  # [s, V / TP]
        ps = megatron_groups()
        tp = ps.get_tensor_model_parallel_world_size() if ps is not None else 1
        group = ps.get_tensor_model_parallel_group() if tp > 1 else None
        part = raw.shape[-1]
        lo = ps.get_tensor_model_parallel_rank() * part if tp > 1 else 0
        # the log normaliser over the whole vocabulary (every column, as the targets' -log p)
        top = raw.max(-1).values
        if tp > 1:
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
        z = (raw - top[:, None]).exp().sum(-1)
        if tp > 1:
            torch.distributed.all_reduce(z, group=group)
        log_z = top + z.log()
        real = (vocab or lo + part) - lo  # (this shard's columns that are real tokens)
        candidates = raw.clone()
        candidates[:, max(min(real, part), 0):] = float("-inf")
        top_lp, top_id = candidates.topk(min(k, part), dim=-1)
        top_id = top_id + lo
        if tp > 1:  # (each rank's best k gathered and chosen from: k x TP values, never V)
            lps = [torch.empty_like(top_lp) for _ in range(tp)]
            idx = [torch.empty_like(top_id) for _ in range(tp)]
            torch.distributed.all_gather(lps, top_lp.contiguous(), group=group)
            torch.distributed.all_gather(idx, top_id.contiguous(), group=group)
            top_lp, pick = torch.cat(lps, -1).topk(k, dim=-1)
            top_id = torch.cat(idx, -1).gather(-1, pick)
        top_lp = top_lp - log_z[:, None]
    return [(lp, list(zip(ids_, lps))) for lp, ids_, lps in
            zip(own.tolist(), top_id.tolist(), top_lp.tolist())]


def _is_argmax(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[b, s]``: whether each target's logit is the largest of its row, for vocab-parallel
    ``logits [s, b, V/TP]`` (the target's logit and the row maximum reduced exactly over the
    tensor-parallel group: no gather of the vocabulary)."""
    from setdiff_dist.parallel import megatron_groups

    ps = megatron_groups()  # (None: the whole vocabulary is here)
    logits = logits.float()
    part = logits.shape[-1]
    lo = ps.get_tensor_model_parallel_rank() * part if ps is not None else 0
    local = targets.t() - lo  # [s, b]
    here = (local >= 0) & (local < part)
    target = torch.where(here, logits.gather(-1, local.clamp(0, part - 1)[..., None])[..., 0],
                         torch.zeros((), dtype=logits.dtype))
    best = logits.max(-1).values
    if ps is not None and ps.get_tensor_model_parallel_world_size() > 1:
        group = ps.get_tensor_model_parallel_group()
        torch.distributed.all_reduce(target, group=group)
        torch.distributed.all_reduce(best, op=torch.distributed.ReduceOp.MAX, group=group)
    return (target >= best).t()
