"""DeepSpeed's universal form of a checkpoint, converted by all the ranks together.

A resume that changes the data- or tensor-parallel size (or the optimizer state's form) reads
the optimizer state through DeepSpeed's universal checkpoint: each parameter's fp32 weights
and Adam moments whole, in ``<step>/universal/zero/<name>/``. DeepSpeed's ``ds_to_universal``
makes it in one process, in three passes:

1. *extract*: each ZeRO partition file (one per saving rank) is cut into per-parameter
   fragments;
2. *merge*: each parameter's fragments (over the saving data- and tensor-parallel ranks) are
   joined into the whole tensor;
3. the optimizer's common state and the model-state files are copied.

A checkpoint of megatron-core's distributed optimizer (``zero.implementation=megatron``) is
converted by the same three passes (:func:`_plan_megatron`): its ranks' fragments are written
as DeepSpeed's extraction writes a partition's, merged by DeepSpeed's merge, and given
DeepSpeed's common state and model-state files, so either engine reads the result.

:func:`convert` runs the same passes with DeepSpeed's own functions for each piece of work,
but shares the work of passes 1 and 2 out over the ranks of the resuming job (the partition
files in pass 1, the parameters, largest first, in pass 2), with a check between the passes
that every rank finished its share: a rank whose share fails makes every rank raise the same
:class:`~setdiff_dist.checkpoint.files.CheckpointError` (naming it) instead of waiting for it
at a barrier. Pass 3 is small and runs on rank 0. Everything is written under
``<step>/universal.tmp``, then the ranks share the hashing of its files for its own manifest
(``universal/manifest.json``: every file's size and SHA-256), and it is renamed to
``universal`` only when complete, so an interrupted conversion is redone, never half-used
(``setdiff-train`` removes the leftover at its next start). The checkpoint directory must be
visible to every rank, as it is for a resume anyway.

:func:`prepare` is what a resume calls: under ``<step>/universal.lock`` (held by rank 0; a
second job resuming the same checkpoint waits for it, then finds the form made), it checks an
existing form against its manifest (the ranks share the hashing) and refuses a damaged one,
naming the file; a form without a manifest (an older version's, or a copy cut short) is made
again, never trusted. ``universal_zero3/`` is handled the same way.

Megatron's linear layers save an ``_extra_state`` entry in the module state (Transformer
Engine's FP8 metadata; ``None`` for the local layers), which the converter would take for a
tensor and fail on; the weights come from the ZeRO optimizer's fp32 partitions, so those
entries are left out of what it reads. Every file is read without unpickling code
(:func:`~setdiff_dist.checkpoint.manifest.no_unpickling`).

``python -m setdiff_dist.train.universal --input_folder STEP --output_folder OUT`` converts in
one process (the whole work on one rank), for a checkpoint to be converted ahead of time.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import json
import math
import os
import shutil
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from setdiff_dist.errors import EXIT_USAGE
from setdiff_dist.progress import progress

# (an agreement between the ranks: each gives what it has, ``(error or None, result)``, and
# gets every rank's, in the order of the ranks)
Agree = Callable[[tuple], list]
Say = Callable[[str], None]


def share(items: list, weights: list, rank: int, world: int) -> list:
    """``rank``'s share of ``items``: the heaviest first, each to the rank with the least
    weight so far (the same answer on every rank, with no communication)."""
    load, mine = [0.0] * world, []
    for i in sorted(range(len(items)), key=lambda i: (-weights[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        load[r] += weights[i]
        if r == rank:
            mine.append(items[i])
    return mine


def _alone(mine: tuple) -> list:
    return [mine]


def dist_agree(group=None) -> Agree:
    """An :data:`Agree` over a torch.distributed group (the world by default)."""
    import torch.distributed as dist

    def agree(mine):
        found = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, mine, group=group)
        return found
    return agree


@contextlib.contextmanager
def _module_tensors_only():
    """Within this context a loaded DeepSpeed file's ``module`` state keeps only its tensors
    (see the module's docstring)."""
    load = torch.load

    def wrapped(*args, **kwargs):
        state = load(*args, **kwargs)
        if isinstance(state, dict) and isinstance(state.get("module"), dict):
            state["module"] = {k: v for k, v in state["module"].items() if torch.is_tensor(v)}
        return state

    torch.load = wrapped
    try:
        yield
    finally:
        torch.load = load


class _Passes:
    """Runs each pass's share on this rank, then checks that every rank finished its own."""

    def __init__(self, rank: int, world: int, agree: Agree, say: Callable[[str], None]):
        self.rank, self.world, self.agree, self.say = rank, world, agree, say
        self.started = time.monotonic()

    def run(self, name: str, work: Callable[[], object]) -> list:
        """``work()`` on this rank; every rank's (small) result once all have finished, or
        the first failure's :class:`CheckpointError` on every rank."""
        from setdiff_dist.checkpoint.files import CheckpointError

        try:
            mine = (None, work())
        except CheckpointError as exc:
            mine = (str(exc), None)
        except Exception as exc:  # noqa: BLE001 (told to every rank, below)
            where = traceback.extract_tb(exc.__traceback__)[-1]
            mine = (f"{type(exc).__name__}: {exc} ({os.path.basename(where.filename)}:"
                    f"{where.lineno})", None)
        found = self.agree(mine)
        failed = [(r, e) for r, (e, _) in enumerate(found) if e is not None]
        if failed:
            r, e = failed[0]
            raise CheckpointError(f"the conversion to DeepSpeed's universal form failed: rank "
                                  f"{r} could not {name}: {e}")
        progress()
        self.say(f"{name}: done at {time.monotonic() - self.started:.1f} s")
        return [result for _, result in found]

    def each(self, name: str, items: list, weights: list, do: Callable[[object], object]):
        """``do(item)`` for this rank's share of ``items``; every item's result."""
        mine = share(items, weights, self.rank, self.world)

        def work():
            out = []
            for item in mine:
                out.append(do(item))
                progress()  # (a watchdog sees a long pass move)
            return out
        found = self.run(f"{name} ({len(items)} pieces over {self.world} "
                         f"rank{'s' if self.world > 1 else ''})", work)
        return [x for part in found for x in part]


def convert(input_folder: str, output_folder: str, rank: int = 0, world: int = 1,
            agree: Agree = _alone, say: Optional[Callable[[str], None]] = None) -> None:
    """Write DeepSpeed's universal form of the checkpoint ``input_folder`` to
    ``output_folder``, the work shared by ``world`` ranks (this one ``rank``) that each call
    this with the same arguments and an ``agree`` over them (:func:`dist_agree`). The caller
    makes ``output_folder`` empty beforehand and moves it into place afterwards."""
    from setdiff_dist.checkpoint.manifest import no_unpickling

    passes = _Passes(rank, world, agree, say or (lambda line: None))
    with no_unpickling(), _module_tensors_only():
        plan = {}
        passes.run("read the checkpoint's layout",
                   lambda: plan.update(_plan(input_folder, output_folder)))
        passes.each("extract the ZeRO partitions", plan["files"], [1] * len(plan["files"]),
                    plan["extract"])
        _check_patterns(passes.each("merge each parameter's fragments", plan["params"],
                                    plan["weights"], plan["merge"]))
        passes.run("write the common optimizer state",
                   plan["finish"] if rank == 0 else lambda: None)
        if rank == 0:
            shutil.rmtree(os.path.join(output_folder, "tmp"), ignore_errors=True)


def _plan(src: str, out: str) -> dict:
    """What :func:`convert` does for the checkpoint ``src``, with DeepSpeed's functions:
    ``files`` (the partition files), ``extract(file)``, ``params`` and their ``weights``
    (elements), ``merge(param)`` (its unmatched name patterns, or None), ``finish()``."""
    from deepspeed.checkpoint import ds_to_universal as ds

    from setdiff_dist.checkpoint.files import CheckpointError
    from setdiff_dist.checkpoint.format import megatron_files

    if megatron_files(src)[0]:
        return _plan_megatron(src, out)
    temp, merged = os.path.join(out, "tmp"), os.path.join(out, "zero")
    args = SimpleNamespace(input_folder=src, output_folder=out)
    optim_files = ds._get_optim_files(src)
    zero3_files = ds._filter_zero3_optim_files(optim_files)
    if ds._get_zero_stage(zero3_files or optim_files) <= 2:
        ckpt = _open_stage12(src)
        uc_info = ckpt.get_checkpoint_info(ds.UNIVERSAL_CHECKPOINT_INFO)
        shapes_by_tp, _, _ = ds._aggregate_autoep_zero12_metadata(ckpt.model_state_metadata)
        shapes = sorted(ds._group_per_tp_shapes(shapes_by_tp, ckpt.pp_degree,
                                                ckpt.tp_degree).items())

        def finish():
            _fill_untrained(ckpt.mp_rank_files, merged)
            ds._save_optimizer_state(args, ckpt)
            for f in ckpt.mp_rank_files:
                shutil.copy2(f, out)

        return {"files": list(itertools.product(range(ckpt.pp_degree), range(ckpt.tp_degree),
                                                range(ckpt.dp_degree))),
                "extract": lambda where: ds.extract_zero_shards(temp, ckpt, where),
                "params": shapes,
                "weights": [sum(math.prod(s) for s in per_tp) for _, per_tp in shapes],
                "merge": lambda item: ds.merge_tp_slices(uc_info, merged, temp,
                                                         ckpt.tp_degree, item),
                "finish": finish}
    model_files = ds._get_zero3_model_state_files(src)
    model_grid, tp, dp = ds._build_zero3_rank_grid(model_files)
    optim_grid, tp_o, dp_o = ds._build_zero3_rank_grid(zero3_files)
    if (tp, dp) != (tp_o, dp_o):
        raise CheckpointError(f"{src}: its model-state files are of TP={tp} x DP={dp}, its "
                              f"optimizer files of TP={tp_o} x DP={dp_o}: an incomplete "
                              "checkpoint")
    shapes_grid = [ds._parse_model_states_stage3([model_grid[t][0]]) for t in range(tp)]
    per_tp = [{k: v for group in shapes_grid[t] for k, v in group.items()} for t in range(tp)]
    keys = sorted(per_tp[0])
    uc_info = None
    if tp > 1:
        uc_info = ds._load_universal_checkpoint_info_stage3(model_files)
        ds._validate_autotp_conversion_support(uc_info)

    def merge(key):
        if tp > 1:
            return ds.merge_tp_slices(uc_info, merged, temp, tp, (key, [p[key] for p in per_tp]))
        ds.merge_zero3_slices(dp, merged, temp, key)
        return None

    def finish():
        ds._save_optimizer_state_stage3(args, zero3_files)
        for f in glob.glob(os.path.join(src, "*model_states.pt")):
            if not ds._is_expert_model_state_file(f):
                shutil.copy2(f, out)

    return {"files": [(t, d) for t in range(tp) for d in range(dp)],
            "extract": lambda where: ds.extract_zero_shards_stage3(optim_grid, shapes_grid, dp,
                                                                   temp, where),
            "params": keys, "weights": [sum(math.prod(p[k]) for p in per_tp) for k in keys],
            "merge": merge, "finish": finish}


def _plan_megatron(src: str, out: str) -> dict:
    """:func:`_plan` for a checkpoint of megatron-core's distributed optimizer
    (``zero.implementation=megatron``, :mod:`setdiff_dist.train.megatron_dp`). Each rank's file
    holds, per parameter, the fp32 weights and AdamW moments of a contiguous range of the
    flattened tensor-parallel slice; in data-parallel rank order the ranges follow each other.
    So pass 1 writes each range as DeepSpeed's extraction writes a ZeRO partition's fragment,
    pass 2 is DeepSpeed's own merge of the fragments and the tensor-parallel slices, and pass 3
    writes the common optimizer state and one model-state file per (TP, PP) rank in DeepSpeed's
    form: the result is the universal form a DeepSpeed checkpoint has, read by either engine.
    The tied embedding's copy on the last pipeline stage is left out (the first stage's is
    the parameter)."""
    import deepspeed
    from deepspeed.checkpoint import ds_to_universal as ds
    from deepspeed.checkpoint.constants import PARAM_GROUPS, UNIVERSAL_CHECKPOINT_INFO

    from setdiff_dist.checkpoint.files import CheckpointError
    from setdiff_dist.checkpoint.format import GLOBAL_NAMES, megatron_files, megatron_model_file

    temp, merged = os.path.join(out, "tmp"), os.path.join(out, "zero")
    rank_files, found = megatron_files(src)
    tp = 1 + max((t for t, _ in found), default=-1)
    pp = 1 + max((p for _, p in found), default=-1)
    missing = [megatron_model_file(t, p) for t in range(tp) for p in range(pp)
               if (t, p) not in found]
    if not found or missing:
        raise CheckpointError(f"{src}: {', '.join(missing) or 'every megatron model file'} "
                              "missing: an incomplete checkpoint")
    models = {k: torch.load(f, map_location="cpu", mmap=True) for k, f in found.items()}
    first = models[0, 0]["client_state"]
    uc_info = first[UNIVERSAL_CHECKPOINT_INFO]
    # each parameter's slice shape per TP rank, by global name; a stage's copy of a name an
    # earlier stage has (the tied embedding) is not a parameter of its own
    per_tp: dict = {}
    for p in range(pp):
        stage: dict = {}
        for t in range(tp):
            state = models[t, p]
            names = state["client_state"][GLOBAL_NAMES]
            for local, tensor in state["module"].items():
                if local in names and torch.is_tensor(tensor) and names[local] not in per_tp:
                    stage.setdefault(names[local], [None] * tp)[t] = tuple(tensor.shape)
        per_tp.update(stage)
    shapes = sorted(per_tp.items())

    def extract(file):
        state = torch.load(file, map_location="cpu")
        where = state.get("coords")
        if where is None:
            raise CheckpointError(f"{file} was saved before megatron checkpoints recorded each "
                                  "rank's place in the layout: it resumes at the layout and "
                                  "zero.implementation it was saved with only")
        for name, frag in state["fragments"].items():
            if frag.get("copy"):
                continue
            numel = frag["end"] - frag["start"]
            for key, state_name in (("param", "fp32"), ("exp_avg", "exp_avg"),
                                    ("exp_avg_sq", "exp_avg_sq"), ("step", "step")):
                if key in frag:
                    ds.dump_param_fragment(temp, where["tensor"], where["data"], state_name,
                                           frag[key].reshape(-1) if key != "step" else frag[key],
                                           name, 0, numel)

    def finish():
        any_rank = torch.load(rank_files[0], map_location="cpu")
        os.makedirs(merged, exist_ok=True)
        torch.save({PARAM_GROUPS: _zero12_groups(any_rank.get("param_groups") or [{}]),
                    "ds_version": deepspeed.__version__},
                   os.path.join(merged, "optimizer_state.pt"))
        dp = any_rank["coords"]["data_size"]
        for (t, p), state in models.items():
            sched = state["lr_scheduler"]
            torch.save({"module": {k: v for k, v in state["module"].items() if torch.is_tensor(v)},
                        "lr_scheduler": sched, "skipped_steps": state.get("skipped_steps", 0),
                        "global_steps": sched.get("last_epoch", 0), "dp_world_size": dp,
                        "mp_world_size": tp, "ds_version": deepspeed.__version__,
                        **state["client_state"]},
                       os.path.join(out, f"mp_rank_{p * tp + t:02d}_model_states.pt"))

    return {"files": rank_files, "extract": extract, "params": shapes,
            "weights": [sum(math.prod(s) for s in per) for _, per in shapes],
            "merge": lambda item: ds.merge_tp_slices(uc_info, merged, temp, tp, item),
            "finish": finish}


def _zero12_groups(groups: list) -> list:
    """The parameter groups of a universal form's common state, for a ZeRO-1/2 engine: DeepSpeed
    pairs the saved groups with its own (weight decay, none) in order and loads only the groups
    it pairs, so one of each comes first, then the rest (it overwrites their hyperparameters
    with the run's)."""
    decay = next((g for g in groups if g.get("weight_decay", 0) > 0), groups[0])
    return [decay, next((g for g in groups if not g.get("weight_decay", 0)), decay), *groups]


def _open_stage12(folder: str):
    from deepspeed.checkpoint import DeepSpeedCheckpoint
    from deepspeed.checkpoint import ds_to_universal as ds

    from setdiff_dist.checkpoint.files import CheckpointError

    ckpt = DeepSpeedCheckpoint(folder)
    ds._check_for_required_state(ckpt)
    _, experts, _ = ds._aggregate_autoep_zero12_metadata(ckpt.model_state_metadata)
    if experts or glob.glob(os.path.join(folder, "layer_*_expert_*_model_states.pt")):
        raise CheckpointError(f"{folder} has mixture-of-experts layers, which this converter "
                              "does not handle")
    return ckpt


def _check_patterns(unmatched: list) -> None:
    """DeepSpeed's strict check: a name pattern of the universal-checkpoint info that matched
    no parameter at all (on any rank) means the info does not describe this model."""
    unmatched = [u for u in unmatched if u is not None]
    if unmatched:
        never = set.intersection(*(set(u) for u in unmatched))
        if never:
            from setdiff_dist.checkpoint.files import CheckpointError

            raise CheckpointError(f"the checkpoint's universal-checkpoint info names patterns "
                                  f"no parameter matches: {sorted(never)}")


def _fill_untrained(mp_rank_files: list, merged: str) -> None:
    """As DeepSpeed's converter: a parameter that never received a gradient has no optimizer
    fragment; its model value is written as its fp32 weights."""
    from deepspeed.checkpoint.constants import PARAM

    from setdiff_dist.checkpoint.format import GLOBAL_NAMES

    for model_file in mp_rank_files:
        state = torch.load(model_file, map_location="cpu")
        names = state.get(GLOBAL_NAMES) or {}  # (older checkpoints: the stage's own names)
        for name, tensor in (state.get("module") or {}).items():
            path = os.path.join(merged, names.get(name, name), "fp32.pt")
            if not os.path.isfile(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save({PARAM: tensor.float()}, path)


def zero3_view(universal: str, out: str, padded_vocab: int) -> None:
    """``out``: the universal form ``universal`` of a ZeRO 1-2 checkpoint as DeepSpeed's ZeRO-3
    engine reads it (at tensor-parallel size 1). Each parameter's directory is a link into
    ``universal`` but for the vocabulary tensors, which the converter stripped of their padding
    and ZeRO-3 does not pad again: written padded with zeros to ``padded_vocab`` rows, as the
    ZeRO-1/2 load pads them. The common optimizer state gets the ZeRO-3 keys (the AdamW step
    and parameter groups, from the ZeRO-1/2 state), and the model-state files the ZeRO-3 names
    (links)."""
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        OPTIMIZER_STATE_DICT,
        PARAM,
        PARAM_GROUPS,
        VOCAB_TENSOR,
    )

    from setdiff_dist.checkpoint.manifest import no_unpickling

    source, target = os.path.join(universal, "zero"), os.path.join(out, "zero")
    os.makedirs(target)
    step = None
    with no_unpickling():
        for name in sorted(os.listdir(source)):
            there = os.path.join(source, name)
            if not os.path.isdir(there):
                continue
            fp32 = torch.load(os.path.join(there, "fp32.pt"), map_location="cpu")
            if step is None and os.path.isfile(os.path.join(there, "step.pt")):
                step = torch.load(os.path.join(there, "step.pt"), map_location="cpu")
            if not (isinstance(fp32, dict) and fp32.get(VOCAB_TENSOR)):
                os.symlink(os.path.relpath(there, target), os.path.join(target, name))
                continue
            os.makedirs(os.path.join(target, name))
            for f in sorted(os.listdir(there)):
                state = torch.load(os.path.join(there, f), map_location="cpu")
                if isinstance(state, dict) and torch.is_tensor(state.get(PARAM)):
                    rows = padded_vocab - state[PARAM].shape[0]
                    state = dict(state, **{PARAM: torch.nn.functional.pad(
                        state[PARAM], (0, 0, 0, rows), "constant", 0)})
                    state.pop(VOCAB_TENSOR, None)
                torch.save(state, os.path.join(target, name, f))
        common = torch.load(os.path.join(source, "optimizer_state.pt"), map_location="cpu")
    groups = common.get(PARAM_GROUPS) or common[BASE_OPTIMIZER_STATE][PARAM_GROUPS]
    common[OPTIMIZER_STATE_DICT] = {"state": {0: {"step": step}}, "param_groups": groups}
    torch.save(common, os.path.join(target, "optimizer_state.pt"))
    for f in sorted(os.listdir(universal)):
        if f.startswith("mp_rank_") and f.endswith("_model_states.pt"):
            os.symlink(os.path.relpath(os.path.join(universal, f), out),
                       os.path.join(out, f"zero_pp_rank_0_{f}"))


def zero12_view(universal: str, out: str) -> None:
    """``out``: the universal form ``universal`` of a ZeRO-3 checkpoint (of tensor-parallel size
    1) as a ZeRO-1/2 engine, DeepSpeed's or megatron's distributed optimizer, reads it. DeepSpeed's
    ZeRO-3 converter keeps each state a flat tensor with no flags; each parameter is written
    again by DeepSpeed's own ZeRO-1/2 merge (``merge_tp_slices``, one tensor-parallel slice) from
    that tensor as its one fragment: shaped, the vocabulary padding stripped and flagged, the
    tensor-parallel flags of the checkpoint's universal-checkpoint info. The AdamW step (kept
    once, in the common state) goes to every parameter's ``step.pt``; the common state gets a
    DeepSpeed version and the groups of a ZeRO-1/2 optimizer (:func:`_zero12_groups`); the
    model-state files the ZeRO-1/2 names (links)."""
    from deepspeed.checkpoint import ds_to_universal as ds
    from deepspeed.checkpoint.constants import (
        OPTIMIZER_STATE_DICT,
        PARAM_GROUPS,
        UNIVERSAL_CHECKPOINT_INFO,
    )

    from setdiff_dist.checkpoint.files import CheckpointError
    from setdiff_dist.checkpoint.manifest import no_unpickling

    models = sorted(f for f in os.listdir(universal)
                    if f.startswith("zero_pp_rank_") and f.endswith("_model_states.pt"))
    if not models:
        raise CheckpointError(f"{universal} holds no ZeRO-3 model-state file")
    source, target, temp = (os.path.join(universal, "zero"), os.path.join(out, "zero"),
                            os.path.join(out, "tmp"))
    os.makedirs(target)
    with no_unpickling():
        state = torch.load(os.path.join(universal, models[0]), map_location="cpu")
        uc_info = state[UNIVERSAL_CHECKPOINT_INFO]
        shapes = {k: tuple(v) for group in state["param_shapes"] for k, v in group.items()}
        common = torch.load(os.path.join(source, "optimizer_state.pt"), map_location="cpu")
    steps = [s.get("step") for s in common[OPTIMIZER_STATE_DICT]["state"].values()]
    for name, shape in sorted(shapes.items()):
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            with no_unpickling():
                flat = torch.load(os.path.join(source, name, f"{key}.pt"), map_location="cpu")
            ds.dump_param_fragment(temp, 0, 0, key, flat.reshape(-1), name, 0, flat.numel())
        if steps and steps[0] is not None:
            ds.dump_param_fragment(temp, 0, 0, "step", steps[0], name, 0, 1)
        ds.merge_tp_slices(uc_info, target, temp, 1, (name, [shape]))
        progress()
    shutil.rmtree(temp)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in common[PARAM_GROUPS]]
    import deepspeed

    torch.save({PARAM_GROUPS: _zero12_groups(groups), "ds_version": deepspeed.__version__,
                **{k: common[k] for k in ("loss_scaler", "dynamic_loss_scale", "overflow")
                   if k in common}},
               os.path.join(target, "optimizer_state.pt"))
    for f in models:  # zero_pp_rank_0_mp_rank_TT_model_states.pt -> mp_rank_TT_model_states.pt
        if f.startswith("zero_pp_rank_0_"):
            os.symlink(os.path.relpath(os.path.join(universal, f), out),
                       os.path.join(out, f[len("zero_pp_rank_0_"):]))


