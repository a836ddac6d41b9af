"""What the training model and the decode-time model (:mod:`setdiff_dist.inference.lean`) share
of the architecture's arithmetic: the padded vocabulary and the rotary frequencies. Plain torch:
inference imports this without megatron-core."""

from __future__ import annotations

import math

import torch

VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int) -> int:
    """Rows of the embedding table: the vocabulary plus ``[MASK]``, rounded up for TP."""
    m = VOCAB_PAD_MULTIPLE * tensor_parallel_size
    return (vocab_size + 1 + m - 1) // m * m


def rotary_inv_freq(model_cfg, head_dim: int) -> torch.Tensor:
    """The rotary frequencies ``[head_dim / 2]`` of ``model.rotary_base`` and
    ``model.rope_scaling``, computed as Hugging Face's Llama / Qwen3 compute them (same formula,
    same float32 operations) so that imported checkpoints see the positions they were trained on:

    - ``none``: ``base ** (-2i / head_dim)``;
    - ``linear``: divided by ``rope_scaling_factor`` (the same as dividing the positions);
    - ``llama3``: Llama 3.1's interpolation: wavelengths longer than
      ``original_max / low_freq_factor`` are divided by the factor, shorter than
      ``original_max / high_freq_factor`` kept, and the band between blended smoothly.
    """
    m = model_cfg
    inv_freq = 1.0 / (m.rotary_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32)
                                        / head_dim))
    if m.rope_scaling == "linear":
        return inv_freq / m.rope_scaling_factor
    if m.rope_scaling == "llama3":
        factor, low, high = m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor
        old_context = m.rope_original_max_positions
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        return torch.where(medium, blended, scaled)
    return inv_freq
