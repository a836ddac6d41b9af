"""An exponential moving average of the weights (``train.ema_decay``; 0.9999 in the paper's
recipe), the weights that decoding and evaluation use by default.

Each rank keeps, in fp32, the average of what it holds of each parameter: its tensor-parallel
shard, or under ZeRO-3 its data-parallel partition of that shard, so the average costs what the
weights cost and never a whole model on one rank. After every optimizer step,
``ema = decay * ema + (1 - decay) * weight``. A checkpoint writes it beside the weights, under
the same global names and sharding (``weights_ema/``, layout-free like ``weights/``), so it
survives a resume in another layout and inference reads it like the weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def _held(p) -> torch.Tensor:
    """What this rank holds of ``p``: its ZeRO-3 partition (flat), its FSDP shard (rows), or
    the tensor itself."""
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor
    return p.to_local() if hasattr(p, "to_local") else p.data


class EMA:
    def __init__(self, model, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"an EMA decay lies in (0, 1), got {decay}")
        self.decay = decay
        self.params = dict(model.named_parameters())
        self.shadow = {n: _held(p).detach().float().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for name, p in self.params.items():
            self.shadow[name].lerp_(_held(p).float(), 1.0 - self.decay)

    @torch.no_grad()
    def tensor(self, name: str) -> torch.Tensor:
        """The average of parameter ``name`` as this rank's tensor-parallel shard of it (under
        ZeRO-3 or FSDP gathered over the data-parallel group: a collective, called by every
        rank)."""
        p, held = self.params[name], self.shadow[name]
        if hasattr(p, "device_mesh"):  # (FSDP's DTensor: one all-gather of the row shards)
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(held, p.device_mesh, p.placements, shape=p.shape,
                                      stride=p.stride()).full_tensor()
        if not hasattr(p, "ds_tensor"):
            return held
        group = ps.get_data_parallel_group(with_context_parallel=True)  # (ZeRO-3's group)
        parts = [torch.empty_like(held) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, held, group=group)
        return torch.cat(parts)[:p.ds_numel].view(p.ds_shape)

    @torch.no_grad()
    def load(self, name: str, local: torch.Tensor) -> None:
        """Set the average of ``name`` from this rank's tensor-parallel shard ``local`` (under
        ZeRO-3 or FSDP keeping this rank's partition of it)."""
        p, held = self.params[name], self.shadow[name]
        flat = local.detach().float().reshape(-1)
        if hasattr(p, "device_mesh"):  # (FSDP: this rank's torch.chunk of the rows)
            rows = local.float().reshape(p.shape).chunk(p.device_mesh.size(), dim=0)
            mine = p.device_mesh.get_local_rank()
            if mine < len(rows):
                held.copy_(rows[mine].reshape(held.shape))
        elif hasattr(p, "ds_tensor"):
            n = held.numel()
            start = ps.get_data_parallel_rank(with_context_parallel=True) * n
            part = flat[start:start + n]
            held.zero_()
            held[:part.numel()].copy_(part)
        else:
            held.copy_(flat.view_as(held))


def load_ema(ema: EMA, model, path: str) -> bool:
    """Set ``ema`` from the checkpoint's ``weights_ema/`` (saved in any layout); False when
    the checkpoint kept none."""
    import os

    from setdiff_dist.checkpoint.format import EMA_WEIGHTS
    from setdiff_dist.checkpoint.weights import open_weights
    from setdiff_dist.model.load import local_tensors

    if not os.path.isdir(os.path.join(path, EMA_WEIGHTS)):
        return False
    # (verified at resume; a first pipeline stage reads its own copy of a tied embedding: the
    # stages' copies differ in a checkpoint saved before the weight-decay fix, 0c8d7b7)
    first = ps.is_pipeline_first_stage() and not ps.is_pipeline_last_stage()
    state = open_weights(path, which=EMA_WEIGHTS, checksums=False,
                         stage="first" if first else "last")[0]
    for name, _, local in local_tensors(model, state, f"the EMA of {path}",
                                        shape_of=lambda p: getattr(p, "ds_shape", p.shape)):
        ema.load(name, local)
    return True
