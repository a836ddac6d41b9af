"""The set-causal attention mask over ``[clean ; noisy]`` (docs/method.md §3), in three forms.

Convention: ``True`` means *the query may attend the key* (torch SDPA's boolean convention;
megatron-core's is the opposite, and the model layer converts). Rows are queries, columns keys;
indices ``0..L-1`` are the clean copy, ``L..2L-1`` the noisy copy, both at the original positions.

| query \\ key | clean ``m``      | noisy ``m``       |
| clean ``l``  | ``s_m <= s_l``   | never             |
| noisy ``l``  | ``s_m <  s_l``   | ``s_m == s_l``    |

1. :func:`set_causal_mask`: the dense per-sample boolean mask, ``[B, 2L, 2L]`` (the reference).
2. :func:`set_causal_mask_mod`: the same rule as a FlexAttention ``mask_mod``.
3. :func:`permuted_singleton_mask`: for singleton sets, both copies gathered into reveal order
   (:func:`to_reveal_order`) see one static mask, identical for every sample.
"""

from __future__ import annotations

import torch


def set_causal_mask(set_ids: torch.Tensor) -> torch.Tensor:
    """Dense ``[B, 2L, 2L]`` boolean mask from set ids ``[B, L]``."""
    s_q = set_ids[:, :, None]
    s_k = set_ids[:, None, :]
    clean_rows = torch.cat([s_k <= s_q, torch.zeros_like(s_k <= s_q)], dim=2)
    noisy_rows = torch.cat([s_k < s_q, s_k == s_q], dim=2)
    return torch.cat([clean_rows, noisy_rows], dim=1)


def set_causal_rule(q_idx, kv_idx, s_q, s_k, L):
    """The set-causal mask (True = may attend) of query / key indices into ``[clean ; noisy]``
    (``L`` tokens a half) whose sets are ``s_q`` / ``s_k``; broadcasts (FlexAttention's
    ``mask_mod``, context parallelism's rows)."""
    q_noisy = q_idx >= L
    k_noisy = kv_idx >= L
    return ((~q_noisy & ~k_noisy & (s_k <= s_q)) | (q_noisy & ~k_noisy & (s_k < s_q))
            | (q_noisy & k_noisy & (s_k == s_q)))


def step_mask(set_ids: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """The set-causal rule over the tokens of one decoding step, ``[n, n]`` (True = may
    attend) for tokens whose sets are ``set_ids [n]`` (numbered in reveal order) and which are
    clean (``noisy`` False: committed tokens, context) or noisy (``[MASK]`` queries): clean
    tokens see the clean tokens of their set and earlier ones, a noisy token the clean tokens
    of earlier sets and the noisy tokens of its own set, as in training (the KV cache holds
    the earlier sets)."""
    n = set_ids.shape[-1]
    i = torch.arange(n, device=set_ids.device)
    idx = torch.where(noisy, i + n, i)  # (an index into [clean ; noisy] of n tokens a half)
    return set_causal_rule(idx[:, None], idx[None, :], set_ids[:, None], set_ids[None, :], n)


def _half_index(idx, L):
    return torch.where(idx >= L, idx - L, idx)


def set_causal_mask_mod(set_ids: torch.Tensor):
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` for set ids ``[B, L]`` (kept on the
    device of ``set_ids``); for ``torch.nn.attention.flex_attention.create_block_mask``."""
    L = set_ids.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        s_q = set_ids[b, _half_index(q_idx, L)]
        s_k = set_ids[b, _half_index(kv_idx, L)]
        return set_causal_rule(q_idx, kv_idx, s_q, s_k, L)

    return mask_mod


def permuted_singleton_mask(seq_len: int, device=None) -> torch.Tensor:
    """The static ``[2L, 2L]`` mask of the permuted singleton form: in reveal order, clean ``i``
    sees clean ``j <= i``; noisy ``i`` sees clean ``j < i`` and noisy ``i`` itself (the set-causal
    mask of set ids ``0..L-1``)."""
    return set_causal_mask(torch.arange(seq_len, device=device)[None])[0]


def permuted_singleton_mask_mod(seq_len: int):
    """The static permuted mask as a FlexAttention ``mask_mod`` (one block mask for all samples)."""
    L = seq_len

    def mask_mod(b, h, q_idx, kv_idx):
        return set_causal_rule(q_idx, kv_idx, _half_index(q_idx, L), _half_index(kv_idx, L), L)

    return mask_mod


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """``[L, L]`` lower-triangular mask of the plain causal LM."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def to_reveal_order(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Gather ``x [B, L, ...]`` into reveal order: row ``i`` becomes position ``order[:, i]``."""
    idx = order.reshape(order.shape + (1,) * (x.dim() - 2)).expand(order.shape + x.shape[2:])
    return torch.gather(x, 1, idx)


def from_reveal_order(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Undo :func:`to_reveal_order`."""
    idx = order.reshape(order.shape + (1,) * (x.dim() - 2)).expand(order.shape + x.shape[2:])
    return torch.empty_like(x).scatter_(1, idx, x)
