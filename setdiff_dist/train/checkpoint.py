"""Checkpoints: one directory per save, a ``latest`` pointer that only moves when every rank is
done, and resume that checks the checkpoint against the run before loading it.

``run_dir/checkpoints/step_0000123/`` holds
- DeepSpeed's files: model states per model-parallel rank, optimizer states per data-parallel
  rank, LR scheduler, our client state (step, samples seen, data-loader position); files are
  numbered by the rank in the tensor x pipeline grid (see ``build_engine``);
- ``weights/tpTT_ppPP.safetensors`` (+ ``.json``, and ``tpTT_ppPP_partRR.safetensors`` for
  data-parallel rank ``RR``'s share): each model-parallel rank's weights under their global
  names with their sharding, gathered one parameter at a time over ZeRO-3 partitions and
  written by every data-parallel rank: what inference and ``setdiff-convert`` read, in any
  layout, without unpickling anything;
- ``rng_rank{r}.pt`` per rank (torch and megatron RNG states), the tokenizer file,
  ``config.yaml`` and ``manifest.json`` (layout, model, tokenizer). The manifest is written after
a barrier that every rank reaches only once its files are on disk, and ``latest`` is then
replaced atomically, so a crash at any point leaves ``latest`` at a complete checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from setdiff_dist.checkpoint.files import (
    FORMAT,
    LATEST,
    CheckpointError,
    checkpoint_files,
    checkpoint_root,
    damaged,
    describe_files,
    file_problems,
    prune,
    read_manifest,
    resolve_latest,
    step_directory,
    tag_of,
    write_atomic,
)
from setdiff_dist.checkpoint.weights import EMA_WEIGHTS

UNIVERSAL = "universal"  # a step's DeepSpeed universal checkpoint, for another DP size


def _deepspeed_globals() -> list:
    """The classes DeepSpeed pickles into its checkpoint files, beside tensors and containers
    (found with ``torch.serialization.get_unsafe_globals_in_checkpoint`` on ZeRO 0-3, fp32 and
    bf16 checkpoints): plain records, safe to rebuild."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def check_no_code(path: str) -> None:
    """Refuse a checkpoint any of whose pickled files (``*.pt``, the universal form's too)
    names a class or function beyond tensors, containers and :func:`_deepspeed_globals`: read
    from the pickle's opcodes, nothing executed, the same verdict on every rank."""
    import glob

    allowed = {f"{c.__module__}.{c.__name__}" for c in _deepspeed_globals()}
    for file in sorted(glob.glob(os.path.join(path, "**", "*.pt"), recursive=True)):
        try:
            found = set(torch.serialization.get_unsafe_globals_in_checkpoint(file))
        except Exception as exc:
            raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc}); it is "
                                  "damaged: resume from an earlier checkpoint") from None
        unsafe = sorted(found - allowed)
        if unsafe:
            raise CheckpointError(f"{file} would run code when loaded ({', '.join(unsafe[:3])}"
                                  f"{' ...' if len(unsafe) > 3 else ''}): refused, nothing from "
                                  "it was run; resume from a checkpoint you trust")


