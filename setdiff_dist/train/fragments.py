"""The checkpoint files of the engines that shard each parameter's optimizer state over the
data-parallel ranks as contiguous ranges of the flattened parameter: megatron-core's distributed
optimizer (:mod:`~setdiff_dist.train.megatron_dp`, ZeRO-1: ranges cut bucket by bucket) and
torch's FSDP2 (:mod:`~setdiff_dist.train.fsdp_dp`, ZeRO-2: each parameter cut along its first
dimension).

Each rank writes its *fragments* (per parameter, by global name: its range ``[start, end)`` in
the flattened tensor-parallel slice, the fp32 weights and AdamW's moments of that range, the
step) and its place in the layout; the first data-parallel rank of each (TP, PP) rank writes the
module's state and the client state. That is the form DeepSpeed's universal checkpoint is
assembled from (:func:`setdiff_dist.train.universal._plan_megatron`), so either engine resumes
any layout's, or DeepSpeed's, checkpoint through the universal form.

An engine gives :class:`FragmentCheckpoints` its ``form``, :meth:`_fragments` (this rank's),
:meth:`_load_shards` (set every shard from a callback), :meth:`_module_state` (the module's
state with whole tensors, called on every rank), :meth:`_load_module` and :meth:`_after_load`.
"""

from __future__ import annotations

import glob
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from setdiff_dist.checkpoint.format import megatron_model_file, megatron_rank_file