# ------------------------------------------------------------------ made once, checked always

def _together(agree: Agree, work: Callable[[], object], what: str) -> list:
    """``work()`` on every rank; every rank's result, or the first failure (a
    :class:`CheckpointError`, or ``cannot <what>: <the OSError>``) raised on every rank."""
    from setdiff_dist.checkpoint.files import CheckpointError

    try:
        mine = (None, work())
    except CheckpointError as exc:
        mine = (str(exc), None)
    except OSError as exc:
        mine = (f"cannot {what}: {exc}", None)
    found = agree(mine)
    for error, _ in found:
        if error is not None:
            raise CheckpointError(error)
    return [result for _, result in found]


def _seal(directory: str, of: str, rank: int, world: int, agree: Agree, hashes: bool) -> dict:
    """The manifest of the derived form being written in ``directory`` (the ranks share the
    hashing); rank 0 writes it there, last."""
    from setdiff_dist.checkpoint.files import derived_files, describe_files, write_atomic
    from setdiff_dist.checkpoint.format import MANIFEST
    from setdiff_dist.checkpoint.manifest import derived_manifest

    files, links = derived_files(directory)
    tables = _together(agree, lambda: describe_files(directory, files[rank::world], hashes),
                       f"hash the files of {directory}")
    manifest = derived_manifest(of, {k: v for t in tables for k, v in t.items()}, links)
    if rank == 0:
        write_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1))
    return manifest