@contextlib.contextmanager
def no_unpickling():
    """Within this context every ``torch.load`` (DeepSpeed's included) reads with
    ``weights_only=True``, allowing only :func:`_deepspeed_globals`: a checkpoint file cannot
    run code. A file that needs anything else fails with a :class:`CheckpointError`."""
    import pickle

    original = torch.load
    allowed = _deepspeed_globals()

    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(allowed):
                return original(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            found = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line]
            raise CheckpointError(f"{f} would run code when loaded ({(found or ['?'])[0]}): "
                                  "refused, nothing from it was run; resume from a checkpoint "
                                  "you trust") from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def universal_info(model) -> dict:
    """What DeepSpeed's universal-checkpoint converter needs to merge each parameter's tensor-
    parallel slices (megatron's attributes, as patterns of DeepSpeed's parameter names)."""
    from deepspeed.checkpoint import constants as C

    replicated, row, halves, vocab = [], [], [], []
    for name, p in model.named_parameters():
        pattern = re.escape(name) + "$"
        if not getattr(p, "tensor_model_parallel", False):
            replicated.append(pattern)
        elif p.partition_dim == 1:
            row.append(pattern)
        elif getattr(p, "partition_stride", 1) == 2:
            halves.append(pattern)  # SwiGLU's [gate ; up]
        if name.endswith(("embedding.weight", "word_embeddings.weight", "output_layer.weight")):
            vocab.append(pattern)
    return {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.2,
            C.TP_REPLICATED_PARAMETER_PATTERNS: replicated,
            C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: row,
            C.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: halves,
            C.VOCABULARY_PARAMETER_PATTERNS: vocab,
            C.ORIGINAL_VOCAB_SIZE: model.vocab_size + 1, C.PADDED_VOCAB_SIZE: model.padded_vocab}


def needs_universal(path: str) -> bool:
    """Whether resuming ``path`` in this run's layout changes the data- or tensor-parallel size
    (without pipeline parallelism): the optimizer state must then be re-partitioned through
    DeepSpeed's universal checkpoint. :func:`check_compatible` refuses the changes it cannot
    make."""
    try:
        with open(os.path.join(path, "manifest.json")) as fh:
            saved = json.load(fh)["layout"]
    except (OSError, ValueError, KeyError):
        return False  # (check_compatible says what is wrong with it)
    here = layout()
    return (saved["data"] != here["data"] or saved["tensor"] != here["tensor"]) and \
        saved["pipeline"] == here["pipeline"] == 1


def make_universal(path: str) -> str:
    """``path/universal``: DeepSpeed's universal form of the checkpoint (each parameter's fp32
    weights and optimizer moments whole), converted once by rank 0, through a temporary
    directory so that an interrupted conversion is redone, never half-used."""
    out = os.path.join(path, UNIVERSAL)
    if dist.get_rank() == 0 and not os.path.isdir(out):
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        from setdiff_dist.processes import die_with_parent

        # (the converter dies with this rank: a killed job leaves no process writing)
        res = subprocess.run([sys.executable, "-m", "setdiff_dist.train.universal",
                              "--input_folder", path, "--output_folder", tmp,
                              "--num_extract_workers", "1", "--num_merge_workers", "1"],
                             capture_output=True, text=True, preexec_fn=die_with_parent)
        if res.returncode:
            shutil.rmtree(tmp, ignore_errors=True)
            tail = "\n".join(res.stderr.strip().splitlines()[-5:])
            raise CheckpointError(f"cannot convert {path} for another data-parallel size "
                                  f"(DeepSpeed's ds_to_universal failed):\n{tail}")
        os.replace(tmp, out)
        stray = os.path.join(path, "latest_universal")  # the converter's pointer: not ours
        if os.path.isfile(stray):
            os.remove(stray)
    dist.barrier()
    return out


