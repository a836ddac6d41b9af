"""Forward and backward of a global batch through megatron-core's pipeline schedules.

One function for every layout: with PP = 1 megatron runs its no-pipelining schedule (gradient
accumulation over micro-batches), with PP > 1 its 1F1B schedule, whose p2p messages are the
hidden states ``[s, b, h]`` (``s = 2L`` for set diffusion). A ``step`` callable builds each
micro-batch's inputs on every stage (deterministically, so all stages agree) and returns the
model output with a loss function for the last stage.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func


def forward_backward(model, microbatches: Iterable, seq_len: int, micro_batch_size: int,
                     step: Callable, forward_only: bool = False,
                     loss_scale: Optional[float | torch.Tensor] = None,
                     main_grad: Optional[Callable] = None) -> list[dict]:
    """Run megatron's schedule. ``step(module, microbatch) -> (output, terms_fn)`` where
    ``terms_fn(logits) -> (nll_sum, tokens)`` on the last stage.

    Without ``loss_scale`` each micro-batch's loss is its mean per token (megatron's
    normalization); with it, the loss is ``nll_sum * loss_scale`` before megatron's division by
    the number of micro-batches (the trainer passes ``n_micro * dp / global_tokens`` for an exact
    global per-token mean). Returns per-micro-batch ``{"nll_sum", "tokens"}`` on the last stage
    (an empty list elsewhere); tied-embedding gradients are synchronized after the backward
    (in ``main_grad(param)``, the tensor that accumulates a parameter's gradient, when given:
    the fp32 buffer under bf16)."""
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

    stats = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(microbatches), model=[model],
        num_microbatches=len(microbatches), seq_length=seq_len,
        micro_batch_size=micro_batch_size, forward_only=forward_only)
    if not forward_only:
        model.sync_tied_embedding_grads(main_grad)
    return stats if ps.is_pipeline_last_stage() else []

