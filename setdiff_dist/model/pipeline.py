"""Forward and backward of a global batch through megatron-core's pipeline schedules.

One function for every layout: with PP = 1 megatron runs its no-pipelining schedule (gradient
accumulation over micro-batches), with PP > 1 its 1F1B schedule, whose p2p messages are the
hidden states ``[s, b, h]`` (``s = 2L`` for set diffusion). A ``step`` callable builds each
micro-batch's inputs on every stage (deterministically, so all stages agree) and returns the
model output with a loss function for the last stage.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func


def forward_backward(model, microbatches: Iterable, seq_len: int, micro_batch_size: int,
                     step: Callable, forward_only: bool = False,
                     loss_scale: Optional[float | torch.Tensor] = None,
                     sync=None) -> list[dict]:
    """Run megatron's schedule. ``step(module, microbatch) -> (output, terms_fn)`` where
    ``terms_fn(logits) -> (nll_sum, tokens)`` on the last stage.

    Without ``loss_scale`` each micro-batch's loss is its mean per token (megatron's
    normalization); with it, the loss is ``nll_sum * loss_scale`` before megatron's division by
    the number of micro-batches (the trainer passes ``n_micro * dp / global_tokens`` for an exact
    global per-token mean). Returns per-micro-batch ``{"nll_sum", "tokens"}`` on the last stage
    (an empty list elsewhere); tied-embedding gradients are synchronized after the backward.

    ``sync`` (a :class:`setdiff_dist.train.engine.GradientSync`) says where gradients
    accumulate (the fp32 buffers under bf16: the tied embedding is summed there) and, when
    DeepSpeed reduces them in its backward hooks, holds that reduction to the last micro-batch
    (megatron's ``no_sync_func``) and the tied embedding's until its stages have summed it."""
    microbatches = list(microbatches)

    def forward_step(data_iterator, module):
        out, terms = step(module, next(data_iterator))

        def loss_func(logits):
            total, tokens = terms(logits)
            stats = {"nll_sum": total.detach().clone(), "tokens": tokens.detach().clone()}
            if loss_scale is None:
                return total, tokens.to(torch.int), stats
            return total * loss_scale, stats

        return out, loss_func

    overlapped = sync is not None and sync.overlapped and not forward_only
    # megatron's distributed optimizer reduces in its hooks at the last micro-batch; its engine
    # sums the tied embedding's stages after the reduction (MegatronEngine.step)
    megatron = sync is not None and getattr(sync, "megatron", False) and not forward_only
    tied = model.tied_embedding_weight() if overlapped else None
    held = [tied] if tied is not None else []
    model.config.no_sync_func = sync.no_sync if overlapped or megatron else None
    try:
        with sync.held(held) if overlapped else contextlib.nullcontext():
            stats = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(microbatches),
                model=[model], num_microbatches=len(microbatches), seq_length=seq_len,
                micro_batch_size=micro_batch_size, forward_only=forward_only)
            if not forward_only and not megatron:
                model.sync_tied_embedding_grads(sync.main_grad if sync is not None else None)
    finally:
        model.config.no_sync_func = None
    for param in held:
        sync.release(param)
    return stats if ps.is_pipeline_last_stage() else []

