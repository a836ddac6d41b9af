"""A small dense transformer in pure torch: the numerical reference of set diffusion.

It takes explicit positions (rotary embeddings on each token's original position) and an
explicit boolean attention mask, so the same weights can run the vectorized ``[clean ; noisy]``
training forward, a per-position sequential forward, or a plain causal LM. The megatron-core
model is checked against it; the tests and the CPU demo use it directly. Single process, fp32.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, base: float = 10000.0):
    """cos and sin ``[B, N, head_dim]`` for integer ``positions [B, N]`` (rotate-half layout)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=positions.device) / head_dim))
    f = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, H, N, D]`` rotated by ``cos/sin [B, N, D]``."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, h, cos, sin, allowed):
        B, N, C = h.shape
        q, k, v = self.qkv(self.attn_norm(h)).view(B, N, 3, self.heads, C // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        mask = allowed[:, None] if allowed.dim() == 3 else allowed
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.proj(a.transpose(1, 2).reshape(B, N, C))
        gate, up = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class ReferenceTransformer(nn.Module):
    """Pre-norm RMSNorm / RoPE / SwiGLU transformer. Token id ``vocab_size`` is ``[MASK]``."""

    def __init__(self, vocab_size: int, hidden_size: int = 64, num_layers: int = 2,
                 num_heads: int = 4, ffn_hidden_size: int | None = None,
                 rotary_base: float = 10000.0, eps: float = 1e-5, init_std: float = 0.02):
        super().__init__()
        self.vocab_size, self.rotary_base = vocab_size, rotary_base
        self.head_dim = hidden_size // num_heads
        self.embed = nn.Embedding(vocab_size + 1, hidden_size)
        self.blocks = nn.ModuleList(_Block(hidden_size, num_heads,
                                           ffn_hidden_size or 4 * hidden_size, eps)
                                    for _ in range(num_layers))
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=init_std)

    @property
    def mask_id(self) -> int:
        return self.vocab_size

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, N, vocab]`` for ``tokens``/``positions [B, N]`` and an ``allowed`` mask
        ``[B, N, N]`` or ``[N, N]`` (True = the query may attend the key)."""
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rotary_base)
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, cos, sin, allowed)
        # tied output projection over the real vocabulary ([MASK] is never a prediction)
        return self.norm(h) @ self.embed.weight[: self.vocab_size].t()


class AsTrainingModel(nn.Module):
    """A :class:`ReferenceTransformer` called as the objective calls the training model
    (:mod:`setdiff_dist.objective`): ``(tokens, positions, mask, logits_from)`` with megatron's
    dense ``mask [B, 1, N, N]`` (True = may attend), logits ``[N - logits_from, B, vocab]``."""

    def __init__(self, model: ReferenceTransformer):
        super().__init__()
        self.model = model
        self.mask_id = model.mask_id

    def forward(self, tokens, positions, mask, logits_from: int = 0):
        allowed = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool,
                             device=tokens.device).tril() if mask is None else mask[:, 0]
        return self.model(tokens, positions, allowed)[:, logits_from:].transpose(0, 1).contiguous()


def sequential_ar_nll(model: ReferenceTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """``-log p(x_l | x_<l)`` ``[B, L]`` (float64) from the model used one position at a time:
    the clean prefix ``x_<l`` then a ``[MASK]`` query at ``l``, causal in position order. The
    other side of the AR identity of docs/method.md §4.3."""
    B, L = tokens.shape
    out = torch.empty(B, L, dtype=torch.float64)
    for l in range(L):
        t = torch.cat([tokens[:, :l], torch.full((B, 1), model.mask_id)], dim=1)
        pos = torch.arange(l + 1, device=tokens.device).expand(B, l + 1)
        causal = torch.ones(l + 1, l + 1, dtype=torch.bool, device=tokens.device).tril()
        logits = model(t, pos, causal)[:, -1].double()
        out[:, l] = -F.log_softmax(logits, -1).gather(1, tokens[:, l:l + 1])[:, 0]
    return out
