"""Inputs and losses of the two training modes, for any attention backend.

- Set diffusion: ``[clean ; noisy]`` (2L tokens) at the original positions, with the set-causal
  mask in the backend's form (dense for ``sdpa``/``te``, a block mask for ``flex``, the permuted
  order for ``permuted_causal``); logits only for the noisy half; per-token ``-log p`` returned in
  original positions, so the NELBO code does not care which backend ran.
- The plain causal LM: L tokens, causal attention, next-token loss (the AR baseline).

Every pipeline stage calls :func:`set_diffusion_inputs` (deterministic, cheap) so that all of
them agree on positions and masks; only the last stage computes the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core import tensor_parallel

from setdiff_dist.diffusion import (
    OrderSample,
    from_reveal_order,
    set_causal_mask,
    set_causal_mask_mod,
    two_copy_inputs,
)


@dataclass
class ModelInputs:
    tokens: torch.Tensor           # [b, s]
    positions: torch.Tensor        # [b, s]
    attention_mask: Any            # backend-specific, or None
    logits_from: int               # first sequence index that needs logits
    order: Optional[torch.Tensor]  # [b, L] when the inputs are in reveal order


def set_diffusion_inputs(tokens: torch.Tensor, sample: OrderSample, mask_id: int,
                         backend: str) -> ModelInputs:
    """The model inputs of the vectorized training forward for ``tokens [b, L]``."""
    sample = sample.to(tokens.device)
    L = tokens.shape[1]
    both, positions = two_copy_inputs(tokens, sample, mask_id)
    if backend == "permuted_causal":
        perm = torch.cat([sample.order, sample.order + L], dim=1)
        return ModelInputs(both.gather(1, perm), positions.gather(1, perm), None, L, sample.order)
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        B = tokens.shape[0]
        mask = create_block_mask(set_causal_mask_mod(sample.set_ids), B, None, 2 * L, 2 * L,
                                 device=tokens.device)
        return ModelInputs(both, positions, mask, L, None)
    # megatron's convention: True = masked out
    return ModelInputs(both, positions, ~set_causal_mask(sample.set_ids)[:, None], L, None)


def vocab_parallel_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``-log p(target)`` ``[b, s]`` from vocab-parallel logits ``[s, b, V/TP]`` (fp32)."""
    # megatron's cross entropy works in place on its input: give it its own fp32 copy
    return tensor_parallel.vocab_parallel_cross_entropy(
        logits.float().clone(), targets.t().contiguous()).t()


def set_diffusion_nll(logits: torch.Tensor, tokens: torch.Tensor,
                      inputs: ModelInputs) -> torch.Tensor:
    """Per-token ``-log p`` ``[b, L]`` of the noisy half, in original positions."""
    if inputs.order is None:
        return vocab_parallel_nll(logits, tokens)
    targets = tokens.gather(1, inputs.order)
    return from_reveal_order(vocab_parallel_nll(logits, targets), inputs.order)


def causal_lm_inputs(tokens: torch.Tensor) -> ModelInputs:
    """The plain causal LM over ``tokens [b, L]`` (SDPA's causal kernel: no mask tensor)."""
    B, L = tokens.shape
    positions = torch.arange(L, device=tokens.device).expand(B, L)
    return ModelInputs(tokens, positions, None, 0, None)


def causal_lm_nll(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token ``-log p`` ``[b, L-1]``: the output at ``l - 1`` predicts ``x_l``."""
    return vocab_parallel_nll(logits[:-1], tokens[:, 1:])