def _check(directory: str, made_from: str, rank: int, world: int, agree: Agree,
           hashes: bool) -> None:
    """Refuse the derived form ``directory`` (made from ``made_from``) if any of its files or
    links differs from its manifest: every rank checks its share and raises the same
    :class:`CheckpointError`, naming the files and how to have the form made again."""
    from setdiff_dist.checkpoint.files import CheckpointError
    from setdiff_dist.checkpoint.format import UNIVERSAL, UNIVERSAL_ZERO3
    from setdiff_dist.checkpoint.manifest import derived_problems, read_derived

    def mine():
        manifest, problems = read_derived(directory)
        if manifest is None:
            return problems if rank == 0 else []
        return derived_problems(directory, manifest, sorted(manifest["files"])[rank::world],
                                hashes, links=rank == 0)
    problems = sorted(p for part in _together(agree, mine, f"check {directory}") for p in part)
    if problems:
        what = "DeepSpeed's universal form" if directory.endswith(UNIVERSAL) else \
            f"the {'ZeRO-3' if directory.endswith(UNIVERSAL_ZERO3) else 'ZeRO-1/2'} view of " \
            "DeepSpeed's universal form"
        raise CheckpointError(
            f"{directory} ({what} of {made_from}, made for a resume in another layout) is "
            f"damaged: {'; '.join(problems[:3])}"
            f"{f' (and {len(problems) - 3} more)' if len(problems) > 3 else ''}. Remove "
            f"{directory} (rm -r) and resume again: it is made again from {made_from}, which "
            "the resume verifies")


