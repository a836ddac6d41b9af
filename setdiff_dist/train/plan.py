"""A dry run of a training layout: megatron's own model layout on the meta device, under a fake
process group of the full world size, and what each rank will hold in memory.

Nothing is allocated and no GPU is needed: for each pipeline stage the model of one of its
ranks is built on the ``meta`` device (every tensor- and data-parallel rank of a stage holds
the same shapes), which gives the exact parameters megatron places on it. The memory per rank
follows from how our DeepSpeed engine keeps them (:func:`setdiff_dist.train.engine.
deepspeed_config`):

- weights in the compute dtype (bf16 or fp32), partitioned over DP under ZeRO-3;
- gradients: the fp32 accumulator of every parameter (bf16 at ZeRO-1 with ``overlap_comm``:
  each bf16 gradient is folded into it and freed as it comes; without: BF16_Optimizer keeps the
  bf16 gradients too) and the reduced fp32 partition; partitioned over DP from ZeRO-2 on; plus
  DeepSpeed's contiguous gradient-reduction bucket of ``zero.reduce_bucket_size`` fp32 elements
  (two with ``overlap_comm``), which it allocates whole;
- optimizer: AdamW's two fp32 moments and the fp32 master weights that DeepSpeed's ZeRO
  optimizers keep (in fp32 training too), partitioned over DP from ZeRO-1 on; none of these on
  the device when ``zero.offload_optimizer=cpu``;
- activations of one micro-batch of ``data.micro_batch_size`` sequences at the model's sequence
  length (``2L`` for set diffusion, ``L`` for a causal LM): per layer, the tensors the layer
  saves for its backward (:func:`layer_bytes`, calibrated against real layers: norms, rotary
  tables, queries, keys and values, what the attention kernel keeps, the MLP's activations),
  the shared attention mask, and on the last stage the fp32 logits the cross-entropy keeps;
  under 1F1B, stage ``s`` of ``PP`` holds ``min(PP - s, micro-batches)`` micro-batches at
  once; recompute keeps layer inputs instead; the optimizer step's transients (the flattened
  fp32 gradient partition and AdamW's temporaries) take the activations' place at the step.

The figures are estimates of the peak (a real step adds the allocator's slack and transient
buffers); ``benchmarks/plan_vs_measured.py`` compares them with a real one-step run.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from setdiff_dist.diffusion.kinds import order_of
from setdiff_dist.errors import SetdiffError

GiB = 2 ** 30


class PlanError(SetdiffError, ValueError):
    """A layout that cannot run; the message lists every problem."""


@dataclasses.dataclass
class StagePlan:
    stage: int
    ranks: str            # the global ranks of the stage, as a range
    layers: int
    params: int           # parameters on each rank of the stage
    model_params: int     # the stage's share of the model (TP shards summed, tied copy out)
    weights: float        # bytes per rank
    gradients: float
    optimizer: float
    activations: float
    runtime: float = 0.0  # on a GPU: the CUDA context, NCCL's buffers, the allocator's slack

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.runtime


@dataclasses.dataclass
class Plan:
    world_size: int
    tensor: int
    pipeline: int
    data: int
    micro_batches: int     # per rank per optimizer step
    model_params: int      # the whole model (tied embedding counted once)
    stages: list
    context: int = 1       # context-parallel size (``data`` counts those ranks too)
    groups: int = 0        # process groups megatron creates (every rank takes part in each)
    param_tensors: int = 0  # parameter tensors on a rank (DeepSpeed broadcasts each at start)

    def table(self, device_memory: Optional[float] = None) -> str:
        dp = (f"DP {self.data}" if self.context == 1 else
              f"CP {self.context} x DP {self.data // self.context} (ZeRO over {self.data})")
        head = (f"layout: world {self.world_size} = TP {self.tensor} x PP {self.pipeline} x {dp}; "
                f"{self.micro_batches} micro-batch(es) per rank per step\n"
                f"model: {self.model_params / 1e6:,.1f}M parameters; per stage "
                + " + ".join(f"{s.model_params / 1e6:,.1f}M" for s in self.stages)
                + f" = {sum(s.model_params for s in self.stages) / 1e6:,.1f}M\n")
        gpu = any(s.runtime for s in self.stages)
        rows = [f"{'stage':>5} {'ranks':>11} {'layers':>6} {'params/rank':>12} {'weights':>8} "
                f"{'grads':>8} {'optim':>8} {'activ':>8} " + (f"{'runtime':>8} " if gpu else "")
                + f"{'total':>8}"]
        over = []
        for s in self.stages:
            flag = ""
            if device_memory is not None and s.total > device_memory * GiB:
                flag = "  OUT OF MEMORY"
                over.append(s.stage)
            rows.append(f"{s.stage:>5} {s.ranks:>11} {s.layers:>6} {s.params / 1e6:>11.1f}M "
                        + " ".join(f"{v / GiB:7.2f}G" for v in (
                            s.weights, s.gradients, s.optimizer, s.activations,
                            *((s.runtime,) if gpu else ()), s.total)) + flag)
        tail = ""
        if device_memory is not None:
            tail = (f"\nstages over the {device_memory:g} GiB per device: "
                    f"{', '.join(map(str, over))}" if over else
                    f"\nevery stage fits in {device_memory:g} GiB per device")
        if gpu:
            tail += ("\n(runtime: the CUDA context, NCCL's buffers and the allocator's slack; "
                     "activations with the GPU's fused norms)")
        return head + "\n".join(rows) + tail

    def predict(self, cfg, hardware: str, system=None):
        """The scale model's step on this layout (:func:`setdiff_dist.train.scale.predict`),
        with the start-up it takes to reach the first one."""
        from setdiff_dist.train.scale import predict, startup_seconds, step_flows

        groups = {f.group for s in range(self.pipeline) for f in step_flows(cfg, self, s)
                  if f.size > 1}
        sizes = {"tensor": self.tensor, "data": self.data, "context": self.context,
                 "pipeline": 2, "embedding": 2}
        startup = startup_seconds(self.groups, [sizes[g] for g in groups] + [self.world_size],
                                  self.world_size, max(s.params for s in self.stages),
                                  self.param_tensors, cfg, hardware)
        return predict(cfg, self, hardware, system, startup)


def _layout_problems(cfg, world_size: int) -> list[str]:
    from setdiff_dist.config_checks import validate, world_problems

    return list(validate(cfg)) + world_problems(cfg, world_size)


def _stage_model(cfg, world_size: int, stage: int):
    """The meta-device model of the first rank of pipeline stage ``stage``, under a fake
    process group (megatron's rank order tp-cp-ep-dp-pp: the stage's ranks are contiguous)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from setdiff_dist.model.transformer import SetDiffusionTransformer, transformer_config
    from setdiff_dist.parallel import cpu_compat

    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    if dist.is_initialized():
        raise PlanError("a dry run builds its own (fake) process group: run it in a process "
                        "that has none (setdiff-train --dry-run, not under torchrun)")
    cpu_compat.apply()
    dist.init_process_group("fake", store=FakeStore(), rank=stage * (world_size // pp),
                            world_size=world_size)
    groups = []  # the size of each group this rank is in, or 0 for one it only helps create
    real_new_group = dist.new_group

    def counted(*args, **kwargs):
        group = real_new_group(*args, **kwargs)
        member = group not in (None, dist.GroupMember.NON_GROUP_MEMBER)
        groups.append(dist.get_world_size(group) if member else 0)
        return group

    try:
        dist.new_group = counted
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                         pipeline_model_parallel_size=pp,
                                         context_parallel_size=cfg.parallel.context,
                                         create_gloo_process_groups=False)
        finally:
            dist.new_group = real_new_group
        config = transformer_config(cfg.model, tensor=tp, pipeline=pp,
                                    sequence_parallel=cfg.parallel.sequence_parallel)
        with torch.device("meta"):
            model = SetDiffusionTransformer(cfg.model, config,
                                            pre_process=ps.is_pipeline_first_stage(),
                                            post_process=ps.is_pipeline_last_stage())
        params, model_params, tensors = 0, 0, 0
        for name, p in model.named_parameters():
            params += p.numel()
            tensors += 1
            if name.startswith("output_layer") and model.tie and pp > 1:
                continue  # the last stage's copy of the tied embedding
            model_params += p.numel() * (tp if getattr(p, "tensor_model_parallel", False)
                                         else 1)
        # megatron pads the vocabulary rows to a multiple of 128 x TP: count the real ones
        pad = model.padded_vocab - (cfg.model.vocab_size + 1)
        h = cfg.model.hidden_size
        if model.pre_process:
            model_params -= pad * h
        if model.post_process and not model.tie:
            model_params -= pad * h
        return params, model_params, len(model.decoder.layers), {
            "groups": len(groups), "member_of": sum(1 for n in groups if n),
            "tensors": tensors}
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()


