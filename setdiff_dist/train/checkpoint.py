"""What a checkpoint needs of DeepSpeed and of the running job: DeepSpeed's engine state (saved and
loaded, with nothing unpickled that could run code), the ZeRO-3 gather of the weights that
:func:`setdiff_dist.checkpoint.weights.write_weights` writes, each rank's RNG state, and the
conversion to DeepSpeed's universal form for a resume at another data-parallel size.

The format itself (names, manifest, the checks before a resume, the weights' reader and writer)
is :mod:`setdiff_dist.checkpoint`'s. A save writes every rank's files, then a barrier that every
rank reaches only once its files are on disk, then the manifest, and then replaces ``latest``
atomically, so a crash at any point leaves ``latest`` at a complete checkpoint. (That barrier and
the gathering of the manifest's file tables go through the default group's c10d store, not a
process group: :class:`setdiff_dist.train.async_save.SaveAgreement`.)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from setdiff_dist.checkpoint.files import (
    CheckpointError,
    checkpoint_files,
    describe_files,
    prune,
    write_atomic,
)
from setdiff_dist.checkpoint.format import (
    BEST,
    CONFIG,
    EMA_WEIGHTS,
    GLOBAL_NAMES,
    LATEST,
    MANIFEST,
    WEIGHTS,
    checkpoint_root,
    rng_file,
    tag_of,
)
from setdiff_dist.checkpoint.manifest import build_manifest, no_unpickling
from setdiff_dist.checkpoint.manifest import needs_universal as layout_needs_universal
from setdiff_dist.checkpoint.saving import check_space, save_failed, write_failure
from setdiff_dist.progress import progress

from .optimizer_state import FRAGMENTS, optimizer_changes, saved_form


def universal_info(model, group=None) -> dict:
    """What DeepSpeed's universal-checkpoint converter needs to merge each parameter's tensor-
    parallel slices (megatron's attributes, as patterns of the parameters' global names, any
    layer), for the whole model: the patterns of every pipeline stage in ``group`` (collective
    over it), since the converter reads them from the first stage's files. With the embedding
    tied across pipeline stages, the last stage's copy is marked pipeline-replicated: the
    converter takes the first stage's."""
    from deepspeed.checkpoint import constants as C

    from setdiff_dist.model.transformer import global_name

    found = {"replicated": set(), "row": set(), "halves": set(), "vocab": set()}
    for name, p in model.named_parameters():
        pattern = re.sub(r"^decoder\\\.layers\\\.\d+", r"decoder\\.layers\\.\\d+",
                         re.escape(global_name(model, name))) + "$"
        if not getattr(p, "tensor_model_parallel", False):
            found["replicated"].add(pattern)
        elif p.partition_dim == 1:
            found["row"].add(pattern)
        elif getattr(p, "partition_stride", 1) == 2:
            found["halves"].add(pattern)  # SwiGLU's [gate ; up]
        if name.endswith(("embedding.weight", "word_embeddings.weight", "output_layer.weight")):
            found["vocab"].add(pattern)
    stages = [found]
    if group is not None and dist.get_world_size(group) > 1:
        stages = [None] * dist.get_world_size(group)
        dist.all_gather_object(stages, found, group=group)
    union = {k: sorted(set().union(*(s[k] for s in stages))) for k in found}
    tied_across_stages = model.tie and ps.get_pipeline_model_parallel_world_size() > 1
    return {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.2,
            C.TP_REPLICATED_PARAMETER_PATTERNS: union["replicated"],
            C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: union["row"],
            C.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: union["halves"],
            C.VOCABULARY_PARAMETER_PATTERNS: union["vocab"],
            C.PIPELINE_REPLICATED_PARAMETER_PATTERNS:
                [r"embedding\.weight$"] if tied_across_stages else [],
            C.ORIGINAL_VOCAB_SIZE: model.vocab_size + 1, C.PADDED_VOCAB_SIZE: model.padded_vocab}


def needs_universal(path: str, cfg) -> bool:
    """Whether resuming ``path`` in this run's layout re-partitions the optimizer state through
    DeepSpeed's universal checkpoint (:func:`setdiff_dist.checkpoint.manifest.needs_universal`;
    :func:`check_compatible` refuses the changes it cannot make)."""
    try:
        with open(os.path.join(path, MANIFEST)) as fh:
            manifest = json.load(fh)
        saved, stage = manifest["layout"], manifest["zero_stage"]
    except (OSError, ValueError, KeyError):
        return False  # (check_compatible says what is wrong with it)
    return layout_needs_universal(saved, layout(), optimizer_changes(path, cfg) is not None
                                  or stage != cfg.zero.stage)


