"""Inputs and losses of the two training modes, for any attention backend.

- Set diffusion: ``[clean ; noisy]`` (2L tokens) at the original positions, with the set-causal
  mask in the backend's form, built once per micro-batch (dense boolean for ``sdpa``, True =
  may attend; its inverse, megatron's convention, for ``te``; a block mask for ``flex``; none
  for ``permuted_causal``, whose inputs are in reveal order); logits only for the noisy half;
  per-token ``-log p`` returned in original positions, so the NELBO code does not care which
  backend ran.
- The plain causal LM: L tokens, causal attention, next-token loss (the AR baseline).

Every pipeline stage calls :func:`set_diffusion_inputs` (deterministic, cheap) so that all of
them agree on positions and masks; only the last stage computes the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from setdiff_dist.diffusion import (
    OrderSample,
    from_reveal_order,
    set_causal_mask,
    set_causal_mask_mod,
    set_causal_rule,
    two_copy_inputs,
)


@dataclass
class ModelInputs:
    tokens: torch.Tensor           # [b, s]
    positions: torch.Tensor        # [b, s]
    attention_mask: Any            # backend-specific, or None
    logits_from: int               # first sequence index that needs logits
    order: Optional[torch.Tensor]  # [b, L] when the inputs are in reveal order
    # context parallelism: this rank's positions within a half (in reveal order when ``order``
    # is set), whose noisy tokens it scores; None without
    context: Optional[torch.Tensor] = None

    def scored(self, L: int) -> Optional[torch.Tensor]:
        """Under context parallelism, ``[b, L]`` (original positions): the tokens this rank
        scores; None without."""
        if self.context is None:
            return None
        B = self.tokens.shape[0]
        mine = torch.zeros(B, L, dtype=torch.bool, device=self.tokens.device)
        mine[:, self.context.to(mine.device)] = True
        return mine if self.order is None else from_reveal_order(mine, self.order)


def set_diffusion_inputs(tokens: torch.Tensor, sample: OrderSample, mask_id: int,
                         backend: str) -> ModelInputs:
    """The model inputs of the vectorized training forward for ``tokens [b, L]``."""
    sample = sample.to(tokens.device)
    L = tokens.shape[1]
    both, positions = two_copy_inputs(tokens, sample, mask_id)
    from . import context

    if context.size() > 1:
        return _context_parallel_inputs(both, positions, sample, backend)
    if backend == "permuted_causal":
        perm = torch.cat([sample.order, sample.order + L], dim=1)
        return ModelInputs(both.gather(1, perm), positions.gather(1, perm), None, L, sample.order)
    if backend == "flex":
        B = tokens.shape[0]
        # once per micro-batch, shared by the layers; compiled on a GPU (no [2L, 2L] mask is
        # materialised to find the blocks)
        mask = _block_mask_builder(tokens.is_cuda)(set_causal_mask_mod(sample.set_ids), B, None,
                                                   2 * L, 2 * L, device=tokens.device)
        return ModelInputs(both, positions, mask, L, None)
    allowed = set_causal_mask(sample.set_ids)[:, None]  # [b, 1, 2L, 2L], True = may attend
    if backend == "te":  # megatron's convention for Transformer Engine: True = masked out
        return ModelInputs(both, positions, ~allowed, L, None)
    # sdpa: the form SDPA takes, built once per micro-batch; every layer reads (and autograd
    # keeps) this one tensor, no per-layer inverted copy
    return ModelInputs(both, positions, allowed, L, None)


def _block_mask_builder(compiled: bool):
    """``create_block_mask``, compiled once per process when ``compiled`` (torch's advice since
    its ``_compile=True`` flag was deprecated): compiled, the mask function is fused into the
    reduction to blocks, so the ``[2L, 2L]`` mask is never materialised."""
    from torch.nn.attention.flex_attention import create_block_mask

    from .attention import compiled_once

    return compiled_once(create_block_mask) if compiled else create_block_mask


def _context_parallel_inputs(both, positions, sample, backend: str) -> ModelInputs:
    """This rank's share of the ``[clean ; noisy]`` inputs and its rows of the mask (see
    :mod:`setdiff_dist.model.context`): in reveal order with the reveal order's static mask for
    ``permuted_causal``, in position order with the set-causal mask for ``sdpa``."""
    from . import context

    if backend not in ("sdpa", "permuted_causal"):
        raise ValueError(f"model.attention_backend={backend} has no context parallelism; use "
                         "sdpa or permuted_causal")
    L = both.shape[1] // 2
    part = context.split(L, halves=2)
    local, keys = part.local.to(both.device), part.keys.to(both.device)
    order = None
    if backend == "permuted_causal":
        order = sample.order
        perm = torch.cat([order, order + L], dim=1)
        both, positions = both.gather(1, perm), positions.gather(1, perm)
        set_ids = torch.arange(L, device=both.device)[None]  # a set per token, in order
    else:
        set_ids = sample.set_ids
    rows = set_causal_rule(local[None, :, None], keys[None, None, :],
                           set_ids[:, local % L, None], set_ids[:, None, keys % L], L)
    return ModelInputs(both[:, local], positions[:, local], context.ContextMask(rows[:, None]),
                       local.numel() // 2, order, context=part.half)


def vocab_parallel_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``-log p(target)`` ``[b, s]`` from vocab-parallel logits ``[s, b, V/TP]`` (fp32). Without
    megatron's groups (inference at TP=1, a model outside a training or inference run: the
    demo's reference model) the logits hold the whole vocabulary: torch's cross entropy."""
    from setdiff_dist.parallel import megatron_groups

    if megatron_groups() is None:
        return F.cross_entropy(logits.float().permute(1, 2, 0), targets, reduction="none")
    from megatron.core import tensor_parallel

    # megatron's cross entropy works in place on its input: give it its own fp32 copy
    return tensor_parallel.vocab_parallel_cross_entropy(
        logits.float().clone(), targets.t().contiguous()).t()


