"""The optimizer's schedule and rules that every engine shares (DeepSpeed's ``LambdaLR``,
megatron's and FSDP's optimizers) and the CPU demo uses: the learning rate as a multiplier of
``optimizer.lr`` per optimizer step, and which parameters are weight-decayed. Imports nothing
heavy."""

from __future__ import annotations

import math


def lr_multiplier(opt_cfg, total_steps: int):
    """The LR schedule as a multiplier of ``optimizer.lr`` for each optimizer step."""
    floor = opt_cfg.min_lr / opt_cfg.lr if opt_cfg.lr else 0.0
    warm = opt_cfg.warmup_steps

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        frac = min(1.0, (step - warm) / max(1, total_steps - warm))
        if opt_cfg.schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))
        if opt_cfg.schedule == "linear":
            return 1 - (1 - floor) * frac
        return 1.0

    return f


def decayed(param, name: str) -> bool:
    """Whether AdamW weight-decays ``param``, given its layout-free name (:func:`~setdiff_dist.
    model.transformer.global_name`): matrices yes; norms, biases and the embedding no
    (Megatron-LM's rule). By the global name, because under pipeline parallelism the last
    stage's copy of a tied embedding is called ``output_layer.weight`` there: decayed as a
    matrix, it would drift from the first stage's copy. By the parameter's whole shape, because
    ZeRO-3 holds a partitioned parameter as an empty one-dimensional tensor (``ds_shape`` is
    its shape): by that, nothing would be decayed."""
    return len(getattr(param, "ds_shape", param.shape)) >= 2 and "embedding" not in name