def _found(directory: str, say: Say, also: tuple = ()) -> bool:
    """(Rank 0, under the lock.) Whether ``directory`` holds a form to check (it has its
    manifest). One without (an older version's, or cut short) is removed, with ``also`` (the
    forms derived from it), to be made again; so is its temporary directory."""
    from setdiff_dist.checkpoint.format import MANIFEST

    shutil.rmtree(directory + ".tmp", ignore_errors=True)
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        return True
    if os.path.lexists(directory):
        say(f"note: {directory} has no manifest (made by an older version, or not completely): "
            "making it again")
        shutil.rmtree(directory)
    for other in also:
        if os.path.lexists(other):
            shutil.rmtree(other)
    return False


def _take(lock, agree: Agree, say: Say, poll_s: float) -> None:
    """Every rank waits until rank 0 holds ``lock`` (short agreements, every ``poll_s``
    seconds: no rank sits in one collective for as long as another job converts)."""
    waited = False
    while True:
        got = lock.acquire(blocking=False) if lock is not None else None
        if lock is not None and not got and not waited:
            say(f"waiting for {lock.holder()} ({lock.path}), which makes or checks the same "
                "universal form; this job then uses it")
        if agree((None, got))[0][1]:
            return
        waited = True
        time.sleep(poll_s)