def layout() -> dict:
    return {"tensor": ps.get_tensor_model_parallel_world_size(),
            "pipeline": ps.get_pipeline_model_parallel_world_size(),
            "data": ps.get_data_parallel_world_size(), "world": dist.get_world_size(),
            "context": ps.get_context_parallel_world_size()}


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_weights(engine, directory: str, zero_stage: int, ema=None) -> None:
    """This model-parallel rank's weights (global names, TP-local shards) as safetensors, with
    each tensor's sharding in a JSON sidecar. Every data-parallel rank writes a part: tensor
    ``i`` goes to part ``i % DP`` (``tpTT_ppPP.safetensors`` for part 0,
    ``tpTT_ppPP_partRR.safetensors`` for the others), one tensor at a time; under ZeRO-3 each
    parameter is gathered alone, so no rank ever holds the whole model and a writer one tensor.
    With ``ema`` (:class:`~setdiff_dist.train.ema.EMA`) the averages are written instead, in
    fp32, under the same names and layout. Collective over the data-parallel group."""
    from setdiff_dist.checkpoint.weights import StreamingSafetensors
    from setdiff_dist.model.transformer import global_name

    model = engine.module
    entries, meta, local = [], {}, {}
    for name, p in model.named_parameters():
        gname = global_name(model, name)
        if gname in meta:  # the tied output weight on the last stage: a copy
            continue
        entries.append((gname, p))
        local[gname] = name
        meta[gname] = {"tensor_parallel": bool(getattr(p, "tensor_model_parallel", False)),
                       "dim": int(getattr(p, "partition_dim", -1)),
                       "stride": int(getattr(p, "partition_stride", 1))}
    name = (f"tp{ps.get_tensor_model_parallel_rank():02d}_"
            f"pp{ps.get_pipeline_model_parallel_rank():02d}")
    # every rank holding these weights writes its part: data x context-parallel ranks
    parts = ps.get_data_parallel_world_size(with_context_parallel=True)
    part = ps.get_data_parallel_rank(with_context_parallel=True)
    for i, (gname, _) in enumerate(entries):
        meta[gname]["part"] = i % parts
    os.makedirs(directory, exist_ok=True)
    file = name + (f"_part{part:02d}" if part else "") + ".safetensors"
    writer = StreamingSafetensors(
        os.path.join(directory, file),
        [(g, torch.float32 if ema is not None else p.dtype,
          tuple(getattr(p, "ds_shape", p.shape)))
         for i, (g, p) in enumerate(entries) if i % parts == part])
    for i, (gname, p) in enumerate(entries):
        if ema is not None:
            value = ema.tensor(local[gname])  # (under ZeRO-3 a gather every rank takes part in)
            if i % parts == part:
                writer.write(gname, value)
            continue
        gather = contextlib.nullcontext()
        if zero_stage == 3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters([p], modifier_rank=None)
        with gather:  # (every data-parallel rank takes part in each gather)
            if i % parts == part:
                writer.write(gname, p.detach())
    writer.close()
    if part == 0:
        with open(os.path.join(directory, name + ".json"), "w") as fh:
            json.dump({"tensor_parallel_size": ps.get_tensor_model_parallel_world_size(),
                       "parts": parts, "tensors": meta}, fh, indent=1, sort_keys=True)


