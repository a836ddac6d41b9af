"""Log-likelihood scoring of text continuations, as benchmarks score them.

:class:`Scorer` answers ``log p(continuation | context)`` and whether greedy decoding would
produce the continuation, for a batch of ``(context, continuation)`` pairs, on the inference
model at any tensor-parallel size (:func:`setdiff_dist.objective.token_scores`):

- a causal LM: the exact log-likelihood;
- a set-diffusion model: the log-likelihood under the autoregressive order (the context clean,
  then one token at a time, left to right; docs/method.md §4), exact for a model decoded with
  ``W = 1`` and a bound for the model as a whole. :attr:`Scorer.exact` says which.

Pairs are tokenized as lm-evaluation-harness tokenizes them (the whole text, then the context's
tokens as its prefix; trailing spaces of the context belong to the continuation; an empty
context is the end-of-text token), so that :mod:`setdiff_dist.eval.harness` and
``setdiff-eval --task choice`` score the same tokens. Sequences longer than the model's context
keep their last tokens.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from setdiff_dist.errors import SetdiffError


class ScoreError(SetdiffError, ValueError):
    """A request that cannot be scored (the message says why and what to change)."""


class Scorer:
    def __init__(self, model, cfg, tokenizer, batch_size: int = 8):
        from setdiff_dist.inference.decoder import model_device

        self.model, self.cfg, self.tok = model, cfg, tokenizer
        from setdiff_dist.diffusion.kinds import order_of

        self.order = order_of(cfg.order)
        self.max_length = cfg.data.seq_len
        self.batch_size = batch_size
        self.device = model_device(model)
        if tokenizer.eos_id is None:
            raise ScoreError("the tokenizer has no end-of-text token, which an empty context "
                             "stands for")

    @property
    def exact(self) -> bool:
        """Whether the scores are exact log-likelihoods (causal and AR-trained models)."""
        return self.order.exact_likelihood

    @property
    def likelihood(self) -> str:
        """What the scores are, in words (for results files)."""
        if self.order.causal_lm:
            return "exact (causal LM)"
        return ("autoregressive-order log-likelihood: exact for decoding one token at a time "
                f"(W = 1), a bound for this {self.cfg.order.kind}-order model")

    # -- tokens ----------------------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of ``(context, continuation)``, split as lm-evaluation-harness splits them."""
        if not context:
            cont = self.tok.encode(continuation)
            if cont and cont[0] == self.tok.eos_id:
                return cont[:1], cont[1:]
            return [self.tok.eos_id], cont
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok.encode(context + continuation)
        ctx = self.tok.encode(context)
        return ctx, whole[len(ctx):]

    # -- scoring ---------------------------------------------------------------------------------
    def loglikelihood(self, pairs: Iterable[tuple[str, str]]) -> list[tuple[float, bool]]:
        return self.loglikelihood_tokens([self.encode_pair(c, x) for c, x in pairs])

    def loglikelihood_tokens(self, pairs: list[tuple[list[int], list[int]]],
                             progress: Optional[callable] = None) -> list[tuple[float, bool]]:
        """``(sum of log p, greedy)`` of each ``(context ids, continuation ids)``."""
        L = self.max_length
        seqs = []
        for i, (ctx, cont) in enumerate(pairs):
            if len(cont) > L - 1:
                raise ScoreError(f"request {i}: a continuation of {len(cont)} tokens does not fit "
                                 f"the model's context of {L} tokens next to one token of "
                                 "context; shorten it")
            if not ctx:
                raise ScoreError(f"request {i} has no context tokens (an empty context is the "
                                 "end-of-text token)")
            whole = (ctx + cont)[-L:]
            seqs.append((whole, len(whole) - len(cont)))
        out: list = [None] * len(seqs)
        # longest first: a batch pads to its first sequence, and memory peaks at once
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
        for lo in range(0, len(order), self.batch_size):
            chunk = order[lo:lo + self.batch_size]
            for i, res in zip(chunk, self._score([seqs[i] for i in chunk])):
                out[i] = res
            if progress is not None:
                progress(len(chunk))
        return out

    def _score(self, seqs: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        from setdiff_dist.objective import token_scores

        T = max(len(s) for s, _ in seqs)
        B = len(seqs)
        tokens = torch.full((B, T), self.tok.eos_id, dtype=torch.long)
        context = torch.zeros(B, T, dtype=torch.bool)
        padding = torch.zeros(B, T, dtype=torch.bool)
        for b, (s, n_ctx) in enumerate(seqs):
            tokens[b, :len(s)] = torch.tensor(s)
            context[b, :n_ctx] = True
            padding[b, len(s):] = True
        d = self.device
        logp, greedy = token_scores(self.model, self.order.causal_lm, tokens.to(d), context.to(d),
                                    padding.to(d))
        sums = logp.double().sum(1).tolist()
        return [(s, bool(g)) for s, g in zip(sums, greedy.all(1).tolist())]

    def rolling(self, texts: Iterable[str]) -> list[float]:
        """The whole log-likelihood of each text after the end-of-text token, in windows of the
        model's context (each window's tokens conditioned on as many earlier ones as fit, each
        token scored once), as lm-evaluation-harness's ``loglikelihood_rolling``."""
        out = []
        for text in texts:
            ids = self.tok.encode(text)
            if not ids:
                out.append(0.0)
                continue
            pairs = []
            stride = self.max_length - 1  # (one token of context at least)
            for lo in range(0, len(ids), stride):
                cont = ids[lo:lo + stride]
                ctx = ([self.tok.eos_id] + ids)[max(0, lo + 1 - (self.max_length - len(cont))):
                                                 lo + 1]
                pairs.append((ctx, cont))
            out.append(math.fsum(ll for ll, _ in self.loglikelihood_tokens(pairs)))
        return out