def prepare(path: str, rank: int = 0, world: int = 1, agree: Agree = _alone,
            zero3_rows: Optional[int] = None, hashes: bool = True, say: Optional[Say] = None,
            poll_s: float = 2.0) -> str:
    """The tag (directory in the step directory ``path``) a resume in another layout loads the
    optimizer state from: ``universal``, or for a ZeRO-3 run (``zero3_rows``: its padded
    vocabulary rows) of a ZeRO 1-2 checkpoint ``universal_zero3`` (:func:`zero3_view`), or for
    a ZeRO-1/2 run of a ZeRO-3 checkpoint ``universal_zero12`` (:func:`zero12_view`). Made
    if missing (by the ``world`` ranks together, each its share), checked against its manifest
    if there (``hashes``: with SHA-256, else sizes), under the checkpoint's
    :class:`~setdiff_dist.checkpoint.files.ConversionLock`, held by rank 0. Every rank of the
    job calls this with an ``agree`` over them; ``say``: rank 0's notes."""
    from setdiff_dist.checkpoint.files import CheckpointError, ConversionLock
    from setdiff_dist.checkpoint.format import UNIVERSAL, UNIVERSAL_ZERO3, UNIVERSAL_ZERO12

    say = say or (lambda line: None)
    out = os.path.join(path, UNIVERSAL)
    views = (os.path.join(path, UNIVERSAL_ZERO3), os.path.join(path, UNIVERSAL_ZERO12))
    lock = ConversionLock(path) if rank == 0 else None
    try:
        _take(lock, agree, say, poll_s)
        there = _together(agree, lambda: _found(out, say, views) if rank == 0 else None,
                          f"clean up {out}")[0]
        if there:
            _check(out, path, rank, world, agree, hashes)
        else:
            _convert_into(path, out, rank, world, agree, hashes, say)
        saved_zero3 = any(f.startswith("zero_pp_rank_") and f.endswith("_model_states.pt")
                          for f in os.listdir(path))
        if saved_zero3 == (zero3_rows is not None):  # (ZeRO-3 from ZeRO-3, 1-2 from 1-2)
            return UNIVERSAL
        tag = UNIVERSAL_ZERO12 if saved_zero3 else UNIVERSAL_ZERO3
        view = os.path.join(path, tag)
        if _together(agree, lambda: _found(view, say) if rank == 0 else None,
                     f"clean up {view}")[0]:
            _check(view, out, rank, world, agree, hashes)
            return tag
        tmp = view + ".tmp"

        def make():
            try:
                if saved_zero3:
                    zero12_view(out, tmp)
                else:
                    zero3_view(out, tmp, zero3_rows)
            except (OSError, CheckpointError) as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(f"cannot make {tag} from {out}: {exc}") from None
        _together(agree, make if rank == 0 else lambda: None, f"make {view}")
        _seal(tmp, path, rank, world, agree, hashes)
        _together(agree, lambda: os.replace(tmp, view) if rank == 0 else None, f"make {view}")
        return tag
    finally:
        if lock is not None:
            lock.release()


