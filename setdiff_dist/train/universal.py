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

:func:`convert` runs the same passes with DeepSpeed's own functions for each piece of work,
but shares the work of passes 1 and 2 out over the ranks of the resuming job (the partition
files in pass 1, the parameters, largest first, in pass 2), with a check between the passes
that every rank finished its share: a rank whose share fails makes every rank raise the same
:class:`~setdiff_dist.checkpoint.files.CheckpointError` (naming it) instead of waiting for it
at a barrier. Pass 3 is small and runs on rank 0. Everything is written under
``<step>/universal.tmp`` and renamed to ``universal`` only when complete, so an interrupted
conversion is redone, never half-used (``setdiff-train`` removes the leftover at its next
start). The checkpoint directory must be visible to every rank, as it is for a resume anyway.

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
import math
import os
import shutil
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from setdiff_dist.progress import progress

# (an agreement between the ranks: each gives what it has, ``(error or None, result)``, and
# gets every rank's, in the order of the ranks)
Agree = Callable[[tuple], list]


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


def main(argv=None) -> int:
    from setdiff_dist.checkpoint.files import CheckpointError

    ap = argparse.ArgumentParser(prog="python -m setdiff_dist.train.universal",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--input_folder", required=True, help="a checkpoint's step directory")
    ap.add_argument("--output_folder", required=True, help="where its universal form goes")
    args = ap.parse_args(argv)
    tmp = os.path.normpath(args.output_folder) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert(args.input_folder, tmp, say=lambda line: print(line, flush=True))
    except CheckpointError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        print(exc, file=sys.stderr)
        return 2
    os.replace(tmp, args.output_folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
