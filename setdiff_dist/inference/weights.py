"""Models for inference from trained weights, and ``setdiff-convert``'s export.

The files (a checkpoint's per-rank safetensors in any training layout, or an export) are read
through :mod:`setdiff_dist.checkpoint.weights`; here they become the decode-time model at any
tensor-parallel size (:func:`build_inference_model`). Nothing is unpickled.
"""

from __future__ import annotations

import numbers
import os
from typing import Optional, Union

import torch

from setdiff_dist.checkpoint.files import pointer_target
from setdiff_dist.checkpoint.weights import (
    LoadError,
    _is_shard_directory,
    locate,
    open_weights,
    read_full_state_dict,
    write_export,
)

#: the ``dtype`` names a model for inference is built in (the commands' ``--dtype`` offers the
#: first three; the short names are the common aliases): "auto" is bfloat16 on a GPU and float32
#: on CPUs (:func:`setdiff_dist.inference.settings.inference_dtype`)
DTYPES = {"auto": "auto", "float32": "float32", "bfloat16": "bfloat16", "fp32": "float32",
          "bf16": "bfloat16"}
_UNSUPPORTED_DTYPES = ("float16", "fp16", "half")


def named(what: str, value) -> str:
    """How an error names ``value`` as its caller gave it (``what``): a flag
    (``--checkpoint runs/x``), a Python argument (``load(path='runs/x')`` for ``what``
    "load(path)") or a key (``dtype=fp16``, as lm-eval's ``--model_args`` take it)."""
    if what.startswith("-"):
        return f"{what} {value}"
    if what.endswith(")"):
        return f"{what[:-1]}={value!r})"
    return f"{what}={value}"


def model_dtype(dtype, what: str = "--dtype") -> torch.dtype:
    """The torch dtype of ``dtype``: a name of :data:`DTYPES` (any case) or ``torch.float32`` /
    ``torch.bfloat16``; anything else (float16 included: the commands decode in float32 or
    bfloat16 only) is a :class:`LoadError` naming it as ``what`` and the accepted values."""
    from .settings import inference_dtype

    if isinstance(dtype, torch.dtype):
        name = str(dtype).replace("torch.", "")
    else:
        name = dtype.strip().lower() if isinstance(dtype, str) else None
    accepted = "auto (bfloat16 on a GPU, float32 on CPUs), float32 (fp32) or bfloat16 (bf16)"
    if name in _UNSUPPORTED_DTYPES:
        raise LoadError(f"{named(what, dtype)}: float16 is not supported (setdiff-dist decodes "
                        f"in float32 or bfloat16 only): give {accepted}")
    if name not in DTYPES:
        raise LoadError(f"{named(what, dtype)}: unknown dtype; give {accepted}")
    return inference_dtype(DTYPES[name])


def positive_int(value, what: str, meaning: str, hint: str = "") -> int:
    """``value`` as an int of 1 or more (an integer, not a bool, a float or a string), else a
    :class:`LoadError` naming it as ``what``; ``meaning``: what the number is, ``hint``: what
    to give, for the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise LoadError(f"{named(what, value)}: {meaning} must be an integer of 1 or more"
                        + (f" ({hint})" if hint else ""))
    return int(value)


def tensor_parallel_size(value, what: str = "--tensor-parallel") -> int:
    """The tensor-parallel size a model is built at, checked (:func:`positive_int`)."""
    return positive_int(value, what, "the tensor-parallel size", "1 in one process; N on N "
                        "ranks started with torchrun --nproc-per-node N")


def check_model_path(path, what: str = "--checkpoint") -> str:
    """``path`` (a string or an ``os.PathLike``) as a string, when it is a directory that may
    hold a model: else a :class:`LoadError` naming it as ``what`` (the flag, argument or key it
    was given as) and what to give instead. Whether the directory holds a complete model is
    :func:`setdiff_dist.checkpoint.weights.locate`'s to say."""
    if not isinstance(path, (str, os.PathLike)):
        raise LoadError(f"{named(what, path)}: expected a directory (a string or a path), got "
                        f"{type(path).__name__}")
    path = os.fspath(path)
    give = ("give a training run directory, a checkpoint directory (checkpoints/step_N, or the "
            "pointer checkpoints/best or checkpoints/latest) or a setdiff-convert export")
    path = pointer_target(path)
    if not os.path.isdir(path):
        what_is = "not a directory" if os.path.exists(path) else "no such directory"
        raise LoadError(f"{named(what, path)}: {what_is}; {give}")
    if _is_shard_directory(path):
        raise LoadError(f"{named(what, path)} is a shard directory (setdiff-prep's output), not "
                        f"a checkpoint: {give}")
    return path