def _convert_into(path: str, out: str, rank: int, world: int, agree: Agree, hashes: bool,
                  say: Say) -> None:
    """Convert the checkpoint ``path`` into ``out`` (through ``out.tmp``), its manifest written
    last, then renamed into place (see :func:`prepare`)."""
    from setdiff_dist.checkpoint.files import CheckpointError

    tmp = out + ".tmp"
    say(f"converting {path} to DeepSpeed's universal form for this layout, on {world} "
        f"rank{'s' if world > 1 else ''}")
    try:
        convert(path, tmp, rank, world, agree, lambda line: say(f"  {line}"))
        agree((None, None))  # (rank 0 has removed the converter's scratch files)
        _seal(tmp, path, rank, world, agree, hashes)
        _together(agree, lambda: os.replace(tmp, out) if rank == 0 else None,
                  f"move {tmp} into place")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv=None) -> int:
    from setdiff_dist.checkpoint.files import CheckpointError, ConversionLock

    ap = argparse.ArgumentParser(prog="python -m setdiff_dist.train.universal",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--input_folder", required=True, help="a checkpoint's step directory")
    ap.add_argument("--output_folder", required=True, help="where its universal form goes")
    args = ap.parse_args(argv)
    out = os.path.normpath(args.output_folder)
    tmp = out + ".tmp"
    lock = ConversionLock(os.path.dirname(out) or ".")
    lock.acquire()
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        convert(args.input_folder, tmp, say=lambda line: print(line, flush=True))
        _seal(tmp, os.path.normpath(args.input_folder), 0, 1, _alone, True)
        os.replace(tmp, out)
    except CheckpointError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    finally:
        lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