def decay_rule(path: Optional[str], manifest: Optional[dict], cfg,
               universal: bool = False) -> str:
    """What DeepSpeed's weight-decay groups decay in a run of ``cfg`` that resumes from ``path``
    (None: a fresh run), whose ``manifest`` :func:`~setdiff_dist.checkpoint.manifest.
    check_resume` returned (``universal``: through the universal form, which loads each
    parameter's state by name into any groups), :func:`setdiff_dist.train.engine.param_groups`:
    ``"global"``, or, in the run of a checkpoint DeepSpeed saved before manifests said
    (``decay_rule``) and loaded as saved, the groups its optimizer state was saved in:

    - ``"none"`` at ZeRO-3: the groups were made from the partitioned (empty, one-dimensional)
      parameters, so nothing was decayed;
    - ``"local"`` under pipeline parallelism with tied embeddings: the last stage decayed its
      copy of the embedding as a matrix (it drifted from the first stage's).

    DeepSpeed refuses optimizer state saved in other groups, so such a run goes on as it was
    saved (:func:`say_decay_rule` tells the user)."""
    from setdiff_dist.config import resolved_model, zero_implementation

    if path is None or universal or zero_implementation(cfg) != "deepspeed":
        return "global"
    if "decay_rule" in manifest:
        return manifest["decay_rule"]
    if saved_form(path) in FRAGMENTS:
        return "global"
    if manifest.get("zero_stage") == 3:
        return "none"
    if manifest.get("layout", {}).get("pipeline", 1) > 1 and \
            resolved_model(manifest.get("model", {})).get("tie_embeddings"):
        return "local"
    return "global"


def say_decay_rule(path: str, cfg, rule: str) -> None:
    """(Rank 0.) The note for a run whose weight-decay groups are those of an earlier version
    (:func:`decay_rule`), where that changes what is decayed."""
    if cfg.optimizer.adamw_weight_decay <= 0 or rule == "global" or \
            (rule == "local" and cfg.parallel.pipeline == 1):
        return
    then = ("ZeRO-3 weight-decayed no parameter" if rule == "none" else
            "the last pipeline stage weight-decayed its copy of the tied embedding as a matrix "
            "(so it drifted from the first stage's copy)")
    print(f"note: {path} was saved when {then}, since fixed; this run goes on that way so that "
          "its optimizer state loads as saved. To train with the fix, start from its weights: "
          f"checkpoint.init_from={path} with a new run_dir", flush=True)


def make_universal(path: str, zero3_rows: Optional[int] = None, hashes: bool = True) -> str:
    """The tag (directory in ``path``) to load the optimizer state from in this layout:
    ``universal``, DeepSpeed's universal form of the checkpoint (each parameter's fp32 weights
    and optimizer moments whole), converted once, by all the ranks together (each its share),
    through a temporary directory so that an interrupted conversion is redone, never half-used,
    with a manifest of its own that every later resume checks (``hashes``: SHA-256 too) before
    DeepSpeed reads it; under a lock, so that two jobs resuming one checkpoint take turns.
    ``zero3_rows``: this run is ZeRO-3 (with that many padded vocabulary rows); a ZeRO 1-2
    checkpoint's form is then read through ``universal_zero3``. See
    :func:`setdiff_dist.train.universal.prepare`."""
    from .universal import dist_agree, prepare

    # (every rank sees the same directory: a checkpoint is resumed from a shared file system)
    rank = dist.get_rank()
    say = (lambda line: print(line, flush=True)) if rank == 0 else None
    tag = prepare(path, rank, dist.get_world_size(), dist_agree(), zero3_rows, hashes, say)
    dist.barrier()
    return tag


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


