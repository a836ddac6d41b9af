"""A checkpoint's manifest, written and read here, and every check that decides from it, before
any model is built, whether a run may go on from the checkpoint: the architecture, layout,
order, seed, sequence length, tokenizer and data stream against the run's; every file against
its size and SHA-256; no pickled code. Pure functions of their inputs (the run's config, its
layout as a dict, its data stream's state): no model, no DeepSpeed, and a process group only
when one is given to share the hashing."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

from setdiff_dist.config import resolved_model, zero_implementation

from .files import (
    CheckpointError,
    checkpoint_root,
    damaged,
    file_problems,
    pointed,
    shared_problems,
)
from .format import (
    CONFIG,
    DERIVED_FORMAT,
    DERIVED_FORMS,
    FORMAT,
    LATEST,
    MANIFEST,
)

# the classes DeepSpeed pickles into its checkpoint files beside tensors and containers (found
# with ``torch.serialization.get_unsafe_globals_in_checkpoint`` on ZeRO 0-3, fp32 and bf16
# checkpoints): plain records, safe to rebuild. :func:`no_unpickling` imports them
PICKLED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                   "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                   "deepspeed.runtime.zero.config.ZeroStageEnum",
                   "deepspeed.utils.tensor_fragment.fragment_address")

@contextlib.contextmanager
def no_unpickling():
    """Within this context every ``torch.load`` (DeepSpeed's included) reads with
    ``weights_only=True``, allowing only the classes of
    :data:`~setdiff_dist.checkpoint.manifest.PICKLED_GLOBALS`: a checkpoint file cannot run
    code. A file that needs anything else fails with a :class:`CheckpointError`."""
    import importlib
    import pickle

    import torch

    original = torch.load
    allowed = [getattr(importlib.import_module(name.rpartition(".")[0]), name.rpartition(".")[2])
               for name in PICKLED_GLOBALS]

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


# model keys a run may change against its checkpoint: kernels and dropout
RUN_FREE = ("attention_backend", "attention_dropout", "hidden_dropout")


def build_manifest(step: int, layout: dict, cfg, tokenizer_identity: dict, files: dict,
                   data: Optional[dict] = None, decay_rule: str = "global") -> dict:
    """The manifest of a checkpoint of ``cfg``'s run at ``step``, saved in ``layout``, with its
    ``files`` (``{name: {"bytes", "sha256"}}``), its data stream's identity ``data`` and what
    its weight-decay groups decayed (:func:`setdiff_dist.train.checkpoint.decay_rule`)."""
    saved = cfg.to_dict()
    manifest = {"format": FORMAT, "step": step, "layout": layout,
                "zero_stage": cfg.zero.stage, "model": saved["model"], "order": saved["order"],
                "seq_len": cfg.data.seq_len, "seed": cfg.train.seed,
                "tokenizer": tokenizer_identity, "files": dict(sorted(files.items())),
                # DeepSpeed's optimizer state is named by the parameters' global names
                # (train.engine.name_globally): it can change pipeline size
                "optimizer_names": "global",
                # what the weight-decay groups decayed ("global" since this key exists)
                "decay_rule": decay_rule,
                # who ran the data parallelism ("auto" has meant other ones over time)
                "zero_implementation": zero_implementation(cfg)}
    if data is not None:
        manifest["data"] = data
    return manifest


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint directory ``path``, or a CheckpointError that names it."""
    file = os.path.join(path, MANIFEST)
    try:
        with open(file, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is damaged (not JSON: {exc}); resume from an earlier "
                              "checkpoint") from None
    missing = [k for k in ("format", "step", "layout") if not isinstance(manifest, dict)
               or k not in manifest]
    if missing:
        raise CheckpointError(f"{file} is damaged or not a checkpoint manifest (no "
                              f"{', '.join(missing)})")
    return manifest


def saved_config(path: str) -> dict:
    """The config a checkpoint was saved with, as a dict (``{}`` when it has none)."""
    import yaml

    try:
        with open(os.path.join(path, CONFIG)) as fh:
            saved = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError):
        return {}
    return saved if isinstance(saved, dict) else {}


