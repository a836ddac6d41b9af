"""ZeRO-2 by torch's FSDP2 (``zero.implementation=fsdp``; what ``auto`` picks for
``zero.stage=2``): the gradient-sharding path whose collectives do not grow with DP.

DeepSpeed's ZeRO-2 keeps each parameter group as one flat buffer cut into one contiguous
partition per data-parallel rank, so a gradient bucket spans several owners and is reduced by one
``reduce`` per (bucket, owner): O(DP) collectives a step. megatron-core's distributed optimizer
(our ZeRO-1) cuts every bucket over all ranks but keeps whole gradients; its gradient-sharding
FSDP runs on CUDA only. FSDP2 (``fully_shard`` with ``reshard_after_forward=False``, torch's
ZeRO-2, as torchtitan uses it) cuts every parameter along its first dimension over the
data-parallel (x context-parallel) ranks; each transformer layer and the rest of the model are
one unit each, and per step a unit issues one all-gather (in its first forward, the next layer's
prefetched) and one reduce-scatter per micro-batch (in the backward, as the unit's gradients are
ready): a count fixed by the model's depth, whatever DP is, at the reduce-scatter + all-gather
byte bound. Gradients live sharded between micro-batches (the point of ZeRO-2); the whole
parameters live from a step's first forward to its last backward (as DeepSpeed's ZeRO-2 keeps
them), in the compute dtype under bf16 (FSDP's mixed precision: fp32 shards are the master
weights, gradients are reduced in fp32).

:class:`FsdpEngine` gives the trainer the surface of DeepSpeed's engine it uses, as
:class:`~setdiff_dist.train.megatron_dp.MegatronEngine` does, and saves the same per-rank
fragments (:mod:`~setdiff_dist.train.fragments`): a dimension-0 shard of a row-major tensor is a
contiguous range of the flattened tensor, so checkpoints move between FSDP, megatron's
distributed optimizer and DeepSpeed through the universal form. Pipeline parallelism is not
supported (nor is it by DeepSpeed's ZeRO-2).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from .fragments import FragmentCheckpoints
from .schedule import decayed

# megatron's tensor-parallel marks, which FSDP's new (sharded) parameters do not carry over
_TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride",
                  "sequence_parallel", "allreduce")


def _local(p) -> torch.Tensor:
    """This rank's shard of a parameter (or state) FSDP sharded, else the tensor."""
    return p.to_local() if hasattr(p, "to_local") else p