def save(engine, cfg, step: int, client_state: dict, tokenizer_identity: dict,
         tokenizer_dir: Optional[str] = None, ema=None, data: Optional[dict] = None) -> str:
    """Save on every rank; returns the checkpoint directory. ``data``: the data stream's
    identity (the loader's state without its step), which the manifest records so that a
    resume on other data is refused before any model is built."""
    root = checkpoint_root(cfg.run_dir)
    tag = tag_of(step)
    path = os.path.join(root, tag)
    rank = dist.get_rank()
    need = _check_space(root, tag)  # (collective: every rank refuses, or none)
    if rank == 0 and os.path.isdir(path):  # an earlier save of this step (a crash, or resume=never)
        pointer = os.path.join(root, LATEST)
        if os.path.isfile(pointer) and open(pointer).read().strip() == tag:
            os.remove(pointer)  # never leave latest pointing at a directory being rewritten
        shutil.rmtree(path)
    dist.barrier()
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    client_state = dict(client_state, **{UNIVERSAL_CHECKPOINT_INFO: universal_info(engine.module)})
    try:
        engine.save_checkpoint(root, tag=tag, client_state=client_state,
                               save_latest=False)
        save_weights(engine, os.path.join(path, "weights"), cfg.zero.stage)
        if ema is not None:
            save_weights(engine, os.path.join(path, EMA_WEIGHTS), cfg.zero.stage, ema=ema)
        torch.save(_rng_state(), os.path.join(path, f"rng_rank{rank}.pt"))
        if rank == 0:
            with open(os.path.join(path, "config.yaml"), "w") as fh:
                fh.write(cfg.to_yaml())
            if tokenizer_identity.get("file") and tokenizer_dir:
                from setdiff_dist.paths import inside

                name = tokenizer_identity["file"]
                shutil.copyfile(inside(tokenizer_dir, name, "the tokenizer file",
                                       CheckpointError),
                                inside(path, name, "the tokenizer file", CheckpointError))
        _fault_point("after_shards", step)
        dist.barrier()  # every rank's files are on disk
        world = dist.get_world_size()
        mine = describe_files(path, checkpoint_files(path)[rank::world], cfg.checkpoint.checksums)
        tables = [None] * world
        dist.all_gather_object(tables, mine)
        if rank == 0:
            files = {k: v for t in tables for k, v in t.items()}
            manifest = {"format": FORMAT, "step": step, "layout": layout(),
                        "zero_stage": cfg.zero.stage, "model": cfg.to_dict()["model"],
                        "order": cfg.to_dict()["order"], "seq_len": cfg.data.seq_len,
                        "seed": cfg.train.seed,
                        "tokenizer": tokenizer_identity, "files": dict(sorted(files.items()))}
            if data is not None:
                manifest["data"] = data
            write_atomic(os.path.join(path, "manifest.json"), json.dumps(manifest, indent=2))
            write_atomic(os.path.join(root, LATEST), tag + "\n")
    except (OSError, RuntimeError) as exc:
        if not _write_failure(exc):
            raise
        raise _save_failed(exc, root, tag, need) from None
    if rank == 0:
        prune(root, cfg.checkpoint.keep_last, keep=tag)
    dist.barrier()
    return path


# how torch's checkpoint writer reports a write the OS refused (its errno is lost on the way)
_WRITE_FAILURES = ("PytorchStreamWriter", "unexpected pos", "file write failed",
                   "inline_container", "iostream error", "basic_ios")