def export(path: str, out: str, raw: bool = False) -> dict:
    """``setdiff-convert``: one safetensors file of full tensors, with config and tokenizer
    (the EMA of the weights when the run kept one, unless ``raw``)."""
    from setdiff_dist.checkpoint.weights import provenance

    state, cfg, tok, src = read_full_state_dict(path, raw=raw)
    return write_export(out, state, cfg, tok, src,
                        extra_meta={"weights": provenance(path, raw)["weights"]})


def build_inference_model(path: str, tensor: int = 1, device: Optional[str] = None,
                          dtype: torch.dtype = torch.float32,
                          pack: Union[bool, str, None] = None,
                          raw: bool = False, what: str = "--checkpoint"):
    """``(model, config, tokenizer)``: the decode-time model
    (:class:`setdiff_dist.inference.lean.LeanTransformer`) of a checkpoint or export, at
    tensor-parallel size ``tensor`` (the process group must already hold ``tensor`` ranks); each
    rank reads only the tensors it needs, one at a time. On the CPU in fp32, ``pack`` hands the
    large weights to oneDNN (see :data:`setdiff_dist.inference.lean._PACK_MIN`): True all of
    them, "auto" (the default for set-diffusion models, whose steps carry several rows: the
    window's queries and a commit) those measured faster so at the checkpoint's window. Errors
    name ``path`` as ``what`` (:func:`named`: the flag, the Python argument or the key it was
    given as)."""
    import torch.distributed as dist

    from setdiff_dist.parallel.state import init_distributed

    from .lean import LeanError, LeanTransformer

    # tensors are read one at a time, as needed; the EMA of the weights unless ``raw``; the
    # ranks of a tensor-parallel model share the checksums of the files
    path = check_model_path(path, what)  # (a wrong path is said before any process group is
    locate(path, what)                   # set up)
    tp_rank, tp_group = 0, None
    if tensor == 1:  # torch.distributed alone: inference at TP=1 never imports megatron-core
        init_distributed()
    else:
        from megatron.core import parallel_state as ps

        from setdiff_dist.parallel import initialize_model_parallel

        if not ps.model_parallel_is_initialized() or \
                ps.get_tensor_model_parallel_world_size() != tensor:
            initialize_model_parallel(tensor=tensor, seed=0)
        tp_rank, tp_group = ps.get_tensor_model_parallel_rank(), \
            ps.get_tensor_model_parallel_group()
    group = dist.group.WORLD if dist.get_world_size() > 1 else None
    state, cfg, tok, _ = open_weights(path, raw=raw, group=group, what=what)
    # the lean model takes dense masks: scoring (setdiff-eval ppl) builds them for sdpa
    cfg.model.attention_backend = "sdpa"
    cfg.model.attention_dropout = cfg.model.hidden_dropout = 0.0
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = 1
    if pack is None:
        from setdiff_dist.diffusion.kinds import order_of

        pack = "auto" if not order_of(cfg.order).causal_lm else False
    if pack == "auto":  # a step's rows: the window's queries and a commit
        from setdiff_dist.inference.settings import default_window

        rows = (cfg.decode.window or default_window(cfg.order) or 8) + 1
    if device.type != "cpu" or dtype != torch.float32:
        pack = False
    try:
        model = LeanTransformer.from_state_dict(cfg.model, state, tp_rank, tensor, tp_group,
                                                pack=pack, device=device, dtype=dtype,
                                                pack_rows=rows)
    except LeanError as exc:
        raise LoadError(f"{path}: {exc}") from None
    return model.to(device=device, dtype=dtype).eval(), cfg, tok
