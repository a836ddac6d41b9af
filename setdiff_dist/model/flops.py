"""Parameter counts and training FLOPs of the set-diffusion transformer (for MFU).

Conventions (those of Megatron-LM and PaLM): a matmul of ``m x k`` by ``k x n`` costs ``2mkn``
FLOPs; a training step costs 3x the forward (backward = 2x forward); activation recomputation,
norms, softmax and element-wise work are not counted.

A set-diffusion step runs the transformer on ``2L`` tokens (``[clean ; noisy]``) but needs logits
only on the noisy half, and its attention does useful work on about ``L^2`` query-key pairs
(clean-clean causal ``L(L+1)/2``, noisy-clean strictly causal ``L(L-1)/2``, noisy-noisy the
diagonal ``L``), twice the ``L(L+1)/2`` pairs of a causal LM over ``L`` tokens. So its FLOPs per
sequence are ~2x the causal LM's: that is the floor of the step-time ratio.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamCount:
    embedding: int     # input embedding, including the [MASK] row
    per_layer: int
    layers: int        # all transformer layers
    output: int        # untied output projection (0 when tied)
    final_norm: int

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.output + self.final_norm


def _layer(m):
    """(hidden, head_dim, heads, matmul params of one layer, norm params of one layer)."""
    h, heads = m.hidden_size, m.num_attention_heads
    d, groups, ffn = m.head_dim, m.num_query_groups, m.ffn_hidden_size
    per_norm = 2 if m.normalization == "layernorm" else 1  # LayerNorm adds a bias
    attn = h * heads * d + 2 * h * groups * d + heads * d * h
    mlp = (3 if m.activation == "swiglu" else 2) * h * ffn
    norms = per_norm * (2 * h + (2 * d if getattr(m, "qk_norm", False) else 0))
    return h, d, heads, attn + mlp, norms


def param_count(m) -> ParamCount:
    """Parameters of a :class:`setdiff_dist.config.ModelConfig` (no linear biases; norms have a
    weight, and a bias for LayerNorm)."""
    h, _, _, matmul, norms = _layer(m)
    return ParamCount(embedding=(m.vocab_size + 1) * h, per_layer=matmul + norms,
                      layers=m.num_layers * (matmul + norms),
                      output=0 if m.tie_embeddings else m.vocab_size * h,
                      final_norm=h * (2 if m.normalization == "layernorm" else 1))


def forward_flops_per_sequence(m, seq_len: int, causal_lm: bool = False) -> float:
    """Forward FLOPs for one sequence of ``seq_len`` data tokens: the set-diffusion forward on
    ``2L`` tokens, or (``causal_lm=True``) the plain causal LM on ``L`` tokens."""
    h, d, heads, matmul, _ = _layer(m)
    L = seq_len
    tokens = L if causal_lm else 2 * L
    dense = 2 * tokens * m.num_layers * matmul
    # attention scores and the weighted sum: 2 matmuls over head_dim per useful (q, k) pair
    pairs = L * (L + 1) / 2 if causal_lm else L * L + L
    attention = m.num_layers * 2 * 2 * heads * d * pairs
    logits = 2 * L * h * m.vocab_size  # only the predicting half needs logits
    return float(dense + attention + logits)


def training_flops_per_token(m, seq_len: int, causal_lm: bool = False) -> float:
    """Training FLOPs (forward + backward) per *data* token, for MFU:
    ``MFU = tokens_per_s * training_flops_per_token / peak_flops``."""
    return 3.0 * forward_flops_per_sequence(m, seq_len, causal_lm) / seq_len