def save_weights(engine, directory: str, zero_stage: int, ema=None, later: bool = False,
                 copy_tensor=None):
    """This model-parallel rank's weights (global names, TP-local shards), written by
    :func:`~setdiff_dist.checkpoint.weights.write_weights`: every data-parallel (x context-
    parallel) rank writes its share, one tensor at a time; under ZeRO-3 each parameter is
    gathered alone, so no rank ever holds the whole model and a writer one tensor. With ``ema``
    (:class:`~setdiff_dist.train.ema.EMA`) the averages are written instead, in fp32, under the
    same names and layout. Collective over the data-parallel group. ``later``: gather now,
    keep a host copy of this rank's share (made by ``copy_tensor``, a save's staging), and
    return the write as a picklable ``(function, args, kwargs)`` (for a save in the background,
    by the writer process)."""
    from setdiff_dist.checkpoint.weights import write_weights
    from setdiff_dist.model.transformer import global_name

    model = engine.module
    params, entries, local, seen = [], [], [], set()
    for name, p in model.named_parameters():
        gname = global_name(model, name)
        if gname in seen:  # the tied output weight on the last stage: a copy
            continue
        seen.add(gname)
        params.append(p)
        local.append(name)
        entries.append((gname, torch.float32 if ema is not None else
                        getattr(engine, "weights_dtype", p.dtype),
                        tuple(getattr(p, "ds_shape", p.shape)),
                        {"tensor_parallel": bool(getattr(p, "tensor_model_parallel", False)),
                         "dim": int(getattr(p, "partition_dim", -1)),
                         "stride": int(getattr(p, "partition_stride", 1))}))

    def values():  # (every rank takes part in each ZeRO-3 gather and EMA gather)
        for name, p in zip(local, params):
            if ema is not None:
                yield ema.tensor(name)
                continue
            gather = contextlib.nullcontext()
            if zero_stage == 3:
                import deepspeed

                gather = deepspeed.zero.GatheredParameters([p], modifier_rank=None)
            with gather:
                if hasattr(p, "full_tensor"):  # (FSDP's shards: one all-gather, every rank)
                    yield p.detach().full_tensor().to(getattr(engine, "weights_dtype", p.dtype))
                else:
                    yield p.detach()

    parts = ps.get_data_parallel_world_size(with_context_parallel=True)
    part = ps.get_data_parallel_rank(with_context_parallel=True)
    stream = values()
    copy_tensor = copy_tensor or (lambda v: v.detach().to("cpu", copy=True))
    if later:  # (the other shares' tensors: gathered with them, not kept)
        stream = [copy_tensor(v) if i % parts == part else None for i, v in enumerate(stream)]
    args = (directory, ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    kwargs = {"parts": parts, "part": part, "entries": entries, "values": stream}
    if later:
        return write_weights, args, kwargs
    write_weights(*args, **kwargs)


def save(engine, cfg, step: int, client_state: dict, tokenizer_identity: dict,
         tokenizer_dir: Optional[str] = None, ema=None, data: Optional[dict] = None,
         saver=None, best: bool = False) -> str:
    """Save on every rank; returns the checkpoint directory. ``data``: the data stream's
    identity (the loader's state without its step), which the manifest records so that a
    resume on other data is refused before any model is built. ``saver``
    (:class:`~setdiff_dist.train.async_save.AsyncSaver`): capture the state now and write it in
    the background (``latest`` moves when it is all written). ``best``: ``best`` moves to it
    too, with ``latest`` (the checkpoint of the lowest validation loss so far). The procedure
    is :class:`Save`'s, the same either way."""
    job = Save(engine, cfg, step, client_state, tokenizer_identity, tokenizer_dir, ema, data,
               best)
    job.prepare(saver)
    if saver is None:
        job.here()
    else:
        saver.save(job)  # (job.files on this thread, then job.write and job.finish in its own)
    return job.path


class Save:
    """One save of checkpoint ``step`` on this rank, as the sequence of steps that a blocking
    save runs on the training thread (:meth:`here`) and a background save splits between the
    training thread and its saver's thread (:meth:`AsyncSaver.save
    <setdiff_dist.train.async_save.AsyncSaver.save>`): the procedure is written once, here, and
    only where each step runs differs.

    1. :meth:`prepare` (the training thread; collective): the disk-space check, an earlier save
       of this step removed, the client state completed;
    2. :meth:`files` (the training thread; collective): DeepSpeed's files, the weights (and
       the EMA's), the RNG state: written as they come, or, in the background, copied to host
       memory and returned as the writes still to do;
    3. :meth:`write` (in the background only): those writes, by the writer process;
    4. :meth:`small_files` (rank 0): the config and the tokenizer file;
    5. :meth:`finish`: the ranks agree that every file is on disk, share the hashing, and rank
       0 writes the manifest, moves ``latest`` (and ``best``) and prunes.

    A write that fails raises :meth:`failed`'s error (the partial save removed); in the
    background it also tells the other ranks (:meth:`abandon`), so that they stop waiting for
    this rank's files (a blocking save's ranks meet the failure in their own writes, or in
    DeepSpeed's collectives)."""

    def __init__(self, engine, cfg, step: int, client_state: dict, tokenizer_identity: dict,
                 tokenizer_dir: Optional[str] = None, ema=None, data: Optional[dict] = None,
                 best: bool = False):
        from .async_save import save_name

        self.engine, self.cfg, self.step, self.ema, self.data, self.best = \
            engine, cfg, step, ema, data, best
        self.client_state, self.tokenizer_identity, self.tokenizer_dir = \
            client_state, tokenizer_identity, tokenizer_dir
        self.root = checkpoint_root(cfg.run_dir)
        self.tag = tag_of(step)
        # (first: every rank counts every save it begins, failed or not)
        self.name = save_name(self.tag)
        self.path = os.path.join(self.root, self.tag)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.need: Optional[int] = None  # (the size check_space expects)

    def prepare(self, saver=None) -> None:
        """Step 1. ``saver``: the save in flight is complete first (one at a time)."""
        if saver is not None:
            saver.wait()
        root, tag, path, engine = self.root, self.tag, self.path, self.engine
        self.need = check_space(root, tag)  # (collective: every rank refuses, or none)
        # an earlier save of this step (a crash, or resume=never)
        if self.rank == 0 and os.path.isdir(path):
            for pointer in (os.path.join(root, LATEST), os.path.join(root, BEST)):
                if os.path.isfile(pointer) and open(pointer).read().strip() == tag:
                    os.remove(pointer)  # never leave a pointer at a directory being rewritten
            shutil.rmtree(path)
        dist.barrier()
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

        info = getattr(engine, "setdiff_universal_info", None)
        if info is None:  # (once a run: it gathers every pipeline stage's patterns)
            info = engine.setdiff_universal_info = universal_info(
                engine.module, ps.get_pipeline_model_parallel_group())
        from setdiff_dist.model.transformer import global_name

        # (the module state in DeepSpeed's files keeps the stage's own names: how they map)
        names = {n: global_name(engine.module, n) for n, _ in engine.module.named_parameters()}
        self.client_state = dict(self.client_state,
                                 **{UNIVERSAL_CHECKPOINT_INFO: info, GLOBAL_NAMES: names})

    def here(self) -> None:
        """Steps 2, 4 and 5 on this thread: a blocking save."""
        try:
            _fault_point("hang_save", self.step)
            self.files()
            self.small_files()
            self.finish()
        except (OSError, RuntimeError) as exc:
            if not write_failure(exc):
                raise
            raise self.failed(exc) from None

    def files(self, staged: Optional[Callable] = None) -> list:
        """Step 2: this rank's files, in the order they are written: DeepSpeed's, the weights,
        the EMA's, the RNG state, each reported to the hang watch. Without ``staged`` they are
        written as they come (the ZeRO-3 and EMA gathers one tensor at a time) and nothing is
        returned. ``staged`` (a save's :meth:`~setdiff_dist.train.writer.Staging.copy`): the
        state is copied to host memory through it (DeepSpeed's save and the gathers are
        collectives of this thread), and the writes come back for :meth:`write`: ``[DeepSpeed's
        calls, the others]``, each a list of ``(function, args, kwargs)``."""
        from .async_save import Capture, host_copy

        engine, path, stage = self.engine, self.path, self.cfg.zero.stage
        later = staged is not None
        capture = Capture(engine.checkpoint_engine, staged) if later else None
        if capture is not None:
            engine.checkpoint_engine = capture
        try:
            engine.save_checkpoint(self.root, tag=self.tag, client_state=self.client_state,
                                   save_latest=False)
        finally:
            if capture is not None:
                engine.checkpoint_engine = capture.real
        progress()  # (the hang watch: train.save_timeout_s between files written)
        rest = [save_weights(engine, os.path.join(path, WEIGHTS), stage, later=later,
                             copy_tensor=staged)]
        progress()
        if self.ema is not None:
            rest.append(save_weights(engine, os.path.join(path, EMA_WEIGHTS), stage,
                                     ema=self.ema, later=later, copy_tensor=staged))
            progress()
        rng = os.path.join(path, rng_file(self.rank))
        if not later:
            torch.save(_rng_state(), rng)
            return []
        rest.append((torch.save, (host_copy(_rng_state()), rng), {}))
        return [capture.calls(), rest]

    def write(self, writes: list, run: Callable[[list], None]) -> None:
        """Step 3 and 4, in the background: :meth:`files`' ``writes``, each list by ``run`` (the
        saver's writer process), then :meth:`small_files`."""
        deepspeeds, rest = writes
        _fault_point("write_fails", self.step)
        run(deepspeeds)
        _fault_point("async_write", self.step)
        run(rest)
        self.small_files()

    def small_files(self) -> None:
        """Step 4 (rank 0): the config and the tokenizer file."""
        if self.rank != 0:
            return
        with open(os.path.join(self.path, CONFIG), "w") as fh:
            fh.write(self.cfg.to_yaml())
        name = self.tokenizer_identity.get("file")
        if name and self.tokenizer_dir:
            from setdiff_dist.paths import inside

            shutil.copyfile(inside(self.tokenizer_dir, name, "the tokenizer file",
                                   CheckpointError),
                            inside(self.path, name, "the tokenizer file", CheckpointError))

    def finish(self, store=None) -> None:
        """Step 5: this rank's files are on disk: once every rank's are, the manifest (the ranks
        share the hashing), then ``latest``, then the pruning; returns once ``latest`` has
        moved. The ranks agree through the c10d store, not a process group (``store``: a client
        of it; by default one of this save's own): :class:`~.async_save.SaveAgreement`."""
        from .async_save import SaveAgreement

        _fault_point("after_shards", self.step)
        path, rank, world = self.path, self.rank, self.world
        agree = SaveAgreement(store, self.name, rank, world, f"checkpoint {self.tag}")
        agree.decide("written", None, self._all_written)  # every rank's files are on disk
        try:  # (a rank that cannot hash its share says so in the round, not by silence)
            mine = {"files": describe_files(path, checkpoint_files(path)[rank::world],
                                            self.cfg.checkpoint.checksums)}
        except OSError as exc:
            mine = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        agree.decide("tables", mine, self._publish)

    def _all_written(self, reports: list) -> None:
        """(Rank 0, in :meth:`finish`'s first round: each rank's None, or why it failed.)"""
        from .async_save import SaveNotAgreed

        bad = [(r, report) for r, report in enumerate(reports) if report]
        if bad:
            ranks = [r for r, _ in bad]
            exc = SaveNotAgreed(
                f"checkpoint {self.tag} is not complete: rank{'s' if len(ranks) > 1 else ''} "
                f"{', '.join(map(str, ranks[:16]))} could not write "
                f"{'their' if len(ranks) > 1 else 'its'} files ({bad[0][1]['why']}); latest "
                "still points at the previous checkpoint")
            # (the job ends as the failed rank does: a full disk is the user's to fix, exit 2)
            exc.exit_code = max(report["exit_code"] for _, report in bad)
            raise exc

    def _publish(self, tables: list) -> None:
        """(Rank 0, with every rank's file table.) The manifest, then ``latest`` (and
        ``best``), each replaced atomically, then the pruning, which keeps ``best``."""
        from .async_save import SaveNotAgreed

        root, tag = self.root, self.tag
        bad = [(r, t["error"]) for r, t in enumerate(tables) if "error" in t]
        if bad:
            raise SaveNotAgreed(f"checkpoint {tag} is not complete: rank {bad[0][0]} could "
                                f"not read back its files ({bad[0][1]}); latest still "
                                "points at the previous checkpoint")
        manifest = build_manifest(self.step, layout(), self.cfg, self.tokenizer_identity,
                                  {k: v for t in tables for k, v in t["files"].items()},
                                  self.data, self.engine.decay_rule)
        write_atomic(os.path.join(self.path, MANIFEST), json.dumps(manifest, indent=2))
        write_atomic(os.path.join(root, LATEST), tag + "\n")
        if self.best:
            write_atomic(os.path.join(root, BEST), tag + "\n")
        prune(root, self.cfg.checkpoint.keep_last, keep=tag)

    def failed(self, exc: BaseException) -> BaseException:
        """The error a failed write raises: a full disk or a file-size limit explained, the
        partial save removed (:func:`~setdiff_dist.checkpoint.saving.save_failed`); else
        ``exc``."""
        return save_failed(exc, self.root, self.tag, self.need) if write_failure(exc) else exc

    def abandon(self, exc: BaseException) -> None:
        """This rank's background write failed: the others hear it in the save's first round
        (their :meth:`finish` fails at once, rather than waiting for this rank's files)."""
        from setdiff_dist.errors import EXIT_FAILED

        from .async_save import SaveAgreement

        SaveAgreement(None, self.name, self.rank, self.world, f"checkpoint {self.tag}").decide(
            "written", {"why": f"{type(exc).__name__}: "
                               f"{(str(exc).splitlines() or [''])[0][:300]}",
                        # (what failed(exc) will raise here: its class's code; not called
                        # now, it removes the step directory the others still write)
                        "exit_code": CheckpointError.exit_code if write_failure(exc)
                        else EXIT_FAILED},
            self._all_written)


def _fault_point(name: str, step: int) -> None:
    """Fault injection for the crash-consistency tests: ``SETDIFF_FAULT=after_shards:STEP``
    (every file written, no manifest yet) or ``async_write:STEP`` (in the background write,
    DeepSpeed's files written, the weights not) kills this process with SIGKILL at that point
    of the save of checkpoint STEP; ``write_fails:STEP:RANK`` makes rank RANK's background
    write of it fail at its start as a full disk does (ENOSPC). A fault strikes once, in the
    first start: a retried save (``checkpoint.save_retries``) or a restart
    (``train.max_restarts``) meets it no more, as after a transient fault.
    ``hang_save:STEP:RANK`` stops rank RANK at the start of its (synchronous) write of it
    without progress, as a stuck file system does."""
    from .watchdog import restart_count

    if restart_count():
        return
    fault = os.environ.get("SETDIFF_FAULT", "")
    if fault == f"{name}:{step}":
        os.kill(os.getpid(), 9)
    if fault == f"{name}:{step}:{dist.get_rank()}" and fault not in _FIRED:
        _FIRED.add(fault)
        if name.startswith("hang"):
            hang_here()
        raise OSError(errno.ENOSPC, "No space left on device (injected: SETDIFF_FAULT)")


_FIRED: set = set()  # the injected faults that have struck (each strikes once)


def hang_here() -> None:
    """An injected hang: no progress, for as long as it takes a hang watch to end it."""
    while True:
        time.sleep(60)


def load(engine, path: str, universal: Optional[str] = None, parallel: bool = True) -> dict:
    """Load model, optimizer, LR schedule and this rank's RNG; returns the client state. With
    ``universal`` (an engine configured to load universal checkpoints; the tag
    :func:`make_universal` returned) the optimizer state comes from ``path/<universal>``,
    re-partitioned for this layout. ``parallel`` (``checkpoint.parallel_load``): the files
    every data-parallel replica loads are read in shares and exchanged
    (:func:`~setdiff_dist.checkpoint.reading.parallel_load`); either way every byte read is
    counted in :data:`~setdiff_dist.checkpoint.reading.TALLY`."""
    from megatron.core import parallel_state as ps

    from setdiff_dist.checkpoint.reading import ParallelRead, whole_load

    root, tag = (path, universal) if universal else os.path.split(os.path.normpath(path))
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch AdamW
    # this run's hyperparameters, which the checkpoint's optimizer state would replace (the
    # caller puts the LR back on this run's schedule: train.engine.follow_schedule)
    hyper = [{k: g[k] for k in ("weight_decay", "betas", "eps") if k in g}
             for g in inner.param_groups]
    real = engine.checkpoint_engine
    engine.checkpoint_engine = ParallelRead(
        real, ps.get_data_parallel_group(with_context_parallel=True) if parallel else None)
    try:
        with no_unpickling():
            loaded, client = engine.load_checkpoint(root, tag=tag, load_optimizer_states=True,
                                                    load_lr_scheduler_states=True)
    finally:
        engine.checkpoint_engine = real
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load {path}")
    # non-finite weights: each rank checks what it holds (its ZeRO-3 partition, its FSDP
    # shard), all agree
    from .ema import _held

    bad = [n for n, p in engine.module.named_parameters()
           if not bool(torch.isfinite(_held(p).detach().sum()))]
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
    rng = os.path.join(path, rng_file(dist.get_rank()))
    if os.path.isfile(rng):
        _set_rng_state(whole_load(rng, weights_only=True))
    return client