def layer_bytes(cfg, fused_norm: bool = False) -> float:
    """The tensors one layer saves for its backward for one micro-batch on one rank, as
    measured on the layers (tests/test_plan.py holds it to the saved-tensor bytes of real layers
    within 10% across backend x precision x recompute x GQA x CP). Under full recompute: its
    input (:func:`kept_by_layer` is then what a recomputed layer holds in the backward)."""
    if cfg.train.recompute != "full":
        return kept_by_layer(cfg, fused_norm)
    _, tokens, e, sp = _micro_batch(cfg)
    return tokens * cfg.model.hidden_size / sp * e


def _micro_batch(cfg) -> tuple:
    """``(seq, tokens, e, sp)`` of one micro-batch on a rank: the model's sequence length, the
    rank's tokens (its context-parallel share), the compute dtype's bytes, and the split of
    norms and residuals over TP (sequence parallelism)."""
    par = cfg.parallel
    seq = order_of(cfg.order).model_len(cfg.data.seq_len)
    return (seq, cfg.data.micro_batch_size * seq // par.context,
            2 if cfg.train.precision in ("bf16", "fp8") else 4,
            par.tensor if par.sequence_parallel else 1)


def kept_by_layer(cfg, fused_norm: bool = False) -> float:
    """What a layer that runs its forward with autograd keeps for its backward (no recompute,
    or the core attention recomputed under selective recompute):

    - each RMSNorm: its input in fp32 (a cast under bf16), the inverse RMS, the normalized
      input in fp32, and its output, the next linear's input (LayerNorm: the input, mean and
      inverse deviation, the output);
    - the rotary cos / sin of queries and keys, ``[s, b, 1, head_dim]`` four times, per layer;
    - the rotated queries; with as many key/value heads as query heads the rotated keys and the
      fused qkv output (the values are a view of it), with grouped-query attention the keys
      and values expanded to the query heads; under context parallelism the whole sequence's
      keys and values instead (gathered, then expanded);
    - the kernel: ``sdpa`` its output (the projection's input too), its log-sum-exp and a copy
      of the mask in the compute dtype (each layer converts the boolean mask); ``permuted_causal``
      the outputs of its two causal calls, their merge in fp32 and log-sum-exps, and the
      projection's input; ``flex`` / ``te`` their output and log-sum-exp; selective recompute
      keeps only the projection's input;
    - SwiGLU (megatron's fused function, which recomputes the activation in the backward):
      fc1's output and fc2's input (3 x ffn; unfused it was 5); GeLU: fc1's output and the
      activation (2 x ffn)."""
    m, par = cfg.model, cfg.parallel
    tp, cp = par.tensor, par.context
    seq, tokens, e, sp = _micro_batch(cfg)
    h, heads, groups = m.hidden_size, m.num_attention_heads, m.num_query_groups
    dh, ffn = m.head_dim, m.ffn_hidden_size
    q, kv = heads * dh / tp, groups * dh / tp
    gqa = groups < heads
    norm = (8 * h + 4 + e * h) if m.normalization == "rmsnorm" else (2 * e * h + 8)
    if fused_norm:  # a GPU's fused kernel (torch's CUDA RMSNorm, TE, apex): input, 1/rms, output
        norm = 2 * e * h + (4 if m.normalization == "rmsnorm" else 8)
    per_token = 2 * norm / sp                # both norms
    per_token += 4 * dh * e                  # rotary cos / sin
    per_token += q * e                       # rotated queries
    if cp > 1:   # the whole sequence's keys and values, per rank's token: x cp
        per_token += 2 * (q if gqa else kv) * e * cp
    elif gqa:
        per_token += 2 * q * e               # keys and values expanded to the query heads
    else:
        per_token += kv * e + (q + 2 * kv) * e   # rotated keys, the fused qkv output
    backend = m.attention_backend
    selective = cfg.train.recompute == "selective"
    if backend == "permuted_causal":
        per_token += q * e                   # the projection's input
        if not selective:
            per_token += q * e + 2 * q + 12 * heads / tp   # halves, fp32 merge, lse
    else:
        per_token += q * e                   # the output (the projection's input)
        if not selective:
            per_token += 4 * heads / tp      # log-sum-exp
            if backend == "sdpa" and not order_of(cfg.order).causal_lm:
                per_token += seq * e         # this layer's copy of the mask: a row per token
            elif backend == "sdpa" and cfg.parallel.context > 1:
                # the causal LM's rows under CP: one copy for every sample of the micro-batch
                per_token += seq * e / cfg.data.micro_batch_size
    per_token += (3 if m.activation == "swiglu" else 2) * ffn / tp * e
    if m.hidden_dropout > 0:
        per_token += 2 * h / sp              # two boolean dropout masks
    return tokens * per_token