def _write_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed write (an OSError, or torch's writer failing under one),
    not a collective that lost a peer."""
    return isinstance(exc, OSError) or any(s in str(exc) for s in _WRITE_FAILURES)


def _previous_size(root: str, tag: str) -> Optional[int]:
    """Bytes of the newest complete checkpoint before ``tag`` (what this save will take,
    give or take a few bytes of metadata), or None without one."""
    from setdiff_dist.checkpoint.files import complete_checkpoints

    older = [p for p in complete_checkpoints(os.path.dirname(root)) if os.path.basename(p) < tag]
    if not older:
        return None
    try:
        return sum(f["bytes"] for f in read_manifest(older[-1]).get("files", {}).values()) or None
    except (CheckpointError, KeyError, TypeError):
        return None


def _free_bytes(path: str) -> int:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _check_space(root: str, tag: str) -> Optional[int]:
    """Refuse a save that cannot fit, before anything is written: the previous checkpoint's
    size against the least free space any rank sees (all ranks agree). Returns the size (None
    before the first save: the save itself then says it if the disk fills)."""
    box = [_previous_size(root, tag) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    need = box[0]
    free = torch.tensor([float(_free_bytes(root))], dtype=torch.float64)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    free = free.item()
    if need is not None and free < need:
        raise CheckpointError(
            f"not enough disk space to save {tag}: it needs about {need / 2**20:,.1f} MiB (the "
            f"size of the previous checkpoint) and {root} has {free / 2**20:,.1f} MiB free"
            f"{' on one of the ranks' if dist.get_world_size() > 1 else ''}. Nothing was "
            f"written; {_resumable(root)}. Free space (or lower checkpoint.keep_last) and run "
            "the same command again")
    return need


def _resumable(root: str) -> str:
    from setdiff_dist.checkpoint.files import pointed

    latest = pointed(root)
    return (f"{LATEST} still points at {os.path.basename(latest)}, and resume=auto goes on "
            "from it (the steps since are lost)" if latest else
            "there is no earlier checkpoint: the run starts over")


def _save_failed(exc: BaseException, root: str, tag: str, need: Optional[int]) -> CheckpointError:
    """The error for a save that failed to write (removing its partial directory, so that the
    space comes back and nothing half-written remains): the disk full, a file-size limit, or
    the OS error as it came."""
    import errno
    import resource

    code = getattr(exc, "errno", None)
    free = _free_bytes(root)  # (before the partial save is removed)
    path = os.path.join(root, tag)
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        shutil.rmtree(path, ignore_errors=True)
    for f in os.listdir(root) if os.path.isdir(root) else []:
        if f.startswith(f"{LATEST}.tmp-"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(root, f))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    size = f"about {need / 2**20:,.1f} MiB" if need else \
        "about the size of the weights and the optimizer state"
    if code in (errno.ENOSPC, errno.EDQUOT) or (code is None and free < 16 * 2**20):
        cause = (f"the disk is full ({free / 2**20:,.1f} MiB free in {root}; the save needs "
                 f"{size})")
    elif code == errno.EFBIG or (code is None and limit != resource.RLIM_INFINITY):
        cause = (f"a file of the save is larger than this process may write (ulimit -f: "
                 f"{limit / 1024:,.0f} KiB; the save needs {size} in all)")
    else:
        cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
    return CheckpointError(f"cannot save checkpoint {tag}: {cause}. The partial save is "
                           f"removed (what another rank still wrote, by the next start); "
                           f"{_resumable(root)}. Fix it and run the same command again",
                           every_rank=False)


def _fault_point(name: str, step: int) -> None:
    """Fault injection for the crash-consistency test: ``SETDIFF_FAULT=after_shards:STEP`` kills
    this process with SIGKILL at that point of the save of checkpoint STEP."""
    if os.environ.get("SETDIFF_FAULT") == f"{name}:{step}":
        os.kill(os.getpid(), 9)


def resolve(cfg) -> Optional[str]:
    """The checkpoint directory to resume from, per ``resume`` (auto / never / a path)."""
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        return resolve_latest(cfg.run_dir)
    path = step_directory(cfg.resume)
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        raise CheckpointError(f"resume={cfg.resume}: {path} is not a complete checkpoint (no "
                              "manifest.json); point at a step_* directory, a checkpoints "
                              "directory or a run directory")
    return path


def saved_config(path: str) -> dict:
    """The config a checkpoint was saved with, as a dict (``{}`` when it has none)."""
    import yaml

    try:
        with open(os.path.join(path, "config.yaml")) as fh:
            saved = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError):
        return {}
    return saved if isinstance(saved, dict) else {}


# model keys a run may change against its checkpoint: kernels and dropout
RUN_FREE = ("attention_backend", "attention_dropout", "hidden_dropout")


def model_differences(here: dict, there: dict, free=RUN_FREE) -> list[str]:
    """``model.*`` keys that differ between this run (``here``) and a checkpoint (``there``),
    outside ``free``, as lines of a refusal."""
    return [f"model.{k}: checkpoint {there.get(k)!r}, this run {here.get(k)!r}"
            for k in sorted(set(here) | set(there))
            if k not in free and here.get(k) != there.get(k)]


def init_from_weights(model, cfg, path: str, gathered=None) -> None:
    """Set ``model`` (this rank's stage and TP shard, any layout) to the weights of the setdiff
    checkpoint or export at ``path``: each rank reads only its rows or columns of each tensor
    (vocabulary tables: the real rows, padded to this layout's table). The architecture must be
    the checkpoint's; every parameter must be found with its shape."""
    from setdiff_dist.checkpoint.weights import open_weights
    from setdiff_dist.model.transformer import global_name

    # (the weights training left, not the EMA; every rank hashes its share of the files)
    state, saved, _, _ = open_weights(path, raw=True, group=dist.group.WORLD,
                                      what="checkpoint.init_from")
    # (the weights are read by layout-free names: the layer spec may change too)
    diffs = model_differences(cfg.to_dict()["model"], saved.to_dict()["model"],
                              RUN_FREE + ("layer_spec",))
    if diffs:
        raise CheckpointError(f"checkpoint.init_from={path}: another architecture:\n  - "
                              + "\n  - ".join(diffs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            with gathered(p) if gathered is not None else contextlib.nullcontext():
                local = _local_tensor(state, global_name(model, name), p, list(p.shape),
                                      f"checkpoint.init_from={path}")
                p.copy_(local.to(p.dtype))


def _local_tensor(state, g: str, p, shape: list, what: str) -> torch.Tensor:
    """This rank's tensor-parallel shard of tensor ``g`` of a weights source (any saved
    layout), for parameter ``p`` whose local shape is ``shape``: each rank reads only its rows
    or columns; vocabulary tables keep their real rows, padded to this layout's table."""
    from setdiff_dist.checkpoint.sharding import split_shard
    from setdiff_dist.checkpoint.weights import VOCAB_ROWS, LoadError

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if g not in state:
        raise LoadError(f"{what}: tensor {g} is missing")
    split = getattr(p, "tensor_model_parallel", False) and tp > 1
    dim, stride = getattr(p, "partition_dim", 0), getattr(p, "partition_stride", 1)
    want = list(shape)
    if getattr(p, "tensor_model_parallel", False):
        want[dim] *= tp
    if g in VOCAB_ROWS:  # the real rows, padded to this layout's table
        full = state[g]
        if list(full.shape[1:]) != want[1:] or full.shape[0] > want[0]:
            raise LoadError(f"{what}: tensor {g} has shape {tuple(full.shape)}, this model "
                            f"{tuple(want)}")
        full = torch.cat([full, full.new_zeros(want[0] - full.shape[0], *full.shape[1:])])
        return split_shard(full, rank, tp, dim, stride) if split else full
    if state.shape(g) != want:
        raise LoadError(f"{what}: tensor {g} has shape {tuple(state.shape(g))}, this model "
                        f"{tuple(want)}")
    return state.shard(g, rank, tp, dim, stride) if split else state[g]


def load_ema(ema, model, path: str) -> bool:
    """Set ``ema`` from the checkpoint's ``weights_ema/`` (saved in any layout); False when
    the checkpoint kept none."""
    from setdiff_dist.checkpoint.weights import open_weights
    from setdiff_dist.model.transformer import global_name

    if not os.path.isdir(os.path.join(path, EMA_WEIGHTS)):
        return False
    state = open_weights(path, which=EMA_WEIGHTS, checksums=False)[0]  # (verified at resume)
    for name, p in model.named_parameters():
        shape = list(getattr(p, "ds_shape", p.shape))
        ema.load(name, _local_tensor(state, global_name(model, name), p, shape,
                                     f"the EMA of {path}"))
    return True


def verify(path: str, manifest: dict, hashes: bool = True) -> None:
    """Check every file of the checkpoint against its manifest (size, and SHA-256 with
    ``hashes``), the ranks of the process group (if any) sharing the work; all ranks raise the same
    :class:`CheckpointError`, naming the damaged files and the checkpoint to go back to.
    A checkpoint written before the manifest listed its files passes unchecked."""
    table = manifest.get("files")
    if table is None:
        return
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = file_problems(path, table, sorted(table)[rank::world], hashes)
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, problems)
        problems = sorted(p for ps_ in every for p in ps_)
    if problems:
        raise damaged(path, problems)


def check_resume(path: str, cfg, tokenizer_identity: dict, here: dict, stream: dict,
                 say: bool = True) -> dict:
    """Everything that decides, before any model is built, whether this run (``cfg``, its
    tokenizer, its ``here`` layout as :func:`layout` gives it, its data ``stream``: a loader's
    state) can go on from the checkpoint at ``path``: the manifest against the run, the data
    stream, every file's size and checksum, and no pickled code. Returns the manifest or raises
    a :class:`CheckpointError` (or the data's ShardError) naming what differs. ``say``: print
    the notes (rank 0). No model, and no process group unless one is initialized (the ranks
    then share the hashing)."""
    from setdiff_dist.checkpoint.files import checkpoint_root, pointed
    from setdiff_dist.data.loader import check_stream

    root = checkpoint_root(cfg.run_dir)
    if say and cfg.resume == "auto" and pointed(root) is None:
        print(f"note: {root}/{LATEST} is missing; resuming from the newest complete "
              f"checkpoint, {path}", flush=True)
    ck = cfg.checkpoint
    for key, source in (("init_from", ck.init_from), ("init_from_hf", ck.init_from_hf)):
        if source and say:
            print(f"note: resuming from {path}; checkpoint.{key}={source} only starts a "
                  "new run and is not used (give a new run_dir to start from it)", flush=True)
    manifest = check_compatible(path, cfg, tokenizer_identity, here)
    if manifest["step"] > cfg.train.steps:
        raise CheckpointError(f"{path} is at step {manifest['step']}, past train.steps="
                              f"{cfg.train.steps}: raise train.steps to train on, or give a new "
                              "run_dir (resume=never) to start over")
    if "data" in manifest:  # (the same data stream: checked again when it is loaded)
        check_stream(manifest["data"], stream)
    verify(path, manifest, cfg.checkpoint.checksums)
    check_no_code(path)  # (DeepSpeed's files are pickles)
    return manifest


def check_compatible(path: str, cfg, tokenizer_identity: dict,
                     here: Optional[dict] = None) -> dict:
    """The manifest of ``path``, or a CheckpointError listing every difference with this run
    (``here``: this run's layout, by default :func:`layout`)."""
    m = read_manifest(path)
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {m.get('format')!r}, expected {FORMAT!r}")
    # a key added after the checkpoint was written has its default there (e.g. model.head_dim)
    diffs = model_differences(cfg.to_dict()["model"],
                              dict(dataclasses.asdict(type(cfg.model)()), **m["model"]))
    here, saved = here or layout(), m["layout"]
    if saved.get("context", 1) != here["context"]:
        diffs.append(f"parallel.context: checkpoint {saved.get('context', 1)}, this run "
                     f"{here['context']} (a checkpoint resumes at its own context-parallel size; "
                     "to go on from its weights with a fresh optimizer: setdiff-train --config "
                     f"{os.path.join(path, 'config.yaml')} run_dir=NEW_RUN_DIR "
                     f"checkpoint.init_from={path} parallel.context={here['context']} ...)")
    if saved["pipeline"] != here["pipeline"]:
        diffs.append(f"parallel.pipeline: checkpoint {saved['pipeline']}, this run "
                     f"{here['pipeline']} (stages name their layers locally: a checkpoint "
                     "resumes at its own pipeline size; to go on from its weights at "
                     f"pipeline size {here['pipeline']}, with a fresh optimizer: setdiff-train "
                     f"--config {os.path.join(path, 'config.yaml')} run_dir=NEW_RUN_DIR "
                     f"checkpoint.init_from={path} parallel.pipeline={here['pipeline']} ...)")
    elif here["pipeline"] > 1:
        for key, name in (("tensor", "parallel.tensor"), ("data", "data-parallel size")):
            if saved[key] != here[key]:
                diffs.append(f"{name}: checkpoint {saved[key]}, this run {here[key]} (with "
                             "pipeline parallelism a checkpoint resumes in its own layout)")
    elif m["zero_stage"] == cfg.zero.stage == 0 and (saved["tensor"], saved["data"]) != \
            (here["tensor"], here["data"]):
        diffs.append(f"parallel.tensor x data-parallel size: checkpoint {saved['tensor']} x "
                     f"{saved['data']}, this run {here['tensor']} x {here['data']} (zero.stage=0 "
                     "has no ZeRO state to re-partition; ZeRO 1-3 checkpoints can change it)")
    elif cfg.zero.stage == 3 and saved["tensor"] != here["tensor"]:
        diffs.append(f"parallel.tensor: checkpoint {saved['tensor']}, this run {here['tensor']} "
                     "(DeepSpeed re-slices ZeRO-3 state for another data-parallel size only; "
                     "ZeRO-1/2 checkpoints can change the tensor-parallel size too)")
    if m["zero_stage"] != cfg.zero.stage:
        diffs.append(f"zero.stage: checkpoint {m['zero_stage']}, this run {cfg.zero.stage}")
    # the order schedule and the seed define what the run learns: another one is another run
    order = cfg.to_dict()["order"]
    for key in sorted(set(order) | set(m.get("order", {}))):
        if key != "eval_seed" and key in m.get("order", {}) and m["order"][key] != order.get(key):
            diffs.append(f"order.{key}: checkpoint {m['order'][key]!r}, this run "
                         f"{order.get(key)!r}")
    if "seed" in m and m["seed"] != cfg.train.seed:
        diffs.append(f"train.seed: checkpoint {m['seed']}, this run {cfg.train.seed}")
    if m["seq_len"] != cfg.data.seq_len:
        diffs.append(f"data.seq_len: checkpoint {m['seq_len']}, this run {cfg.data.seq_len}")
    if m["tokenizer"]["sha256"] != tokenizer_identity["sha256"]:
        diffs.append(f"tokenizer: checkpoint {m['tokenizer']['spec']!r}, this run "
                     f"{tokenizer_identity['spec']!r}")
    if diffs:
        raise CheckpointError(f"cannot resume from {path}; it differs from this run:\n  - "
                              + "\n  - ".join(diffs)
                              + "\n(to change the model, start a new run_dir)")
    return m


def load(engine, path: str, universal: bool = False) -> dict:
    """Load model, optimizer, LR schedule and this rank's RNG; returns the client state. With
    ``universal`` (an engine configured to load universal checkpoints) the optimizer state
    comes from ``path/universal``, re-partitioned for this data-parallel size."""
    root, tag = (path, UNIVERSAL) if universal else os.path.split(os.path.normpath(path))
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch AdamW
    # this run's hyperparameters, which the checkpoint's optimizer state would replace (the
    # caller puts the LR back on this run's schedule: train.engine.follow_schedule)
    hyper = [{k: g[k] for k in ("weight_decay", "betas", "eps") if k in g}
             for g in inner.param_groups]
    with no_unpickling():
        loaded, client = engine.load_checkpoint(root, tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load {path}")
    # non-finite weights: each rank checks what it holds (its ZeRO-3 partition), all agree
    bad = [n for n, p in engine.module.named_parameters()
           if not bool(torch.isfinite(getattr(p, "ds_tensor", p).detach().sum()))]
    flag = torch.tensor([float(len(bad))], device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise CheckpointError(f"{path} holds non-finite weights "
                              f"({', '.join(bad[:3]) or 'on another rank'}"
                              f"{' ...' if len(bad) > 3 else ''}): the run diverged before it; "
                              "resume from an earlier checkpoint (resume=<step dir>)")
    # the optimizer state keeps the checkpoint's betas, eps and weight decay (and DeepSpeed's
    # universal load gives every group the first one's: the no-decay group would decay): this
    # run's config says what they are
    for group, values in zip(inner.param_groups, hyper):
        group.update(values)
    if universal:
        # under ZeRO-3 DeepSpeed's universal load gives every sub-group one shared AdamW step
        # tensor, which each sub-group's step then increments (the bias correction would count
        # steps several times over): undo it
        for flat in getattr(engine.optimizer, "fp32_partitioned_groups_flat", []):
            state = inner.state.get(flat, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
    rng = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if os.path.isfile(rng):
        _set_rng_state(torch.load(rng, weights_only=True))
    return client
