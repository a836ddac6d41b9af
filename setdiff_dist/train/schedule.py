"""The learning-rate schedule as a multiplier of ``optimizer.lr`` per optimizer step: the one
function the trainer (DeepSpeed's ``LambdaLR``, megatron's and FSDP's optimizers) and the CPU
demo use. Imports nothing heavy."""

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