def model_differences(here: dict, there: dict, free=RUN_FREE) -> list[str]:
    """``model.*`` keys that differ between this run (``here``) and a checkpoint (``there``),
    outside ``free``, as lines of a refusal."""
    return [f"model.{k}: checkpoint {there.get(k)!r}, this run {here.get(k)!r}"
            for k in sorted(set(here) | set(there))
            if k not in free and here.get(k) != there.get(k)]


def fresh_start(path: str, saved: dict, here: dict, zero_saved: int, zero_here: int,
                *more: str) -> str:
    """The command that starts a new run from the weights of the checkpoint at ``path`` (saved
    in layout ``saved`` at ZeRO stage ``zero_saved``) in this run's layout ``here`` and stage
    ``zero_here``: its config, with the overrides that the run asked for and it lacks (a
    suggestion that kept the checkpoint's ``zero.stage`` would be refused again), and
    ``more``."""
    overrides = [f"parallel.{key}={here.get(key, 1)}" for key in ("pipeline", "tensor",
                                                                  "context")
                 if saved.get(key, 1) != here.get(key, 1)]
    if zero_saved != zero_here:
        overrides.append(f"zero.stage={zero_here}")
    return " ".join(["setdiff-train --config", os.path.join(path, CONFIG), "run_dir=NEW_RUN_DIR",
                     f"checkpoint.init_from={path}", *overrides, *more, "..."])


def layout_differences(saved: dict, here: dict, zero_saved: int, zero_here: int,
                       path: str, global_names: bool = True) -> list[str]:
    """Why a checkpoint saved in layout ``saved`` (ZeRO stage ``zero_saved``; its optimizer
    state named by global names or, before they were, by each stage's own) cannot resume in
    ``here`` (``zero_here``), as lines of a refusal: none when its optimizer state can be
    re-partitioned (:func:`needs_universal`)."""
    diffs = []
    keys = (("pipeline", "parallel.pipeline"), ("tensor", "parallel.tensor"),
            ("data", "data-parallel size"), ("context", "parallel.context"))
    moved = [f"{name}: checkpoint {saved.get(key, 1)}, this run {here.get(key, 1)}"
             for key, name in keys if saved.get(key, 1) != here.get(key, 1)]
    fresh = ("to go on from its weights in this layout, with a fresh optimizer: "
             + fresh_start(path, saved, here, zero_saved, zero_here))
    if moved and saved["pipeline"] > 1 and not global_names:
        diffs.append(f"{'; '.join(moved)} (this pipeline-parallel checkpoint was saved before "
                     "the optimizer state was named by global layer: each stage's layers are "
                     f"numbered from 0 in it, so it resumes in its own layout only; {fresh})")
    elif moved and zero_saved == zero_here == 0:
        diffs.append(f"{'; '.join(moved)} (zero.stage=0 has no ZeRO state to re-partition; "
                     f"ZeRO 1-3 checkpoints can change layout; {fresh})")
    elif zero_here == 3 and saved["tensor"] != here["tensor"]:
        diffs.append(f"parallel.tensor: checkpoint {saved['tensor']}, this run {here['tensor']} "
                     "(DeepSpeed re-slices ZeRO-3 state for another data-parallel size only; "
                     "ZeRO-1/2 checkpoints can change the tensor-parallel size too)")
    elif zero_here == 3 and here["tensor"] > 1 and (moved or zero_saved != 3):
        diffs.append(f"{'; '.join(moved) or f'zero.stage: checkpoint {zero_saved}, this run 3'}"
                     f" at parallel.tensor={here['tensor']} (DeepSpeed's ZeRO-3 load of the "
                     "universal form takes whole tensors, not megatron's tensor-parallel "
                     f"slices: ZeRO-3 with tensor parallelism resumes in its own layout; {fresh})")
    if zero_saved != zero_here and 0 in (zero_saved, zero_here):
        diffs.append(f"zero.stage: checkpoint {zero_saved}, this run {zero_here} (no ZeRO state "
                     f"to re-partition; ZeRO 1-3 checkpoints resume at ZeRO 1-3; {fresh})")
    elif zero_saved == 3 and zero_here != 3 and saved["tensor"] > 1:
        diffs.append(f"zero.stage: checkpoint 3 at parallel.tensor={saved['tensor']}, this run "
                     f"{zero_here} (a ZeRO-3 checkpoint goes to ZeRO-1/2 from "
                     f"parallel.tensor=1 only; {fresh})")
    return diffs


