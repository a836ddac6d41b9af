"""Layer specs (megatron-core's ModuleSpec pattern): one transformer layer, two variants.

- ``local``: megatron's pure-torch layer (``get_gpt_layer_local_spec``): column/row-parallel
  linears, torch norms, or apex's fused LayerNorm where apex is installed (NVIDIA containers).
- ``te``: megatron's Transformer Engine layer (fused norm + linear, FP8-capable), GPU only.

Both get an arbitrary attention mask and the core attention of ``model.attention_backend``;
nothing else differs, so swapping kernels needs no new class.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType

from .attention import core_attention_class


def _require_te():
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
    except Exception as exc:
        raise RuntimeError("model.layer_spec=te needs Transformer Engine on a CUDA machine "
                           "(pip install '.[gpu]', or the docker image); use layer_spec=local "
                           "on CPUs") from exc
    return get_gpt_layer_with_transformer_engine_spec


class SequenceParallelTorchNorm:
    """torch's RMSNorm / LayerNorm for megatron's local spec under sequence parallelism (which
    megatron's own ``WrappedTorchNorm`` refuses): the same module and parameter names, with the
    weights marked ``sequence_parallel`` as apex's and TE's norms mark theirs, so their
    gradients are summed over the TP group (the norm sees only this rank's tokens)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm = (torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm)(
            hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


class ReplicatedTorchNorm:
    """torch's norm for the QK-norm of the local spec under sequence parallelism: it sees whole
    sequences (after the QKV all-gather), so it is not marked."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        return (torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm)(
            hidden_size, eps=eps)


def layer_spec(model_cfg, sequence_parallel: bool = False):
    """The ModuleSpec of one layer for a :class:`setdiff_dist.config.ModelConfig`."""
    norm = "RMSNorm" if model_cfg.normalization == "rmsnorm" else "LayerNorm"
    if model_cfg.layer_spec == "te":
        spec = _require_te()(qk_layernorm=model_cfg.qk_norm)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(normalization=norm, qk_layernorm=model_cfg.qk_norm)
        if sequence_parallel:
            spec.submodules.input_layernorm = SequenceParallelTorchNorm
            spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
            if model_cfg.qk_norm:
                sub = spec.submodules.self_attention.submodules
                sub.q_layernorm = sub.k_layernorm = ReplicatedTorchNorm
    attention = spec.submodules.self_attention
    attention.params = dict(attention.params, attn_mask_type=AttnMaskType.arbitrary)
    attention.submodules.core_attention = core_attention_class(model_cfg.attention_backend)
    return spec


def final_norm_class(model_cfg, sequence_parallel: bool = False):
    """The block's final norm, chosen explicitly (megatron's default would pick apex's fused
    LayerNorm where apex exists, which rejects RMSNorm)."""
    if model_cfg.layer_spec == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    if sequence_parallel:
        return SequenceParallelTorchNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm
