"""Which form of the ZeRO optimizer state a run saves, and whether a checkpoint's differs from
this run's: the trainer's knowledge of the optimizers it builds (DeepSpeed's ``BF16_Optimizer``
and its ZeRO optimizer, megatron-core's distributed optimizer, FSDP2's ZeRO-2), which decides
whether a resume goes through DeepSpeed's universal form. Beside the code that builds them, not
in :mod:`setdiff_dist.checkpoint` (the format, which knows no optimizer's classes): the format's
checks take the answer as an argument
(:func:`~setdiff_dist.checkpoint.manifest.check_compatible`'s ``form_change``). Light: the
launcher's plan (:mod:`setdiff_dist.train.scale`) imports it without torch."""

from __future__ import annotations

import json
import os
from typing import Optional

from setdiff_dist.checkpoint.format import MANIFEST
from setdiff_dist.checkpoint.manifest import saved_config
from setdiff_dist.config import zero_implementation

# the forms kept as each rank's fragments of each parameter (not DeepSpeed's)
FRAGMENTS = ("megatron", "fsdp")


def optimizer_form(config: dict, implementation: Optional[str] = None) -> str:
    """The form of the ZeRO optimizer state a run of ``config`` (a config as a dict) saves:
    ``"megatron"`` (megatron-core's distributed optimizer, :func:`~setdiff_dist.config.
    zero_implementation`: each rank's fragments of each parameter), ``"fsdp"`` (FSDP2's ZeRO-2:
    fragments too, cut otherwise), ``"bf16_optimizer"`` (DeepSpeed's ``BF16_Optimizer``: bf16
    or fp8 at ZeRO-1 without ``zero.overlap_comm`` or optimizer offload) or ``"zero"`` (its ZeRO
    optimizer). A config from before ``zero.overlap_comm`` existed ran without it.
    ``implementation``: who ran it, where a checkpoint's manifest says so."""
    zero, train = config.get("zero", {}), config.get("train", {})
    implementation = implementation or zero_implementation(config)
    if implementation in FRAGMENTS:
        return implementation
    if train.get("precision", "fp32") in ("bf16", "fp8") and zero.get("stage", 1) == 1 \
            and not zero.get("overlap_comm", False) \
            and zero.get("offload_optimizer", "none") == "none":
        return "bf16_optimizer"
    return "zero"


def saved_form(path: str) -> str:
    """The form of the optimizer state of the checkpoint at ``path``: by the implementation its
    manifest names, else (saved before manifests named it, when ``auto`` meant DeepSpeed at
    ZeRO-2) by its config."""
    try:
        with open(os.path.join(path, MANIFEST)) as fh:
            implementation = json.load(fh).get("zero_implementation")
    except (OSError, ValueError, AttributeError):
        implementation = None
    saved = saved_config(path)
    return optimizer_form(saved, implementation
                          or zero_implementation(saved, saved_before_fsdp=True))


def optimizer_changes(path: str, cfg) -> Optional[str]:
    """``"zero.overlap_comm: checkpoint X, this run Y"`` when the checkpoint at ``path`` keeps
    its optimizer state in another form than this run (DeepSpeed converts it through the
    universal form), ``"zero.implementation: ..."`` between DeepSpeed's, megatron's and
    FSDP's, the bucket settings that cut megatron's state otherwise; else None."""
    saved = saved_config(path)
    if not saved:
        return None
    forms = saved_form(path), optimizer_form(cfg.to_dict())
    if forms[0] in FRAGMENTS or forms[1] in FRAGMENTS:
        zero = saved.get("zero", {})
        if forms[0] != forms[1]:
            name = [f if f in FRAGMENTS else "deepspeed" for f in forms]
            return f"zero.implementation: checkpoint {name[0]}, this run {name[1]}"
        if forms[0] == "fsdp":
            return None
        # (megatron cuts its optimizer state bucket by bucket: other buckets, other shards)
        moved = [f"zero.{k}: checkpoint {zero.get(k)}, this run {getattr(cfg.zero, k)}"
                 for k in ("reduce_bucket_size", "min_bucket_per_rank")
                 if zero.get(k, getattr(cfg.zero, k)) != getattr(cfg.zero, k)]
        return "; ".join(moved) or None
    if forms[0] == forms[1]:
        return None
    before = str(saved.get("zero", {}).get("overlap_comm", False)).lower()
    return f"zero.overlap_comm: checkpoint {before}, this run {str(cfg.zero.overlap_comm).lower()}"


def deepspeed_form_change(path: str, cfg) -> Optional[str]:
    """:func:`optimizer_changes` when the checkpoint at ``path`` and this run both keep one of
    DeepSpeed's forms (``BF16_Optimizer``'s or its ZeRO optimizer's: ``zero.overlap_comm``),
    else None (a change to or from megatron's distributed optimizer or FSDP goes through the
    universal form in any layout): the change that a pipeline-parallel checkpoint saved before
    its optimizer state was named by global layer cannot make
    (:func:`~setdiff_dist.checkpoint.manifest.check_compatible`)."""
    forms = {saved_form(path), optimizer_form(cfg.to_dict())}
    return optimizer_changes(path, cfg) if not forms & set(FRAGMENTS) else None