class FsdpEngine(FragmentCheckpoints):
    """The trainer's engine on torch's FSDP2 (see the module's docstring).
    ``gradient_accumulation_steps``: micro-batches per optimizer step; ``schedule``: the LR
    multiplier of each optimizer step (``engine.lr_multiplier``)."""

    form = "fsdp"

    def __init__(self, cfg, model, gradient_accumulation_steps: int, schedule):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from setdiff_dist.model.transformer import global_name, partial_over_tensor_parallel

        self.cfg = cfg
        bf16 = cfg.train.precision == "bf16"
        self.group = ps.get_data_parallel_group(with_context_parallel=True)
        self.device = next(model.parameters()).device
        mesh = DeviceMesh.from_group(self.group, self.device.type)
        marks = {n: {a: getattr(p, a) for a in _TP_ATTRIBUTES if hasattr(p, a)}
                 for n, p in model.named_parameters()}
        # (summed over the TP group after the reduction: their tensor hooks stay on the
        # parameters FSDP replaces)
        partial = set(partial_over_tensor_parallel(model))
        self.mp_policy = policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
        layers = list(model.decoder.layers)
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        # each layer's all-gather is issued as the previous layer's forward starts
        for layer, following in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([following])
        self.model = model
        for n, p in model.named_parameters():
            for a, v in marks[n].items():
                setattr(p, a, v)
        self.names = {p: global_name(model, n) for n, p in model.named_parameters()}
        self._partial = [p for n, p in model.named_parameters() if n in partial]
        o = cfg.optimizer
        decay, no_decay = [], []
        for p, name in self.names.items():
            (decay if decayed(p, name) else no_decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.adamw_weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.weights_dtype = torch.bfloat16 if bf16 else torch.float32
        self.skipped_steps = 0
        self._micro = 0
        self._norm: Optional[float] = None
        self.checkpoint_engine = self._checkpoint_engine()

    # -- what the trainer reads ---------------------------------------------------------------
    @property
    def module(self):
        return self.model

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        # the model's own attributes (mask_id, ...), as DeepSpeed's engine passes them through
        model = self.__dict__.get("model")
        if model is None:
            raise AttributeError(name)
        return getattr(model, name)

    def get_global_grad_norm(self) -> Optional[float]:
        return self._norm

    # -- a step, as DeepSpeed's engine runs it ----------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward (``loss`` scaled as for DeepSpeed, which divides by the
        accumulation steps); each reduces its gradients into the shards (ZeRO-2), and the
        whole parameters are kept for the next micro-batch's forward until the last one."""
        self._micro += 1
        self.model.set_reshard_after_backward(self._micro >= self.gradient_accumulation_steps)
        (loss / self.gradient_accumulation_steps).backward()

    def allreduce_gradients(self) -> None:
        """(The reduction ran in the backward's hooks.)"""

    @torch.no_grad()
    def step(self) -> None:
        """After every micro-batch; at the last one of a step: the gradient norm over the
        shards (one all-reduce), a non-finite norm skips the update (as DeepSpeed's overflow
        check does), else clip, AdamW on this rank's shards and the LR schedule. The
        parameters' all-gather follows in the next forward."""
        if 0 < self._micro < self.gradient_accumulation_steps:
            return
        self._micro = 0
        params = [p for p in self.names if p.grad is not None]
        self._sum_partial_grads(params)
        tp_rank = ps.get_tensor_model_parallel_rank()
        squares = torch.zeros(1, dtype=torch.float32, device=self.device)
        for p in params:
            # a parameter whole on every TP rank is counted on the first one
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                squares += _local(p.grad).float().pow(2).sum()
        # every (TP, DP x CP) rank holds disjoint shards: one sum over the model's ranks
        dist.all_reduce(squares)
        norm = float(squares.sqrt())
        self._norm = norm
        if math.isfinite(norm):
            clip = self.cfg.optimizer.grad_clip
            coef = clip / (norm + 1e-6) if clip > 0 else 1.0
            if coef < 1.0:
                torch._foreach_mul_([_local(p.grad) for p in params], coef)
            self.optimizer.step()
            self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)

    def _sum_partial_grads(self, params) -> None:
        """The gradients of parameters that see part of the computation on each TP rank
        (QK-norms, sequence-parallel norms) summed over the TP group, in one all-reduce (the
        sum commutes with the data-parallel reduction that ran before)."""
        grads = [_local(p.grad) for p in self._partial if p.grad is not None]
        if not grads or ps.get_tensor_model_parallel_world_size() == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
        torch._foreach_copy_(grads, [t.view_as(g) for t, g in
                                     zip(flat.split([g.numel() for g in grads]), grads)])

    def whole_weights(self) -> None:
        """(FSDP gathers the parameters in each forward.)"""

    def drop_gradients(self) -> None:
        """This step's gradients dropped (a non-finite loss), the whole parameters freed."""
        self._micro = 0
        self.optimizer.zero_grad(set_to_none=True)
        self.model.reshard()

    def time_gradient_reduction(self, timers) -> None:
        """(The reduce-scatters run and are waited for inside the backward, the all-gathers
        inside the forward: FSDP's own streams overlap them on a GPU; no phase of their own.)"""

    # -- checkpoints ------------------------------------------------------------------------------
    def _range(self, p) -> SimpleNamespace:
        """This rank's range of the flattened ``p``: FSDP cuts dimension 0 as ``torch.chunk``
        does (ceil(rows / DP) rows a rank, the last ranks' shards shorter or empty)."""
        rows = p.shape[0]
        per_row = p.numel() // rows if rows else 0
        chunk = -(-rows // dist.get_world_size(self.group))
        start = min(dist.get_rank(self.group) * chunk, rows) * per_row
        return SimpleNamespace(start=start, end=start + _local(p).numel())

    def _fragments(self) -> dict:
        out = {}
        for p, name in self.names.items():
            rng = self._range(p)
            if rng.end == rng.start:
                continue
            state = self.optimizer.state.get(p, {})
            frag = {"start": rng.start, "end": rng.end, "shape": tuple(p.shape), "copy": False,
                    "param": _local(p).detach().float().reshape(-1).clone()}
            for key in ("exp_avg", "exp_avg_sq"):
                frag[key] = _local(state[key]).detach().reshape(-1).clone() if key in state \
                    else torch.zeros_like(frag["param"])
            if "step" in state:
                frag["step"] = state["step"].detach().clone()
            out[name] = frag
        return out

    def _module_state(self) -> dict:
        """The module's state with whole tensors (one all-gather per parameter, every rank)."""
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in self.model.state_dict().items()}

    @torch.no_grad()
    def _load_module(self, state: dict) -> None:
        """The buffers (the weights come with the fragments)."""
        for name, buf in self.model.named_buffers():
            if name in state:
                buf.copy_(state[name])

    @torch.no_grad()
    def _load_shards(self, shard) -> None:
        """Every parameter's shard on this rank from ``shard(param, global name, range)``: the
        fp32 weights (FSDP's shards are the master weights) and AdamW's moments and step."""
        steps = []
        for p, name in self.names.items():
            local, rng = _local(p), self._range(p)
            state = self.optimizer.state[p]
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
            if rng.end == rng.start:
                continue
            tensors, step = shard(p, name, rng)
            local.copy_(tensors["param"].reshape(local.shape))
            for key in ("exp_avg", "exp_avg_sq"):
                _local(state[key]).copy_(tensors[key].reshape(local.shape))
            if step is not None:
                steps.append(float(step))
        step = max(steps, default=0.0)
        for p in self.names:
            self.optimizer.state[p]["step"] = torch.tensor(step, dtype=torch.float32)
