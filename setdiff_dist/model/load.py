"""A built model (one pipeline stage, one tensor-parallel rank's shards) set from the weights
of a setdiff checkpoint or export, saved in any layout: each rank reads only its rows or columns
of each tensor. The Hugging Face counterpart is :func:`setdiff_dist.model.hf.load_hf_into`."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from setdiff_dist.checkpoint.files import CheckpointError
from setdiff_dist.checkpoint.manifest import RUN_FREE, model_differences
from setdiff_dist.checkpoint.weights import local_shard, open_weights

from .transformer import global_name


def local_tensors(model, state, what: str, shape_of=None):
    """``(parameter name, parameter, this rank's shard of its tensor in state)`` for every
    parameter of ``model``; ``shape_of(p)``: its local shape (default: ``p.shape``)."""
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, p in model.named_parameters():
        shape = list(shape_of(p) if shape_of is not None else p.shape)
        yield name, p, local_shard(state, global_name(model, name), p, shape, tp, rank, what)


def init_from_weights(model, cfg, path: str, gathered=None) -> None:
    """Set ``model`` to the weights of the setdiff checkpoint or export at ``path`` (the
    weights training left, not the EMA; vocabulary tables: the real rows, padded to this
    layout's table). The architecture must be the checkpoint's (the layer spec may change:
    weights are read by layout-free names); every parameter must be found with its shape.
    ``gathered(p)``: a context in which a ZeRO-3 partitioned parameter is whole."""
    what = f"checkpoint.init_from={path}"
    # (every rank hashes its share of the files)
    # (a checkpoint whose stages' tied copies drifted: read as tied, with a note, so that a
    # tied model can start from it)
    state, saved, _, _ = open_weights(path, raw=True, group=dist.group.WORLD,
                                      what="checkpoint.init_from", untie_drifted=False)
    diffs = model_differences(cfg.to_dict()["model"], saved.to_dict()["model"],
                              RUN_FREE + ("layer_spec",))
    if diffs:
        raise CheckpointError(f"{what}: another architecture:\n  - " + "\n  - ".join(diffs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            with gathered(p) if gathered is not None else contextlib.nullcontext():
                local = local_shard(state, global_name(model, name), p, list(p.shape),
                                    ps.get_tensor_model_parallel_world_size(),
                                    ps.get_tensor_model_parallel_rank(), what)
                p.copy_(local.to(p.dtype))
