"""Data parallelism by megatron-core's ``DistributedDataParallel`` and distributed optimizer
(``zero.implementation=megatron``, ZeRO-1): the path whose collectives do not grow with DP.

DeepSpeed's ZeRO-1/2 optimizer keeps each parameter group as one flat buffer cut into one
contiguous partition per data-parallel rank, so its gradient reduction is a ``reduce`` per
(bucket, owner) and the parameters' gather a broadcast per (owner, bucket): O(DP) collectives a
step (about 4,000 for 1.3B at DP 1024; ``benchmarks/scale_model.py``). Megatron's buffers are
cut bucket by bucket over all DP ranks, so each bucket is one reduce-scatter (launched in the
last micro-batch's backward as the bucket's gradients are ready) and one all-gather (launched by
the next forward's pre-hooks, one bucket ahead of the layers that need it): a constant number
of collectives at the reduce-scatter + all-gather byte bound.

:class:`MegatronEngine` gives the trainer the surface of DeepSpeed's engine it uses (the
module, ``backward`` / ``step`` per micro-batch with DeepSpeed's accumulation convention, the
optimizer's ``param_groups``, the LR scheduler, the gradient norm, skipped steps, save and load
of its checkpoint files), so the training loop, the metrics and the checkpoint format around it
stay one. Its optimizer state is saved per rank as each parameter's fragment (its range in the
flattened parameter, the fp32 weights, AdamW's moments): the form DeepSpeed's universal
checkpoint is assembled from.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from megatron.core import parallel_state as ps

from .fragments import FragmentCheckpoints
from .schedule import decayed


def bucket_elements(cfg, dp: int) -> int:
    """Elements per bucket: ``zero.reduce_bucket_size``, at least ``zero.min_bucket_per_rank``
    per data-parallel rank (megatron's rule)."""
    return max(cfg.zero.reduce_bucket_size, cfg.zero.min_bucket_per_rank * dp)


class MegatronEngine(FragmentCheckpoints):
    """The trainer's engine on megatron-core's DDP + distributed optimizer (see the module's
    docstring). ``gradient_accumulation_steps``: micro-batches per optimizer step;
    ``schedule``: the LR multiplier of each optimizer step (``engine.lr_multiplier``, passed in
    so that this module does not import the engine that builds it)."""

    def __init__(self, cfg, model, gradient_accumulation_steps: int, schedule):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate
        from megatron.core.optimizer_param_scheduler import ParamGroupOverride

        from setdiff_dist.model.transformer import global_name
        from setdiff_dist.parallel import cpu_compat

        cpu_compat.apply_distributed_optimizer()
        self.cfg = cfg
        bf16 = cfg.train.precision == "bf16"
        if bf16:
            # the parameters only, as DeepSpeed casts them: buffers (the rotary frequencies)
            # stay fp32
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)
        z, o = cfg.zero, cfg.optimizer
        # the tied embedding's copies on the first and last pipeline stages in a bucket of
        # their own, cut the same way on both: their DP-reduced shards can then be summed
        tied = model.tied_embedding_weight()
        if tied is not None:
            tied.shared_embedding = True
            # ... counted once in the gradient norm (on the first stage, megatron's rule)
            tied.shared = not model.pre_process
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        self.ddp = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=z.overlap_comm,
                overlap_param_gather=z.overlap_param_gather, use_distributed_optimizer=True,
                bucket_size=bucket_elements(cfg, dp), average_in_collective=False), model)
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.adamw_weight_decay,
            adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_eps=o.eps,
            clip_grad=o.grad_clip, bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=True, overlap_param_gather=z.overlap_param_gather)
        # weight decay by the layout-free name (the last stage's tied output weight is the
        # embedding)
        names = {id(p): global_name(model, n) for n, p in model.named_parameters()}
        no_decay = ParamKey(with_name_predicate=ParamWithNamePredicate(
            name="setdiff_no_decay", fn=lambda p, n: not decayed(p, names.get(id(p), n))))
        self.optimizer = get_megatron_optimizer(
            opt_cfg, [self.ddp], config_overrides={no_decay: ParamGroupOverride(wd_mult=0.0)},
            use_gloo_process_groups=False)
        self._apply_weight_decay()
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer.optimizer, schedule)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.device = next(model.parameters()).device
        self.skipped_steps = 0
        self._micro = 0
        self._synced = False  # this step's reduction already waited for
        self._norm: Optional[float] = None
        self.checkpoint_engine = self._checkpoint_engine()

    # -- what the trainer reads ---------------------------------------------------------------
    @property
    def module(self):
        return self.ddp.module

    def __call__(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def __getattr__(self, name):
        # the model's own attributes (mask_id, ...), as DeepSpeed's engine passes them through
        ddp = self.__dict__.get("ddp")
        if ddp is None:
            raise AttributeError(name)
        return getattr(ddp.module, name)

    def _apply_weight_decay(self) -> None:
        """AdamW's decay per group: megatron's ``wd_mult`` is read by its own scheduler only."""
        for g in self.optimizer.param_groups:
            g["weight_decay"] = self.cfg.optimizer.adamw_weight_decay * g.get("wd_mult", 1.0)

    _after_load = _apply_weight_decay

    def get_global_grad_norm(self) -> Optional[float]:
        return self._norm

    # -- a step, as DeepSpeed's engine runs it ----------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward (``loss`` scaled as for DeepSpeed, which divides by the
        accumulation steps); only the last one of a step reduces, bucket by bucket."""
        self._micro += 1
        scaled = loss / self.gradient_accumulation_steps
        if self._micro < self.gradient_accumulation_steps:
            with self.ddp.no_sync():
                scaled.backward()
        else:
            scaled.backward()

    def allreduce_gradients(self) -> None:
        """(The reduction ran in the backward's hooks; :meth:`step` waits for it.)"""

    @torch.no_grad()
    def step(self) -> None:
        """After every micro-batch; at the last one of a step: wait for the reduce-scatters,
        the gradient norm over the shards, a non-finite norm skips the update (as DeepSpeed's
        overflow check does), else clip, AdamW on this rank's shard and the LR schedule. The
        parameters' all-gather follows in the next forward's pre-hooks."""
        if 0 < self._micro < self.gradient_accumulation_steps:
            return  # (0: megatron's pipeline schedule ran the backward)
        self._micro = 0
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        if not self._synced:
            self.ddp.finish_grad_sync()
            # the tied embedding's stages sum their (identically sharded, reduced) gradients
            self.module.sync_tied_embedding_grads(lambda w: w.main_grad)
        self._synced = False
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        self._norm = norm
        if math.isfinite(norm):
            clip = self.cfg.optimizer.grad_clip
            if clip > 0:
                for opt in self.optimizer.chained_optimizers:
                    params = opt.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, max_norm=clip, total_norm=norm)
            self.optimizer.step_with_ready_grads()
            self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def whole_weights(self) -> None:
        """Every parameter gathered now (before anything reads them outside a forward)."""
        self.ddp.start_param_sync(force_sync=True)

    def drop_gradients(self) -> None:
        """This step's gradients zeroed (a non-finite loss): the reduction in flight first."""
        if (self._micro == 0 or self._micro >= self.gradient_accumulation_steps) \
                and not self._synced:
            self.ddp.finish_grad_sync()
            self._synced = True
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def time_gradient_reduction(self, timers) -> None:
        """The reduction's wait as the ``grad_reduce`` phase, each bucket's gather wait as
        ``param_gather``."""
        self.ddp.finish_grad_sync = timers.timed("grad_reduce", self.ddp.finish_grad_sync)
        for group in self.ddp.bucket_groups:
            group.finish_param_sync = timers.timed("param_gather", group.finish_param_sync)

    # -- checkpoints ------------------------------------------------------------------------------
    def _fragments(self) -> dict:
        """This rank's optimizer state: per parameter (global name) its range in the flattened
        parameter and the fp32 weights and AdamW moments of that range."""
        from setdiff_dist.model.transformer import global_name

        model = self.module
        names = {p: global_name(model, n) for n, p in model.named_parameters()}
        out = {}
        for opt in self.optimizer.chained_optimizers:
            for p in opt.model_param_gbuf_map:
                rng = opt._get_model_param_range_map(p)["param"]
                tensors = opt._get_main_param_and_optimizer_states(p)
                out[names[p]] = {"start": rng.start, "end": rng.end, "shape": tuple(p.shape),
                                 # (the last stage's copy of the tied embedding)
                                 "copy": bool(getattr(p, "shared_embedding", False)
                                              and getattr(p, "shared", False)),
                                 **{k: (v.detach().clone() if torch.is_tensor(v) else v)
                                    for k, v in tensors.items()}}
        return out

    @torch.no_grad()
    def _load_shards(self, shard) -> None:
        """Every parameter's shard on this rank: ``shard(param, global name, its range in the
        flattened parameter)`` gives the fp32 weights and AdamW moments of that range and the
        AdamW step (or None); then the model's (bf16) weights from the fp32 ones, as after a
        step, gathered whole."""
        from setdiff_dist.model.transformer import global_name

        model = self.module
        names = {p: global_name(model, n) for n, p in model.named_parameters()}
        for opt in self.optimizer.chained_optimizers:
            opt.init_state_fn(opt.optimizer, opt.config)  # (torch's AdamW makes it lazily)
            for p in opt.model_param_gbuf_map:
                tensors, step = shard(p, names[p], opt._get_model_param_range_map(p)["param"])
                opt._set_main_param_and_optimizer_states(p, tensors)
                if step is not None:  # (AdamW's step count, one per shard)
                    group, order = opt.model_param_group_index_map[p]
                    main = opt.optimizer.param_groups[group]["params"][order]
                    opt.optimizer.state[main]["step"] = torch.as_tensor(
                        step, dtype=torch.float32).clone()
            opt._copy_main_params_to_model_params()
        self.whole_weights()


@contextlib.contextmanager
def no_grad_sync(engine):
    """Inside, the micro-batches only accumulate (megatron's schedule's ``no_sync_func``)."""
    with engine.ddp.no_sync():
        yield