class FragmentCheckpoints:
    """Save and load of a fragment-sharded engine (see the module's docstring)."""

    form = "megatron"
    # weight decay by the global names (train.schedule.decayed), in every checkpoint's manifest
    decay_rule = "global"

    def _checkpoint_engine(self):
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
            TorchCheckpointEngine,
        )

        engine = TorchCheckpointEngine()
        engine.zipfile_serialization = True  # (DeepSpeed's default config's)
        return engine

    # -- what an engine gives -------------------------------------------------------------------
    def _fragments(self) -> dict:
        raise NotImplementedError

    def _load_shards(self, shard) -> None:
        raise NotImplementedError

    def _module_state(self) -> dict:
        return self.module.state_dict()

    def _load_module(self, state: dict) -> None:
        self.module.load_state_dict(state)

    def _after_load(self) -> None:
        """(AdamW's per-group weight decay again, where the engine keeps it apart)"""

    # -- save -----------------------------------------------------------------------------------
    def save_checkpoint(self, root: str, tag: str, client_state: dict,
                        save_latest: bool = False) -> None:
        """Each rank its fragments; the first data-parallel rank of each (TP, PP) rank the
        module's state and the client state (with the LR scheduler's)."""
        path = os.path.join(root, tag)
        self.checkpoint_engine.makedirs(path, exist_ok=True)
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        coords = {"tensor": ps.get_tensor_model_parallel_rank(),
                  "pipeline": ps.get_pipeline_model_parallel_rank(),
                  "data": dp_rank,
                  "data_size": ps.get_data_parallel_world_size(with_context_parallel=True)}
        groups = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay") if k in g}
                  for g in self.optimizer.param_groups]
        self.checkpoint_engine.save({"fragments": self._fragments(), "form": self.form,
                                     "coords": coords, "param_groups": groups},
                                    os.path.join(path, megatron_rank_file(dist.get_rank())))
        module = self._module_state()  # (a collective where the engine shards the weights)
        if dp_rank == 0:
            self.checkpoint_engine.save(
                {"module": module, "client_state": client_state,
                 "lr_scheduler": self.lr_scheduler.state_dict(),
                 "skipped_steps": self.skipped_steps},
                os.path.join(path, megatron_model_file(ps.get_tensor_model_parallel_rank(),
                                                       ps.get_pipeline_model_parallel_rank())))

    # -- load -----------------------------------------------------------------------------------
    def load_checkpoint(self, root: str, tag: str, **_) -> tuple:
        """The same layout's files back (the module, the fragments into the optimizer, the LR
        scheduler); returns ``(path, client_state)``. A universal form (``tag`` a directory with
        ``zero/``: another layout's or DeepSpeed's checkpoint, :mod:`~setdiff_dist.train.
        universal`): :meth:`_load_universal`."""
        path = os.path.join(root, tag)
        if os.path.isdir(os.path.join(path, "zero")):
            return path, self._load_universal(path)
        common = self.checkpoint_engine.load(
            os.path.join(path, megatron_model_file(ps.get_tensor_model_parallel_rank(),
                                                   ps.get_pipeline_model_parallel_rank())),
            map_location="cpu")
        self._load_module(common["module"])
        mine = self.checkpoint_engine.load(
            os.path.join(path, megatron_rank_file(dist.get_rank())), map_location="cpu")
        self._load_fragments(mine["fragments"], path)
        self.lr_scheduler.load_state_dict(common["lr_scheduler"])
        self.skipped_steps = common.get("skipped_steps", 0)
        self._after_load()
        return path, common["client_state"]

    def _load_fragments(self, fragments: dict, path: str) -> None:
        """This rank's shards from its own fragment file (the same layout and cut)."""
        from setdiff_dist.checkpoint.files import CheckpointError

        def shard(p, name, rng):
            saved = fragments.get(name)
            if saved is None or (saved["start"], saved["end"]) != (rng.start, rng.end):
                raise CheckpointError(
                    f"{path}: {name}'s optimizer shard on rank {dist.get_rank()} does not match "
                    "this run's (a change of zero.reduce_bucket_size or of the layout); resume "
                    "with the checkpoint's settings")
            return {k: saved[k] for k in ("param", "exp_avg", "exp_avg_sq")}, saved.get("step")

        self._load_shards(shard)

    def _load_universal(self, path: str) -> dict:
        """Each parameter's shard of this rank from DeepSpeed's universal form at ``path``, cut
        for this layout by DeepSpeed's own loader (``load_hp_checkpoint_state``: the tensor-
        parallel slice, the vocabulary padding), then the range of it this rank holds. Returns
        the client state (one model-state file's: every rank's holds the same). The LR scheduler
        is put on this run's schedule by the caller (``engine.follow_schedule``)."""
        from deepspeed.checkpoint.universal_checkpoint import load_hp_checkpoint_state

        from setdiff_dist.checkpoint.files import CheckpointError

        tp_rank = ps.get_tensor_model_parallel_rank()
        tp_size = ps.get_tensor_model_parallel_world_size()

        def shard(p, name, rng):
            folder = os.path.join(path, "zero", name)
            if not os.path.isfile(os.path.join(folder, "fp32.pt")):
                raise CheckpointError(f"{path}: no universal state for {name} (a checkpoint of "
                                      "another model?)")
            weights = torch.empty(rng.end - rng.start, dtype=torch.float32)
            # (what DeepSpeed's loader reads of a parameter and its fragment)
            target = SimpleNamespace(
                shape=p.shape, numel=p.numel, _hp_mapping=SimpleNamespace(
                    lp_fragment_address=SimpleNamespace(start=rng.start,
                                                        numel=rng.end - rng.start),
                    get_hp_fragment=lambda: weights, optim_fragment={}))
            step = load_hp_checkpoint_state(target, folder, tp_rank, tp_size)
            moments = target._hp_mapping.optim_fragment
            return {"param": weights, "exp_avg": moments["exp_avg"],
                    "exp_avg_sq": moments["exp_avg_sq"]}, step

        self._load_shards(shard)
        files = sorted(glob.glob(os.path.join(path, "mp_rank_*_model_states.pt")))
        if not files:
            raise CheckpointError(f"{path}: no model-state file in this universal form")
        state = self.checkpoint_engine.load(files[0], map_location="cpu")
        self.skipped_steps = state.get("skipped_steps", 0)
        self._after_load()
        return {k: v for k, v in state.items() if k not in ("module", "optimizer")}
