"""The DeepSpeed engine, built from our config, over the megatron-core model.

- ZeRO stage, CPU offload, bf16, gradient clipping and accumulation come from the config
  sections ``zero``, ``optimizer``, ``train`` and ``data``; the optimizer is DeepSpeed's AdamW
  (torch's implementation unless the optimizer state is offloaded, which needs DeepSpeed's CPU
  Adam), with weight decay on matrices only; the LR schedule is ours (warm-up, then constant,
  cosine or linear), stepped by the engine and saved in its checkpoints.
- DeepSpeed sees megatron's groups through :class:`MegatronMPU`, so its data-parallel group is
  megatron's and tensor-parallel shards are neither averaged nor double-counted in the grad norm.
- With pipeline parallelism megatron's schedule runs the micro-batches and DeepSpeed is told the
  whole per-rank batch is one micro-batch (ZeRO 0/1 only; the config rejects 2/3).
"""

from __future__ import annotations

import contextlib
import importlib
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from setdiff_dist.train.optimizer_state import optimizer_form
from setdiff_dist.train.schedule import decayed, lr_multiplier


class MegatronMPU:
    """What DeepSpeed asks an ``mpu`` for, answered from megatron's ``parallel_state``.

    ``get_model_parallel_rank`` is the *tensor*-parallel rank: DeepSpeed counts a replicated
    parameter in the grad norm only on model-parallel rank 0, and with PP > 1 a rank of the
    TP x PP group would drop the replicated parameters of the other stages. There is deliberately
    no ``initialize_sequence_parallel`` (ZeRO would then treat this as a sequence-parallel mpu)."""

    get_model_parallel_group = staticmethod(ps.get_model_parallel_group)
    get_tensor_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_tensor_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_src_rank = staticmethod(ps.get_tensor_model_parallel_src_rank)
    get_pipeline_model_parallel_group = staticmethod(ps.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_world_size = staticmethod(
        ps.get_pipeline_model_parallel_world_size)
    get_pipeline_model_parallel_rank = staticmethod(ps.get_pipeline_model_parallel_rank)
    # DeepSpeed's data-parallel group is megatron's data x context-parallel one: the ranks that
    # hold the same weights and sum their gradients (context-parallel ranks hold the same samples
    # and each its share of the tokens); without context parallelism, the data-parallel group
    get_data_parallel_group = staticmethod(
        lambda: ps.get_data_parallel_group(with_context_parallel=True))
    get_data_parallel_world_size = staticmethod(
        lambda: ps.get_data_parallel_world_size(with_context_parallel=True))
    get_data_parallel_rank = staticmethod(
        lambda: ps.get_data_parallel_rank(with_context_parallel=True))

    @staticmethod
    def get_model_parallel_world_size():
        return dist.get_world_size(ps.get_model_parallel_group())

    @staticmethod
    def get_model_parallel_rank():
        return ps.get_tensor_model_parallel_rank()

    @staticmethod
    def get_data_parallel_group_ranks():
        return dist.get_process_group_ranks(
            ps.get_data_parallel_group(with_context_parallel=True))


def micro_batches_per_step(cfg, dp_size: int) -> int:
    per_rank = cfg.data.global_batch_size // dp_size
    if cfg.data.global_batch_size % dp_size or per_rank % cfg.data.micro_batch_size:
        raise ValueError(f"data.global_batch_size={cfg.data.global_batch_size} must be a multiple "
                         f"of data.micro_batch_size={cfg.data.micro_batch_size} x data-parallel "
                         f"size {dp_size}")
    return per_rank // cfg.data.micro_batch_size


def deepspeed_config(cfg, dp_size: int, load_universal: bool = False) -> dict:
    """The DeepSpeed JSON config of a run (``load_universal``: to resume a checkpoint saved at
    another data-parallel size, from its universal form). ``dp_size`` is the data-parallel size
    without context parallelism; DeepSpeed counts the context-parallel ranks as data-parallel
    ones (they sum gradients), so its batch is ``parallel.context`` times the global batch."""
    gas = micro_batches_per_step(cfg, dp_size)
    pipelined = cfg.parallel.pipeline > 1
    o, z = cfg.optimizer, cfg.zero
    offload = z.offload_optimizer == "cpu"
    zero = {"stage": z.stage, "overlap_comm": z.overlap_comm,
            "contiguous_gradients": True,
            # each gradient slice reduced to the rank that owns its partition (a reduce-scatter),
            # not all-reduced whole
            "use_multi_rank_bucket_allreduce": False,
            "reduce_bucket_size": z.reduce_bucket_size,
            "allgather_bucket_size": z.reduce_bucket_size}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if z.offload_params == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    params = {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
              "weight_decay": o.adamw_weight_decay}
    if not offload:
        params["torch_adam"] = True  # no JIT-compiled fused Adam
    return {
        "train_batch_size": cfg.data.global_batch_size * cfg.parallel.context,
        # megatron's schedule accumulates the micro-batches when pipelining
        "train_micro_batch_size_per_gpu": cfg.data.global_batch_size // dp_size if pipelined
        else cfg.data.micro_batch_size,
        "gradient_accumulation_steps": 1 if pipelined else gas,
        "gradient_clipping": o.grad_clip,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": zero,
        **precision_config(cfg.train.precision),
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        **({"checkpoint": {"load_universal": True}} if load_universal else {}),
    }


def precision_config(precision: str) -> dict:
    """DeepSpeed's precision keys. bf16 (and FP8, which runs the matmuls of TE layers in FP8
    inside bf16 training) keeps fp32 master weights in the ZeRO optimizer and, as Megatron does
    with its fp32 ``main_grad`` buffers, accumulates gradients over micro-batches and reduces
    them over data-parallel ranks in fp32:

    - ``data_types.grad_accum_dtype=fp32``: ZeRO-1 runs DeepSpeed's ``BF16_Optimizer`` (fp32
      gradient buffers), ZeRO-2/3 keep their gradient partitions in fp32;
    - ``bf16.immediate_grad_update``: each parameter's bf16 gradient is added to its fp32
      buffer by a hook as soon as autograd produces it, so the accumulation is fp32 also when
      megatron's pipeline schedule, not ``engine.backward``, runs the backward;
    - ``communication_data_type=fp32``: reductions in fp32.

    A non-finite gradient norm makes DeepSpeed skip the step (``bf16.check_grad_overflow``).
    ZeRO-0 has neither fp32 master weights nor fp32 accumulation in DeepSpeed; the config
    refuses it with bf16."""
    if precision not in ("bf16", "fp8"):
        return {"bf16": {"enabled": False}}
    return {"bf16": {"enabled": True, "immediate_grad_update": True,
                     "check_grad_overflow": True},
            "data_types": {"grad_accum_dtype": "fp32"},
            "communication_data_type": "fp32"}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the model computes in (DeepSpeed casts the weights to it): what pipeline stages
    send each other."""
    return torch.bfloat16 if precision in ("bf16", "fp8") else torch.float32


class GradientSync:
    """Where DeepSpeed keeps each parameter's gradient and when it reduces it, for the code that
    runs the backward itself (megatron's pipeline schedule) and for a skipped step.

    - :meth:`main_grad` is the tensor a parameter's gradient accumulates in over a step's
      micro-batches: ``BF16_Optimizer``'s fp32 buffer, the ZeRO optimizer's fp32 ``grad_accum``
      (bf16 weights), else ``param.grad``. Gradients synchronized by hand (the tied embedding
      across pipeline stages) are summed there.
    - With ``zero.overlap_comm`` on the ZeRO-1/2 optimizer, a parameter's gradient is reduced
      over the data-parallel ranks by a hook as soon as the last micro-batch's backward has
      produced it. :meth:`no_sync` is megatron's ``no_sync_func``: the micro-batches inside it
      only accumulate. :meth:`held` keeps some parameters out of that reduction until
      :meth:`release` (the tied embedding, whose stages must first sum their halves: an
      all-reduce between stages inside the hooks would deadlock the pipeline)."""

    def __init__(self, engine):
        self.engine = engine
        opt = engine.optimizer
        self.megatron = hasattr(engine, "ddp")  # (megatron_dp.MegatronEngine)
        self._buffers = {}
        if hasattr(opt, "bf16_groups") and hasattr(opt, "fp32_groups_gradients"):
            for i, group in enumerate(opt.bf16_groups):
                for j, p in enumerate(group):
                    self._buffers[id(p)] = opt.fp32_groups_gradients[i][j]
        self._grad_accum = bool(getattr(opt, "use_grad_accum_attribute", False))
        # the ZeRO optimizer reducing in its backward hooks (stage 2 always, stage 1 with
        # overlap_comm): at the gradient-accumulation boundary only, unless stage 2
        self.overlapped = bool(getattr(opt, "overlap_comm", False)) and \
            hasattr(opt, "reduce_ready_partitions_and_remove_grads") and \
            not getattr(opt, "partition_gradients", False)
        self._group_of = {}
        for i, group in enumerate(getattr(opt, "bit16_groups", [])):
            for p in group:
                self._group_of[id(p)] = i

    def main_grad(self, param):
        if self.megatron:
            return param.main_grad
        if id(param) in self._buffers:
            return self._buffers[id(param)]
        if self._grad_accum:
            return param.grad_accum
        return param.grad

    @contextlib.contextmanager
    def no_sync(self):
        if self.megatron:
            with self.engine.ddp.no_sync():
                yield
            return
        opt = self.engine.optimizer
        opt.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            opt.set_gradient_accumulation_boundary(True)

    @contextlib.contextmanager
    def held(self, params):
        """Inside, ``params``' gradients accumulate but are not reduced (DeepSpeed's own flag
        for gradients that are not final yet)."""
        if not self.overlapped:
            yield
            return
        for p in params:
            p.ds_grad_is_ready = False
        try:
            yield
        finally:
            for p in params:
                p.ds_grad_is_ready = True

    def release(self, param) -> None:
        """Reduce the held ``param``'s gradient now (into the current bucket)."""
        if self.overlapped:
            self.engine.optimizer.reduce_ready_partitions_and_remove_grads(
                param, self._group_of[id(param)])

    def drop(self) -> None:
        """Zero every gradient of this step, wherever DeepSpeed keeps it before or after the
        reduction (the parameters' ``.grad`` and ``grad_accum``, ``BF16_Optimizer``'s fp32
        buffers, the ZeRO optimizer's reduced partitions)."""
        engine = self.engine
        if hasattr(engine, "drop_gradients"):  # (megatron's or FSDP's engine)
            engine.drop_gradients()
            return
        for p in engine.module.parameters():
            for t in (p.grad, getattr(p, "grad_accum", None)):
                if t is not None:
                    t.zero_()
        if hasattr(engine.optimizer, "clear_hp_grads"):
            engine.optimizer.clear_hp_grads()
        for g in getattr(engine.optimizer, "averaged_gradients", {}).values():
            for t in (g if isinstance(g, (list, tuple)) else [g]):
                if t is not None:
                    t.zero_()


def time_gradient_reduction(engine, timers) -> None:
    """Time DeepSpeed's gradient reductions as the ``grad_reduce`` phase of ``timers``
    (:class:`setdiff_dist.train.timers.PhaseTimers`): the engine's reduction after the backward
    and, where the ZeRO optimizer reduces in its backward hooks, each bucket's."""
    if hasattr(engine, "time_gradient_reduction"):  # (megatron's or FSDP's engine)
        engine.time_gradient_reduction(timers)
        return
    engine.allreduce_gradients = timers.timed("grad_reduce", engine.allreduce_gradients)
    opt = engine.optimizer
    if hasattr(opt, "reduce_ipg_grads"):
        opt.reduce_ipg_grads = timers.timed("grad_reduce", opt.reduce_ipg_grads)


# the optimizer settings that define the LR of every step, and the other hyperparameters a
# checkpoint's optimizer state carries: on resume both come from this run's config
SCHEDULE_KEYS = ("optimizer.lr", "optimizer.min_lr", "optimizer.warmup_steps",
                 "optimizer.schedule", "train.steps")
HYPER_KEYS = ("optimizer.betas", "optimizer.eps", "optimizer.weight_decay",
              "optimizer.lr_free_weight_decay")


def follow_schedule(scheduler, cfg, step: int) -> list[float]:
    """Put ``scheduler`` (the ``LambdaLR`` over :func:`lr_multiplier`) and its optimizer's
    groups on this run's schedule at ``step`` (optimizer steps done): the LR of the next step
    is ``optimizer.lr x lr_multiplier(step)``, as in a fresh run with this config, whatever the
    checkpoint loaded into them (its base LR, its last LR). Computed as ``LambdaLR`` computes
    it, so that an unchanged schedule resumes bit-exactly. Returns the groups' new LRs."""
    f = lr_multiplier(cfg.optimizer, cfg.train.steps)
    # (the optimizer's groups, not the loaded state's: a ZeRO-1 checkpoint's scheduler has one
    # entry per parameter group, a ZeRO-3 optimizer may group them otherwise)
    n = len(scheduler.optimizer.param_groups)
    scheduler.lr_lambdas = [f] * n
    scheduler.base_lrs = [cfg.optimizer.lr] * n
    scheduler.last_epoch = step
    lrs = [base * lam(step) for base, lam in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["initial_lr"], group["lr"] = cfg.optimizer.lr, lr
    scheduler._last_lr = list(lrs)
    return lrs


def schedule_changes(saved: dict, cfg) -> list[str]:
    """``key: old -> new`` for the schedule and optimizer keys of :data:`SCHEDULE_KEYS` and
    :data:`HYPER_KEYS` that differ between a checkpoint's config (``saved``, a dict) and
    ``cfg``."""
    here = cfg.to_dict()
    out = []
    for key in SCHEDULE_KEYS + HYPER_KEYS:
        section, name = key.split(".")
        old, new = saved.get(section, {}).get(name), here[section][name]
        if old is not None and old != new:
            out.append(f"{key} {old} -> {new}")
    return out


def param_groups(model, weight_decay: float, rule: str = "global") -> list[dict]:
    """DeepSpeed's parameter groups: weight decay where :func:`~setdiff_dist.train.schedule.
    decayed` says so (``rule="global"``) or, in the run of a checkpoint saved before, as it was
    then (:func:`setdiff_dist.train.checkpoint.decay_rule`: ``"local"``, by each pipeline
    stage's own names; ``"none"``, nothing), so that its optimizer state loads into the groups
    it was saved from."""
    from setdiff_dist.model.transformer import global_name

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            key = global_name(model, name) if rule == "global" else name
            (decay if rule != "none" and decayed(p, key) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def skip_deepspeed_shm_build() -> bool:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory collective (40-90 s on 2 cores) in
    every new process; gloo does the same job. Returns whether it patched (CPU only)."""
    if torch.cuda.is_available():
        return False
    module = importlib.import_module("deepspeed.comm.torch")  # the module, not torch itself
    module.build_shm_op = lambda: None
    return True


@contextlib.contextmanager
def zero_optimizer_for_bf16(wanted: bool):
    """While DeepSpeed builds its engine (``wanted``: when the config's optimizer form is
    ``"zero"``, :func:`setdiff_dist.train.optimizer_state.optimizer_form`), make ZeRO-1 with bf16
    weights and fp32 gradient accumulation run the ZeRO optimizer (``DeepSpeedZeroOptimizer``,
    as with CPU offload) instead of ``BF16_Optimizer``, whose gradient reduction is one
    all-reduce after the backward. The ZeRO optimizer accumulates each micro-batch's gradient
    in an fp32 copy per parameter (``grad_accum``) and, in the last micro-batch's backward,
    reduces them in buckets to the ranks that own their partitions as they become ready
    (``overlap_comm``)."""
    if not wanted:
        yield
        return
    from deepspeed.runtime import engine as ds_engine

    original = ds_engine.DeepSpeedEngine._do_optimizer_sanity_check

    def check(self, basic_optimizer):
        kind = original(self, basic_optimizer)
        return ds_engine.ZERO_OPTIMIZATION if kind == ds_engine.BFLOAT16 else kind

    ds_engine.DeepSpeedEngine._do_optimizer_sanity_check = check
    try:
        yield
    finally:
        ds_engine.DeepSpeedEngine._do_optimizer_sanity_check = original


def build_engine(cfg, model, load_universal: bool = False, decay_rule: str = "global"):
    """``deepspeed.initialize`` over ``model`` with megatron's groups (with
    megatron's data parallelism, :func:`~setdiff_dist.config.zero_implementation`:
    :class:`~setdiff_dist.train.megatron_dp.MegatronEngine`, the same surface over megatron-core's
    distributed optimizer; with FSDP's, :class:`~setdiff_dist.train.fsdp_dp.FsdpEngine`).
    ``decay_rule``: what DeepSpeed's weight-decay groups decay (:func:`param_groups`); the
    engine keeps it as ``decay_rule`` for the checkpoints' manifests."""
    from setdiff_dist.config import zero_implementation

    implementation = zero_implementation(cfg)
    if implementation == "fsdp":
        from .fsdp_dp import FsdpEngine

        micro = micro_batches_per_step(cfg, ps.get_data_parallel_world_size())
        return FsdpEngine(cfg, model, micro, lr_multiplier(cfg.optimizer, cfg.train.steps))
    if implementation == "megatron":
        from .megatron_dp import MegatronEngine

        # (with pipeline parallelism megatron's schedule runs the micro-batches: one backward)
        return MegatronEngine(cfg, model, 1 if cfg.parallel.pipeline > 1 else
                              micro_batches_per_step(cfg, ps.get_data_parallel_world_size()),
                              lr_multiplier(cfg.optimizer, cfg.train.steps))
    skip_deepspeed_shm_build()
    import deepspeed

    dp = ps.get_data_parallel_world_size()
    schedule = lr_multiplier(cfg.optimizer, cfg.train.steps)
    # (the form checkpoints are told apart by: one definition of which optimizer a config runs)
    with zero_optimizer_for_bf16(optimizer_form(cfg.to_dict()) == "zero"):
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, cfg.optimizer.adamw_weight_decay,
                                                       decay_rule),
            config=deepspeed_config(cfg, dp, load_universal), mpu=MegatronMPU(),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    # DeepSpeed names checkpoint files by the mpu's model-parallel rank, which is the TP rank
    # (see MegatronMPU): pipeline stages would overwrite each other's files. Number them by the
    # rank in the TP x PP grid instead (only file naming reads this attribute).
    engine.checkpoint_mp_rank = (ps.get_pipeline_model_parallel_rank()
                                 * ps.get_tensor_model_parallel_world_size()
                                 + ps.get_tensor_model_parallel_rank())
    name_globally(engine)
    engine.decay_rule = decay_rule
    clip_by_one_norm(engine, cfg.optimizer.grad_clip)
    return engine


def clip_by_one_norm(engine, max_norm: float) -> None:
    """Make an fp32 ZeRO-0 engine (DeepSpeed's basic optimizer) clip by the norm every other
    engine clips by, and keep it for ``get_global_grad_norm``; other engines are left as they are.

    There DeepSpeed clips with ``deepspeed.runtime.utils.clip_grad_norm_``, which counts the last
    pipeline stage's copy of the tied embedding a second time (DeepSpeed's ZeRO and bf16
    optimizers skip parameters marked ``ds_pipe_replicated``; it does not): on the tiny model at
    PP=2 the loss left the one-stage run's at the second step. It also keeps no norm, so the
    metrics said ``grad nan``. Instead, before DeepSpeed's step: each gradient counted once (a
    parameter whole on every TP rank on the first, the tied copy on the first stage), one
    all-reduce over the model-parallel group, then every gradient (the copy too) scaled by
    megatron's clip coefficient, as :class:`~setdiff_dist.train.megatron_dp.MegatronEngine` does."""
    if engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization():
        return
    take_step = engine._take_model_step

    def _take_model_step(lr_kwargs):
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        first = ps.get_tensor_model_parallel_rank() == 0
        counted = [p.grad.float().pow(2).sum() for p in engine.module.parameters()
                   if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
                   and (first or getattr(p, "tensor_model_parallel", False))]
        squares = torch.stack(counted).sum().reshape(1) if counted else \
            torch.zeros(1, device=engine.device)
        dist.all_reduce(squares, group=ps.get_model_parallel_group())
        norm = float(squares.sqrt())
        engine._global_grad_norm = norm
        coef = max_norm / (norm + 1e-6) if max_norm > 0 and math.isfinite(norm) else 1.0
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        return take_step(lr_kwargs)

    engine._take_model_step = _take_model_step
    engine.clip_fp32_gradients = lambda: None  # (done above)


def name_globally(engine) -> None:
    """Give DeepSpeed the parameters' global names (:func:`~setdiff_dist.model.transformer.
    global_name`: the layer index in the whole model, the tied output weight as the embedding).

    DeepSpeed names each parameter's optimizer state by ``engine.param_names``, which it takes
    from the stage's module: in the ZeRO partitions' slice mappings and the model-state files'
    shapes it saves, and in the universal form it converts to and loads from. Each pipeline
    stage numbers its layers from 0, so with local names the stages' states would share names
    and no checkpoint could change its pipeline size. Without pipeline parallelism (and with
    the local layers) the global names are the local ones."""
    from setdiff_dist.model.transformer import global_name

    model = engine.module
    names = {p: global_name(model, n) for n, p in model.named_parameters()}
    for p in engine.param_names:  # (the optimizer holds the same dict)
        engine.param_names[p] = names.get(p, engine.param_names[p])
    optimizer = engine.optimizer
    if hasattr(optimizer, "_create_param_mapping"):  # (BF16_Optimizer, ZeRO-1/2: built once)
        optimizer._param_slice_mappings = optimizer._create_param_mapping()


def partitioned_construction(cfg):
    """``(construct, gathered)`` for :func:`setdiff_dist.model.transformer.build_model` under
    ZeRO-3: DeepSpeed's ``zero.Init`` partitions each parameter over the data-parallel ranks
    as megatron creates it, in the compute dtype (as DeepSpeed casts the module without it:
    bf16 training makes its fp32 master weights from the bf16 ones either way), and
    ``GatheredParameters`` makes one parameter whole at a time for its initialization, so no
    rank ever holds the whole model. ``(None, None)`` below ZeRO-3."""
    if cfg.zero.stage != 3:
        return None, None
    skip_deepspeed_shm_build()
    import deepspeed

    dtype = compute_dtype(cfg.train.precision)
    construct = deepspeed.zero.Init(data_parallel_group=ps.get_data_parallel_group(
                                        with_context_parallel=True), dtype=dtype)
    # DeepSpeed 0.19's Init._set_dtype reads `dtype or fp16 if fp16_supported() else bf16 ...`,
    # which drops the dtype we pass on an accelerator without fp16 (a CPU without AVX512-FP16):
    # fp32 runs were built in bf16 there. Keep the dtype asked for.
    construct.dtype = dtype

    def gathered(param):
        return deepspeed.zero.GatheredParameters([param], modifier_rank=0)

    return construct, gathered


def check_precision(cfg) -> None:
    """Refuse, at start, a precision this machine cannot run (never fall back silently)."""
    from setdiff_dist.errors import TrainingError

    if cfg.train.precision != "fp8":
        return
    if not torch.cuda.is_available():
        raise TrainingError("train.precision=fp8 needs NVIDIA GPUs (Hopper, sm_90, or newer) with "
                            "Transformer Engine; this machine has no CUDA device. Use "
                            "train.precision=bf16 or fp32 here.")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:
        raise TrainingError("train.precision=fp8 needs Transformer Engine: install the [gpu] extra "
                            f"(pip install '.[gpu]') or use the docker image ({exc})") from None
    if torch.cuda.get_device_capability() < (8, 9):
        raise TrainingError(f"train.precision=fp8 needs FP8 tensor cores (sm_89 / sm_90 or "
                            f"newer); {torch.cuda.get_device_name()} is "
                            f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
