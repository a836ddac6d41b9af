"""The training objective of a run: the set-diffusion NELBO of an order schedule, or the plain
causal-LM loss. It turns a loader :class:`~setdiff_dist.data.loader.Batch` into model inputs and a
loss *sum* with its number of target tokens (the trainer normalizes over the global batch).

Every order scores the same positions: the first token of each sequence is clean context,
revealed first and never predicted, as the reference code keeps a BOS clean (SPEC section 4);
the causal LM cannot predict it either, so both score positions ``1..L-1`` (less padding and
prompt context), and their bounds compare like for like."""

from __future__ import annotations

import torch

from setdiff_dist.diffusion import nelbo, sample_orders, schedule_from_config
from setdiff_dist.model.forward import (causal_lm_inputs, set_diffusion_inputs,
                                        set_diffusion_nll, vocab_parallel_nll)


def first_clean(context: torch.Tensor) -> torch.Tensor:
    """``context`` with every sequence's first position in it (clean, never predicted)."""
    out = context.clone()
    out[:, 0] = True
    return out


class Objective:
    def __init__(self, cfg, seed: int, stream: int = 0, evaluation: bool = False):
        """``evaluation``: the likelihood bound (the unclipped diffusion-time range)."""
        self.kind = cfg.order.kind
        self.backend = cfg.model.attention_backend
        self.seq_len = cfg.data.seq_len
        self.seed, self.stream = seed, stream
        self.schedule = None if self.kind == "causal" else schedule_from_config(
            cfg.order, self.seq_len, evaluation=evaluation)

    @property
    def model_seq_len(self) -> int:
        """Tokens per sequence in the model (the p2p message length with pipelining)."""
        return self.seq_len if self.kind == "causal" else 2 * self.seq_len

    def target_mask(self, batch) -> torch.Tensor:
        """Which tokens carry loss (known before the forward, for the global normalizer)."""
        keep = ~(batch.padding | first_clean(batch.context))
        if self.kind == "causal":
            return keep[:, 1:]  # the output at l - 1 predicts token l
        return keep

    def step(self, module, batch):
        """``(model output, terms_fn)``; ``terms_fn(logits) -> (loss sum, target tokens)``."""
        tokens = batch.tokens
        if self.kind == "causal":
            inp = causal_lm_inputs(tokens)
            out = module(inp.tokens, inp.positions, None)
            mask = self.target_mask(batch).to(tokens.device)

            def terms(logits):
                nll = vocab_parallel_nll(logits[:-1], tokens[:, 1:])
                return torch.where(mask, nll, 0.0).sum(), mask.sum().to(nll.dtype)

            return out, terms
        sample = sample_orders(self.schedule, self.seq_len, batch.indices, self.seed,
                               context=first_clean(batch.context), padding=batch.padding,
                               stream=self.stream)
        inp = set_diffusion_inputs(tokens, sample, module.mask_id, self.backend)
        out = module(inp.tokens, inp.positions, inp.attention_mask, inp.logits_from)

        def terms(logits):
            bound = nelbo(set_diffusion_nll(logits, tokens, inp), sample.to(tokens.device))
            return bound.total, bound.tokens

        return out, terms
