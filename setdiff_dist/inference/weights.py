"""Models for inference from trained weights, and ``setdiff-convert``'s export.

The files (a checkpoint's per-rank safetensors in any training layout, or an export) are read
through :mod:`setdiff_dist.checkpoint.weights`; here they become the decode-time model at any
tensor-parallel size (:func:`build_inference_model`). Nothing is unpickled.
"""

from __future__ import annotations

from typing import Optional

import torch

from setdiff_dist.checkpoint.weights import (
    LoadError,
    locate,
    open_weights,
    read_full_state_dict,
    write_export,
)


def export(path: str, out: str, raw: bool = False) -> dict:
    """``setdiff-convert``: one safetensors file of full tensors, with config and tokenizer
    (the EMA of the weights when the run kept one, unless ``raw``)."""
    from setdiff_dist.checkpoint.weights import provenance

    state, cfg, tok, src = read_full_state_dict(path, raw=raw)
    return write_export(out, state, cfg, tok, src,
                        extra_meta={"weights": provenance(path, raw)["weights"]})


def build_inference_model(path: str, tensor: int = 1, device: Optional[str] = None,
                          dtype: torch.dtype = torch.float32, pack: Optional[bool] = None,
                          raw: bool = False):
    """``(model, config, tokenizer)``: the decode-time model
    (:class:`setdiff_dist.inference.lean.LeanTransformer`) of a checkpoint or export, at
    tensor-parallel size ``tensor`` (the process group must already hold ``tensor`` ranks); each
    rank reads only the tensors it needs, one at a time. On the CPU in fp32, ``pack`` (default:
    for set-diffusion models, whose steps carry several rows) hands the large weights to oneDNN
    (see :data:`setdiff_dist.inference.lean._PACK_MIN`)."""
    import torch.distributed as dist

    from setdiff_dist.parallel.state import init_distributed

    from .lean import LeanError, LeanTransformer

    # tensors are read one at a time, as needed; the EMA of the weights unless ``raw``; the
    # ranks of a tensor-parallel model share the checksums of the files
    locate(path)  # (a wrong path is said before any process group is set up)
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
    state, cfg, tok, _ = open_weights(path, raw=raw, group=group)
    # the lean model takes dense masks: scoring (setdiff-eval ppl) builds them for sdpa
    cfg.model.attention_backend = "sdpa"
    cfg.model.attention_dropout = cfg.model.hidden_dropout = 0.0
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if pack is None:
        from setdiff_dist.diffusion.kinds import order_of

        pack = not order_of(cfg.order).causal_lm
    pack = pack and device.type == "cpu" and dtype == torch.float32
    try:
        model = LeanTransformer.from_state_dict(cfg.model, state, tp_rank, tensor, tp_group,
                                                pack=pack, device=device, dtype=dtype)
    except LeanError as exc:
        raise LoadError(f"{path}: {exc}") from None
    return model.to(device=device, dtype=dtype).eval(), cfg, tok
