"""The set-diffusion transformer on megatron-core layers (tensor- and pipeline-parallel).

- a vocab-parallel embedding with one extra row, ``[MASK]`` (id ``vocab_size``); the table is
  padded to a multiple of ``128 x TP`` and the padded and ``[MASK]`` logits are never predicted;
- megatron's ``TransformerBlock`` of layers from a :mod:`~setdiff_dist.model.specs` layer spec
  (column/row-parallel attention and MLP, RMSNorm or LayerNorm, SwiGLU or GELU) with the
  attention backend of the config and an arbitrary mask;
- rotary embeddings on each token's *original* position, given per token (so both halves of
  ``[clean ; noisy]``, or a permuted order, carry the right positions);
- an output projection tied to the embedding or not; no time conditioning.

Weights are drawn per rank, in blocks seeded by the *global* parameter name, the block and a seed
(:func:`init_weights_`), so every tensor / pipeline layout starts from identical weights
without any rank drawing a full tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from setdiff_dist.checkpoint.sharding import merge_shards, split_shard

from .dims import padded_vocab_size, rotary_inv_freq
from .specs import final_norm_class, layer_spec

FP8_RECIPES = {"delayed": "delayed", "current": "tensorwise"}  # ours -> megatron's names


def transformer_config(model_cfg, tensor: int = 1, pipeline: int = 1,
                       params_dtype: torch.dtype = torch.float32,
                       sequence_parallel: bool = False,
                       fp8_recipe: str | None = None,
                       compute_dtype: torch.dtype | None = None,
                       recompute: str = "none", recompute_num_layers: int = 1,
                       fused_activation: bool = True) -> TransformerConfig:
    """The megatron ``TransformerConfig`` of a :class:`setdiff_dist.config.ModelConfig`.
    ``fp8_recipe`` (``delayed`` or ``current``) turns on FP8: megatron then runs each layer of
    the Transformer Engine spec under TE's ``fp8_autocast`` with that recipe (hybrid E4M3/E5M2).
    ``compute_dtype`` is the dtype the weights are cast to for training (bf16 under DeepSpeed's
    bf16, default ``params_dtype``): pipeline stages send and receive activations in it.
    ``recompute`` is megatron's activation recompute: ``selective`` recomputes each layer's core
    attention (our attention backends included) in the backward, ``full`` whole layers in
    uniform chunks of ``recompute_num_layers``."""
    m = model_cfg
    compute_dtype = compute_dtype or params_dtype
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        kv_channels=m.head_dim, qk_layernorm=m.qk_norm,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization="RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.activation == "swiglu",
        activation_func=F.silu if m.activation == "swiglu" else F.gelu,
        # megatron's fused SwiGLU: its autograd function keeps only fc1's output and recomputes
        # the activation in the backward, where the unfused one keeps five ffn-wide tensors per
        # token (three with it): the largest share of a layer's activations
        bias_activation_fusion=fused_activation and m.activation == "swiglu",
        add_bias_linear=False, init_method_std=m.init_std,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype, pipeline_dtype=compute_dtype,
        bf16=compute_dtype == torch.bfloat16,
        # weights are created on the CPU and then set by init_weights_ (layout-invariant)
        use_cpu_initialization=True, perform_initialization=False,
        # the p2p sync is a torch.cuda.synchronize(); batched isend/irecv are waited on anyway
        batch_p2p_sync=torch.cuda.is_available(),
        recompute_granularity=None if recompute == "none" else recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=recompute_num_layers if recompute == "full" else None,
        recompute_modules=["core_attn"],
        fp8="hybrid" if fp8_recipe else None,
        fp8_recipe=FP8_RECIPES[fp8_recipe] if fp8_recipe else "delayed",
        fp8_amax_history_len=16 if fp8_recipe == "delayed" else 1,
        fp8_amax_compute_algo="max",
    )


class SetDiffusionTransformer(MegatronModule):
    """One pipeline stage of the model (the whole model when PP = 1).

    ``forward(tokens [b, s], positions [b, s], attention_mask)`` returns vocab-parallel logits
    ``[s', b, V_pad / TP]`` on the last stage (``s' = s - logits_from``), hidden states
    ``[s, b, h]`` elsewhere. ``attention_mask`` is what the backend takes: a boolean
    ``[b, 1, s, s]`` (True = may attend; ``te``: True = masked out), a FlexAttention block mask,
    or None (causal / permuted).
    """

    def __init__(self, model_cfg, config: TransformerConfig, pre_process: bool = True,
                 post_process: bool = True):
        super().__init__(config)
        self.model_cfg = model_cfg
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process, self.post_process = pre_process, post_process
        self.vocab_size = model_cfg.vocab_size
        self.mask_id = model_cfg.vocab_size
        self.tie = model_cfg.tie_embeddings
        tp = config.tensor_model_parallel_size
        self.padded_vocab = padded_vocab_size(self.vocab_size, tp)
        if pre_process:
            self.embedding = tensor_parallel.VocabParallelEmbedding(
                self.padded_vocab, config.hidden_size, init_method=config.init_method,
                config=config)
        n_layers = get_num_layers_to_build(config, pp_rank=ps.get_pipeline_model_parallel_rank())
        spec = layer_spec(model_cfg, sequence_parallel=config.sequence_parallel)
        self.decoder = TransformerBlock(
            config, TransformerBlockSubmodules(
                layer_specs=[spec] * n_layers,
                layer_norm=final_norm_class(model_cfg, config.sequence_parallel)),
            pre_process=pre_process, post_process=post_process)
        self.sequence_parallel = config.sequence_parallel
        if post_process:
            # with sequence parallelism the hidden states are gathered before the noisy half is
            # sliced off, so the output projection itself sees the whole (sliced) sequence
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, self.padded_vocab,
                config=dataclasses.replace(config, sequence_parallel=False),
                init_method=config.init_method, bias=False, gather_output=False,
                skip_weight_param_allocation=pre_process and self.tie)
            if self.tie and not pre_process:
                # the last stage's copy of the tied embedding: its gradient is the first
                # stage's (summed between them), so the gradient norm for clipping counts it
                # once, on the first stage (DeepSpeed skips parameters marked so)
                self.output_layer.weight.ds_pipe_replicated = True
        _mark_tensor_parallel(self)
        _sum_partial_grads_over_tensor_parallel_ranks(self)
        self.register_buffer("inv_freq", rotary_inv_freq(model_cfg, config.kv_channels),
                             persistent=False)

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.bfloat16()``...: the rotary frequencies stay float32, computed again
        from the config where the move cast them (positions times frequencies is a float32
        product; frequencies rounded to bf16 shift the angles of positions in the thousands by
        radians). The engines cast parameters only; this holds for a caller's own cast."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = rotary_inv_freq(self.model_cfg, self.config.kv_channels).to(
                self.inv_freq.device)
        return self

    # -- pipeline plumbing -------------------------------------------------------------------
    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def output_weight(self):
        """The weight of the output projection (the embedding's, when tied on this stage)."""
        if self.tie and self.pre_process:
            return self.embedding.weight
        return self.output_layer.weight

    def tied_embedding_weight(self):
        """This stage's copy of the embedding tied across pipeline stages, or None (also when
        the output projection is not tied to the embedding)."""
        if not self.tie or ps.get_pipeline_model_parallel_world_size() == 1 \
                or not ps.is_rank_in_embedding_group():
            return None
        return self.embedding.weight if self.pre_process else self.output_layer.weight

    def sync_tied_embedding_grads(self, main_grad=None) -> None:
        """All-reduce the tied embedding gradient between the first and last pipeline stages
        (``main_grad(weight)``: where the gradient accumulates, default ``weight.grad``)."""
        w = self.tied_embedding_weight()
        if w is None:
            return
        grad = main_grad(w) if main_grad is not None else w.grad
        if grad is not None:
            torch.distributed.all_reduce(grad, group=ps.get_embedding_group())

    # -- forward -------------------------------------------------------------------------------
    def rotary(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotary frequencies ``[s, b, 1, head_dim]`` for per-token positions ``[b, s]``."""
        f = positions.t().to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        return torch.cat([f, f], dim=-1)[:, :, None, :]

    def forward(self, tokens, positions, attention_mask=None, logits_from: int = 0):
        hidden = None
        if self.pre_process:
            hidden = self.embedding(tokens).transpose(0, 1).contiguous()
            if self.sequence_parallel:  # each TP rank keeps its slice of the sequence
                hidden = tensor_parallel.scatter_to_sequence_parallel_region(hidden)
        hidden = self.decoder(hidden, attention_mask=attention_mask,
                              rotary_pos_emb=self.rotary(positions))
        if not self.post_process:
            return hidden
        if self.sequence_parallel:
            # the whole sequence again; the output projection's input copy all-reduces the
            # gradient over TP, so the gather's backward only splits it
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False)
        logits, _ = self.output_layer(hidden[logits_from:], weight=self.output_weight())
        return self._mask_unpredictable(logits)

    def _mask_unpredictable(self, logits):
        """[MASK] and the padding rows of the vocabulary are never predicted."""
        local = logits.size(-1)
        start = ps.get_tensor_model_parallel_rank() * local
        if start + local <= self.vocab_size:
            return logits
        ids = torch.arange(start, start + local, device=logits.device)
        return logits.masked_fill(ids >= self.vocab_size, torch.finfo(logits.dtype).min)


def build_model(model_cfg, config: TransformerConfig, seed: Optional[int], construct=None,
                gathered=None) -> SetDiffusionTransformer:
    """This rank's pipeline stage, initialized from (seed, global parameter names); with
    ``seed=None`` left uninitialized, for a caller that sets every weight itself.

    ``construct`` is a context the modules are built in and ``gathered(param)`` one in which a
    parameter is whole (the trainer passes DeepSpeed's ``zero.Init`` and
    ``GatheredParameters`` under ZeRO-3, so that each parameter is partitioned over the
    data-parallel ranks as it is created and initialized one at a time)."""
    with construct if construct is not None else contextlib.nullcontext():
        model = SetDiffusionTransformer(model_cfg, config,
                                        pre_process=ps.is_pipeline_first_stage(),
                                        post_process=ps.is_pipeline_last_stage())
    if seed is not None:
        init_weights_(model, seed, gathered)
    return model


# -- layout-invariant initialization ---------------------------------------------------------

def _mark_tensor_parallel(model: SetDiffusionTransformer) -> None:
    """Give every TP-sharded weight megatron's ``tensor_model_parallel`` / ``partition_dim`` /
    ``partition_stride`` attributes. megatron sets them only inside its own initializers, which
    :func:`init_weights_` replaces; DeepSpeed's grad norm and our sharding read them."""
    gated = model.config.gated_linear_unit
    for name, module in model.named_modules():
        mode = parallel_mode(module)
        if isinstance(module, tensor_parallel.VocabParallelEmbedding):
            dim, stride = 0, 1
        elif mode == "column":
            # a gated fc1 holds [gate shard ; up shard] on each rank: the full [gate ; up] is
            # split with stride 2 (megatron's layout, under the local and the TE spec alike)
            dim, stride = 0, 2 if (gated and name.endswith("linear_fc1")) else 1
        elif mode == "row":
            dim, stride = 1, 1
        else:
            continue
        if getattr(module, "weight", None) is not None:
            tensor_parallel.set_tensor_model_parallel_attributes(module.weight, True, dim, stride)


def _sum_partial_grads_over_tensor_parallel_ranks(model) -> None:
    """Parameters that are replicated over TP ranks but see only part of the computation there
    get each backward's gradient summed over the TP group before it accumulates (a tensor hook,
    so every ZeRO stage and the fp32 buffers see the full gradient), as megatron's
    ``finalize_model_grads`` does once per step:

    - QK-norm weights (each rank normalizes only its own heads), whenever TP > 1;
    - with sequence parallelism, the norms that run on a rank's slice of the sequence (the
      parameters megatron and TE mark ``sequence_parallel``, and ours)."""
    params = dict(model.named_parameters())
    for name in partial_over_tensor_parallel(model):
        params[name].register_hook(_all_reduce_over_tensor_parallel)


def partial_over_tensor_parallel(model) -> list[str]:
    """The names of the parameters whose gradient each TP rank sees only part of (see
    :func:`_sum_partial_grads_over_tensor_parallel_ranks`); none at TP = 1."""
    if ps.get_tensor_model_parallel_world_size() == 1:
        return []
    return [name for name, p in model.named_parameters()
            if ".q_layernorm." in name or ".k_layernorm." in name
            or (model.config.sequence_parallel and getattr(p, "sequence_parallel", False))]


def _all_reduce_over_tensor_parallel(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    torch.distributed.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
    return grad


def parallel_mode(module) -> str | None:
    """``"column"``, ``"row"`` or None: how a linear layer is split over tensor-parallel ranks,
    for megatron's own layers and Transformer Engine's (which say it in ``parallel_mode``)."""
    if isinstance(module, tensor_parallel.ColumnParallelLinear):
        return "column"
    if isinstance(module, tensor_parallel.RowParallelLinear):
        return "row"
    mode = getattr(module, "parallel_mode", None)
    return mode if mode in ("column", "row") else None


# Transformer Engine's layer spec fuses the pre-attention and pre-MLP norms into the following
# linear layer; their weights take the local spec's names, so that checkpoints, exports, the HF
# adapter and the layout-invariant initialization see one model whatever the spec.
TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def layout_free_name(name: str, global_layer: int | None = None, tied: bool = False) -> str:
    """The layout- and spec-independent name of a parameter called ``name`` in its stage:
    the layer index replaced by ``global_layer``, TE's fused norm weights by the local spec's
    names, a tied output weight by the embedding."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        if global_layer is not None:
            parts[2] = str(global_layer)
        rest = ".".join(parts[3:])
        if rest in TE_FUSED_NORMS:
            parts = parts[:3] + TE_FUSED_NORMS[rest].split(".")
    if name == "output_layer.weight" and tied:
        return "embedding.weight"
    return ".".join(parts)


def global_name(model: SetDiffusionTransformer, name: str) -> str:
    """The layout-independent name of a parameter of ``model`` (see :func:`layout_free_name`)."""
    parts = name.split(".")
    layer = None
    if parts[:2] == ["decoder", "layers"]:
        layer = model.decoder.layers[int(parts[2])].layer_number - 1
    return layout_free_name(name, layer, model.tie)


def shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This TP rank's slice of ``full`` for ``param`` (per its megatron attributes)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    return split_shard(full, ps.get_tensor_model_parallel_rank(),
                       ps.get_tensor_model_parallel_world_size(), param.partition_dim,
                       getattr(param, "partition_stride", 1))


INIT_BLOCK = 64  # slices (rows, or columns of row-parallel weights) drawn from one seed


def _local_ranges(param: torch.Tensor, dim: int) -> list[tuple[int, int]]:
    """The global index ranges ``[lo, hi)`` along ``dim`` that this rank's ``param`` holds, in
    its local order (megatron's strided split: rank r holds part r of each of ``stride``
    blocks)."""
    if not getattr(param, "tensor_model_parallel", False):
        return [(0, param.shape[dim])]
    size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    stride = getattr(param, "partition_stride", 1)
    chunk = param.shape[dim] // stride
    return [((j * size + rank) * chunk, (j * size + rank + 1) * chunk) for j in range(stride)]


def init_weights_(model: SetDiffusionTransformer, seed: int, gathered=None) -> None:
    """Normal(0, std) matrices (output projections of each residual branch scaled by
    ``1/sqrt(2 * num_layers)``, as in Megatron-LM), ones for norm weights, zeros for biases.

    Each rank draws only what it holds, where it holds it, and still every layout starts from
    the same weights: a matrix is cut along its tensor-parallel dimension (rows; columns of
    row-parallel weights) into blocks of :data:`INIT_BLOCK` slices, block ``b`` of a tensor is
    drawn from a generator seeded by (seed, global name, b), and a rank draws the blocks that
    overlap its slices. The real rows of the vocabulary tables (vocabulary and ``[MASK]``) are
    drawn independently of the TP padding, which is zero. Blocks are drawn on the CPU and
    copied where the parameter lives, so a model built on a GPU (ZeRO-3's partitions) starts
    from the same weights as one built on the CPU (a CUDA generator draws other numbers).
    ``gathered(param)``: a context in which a partitioned parameter is whole (see
    :func:`build_model`)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            with gathered(p) if gathered is not None else contextlib.nullcontext():
                _init_parameter(model, global_name(model, name), p, seed)


def _init_parameter(model: SetDiffusionTransformer, gname: str, p: torch.Tensor,
                    seed: int) -> None:
    """Draw this rank's part of the parameter ``gname`` into ``p`` (see :func:`init_weights_`)."""
    if gname.endswith("bias"):
        p.zero_()
        return
    if p.dim() == 1:
        p.fill_(1.0)
        return
    std = model.config.init_method_std
    if gname.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std = std / math.sqrt(2.0 * model.config.num_layers)
    real = model.vocab_size + 1 if gname in ("embedding.weight", "output_layer.weight") else None
    dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else 0
    other = p.shape[1 - dim]
    key = zlib.crc32(f"{seed}/{gname}".encode())
    at = 0  # local index of the current range's first slice
    for lo, hi in _local_ranges(p, dim):
        for b in range(lo // INIT_BLOCK, (hi - 1) // INIT_BLOCK + 1):
            # drawn on the CPU whatever the device: a CUDA generator gives other numbers, and
            # ZeRO-3 builds its partitions on the GPU where the other engines build on the CPU
            g = torch.Generator().manual_seed((key + b * 0x9E3779B9) & 0xFFFFFFFF)
            block = (torch.randn(INIT_BLOCK, other, generator=g) * std).to(p.device)
            first = b * INIT_BLOCK
            if real is not None and real < first + INIT_BLOCK:
                block[max(0, real - first):] = 0.0  # TP padding rows
            a, e = max(lo, first), min(hi, first + INIT_BLOCK)
            part = block[a - first:e - first]
            p.narrow(dim, at + a - lo, e - a).copy_(part if dim == 0 else part.t())
        at += hi - lo


def unshard(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The full tensor from every TP rank's ``local`` slice (inverse of :func:`shard`)."""
    if not getattr(param, "tensor_model_parallel", False):
        return local
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, local.contiguous(),
                                 group=ps.get_tensor_model_parallel_group())
    return merge_shards(parts, param.partition_dim, getattr(param, "partition_stride", 1))
