"""The NELBO (docs/method.md §4): the noisy copy, per-token weights, reductions, the PPL bound.

- Singleton sets (autoregressive, staggered): every target is ``[MASK]`` in the noisy copy and the
  loss is the unweighted any-order AR loss ``sum_l -log p(x_l | x revealed before l)``.
- In-set diffusion (block, masked): each set has its own time ``t``; a masked token's
  ``-log p`` is weighted by ``1/t`` (linear schedule), unmasked ones contribute nothing.

The bound is reported per target token (context and padding excluded): ``PPL <= exp(NELBO / N)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .orders import OrderSample


def noisy_copy(tokens: torch.Tensor, sample: OrderSample, mask_id: int) -> torch.Tensor:
    """``tokens [B, L]`` with ``[MASK]`` where the sample's noisy copy is masked."""
    return torch.where(sample.noisy.to(tokens.device), torch.full_like(tokens, mask_id), tokens)


def two_copy_inputs(tokens: torch.Tensor, sample: OrderSample, mask_id: int):
    """The ``[clean ; noisy]`` input of the vectorized training forward: token ids ``[B, 2L]`` and
    the original positions ``[B, 2L]`` (the same in both halves, for rotary embeddings)."""
    B, L = tokens.shape
    pos = torch.arange(L, device=tokens.device).expand(B, L)
    return (torch.cat([tokens, noisy_copy(tokens, sample, mask_id)], dim=1),
            torch.cat([pos, pos], dim=1))


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``-log p(target)`` per token, ``[B, L]``, computed in float32."""
    B, L, V = logits.shape
    return F.cross_entropy(logits.float().reshape(B * L, V), targets.reshape(B * L),
                           reduction="none").reshape(B, L)


@dataclass
class Nelbo:
    """Weighted NELBO terms of a batch."""

    terms: torch.Tensor   # [B, L] weighted -log p (0 where the token is not predicted)
    total: torch.Tensor   # scalar: sum of terms
    tokens: torch.Tensor  # scalar: target tokens (the PPL denominator)

    @property
    def per_token(self) -> torch.Tensor:
        """The training loss: the NELBO per target token."""
        return self.total / self.tokens.clamp_min(1)


def nelbo(nll: torch.Tensor, sample: OrderSample, scored: torch.Tensor | None = None) -> Nelbo:
    """Weight per-token ``nll [B, L]`` (from the noisy half) by the sample's loss weights.
    ``scored [B, L]``: only these tokens count (a context-parallel rank's share)."""
    w = sample.loss_weight.to(nll.device)
    targets = sample.targets.to(nll.device)
    if scored is not None:
        w, targets = torch.where(scored, w, torch.zeros_like(w)), targets & scored
    # where(), not a product: an unpredicted token's nll may be inf or nan, and 0 * inf = nan
    terms = torch.where(w > 0, nll * w, torch.zeros_like(nll))
    return Nelbo(terms=terms, total=terms.sum(), tokens=targets.sum().to(nll.dtype))


#: the per-token loss (nats) past which a perplexity bound reports ``exp(MAX_LOG_PPL)``
MAX_LOG_PPL = 50.0


def perplexity_bound(total: float, tokens: float = 1.0) -> float:
    """``exp(NELBO / tokens)``: an upper bound on perplexity (``PPL <=``); ``tokens`` left out,
    ``total`` is a per-token loss. The one policy of every report (logs, tensorboard, results
    files): a loss past :data:`MAX_LOG_PPL` nats a token (an untrained or diverging run) reports
    ``exp(MAX_LOG_PPL)`` rather than overflowing; a non-finite loss reports nan (inf: the cap)."""
    return math.exp(min(float(total) / max(float(tokens), 1.0), MAX_LOG_PPL))