def needs_universal(saved: dict, here: dict, optimizer_changed: bool) -> bool:
    """Whether a checkpoint saved in layout ``saved`` resumes in ``here`` through DeepSpeed's
    universal form, which re-partitions the optimizer state: another pipeline or tensor-
    parallel size, another ZeRO partition count (data x context-parallel size), or another
    form of the optimizer state (``optimizer_changed``:
    :func:`setdiff_dist.train.optimizer_state.optimizer_changes`, or another ZeRO stage)."""
    def zero_ranks(layout):
        return layout["data"] * layout.get("context", 1)
    return optimizer_changed or saved["pipeline"] != here["pipeline"] or \
        saved["tensor"] != here["tensor"] or zero_ranks(saved) != zero_ranks(here)


def check_compatible(manifest: dict, path: str, cfg, tokenizer_identity: dict,
                     here: dict, form_change: Optional[str] = None) -> dict:
    """``manifest`` (of the checkpoint at ``path``), or a CheckpointError listing every
    difference with this run: ``cfg``, its tokenizer, its layout ``here`` (``{"tensor",
    "pipeline", "data", "world", "context"}``). ``form_change``: how the checkpoint's form of
    DeepSpeed's optimizer state differs from this run's, if it does
    (:func:`setdiff_dist.train.optimizer_state.deepspeed_form_change`: which form a config
    saves is the trainer's knowledge of DeepSpeed's optimizers, not the format's)."""
    m = manifest
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {m.get('format')!r}, expected {FORMAT!r}")
    # a key added after the checkpoint was written has its default there (e.g. model.head_dim),
    # a width saved as null the value it stood for
    diffs = model_differences(cfg.to_dict()["model"], resolved_model(m["model"]))
    global_names = m.get("optimizer_names") == "global"
    diffs += layout_differences(m["layout"], here, m["zero_stage"], cfg.zero.stage, path,
                                global_names)
    if form_change and m["layout"]["pipeline"] > 1 and not global_names:
        diffs.append(f"{form_change} (bf16 ZeRO-1 keeps its optimizer state in another form with "
                     "overlap_comm; this pipeline-parallel checkpoint was saved before its "
                     "optimizer state was named by global layer and cannot be converted: resume "
                     f"with zero.overlap_comm={str(not cfg.zero.overlap_comm).lower()})")
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


def verify(path: str, manifest: dict, hashes: bool = True, group=None) -> None:
    """Check every file of the checkpoint against its manifest (size, and SHA-256 with
    ``hashes``); the ranks of ``group`` (a torch.distributed group whose ranks all call this)
    share the work and raise the same :class:`CheckpointError`, naming the damaged files and
    the checkpoint to go back to. A checkpoint written before the manifest listed its files
    passes unchecked."""
    table = manifest.get("files")
    if table is None:
        return
    problems = shared_problems(path, table, sorted(table), hashes, group)
    if problems:
        raise damaged(path, problems)


# ------------------------------------------------------------------------- derived forms
# A form derived from a checkpoint (its universal/ and universal_zero3/) is made once and reused
# by every later resume at that layout: a manifest of its own, written last, lists its files
# (size, SHA-256) and links, and carries the SHA-256 of its own content, so that damage to any
# byte of the form, the manifest included, is named before DeepSpeed reads it.

def _self_checksum(body: dict) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def derived_manifest(of: str, files: dict, links: dict) -> dict:
    """The manifest of a form derived from the checkpoint ``of``: its ``files``
    (``{name: {"bytes", "sha256"}}``) and ``links`` (``{name: target}``)."""
    body = {"format": DERIVED_FORMAT, "of": of, "files": dict(sorted(files.items())),
            "links": dict(sorted(links.items()))}
    return dict(body, sha256=_self_checksum(body))


