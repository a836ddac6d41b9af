"""Context parallelism (``parallel.context = N``): each sequence's tokens split over the N ranks
of a context-parallel group, so that one sequence need not fit one device.

The all-gather form, as Llama 3 trained its long contexts: every rank keeps the hidden states of
its share of the model's tokens through all layers (embeddings, MLPs and norms are per token);
attention gathers the keys and values of the whole sequence from the group (differentiably:
their gradients go back to the ranks that own them) and each rank's queries attend them under
their own rows of the mask. Because the rows are those of the full mask, it is exact for every
order and backend form that has rows (``sdpa``: the set-causal mask; ``permuted_causal``: the
static mask of the reveal order), and the result equals CP=1 up to float reordering. Keys and
values are ``2 x tokens x kv-heads x head_dim`` per layer, small next to attention's own work
at the lengths where CP is used; ring exchange (keys passed around the group, partial results
merged by log-sum-exp) would overlap that traffic with compute, and is the next step.

The split is the zigzag of causal ring attention: the ``L`` positions of a half in ``2N``
chunks, rank ``r`` keeping chunks ``r`` and ``2N - 1 - r``, so that under a causal mask every
rank has the same work. Set diffusion splits its two halves ``[clean ; noisy]`` alike (in
reveal order for ``permuted_causal``, in position order for ``sdpa``): each rank holds the
clean and the noisy copies of the same tokens, and scores the noisy ones
(docs/design.md §6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def size() -> int:
    """The context-parallel size (1 without megatron's groups)."""
    from setdiff_dist.parallel import megatron_groups

    ps = megatron_groups()
    return 1 if ps is None else ps.get_context_parallel_world_size()


def zigzag(n: int, cp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s positions of ``range(n)``: chunks ``rank`` and ``2 cp - 1 - rank`` of
    ``2 cp`` equal chunks (``n`` a multiple of ``2 cp``)."""
    if n % (2 * cp):
        raise ValueError(f"{n} positions cannot be split into {2 * cp} equal chunks for "
                         f"context parallelism {cp}")
    c = n // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


@dataclass
class Split:
    """This rank's share of a model sequence of ``halves x n`` tokens."""

    half: torch.Tensor   # [n / cp] this rank's positions within a half
    local: torch.Tensor  # [halves n / cp] its indices into the model sequence
    keys: torch.Tensor   # [halves n] the model index of each gathered key (rank 0's first)


def split(n: int, halves: int) -> Split:
    """The zigzag split of a model sequence of ``halves`` halves of ``n`` tokens each."""
    from megatron.core import parallel_state as ps

    cp, rank = size(), ps.get_context_parallel_rank()

    def of(r):
        z = zigzag(n, cp, r)
        return torch.cat([z + h * n for h in range(halves)])

    return Split(half=zigzag(n, cp, rank), local=of(rank),
                 keys=torch.cat([of(r) for r in range(cp)]))


class ContextMask(torch.Tensor):
    """What attention receives under context parallelism: this rank's rows of the mask
    (``rows [b or 1, 1, local tokens, all tokens]``, True = may attend), the keys in the order
    :func:`gather` assembles them. A tensor (the rows themselves, marked by their type), so that
    megatron's activation recompute, which saves a layer's inputs with ``save_for_backward``,
    can keep it; its copies (``detach``, ``to``) stay one."""

    @staticmethod
    def __new__(cls, rows: torch.Tensor):
        return torch.Tensor._make_subclass(cls, rows)

    def __init__(self, rows: torch.Tensor):  # (the tensor was made in __new__)
        pass

    @property
    def rows(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


class _Gather(torch.autograd.Function):
    """All-gather along dim 0; the backward sums the gradient over the group and returns each
    rank its slice (a reduce-scatter; on gloo, which has none, an all-reduce and a slice).
    torch's differentiable all_gather is not used: on gloo its backward exchanges the gradient
    slices with all_to_all, which reads strided (e.g. transposed) gradients wrongly."""

    @staticmethod
    def forward(ctx, t, group):
        import torch.distributed as dist

        ctx.group, ctx.rows = group, t.shape[0]
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        rank, n = dist.get_rank(ctx.group), ctx.rows
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            out = grad.new_empty((n,) + grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[rank * n:(rank + 1) * n].contiguous(), None


def gather(t: torch.Tensor) -> torch.Tensor:
    """``t [s, ...]`` of every rank of the context-parallel group, concatenated along the
    sequence (rank 0's first); the backward returns each rank its slice's gradient, summed over
    the ranks that used it."""
    from megatron.core import parallel_state as ps

    return _Gather.apply(t, ps.get_context_parallel_group())


def attend(query, key, value, mask: ContextMask, scale=None, dropout_p: float = 0.0):
    """Attention of this rank's queries ``[s, b, np, hn]`` over the whole sequence's keys and
    values (gathered from the group), under the rows of the mask: ``[b, np, s, hn]``."""
    import torch.nn.functional as F

    k, v = gather(key), gather(value)
    rep = query.size(2) // k.size(2)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.rows, dropout_p=dropout_p,
                                          scale=scale)
