"""The cross-field checks of a loaded config (:func:`validate`: every problem at once, each
naming the settings that conflict and the fix), and those that need the world size
(:func:`world_problems`). The schema, parsing and per-field checks are :mod:`setdiff_dist.config`'s;
an order kind's own requirements are its :meth:`~setdiff_dist.diffusion.kinds.Order.problems`."""

from __future__ import annotations

from setdiff_dist.diffusion.kinds import order_kinds, order_of


def validate(cfg) -> list[str]:
    """Cross-field checks. Returns the problems (empty when the config is consistent); each
    names the settings that conflict and, where there is one, the fix."""
    p: list[str] = []
    m, o, par, d = cfg.model, cfg.order, cfg.parallel, cfg.data
    L = d.seq_len
    from setdiff_dist.data.blend import parse_blend
    from setdiff_dist.data.shards import ShardError

    for key in ("train_shards", "valid_shards"):
        try:
            if getattr(d, key).strip():
                parse_blend(getattr(d, key))
        except ShardError as exc:
            p.append(f"data.{key}: {exc}")

    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        p.append(f"model.hidden_size={m.hidden_size} is not divisible by "
                 f"model.num_attention_heads={m.num_attention_heads} (or set model.head_dim)")
    if m.head_dim is not None and m.head_dim % 2:
        p.append(f"model.head_dim={m.head_dim} must be even (rotary embeddings rotate pairs)")
    if m.rope_scaling == "llama3" and m.rope_low_freq_factor <= 0:
        p.append("model.rope_low_freq_factor must be positive (rope_scaling=llama3)")
    elif m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        p.append(f"model.rope_high_freq_factor={m.rope_high_freq_factor:g} must be above "
                 f"model.rope_low_freq_factor={m.rope_low_freq_factor:g} (rope_scaling=llama3)")
    groups = m.num_query_groups
    if m.num_attention_heads % groups:
        p.append(f"model.num_query_groups={groups} must divide "
                 f"model.num_attention_heads={m.num_attention_heads}")
    if m.num_attention_heads % par.tensor:
        p.append(f"parallel.tensor={par.tensor} must divide "
                 f"model.num_attention_heads={m.num_attention_heads}")
    if groups % par.tensor:
        p.append(f"parallel.tensor={par.tensor} must divide model.num_query_groups={groups}")
    ffn = m.ffn_hidden_size
    if ffn % par.tensor:
        p.append(f"parallel.tensor={par.tensor} must divide the MLP width {ffn} "
                 "(model.ffn_hidden_size)")
    if m.num_layers % (par.pipeline * (par.virtual_pipeline or 1)):
        p.append(f"model.num_layers={m.num_layers} must be divisible by parallel.pipeline="
                 f"{par.pipeline}" + (f" x parallel.virtual_pipeline={par.virtual_pipeline}"
                                       if par.virtual_pipeline else ""))
    if par.sequence_parallel and par.tensor == 1:
        p.append("parallel.sequence_parallel=true needs parallel.tensor > 1")
    t = cfg.train
    for key in ("hang_timeout_s", "startup_timeout_s", "save_timeout_s"):
        value = getattr(t, key)
        if value and value >= t.collective_timeout_s:
            p.append(f"train.{key}={value:g} must be below train.collective_timeout_s="
                     f"{t.collective_timeout_s:g}: a collective that waits on a hung rank "
                     "would fail first, and nothing would name that rank (lower the first, "
                     f"raise the second, or set train.{key}=0)")
    # (an unknown kind is reported by its field; the rest is checked as for the default's)
    order = order_of(o.kind if o.kind in order_kinds() else "staggered")
    model_len = order.model_len(L)
    which = "L" if model_len == L else "2L"
    if par.sequence_parallel and par.tensor > 1 and model_len % par.tensor:
        p.append(f"parallel.sequence_parallel=true splits the model's sequence ({which} = "
                 f"{model_len} tokens) over parallel.tensor={par.tensor} ranks: it must divide "
                 "it (data.seq_len)")
    if par.virtual_pipeline and par.pipeline == 1:
        p.append("parallel.virtual_pipeline is set but parallel.pipeline=1")
    elif par.virtual_pipeline:
        p.append(f"parallel.virtual_pipeline={par.virtual_pipeline}: the interleaved 1F1B "
                 "schedule is not wired into the trainer yet (it needs one model chunk and one "
                 "data iterator per virtual stage); leave it unset (plain 1F1B)")

    p += order.problems(cfg)
    if o.training_loss == "masked_mean" and o.kind not in ("masked", "block"):
        p.append(f"order.training_loss=masked_mean is the masked-diffusion loss of MDLM and "
                 f"BD3LM (order.kind masked or block), not of order.kind={o.kind!r}; use nelbo")
    if par.context > 1:
        if m.attention_backend not in ("sdpa", "permuted_causal"):
            p.append(f"parallel.context={par.context} with model.attention_backend="
                     f"{m.attention_backend}: context parallelism runs on sdpa or "
                     "permuted_causal (auto picks one)")
        if L % (2 * par.context):
            p.append(f"parallel.context={par.context}: data.seq_len={L} must be a multiple of "
                     f"{2 * par.context} (the zigzag split: 2 x parallel.context equal chunks)")
    if m.attention_backend == "permuted_causal" and (order.causal_lm or not order.singleton):
        singleton = tuple(k for k in order_kinds() if order_of(k).singleton)
        p.append(f"model.attention_backend=permuted_causal needs singleton sets, i.e. "
                 f"order.kind in {singleton}, not {o.kind!r}; use sdpa or flex")

    if cfg.zero.stage >= 2 and par.pipeline > 1:
        p.append(f"zero.stage={cfg.zero.stage} with parallel.pipeline={par.pipeline}: DeepSpeed "
                 "does not partition gradients or parameters across pipeline stages; use "
                 "zero.stage 0 or 1 with pipeline parallelism")
    if cfg.checkpoint.init_from and cfg.checkpoint.init_from_hf:
        p.append("checkpoint.init_from and checkpoint.init_from_hf are both set: start from one")
    if cfg.zero.implementation in ("megatron", "fsdp"):
        z, impl = cfg.zero, cfg.zero.implementation
        stage = {"megatron": (1, "it shards the optimizer state: ZeRO-1"),
                 "fsdp": (2, "it shards the optimizer state and the gradients: ZeRO-2")}[impl]
        why = [f"zero.stage={z.stage} ({stage[1]})" if z.stage != stage[0] else None,
               "zero.offload_optimizer=cpu" if z.offload_optimizer != "none" else None,
               f"train.precision={cfg.train.precision}"
               if cfg.train.precision not in ("fp32", "bf16") else None,
               f"parallel.pipeline={par.pipeline}"
               if impl == "fsdp" and par.pipeline > 1 else None]
        why = [w for w in why if w]
        if why:
            p.append(f"zero.implementation={impl} does not run with {', '.join(why)}; use "
                     "zero.implementation=deepspeed for it")
    if cfg.zero.offload_params != "none" and cfg.zero.stage != 3:
        p.append("zero.offload_params needs zero.stage=3")
    if cfg.train.precision in ("bf16", "fp8") and cfg.zero.stage == 0:
        p.append(f"train.precision={cfg.train.precision} with zero.stage=0: DeepSpeed's stage 0 "
                 "keeps no fp32 master weights and accumulates gradients in bf16 (it would "
                 "update the bf16 weights directly); use zero.stage=1, which keeps fp32 master "
                 "weights and gradients and shards the optimizer state")
    if cfg.train.precision == "fp8" and m.layer_spec != "te":
        p.append("train.precision=fp8 runs through Transformer Engine: set model.layer_spec=te "
                 "(and install the [gpu] extra on a Hopper GPU)")
    if m.attention_backend == "te" and m.layer_spec != "te":
        p.append("model.attention_backend=te needs model.layer_spec=te")

    if d.global_batch_size % d.micro_batch_size:
        p.append(f"data.global_batch_size={d.global_batch_size} must be a multiple of "
                 f"data.micro_batch_size={d.micro_batch_size}")
    if cfg.optimizer.min_lr > cfg.optimizer.lr:
        p.append(f"optimizer.min_lr={cfg.optimizer.min_lr} is above "
                 f"optimizer.lr={cfg.optimizer.lr}")
    prof = cfg.train.profile_steps
    if prof is not None and (len(prof) != 2 or prof[0] > prof[1]):
        p.append(f"train.profile_steps={prof} must be two steps [a, b] with a <= b")
    if len(cfg.optimizer.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optimizer.betas):
        p.append(f"optimizer.betas={cfg.optimizer.betas} must be two numbers in [0, 1)")
    if not cfg.run_dir:
        p.append("run_dir must not be empty")
    if not cfg.resume:
        p.append("resume must be auto, never, or a checkpoint path")
    if cfg.decode.threshold <= 0:
        p.append("decode.threshold must be positive (inf = one token per step)")
    return p


def world_problems(cfg, world_size: int) -> list[str]:
    """What keeps ``cfg`` from running on ``world_size`` ranks (the checks that need the world
    size, which the config alone does not know); empty when it can."""
    tp, pp, cp = cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.context
    if world_size < 1:
        return [f"the world size must be at least 1, got {world_size}"]
    if world_size % (tp * pp * cp):
        with_cp = f" x parallel.context={cp}" if cp > 1 else ""
        return [f"world size {world_size} is not divisible by parallel.tensor={tp} x "
                f"parallel.pipeline={pp}{with_cp}: launch a multiple of {tp * pp * cp} ranks "
                "or lower parallel.tensor / parallel.pipeline / parallel.context"]
    dp = world_size // (tp * pp * cp)
    d = cfg.data
    unit = d.micro_batch_size * dp
    if d.global_batch_size % unit:
        return [f"data.global_batch_size={d.global_batch_size} must be a multiple of "
                f"data.micro_batch_size={d.micro_batch_size} x data-parallel size {dp} "
                f"(world {world_size} / (tensor {tp} x pipeline {pp} x context {cp})): set "
                f"data.global_batch_size={max(1, round(d.global_batch_size / unit)) * unit} "
                "or lower data.micro_batch_size"]
    return []