def set_diffusion_nll(logits: torch.Tensor, tokens: torch.Tensor,
                      inputs: ModelInputs) -> torch.Tensor:
    """Per-token ``-log p`` ``[b, L]`` of the noisy half, in original positions (under context
    parallelism: of this rank's tokens, 0 elsewhere; see :meth:`ModelInputs.scored`)."""
    if inputs.context is not None:
        mine = inputs.context.to(tokens.device)
        ordered = tokens if inputs.order is None else tokens.gather(1, inputs.order)
        nll = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        nll[:, mine] = vocab_parallel_nll(logits, ordered[:, mine])
        return nll if inputs.order is None else from_reveal_order(nll, inputs.order)
    if inputs.order is None:
        return vocab_parallel_nll(logits, tokens)
    targets = tokens.gather(1, inputs.order)
    return from_reveal_order(vocab_parallel_nll(logits, targets), inputs.order)


def causal_lm_inputs(tokens: torch.Tensor) -> ModelInputs:
    """The plain causal LM over ``tokens [b, L]`` (SDPA's causal kernel: no mask tensor). Under
    context parallelism, this rank's zigzag share of the positions and its rows of the causal
    mask over the gathered keys (:mod:`.context`: the same split as set diffusion's, one half)."""
    B, L = tokens.shape
    positions = torch.arange(L, device=tokens.device).expand(B, L)
    from . import context

    if context.size() == 1:
        return ModelInputs(tokens, positions, None, 0, None)
    part = context.split(L, halves=1)
    local, keys = part.local.to(tokens.device), part.keys.to(tokens.device)
    rows = keys[None, None, None, :] <= local[None, None, :, None]  # [1, 1, L / cp, L]
    return ModelInputs(tokens[:, local], positions[:, local], context.ContextMask(rows), 0,
                       None, context=part.half)


def causal_lm_nll(logits: torch.Tensor, tokens: torch.Tensor,
                  inputs: ModelInputs) -> torch.Tensor:
    """Next-token ``-log p`` ``[b, L-1]``: the output at ``l - 1`` predicts ``x_l`` (under
    context parallelism: of the positions this rank holds, 0 elsewhere)."""
    if inputs.context is None:
        return vocab_parallel_nll(logits[:-1], tokens[:, 1:])
    L = tokens.shape[1]
    mine = inputs.context.to(tokens.device)
    # (the last position predicts nothing: its term is computed on a stand-in and cut off)
    targets = tokens[:, (mine + 1).clamp_max(L - 1)]
    nll = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    nll[:, mine] = vocab_parallel_nll(logits, targets)
    return nll[:, :-1]