def activation_bytes(cfg, layers: int, first: bool, last: bool,
                     fused_norm: bool = False) -> float:
    """The tensors one micro-batch leaves saved for the backward on a rank of a stage with
    ``layers`` layers (see the module docstring and :func:`layer_bytes`)."""
    m, par, d = cfg.model, cfg.parallel, cfg.data
    tp, cp, h = par.tensor, par.context, m.hidden_size
    order = order_of(cfg.order)
    seq, tokens, b, sp = _micro_batch(cfg)
    saved = layer_bytes(cfg, fused_norm) * layers
    if cfg.train.recompute == "full":    # layer inputs, plus one chunk's layers live
        chunk = min(cfg.train.recompute_num_layers, layers)
        saved += kept_by_layer(cfg, fused_norm) * chunk
    mask = 0 if m.attention_backend in ("flex", "permuted_causal") or order.causal_lm \
        else d.micro_batch_size * seq * seq    # the dense boolean mask, shared by the layers
    if cp > 1:
        # this rank's rows of the mask (one for all samples in the permuted form and the
        # causal LM's)
        mask = (1 if m.attention_backend == "permuted_causal" or order.causal_lm
                else d.micro_batch_size) \
            * (seq // cp) * seq
    if first:
        saved += tokens * h * b                # the embedding output
    if last:
        out = d.micro_batch_size * d.seq_len   # the logits are computed on L tokens
        vocab = (m.vocab_size + 1) / tp
        saved += tokens * h / sp * b + out * h * b   # final norm input, output layer input
        saved += out * vocab * 4               # the fp32 softmax the cross-entropy keeps
        saved += out * vocab * (b + 4)         # peak: the logits and their fp32 gradient
    return saved + mask


def rank_memory(cfg, params: int, dp: int, in_flight: int, activations: float) -> dict:
    """Bytes a rank holding ``params`` parameters needs at its peak in steady state (see the
    module docstring), by kind: ``weights``, ``gradients`` (with DeepSpeed's reduction
    buckets), ``optimizer`` (fp32 master weights and moments, and the EMA of the weights when
    ``train.ema_decay`` keeps one) and ``activations``, which here
    is the larger of the backward's saved tensors and the optimizer step's transients (the
    flattened fp32 gradient partition and AdamW's temporaries: the activations are gone by
    then)."""
    z = cfg.zero
    bf16 = cfg.train.precision in ("bf16", "fp8")
    b = 2 if bf16 else 4
    weights = b * params / (dp if z.stage == 3 else 1)
    if z.stage == 0:
        grads, optim, step = 4.0 * params, 8.0 * params, 4.0 * params
    else:
        optim = 12.0 * params / dp       # fp32 master weights and two moments, sharded
        step = 8.0 * params / dp         # the flat fp32 gradient partition, AdamW temporaries
        bf16_optimizer = z.stage == 1 and bf16 and not z.overlap_comm
        if bf16_optimizer:               # BF16_Optimizer: bf16 grads, fp32 accumulation
            grads = 6.0 * params
        elif z.stage == 1:               # the full fp32 accumulator (bf16: each bf16 gradient
            # is folded into it and freed as it comes), and the reduced fp32 partition
            grads = 4.0 * params + (4.0 * params / dp if bf16 else 0.0)
        else:                            # reduced into fp32 partitions during the backward
            grads = 4.0 * params / dp
        if not bf16_optimizer:           # the contiguous gradient-reduction bucket(s)
            grads += 4.0 * z.reduce_bucket_size * (2 if z.overlap_comm else 1)
        if z.stage == 3:                 # parameter prefetch and the gathered working set
            grads += b * 5e7
    if z.offload_optimizer == "cpu":
        optim, step = 0.0, 0.0
    if cfg.train.ema_decay:  # the fp32 average of what the rank holds of each weight
        optim += 4.0 * params / (dp if z.stage == 3 else 1)
    return {"weights": weights, "gradients": grads, "optimizer": optim,
            "activations": max(in_flight * activations, step)}


def gpu_runtime(cfg, world_size: int, allocated: float) -> float:
    """What a GPU process holds beyond its tensors: the CUDA context, the buffers of each NCCL
    communicator it uses (tensor, data, context, pipeline neighbours, tied embedding, the world
    group), and the caching allocator's slack over ``allocated`` bytes
    (:data:`setdiff_dist.train.scale.CONSTANTS` ``memory.*``)."""
    from setdiff_dist.train.scale import const

    par = cfg.parallel
    tp, pp, cp = par.tensor, par.pipeline, par.context
    dp = world_size // (tp * pp)
    comms = sum(1 for n in (tp, dp, cp, world_size) if n > 1)
    comms += 2 if pp > 1 else 0   # the stages before and after (send / receive)
    comms += 1 if pp > 1 and cfg.model.tie_embeddings else 0
    nccl = comms * const("memory.nccl_channels") * 2 * const("memory.nccl_per_channel_peer")
    return const("memory.cuda_context") + nccl + const("memory.fragmentation") * allocated


def plan(cfg, world_size: int, hardware: Optional[str] = None) -> Plan:
    """The :class:`Plan` of ``cfg`` on ``world_size`` ranks; :class:`PlanError` lists the
    problems of a layout that cannot run. With ``hardware`` (a GPU of
    :data:`setdiff_dist.train.scale.HARDWARE`) the memory is a GPU's: fused norms, and the
    runtime's share (:func:`gpu_runtime`); without, the tensors alone, as on the CPU."""
    problems = _layout_problems(cfg, world_size)
    if problems:
        raise PlanError("\n".join(f"  - {p}" for p in problems))
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    dp = world_size // (tp * pp)  # ZeRO shards over data x context-parallel ranks
    micro = cfg.data.global_batch_size // (cfg.data.micro_batch_size
                                           * (dp // cfg.parallel.context))
    stages, counts = [], {}
    gpu = hardware is not None
    for s in range(pp):
        params, model_params, layers, counts[s] = _stage_model(cfg, world_size, s)
        mem = rank_memory(cfg, params, dp, min(pp - s, micro),
                          activation_bytes(cfg, layers, s == 0, s == pp - 1, fused_norm=gpu))
        if gpu:
            mem["runtime"] = gpu_runtime(cfg, world_size, sum(mem.values()))
        per_stage = world_size // pp
        stages.append(StagePlan(s, f"{s * per_stage}-{(s + 1) * per_stage - 1}", layers, params,
                                model_params, **mem))
    return Plan(world_size, tp, pp, dp, micro, _whole_model(cfg), stages, cfg.parallel.context,
                counts[0]["groups"], max(c["tensors"] for c in counts.values()))


def _whole_model(cfg):
    """The model's own parameter count (one rank, one stage), to check the stages against."""
    whole = dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, tensor=1, pipeline=1, sequence_parallel=False, virtual_pipeline=None,
        context=1))
    return _stage_model(whole, 1, 0)[1]
