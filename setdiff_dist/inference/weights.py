"""Models for inference from trained weights, and ``setdiff-convert``'s export.

The files (a checkpoint's per-rank safetensors in any training layout, or an export) are read
through :mod:`setdiff_dist.checkpoint.weights`; here they become a model:
:func:`build_inference_model` (the lean decode-time model by default, or the training model,
at any tensor-parallel size) and :func:`load_into` (full tensors sharded into a megatron model).
Nothing is unpickled.
"""

from __future__ import annotations

from typing import Optional

import torch

from setdiff_dist.checkpoint.weights import (VOCAB_ROWS, LoadError, open_weights,
                                             read_full_state_dict, write_export)


def export(path: str, out: str) -> dict:
    """``setdiff-convert``: one safetensors file of full tensors, with config and tokenizer."""
    state, cfg, tok, src = read_full_state_dict(path)
    return write_export(out, state, cfg, tok, src)


def load_into(model, state: dict) -> None:
    """Copy full tensors into ``model`` (this rank's TP shard of each); every tensor must be
    there with its full shape, and nothing else."""
    from setdiff_dist.model.transformer import full_shape, global_name, shard

    expected = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            gname = global_name(model, name)
            expected[gname] = True
            if gname not in state:
                raise LoadError(f"tensor {gname} is missing from the checkpoint")
            full = state[gname]
            want = full_shape(p)
            if gname in VOCAB_ROWS:  # pad the real rows to this TP size's table
                if full.shape[1:] != torch.Size(want[1:]) or full.shape[0] > want[0]:
                    raise LoadError(f"tensor {gname}: checkpoint shape {tuple(full.shape)} does "
                                    f"not fit the model's {tuple(want)}")
                full = torch.cat([full, full.new_zeros(want[0] - full.shape[0], *want[1:])])
            if list(full.shape) != want:
                raise LoadError(f"tensor {gname}: checkpoint shape {tuple(full.shape)}, model "
                                f"shape {tuple(want)}")
            p.copy_(shard(full, p).to(p.dtype))
    extra = sorted(set(state) - set(expected))
    if extra:
        raise LoadError(f"the checkpoint has tensors the model does not: {', '.join(extra[:5])}")


ENGINES = ("lean", "megatron")


def build_inference_model(path: str, tensor: int = 1, device: Optional[str] = None,
                          dtype: torch.dtype = torch.float32, engine: str = "lean"):
    """``(model, config, tokenizer)``: the model of a checkpoint or export, at tensor-parallel
    size ``tensor`` (the process group must already hold ``tensor`` ranks), attention ``sdpa``.
    ``engine="lean"`` (the default) is :class:`setdiff_dist.inference.lean.LeanTransformer`,
    the same function in plain torch; ``"megatron"`` is the training model."""
    from megatron.core import parallel_state as ps

    from setdiff_dist.parallel import initialize_model_parallel

    if engine not in ENGINES:
        raise LoadError(f"unknown inference engine {engine!r}; one of {', '.join(ENGINES)}")
    state, cfg, tok, _ = open_weights(path)  # tensors are read one at a time, as needed
    if not ps.model_parallel_is_initialized() or \
            ps.get_tensor_model_parallel_world_size() != tensor:
        initialize_model_parallel(tensor=tensor, seed=0)
    cfg.model.attention_backend = "sdpa"  # the KV-cached decoder's kernel
    cfg.model.layer_spec = "local"
    cfg.model.attention_dropout = cfg.model.hidden_dropout = 0.0
    if engine == "lean":
        from .lean import LeanError, LeanTransformer

        try:
            model = LeanTransformer.from_state_dict(
                cfg.model, state, ps.get_tensor_model_parallel_rank(), tensor,
                ps.get_tensor_model_parallel_group())
        except LeanError as exc:
            raise LoadError(f"{path}: {exc}") from None
    else:
        from setdiff_dist.model.transformer import SetDiffusionTransformer, transformer_config

        model = SetDiffusionTransformer(cfg.model, transformer_config(cfg.model, tensor=tensor))
        load_into(model, state)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device=device, dtype=dtype).eval(), cfg, tok