def read_derived(directory: str) -> tuple[Optional[dict], list[str]]:
    """The manifest of the derived form ``directory`` and [], or None and what is wrong with
    it."""
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, [f"{MANIFEST} is damaged (not JSON: {exc})"]
    if not isinstance(manifest, dict) or manifest.get("format") != DERIVED_FORMAT or \
            not isinstance(manifest.get("files"), dict) or \
            not isinstance(manifest.get("links"), dict):
        return None, [f"{MANIFEST} is damaged (not a {DERIVED_FORMAT} manifest)"]
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if manifest.get("sha256") != _self_checksum(body):
        return None, [f"{MANIFEST} does not match its own SHA-256 checksum (damaged)"]
    return manifest, []


def derived_problems(directory: str, manifest: dict, names: list, hashes: bool = True,
                     links: bool = True) -> list[str]:
    """What is wrong with ``names`` (of the manifest's files) of the derived form
    ``directory``, and with its links (``links``)."""
    problems = file_problems(directory, manifest["files"], names, hashes)
    for name, target in manifest["links"].items() if links else ():
        path = os.path.join(directory, name)
        if not os.path.islink(path) or os.readlink(path) != target:
            problems.append(f"{name} is not the link to {target} it was made as")
    return problems


def check_no_code(path: str) -> None:
    """Refuse a checkpoint any of whose pickled files (``*.pt``, the universal form's too)
    names a class or function beyond tensors, containers and :data:`PICKLED_GLOBALS`: read
    from the pickle's opcodes, nothing executed, the same verdict on every rank."""
    import glob

    import torch

    for file in sorted(glob.glob(os.path.join(path, "**", "*.pt"), recursive=True)):
        try:
            found = set(torch.serialization.get_unsafe_globals_in_checkpoint(file))
        except Exception as exc:
            top = os.path.relpath(file, path).split(os.sep)[0]
            fix = (f"remove {os.path.join(path, top)} (rm -r) to have it made again from the "
                   "checkpoint") if top in DERIVED_FORMS else \
                "resume from an earlier checkpoint"
            raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc}); it is "
                                  f"damaged: {fix}") from None
        unsafe = sorted(found - set(PICKLED_GLOBALS))
        if unsafe:
            raise CheckpointError(f"{file} would run code when loaded ({', '.join(unsafe[:3])}"
                                  f"{' ...' if len(unsafe) > 3 else ''}): refused, nothing from "
                                  "it was run; resume from a checkpoint you trust")


def check_resume(path: str, cfg, tokenizer_identity: dict, here: dict, stream: dict,
                 say: bool = True, group=None, form_change: Optional[str] = None) -> dict:
    """Everything that decides, before any model is built, whether this run (``cfg``, its
    tokenizer, its ``here`` layout, its data ``stream``: a loader's state) can go on from the
    checkpoint at ``path``: the manifest against the run, the data stream, every file's size and
    checksum, and no pickled code. Returns the manifest or raises a :class:`CheckpointError`
    (or the data's ShardError) naming what differs. ``say``: print the notes (rank 0);
    ``group``: the ranks that share the hashing (see :func:`verify`); ``form_change``: see
    :func:`check_compatible`."""
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
    manifest = check_compatible(read_manifest(path), path, cfg, tokenizer_identity, here,
                                form_change)
    if manifest["step"] > cfg.train.steps:
        raise CheckpointError(f"{path} is at step {manifest['step']}, past train.steps="
                              f"{cfg.train.steps}: raise train.steps to train on, or give a new "
                              "run_dir (resume=never) to start over")
    if "data" in manifest:  # (the same data stream: checked again when it is loaded)
        saved = manifest["data"].get("global_batch")
        if saved is not None and saved != stream["global_batch"]:
            raise CheckpointError(
                f"cannot resume from {path}: data.global_batch_size: checkpoint {saved}, this "
                f"run {stream['global_batch']}. The global batch defines the data order and "
                "what each optimizer step averages, so the run would not go on as it was (a "
                f"layout change keeps it: data.global_batch_size={saved}, with "
                "data.micro_batch_size x the data-parallel size dividing it). To go on from its "
                "weights with the new batch and a fresh optimizer: "
                + fresh_start(path, manifest["layout"], here, manifest["zero_stage"],
                              cfg.zero.stage,
                              f"data.global_batch_size={stream['global_batch']}"))
        check_stream(manifest["data"], stream)
    verify(path, manifest, cfg.checkpoint.checksums, group)
    check_no_code(path)  # (DeepSpeed's files are pickles)
    return manifest
