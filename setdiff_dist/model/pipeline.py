"""Forward and backward of a global batch through megatron-core's pipeline schedules.

One function for every layout: with PP = 1 megatron runs its no-pipelining schedule (gradient
accumulation over micro-batches), with PP > 1 its 1F1B schedule, whose p2p messages are the
``[2L, b, h]`` hidden states of the ``[clean ; noisy]`` sequence. Each micro-batch is
``(tokens [b, L], OrderSample)``; every stage rebuilds the same inputs from it, and the last stage
computes the NELBO. Loss normalization is megatron's: each micro-batch's NELBO per target token,
averaged over the micro-batches.
"""

from __future__ import annotations

from typing import Iterable

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from setdiff_dist.diffusion import nelbo

from .forward import set_diffusion_inputs, set_diffusion_nll


def set_diffusion_forward_backward(model, microbatches: Iterable, seq_len: int,
                                   micro_batch_size: int, backend: str,
                                   forward_only: bool = False) -> list[dict]:
    """Run the schedule over ``microbatches``; returns, on the last stage, one dict per
    micro-batch with its NELBO sum and target-token count (an empty list elsewhere). Gradients are
    accumulated in ``.grad``; with tied embeddings and PP > 1 they are synchronized here."""
    microbatches = list(microbatches)

    def forward_step(data_iterator, module):
        tokens, sample = next(data_iterator)
        inp = set_diffusion_inputs(tokens, sample, module.mask_id, backend)
        out = module(inp.tokens, inp.positions, inp.attention_mask, inp.logits_from)

        def loss_func(logits):
            bound = nelbo(set_diffusion_nll(logits, tokens, inp), sample)
            stats = {"nelbo_sum": bound.total.detach().clone(),
                     "tokens": bound.tokens.detach().clone()}
            return bound.total, bound.tokens.to(torch.int), stats

        return out, loss_func

    schedule = get_forward_backward_func()
    stats = schedule(forward_step_func=forward_step, data_iterator=iter(microbatches),
                     model=[model], num_microbatches=len(microbatches),
                     seq_length=2 * seq_len, micro_batch_size=micro_batch_size,
                     forward_only=forward_only)
    if not forward_only:
        model.sync_tied_embedding_grads()
    return stats if ps.is_pipeline_last_stage() else []
