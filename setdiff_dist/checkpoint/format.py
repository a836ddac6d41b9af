"""The names and layout of a run directory and its checkpoints, in one place: every writer and
reader of a run directory or a step directory takes its file names from here.

``run_dir/`` holds, beside ``checkpoints/``
- ``config.yaml`` (the resolved config of the run's last start: :data:`CONFIG`, the name a step
  directory's copy has too), ``metrics.jsonl``, ``tensorboard/`` and ``wandb_id`` (the metrics;
  the last, the W&B run's id that a resume goes on with), ``profile/rank<R>.pt.trace.json``
  (``train.profile_steps``' traces), ``exit_status.json`` (rank 0's record of how the last
  start ended, which the launchers read), ``faults.jsonl`` (the job's faults, a line each) and
  ``.setdiff.lock`` (held by the trainer that owns the directory);
- ``watchdog/`` (the hang watch: each rank's heartbeat ``rank<R>.json`` and stacks
  ``stacks-rank<R>.txt``, the report ``hang.json`` and its claim ``hang.claim``), a previous
  start's as ``watchdog.previous/``;
- ``nccl_trace/`` (NCCL's flight recorder), named by :mod:`setdiff_dist.parallel.state`, which
  turns it on and imports nothing of checkpoints.

``run_dir/checkpoints/step_NNNNNNN/`` (format ``setdiff-ckpt/1``) holds
- DeepSpeed's files (model states per model-parallel rank, optimizer states per data-parallel
  rank, the LR scheduler, our client state), named by DeepSpeed; or, from megatron-core's
  distributed optimizer (``zero.implementation``), ``megatron_dp_rankRRRRR.pt`` per rank (its
  optimizer fragments) and ``megatron_dp_model_tpTT_ppPP.pt`` per model-parallel rank (the
  module, the LR scheduler, our client state);
- ``weights/tpTT_ppPP.safetensors`` (+ ``tpTT_ppPP.json``, the tensor list and sharding, and
  ``tpTT_ppPP_partRR.safetensors`` for data-parallel rank ``RR``'s share) and the same under
  ``weights_ema/`` when the run keeps an EMA: each model-parallel rank's weights under their
  global names, readable in any layout without unpickling anything;
- ``rng_rank{r}.pt`` per rank, the tokenizer file, ``config.yaml`` and ``manifest.json``
  (written last: its presence makes the checkpoint complete);
- ``universal/``: DeepSpeed's universal form, derived on a resume at another data-parallel size
  (and ``universal_zero3/``, its view for a ZeRO-3 engine, or ``universal_zero12/``, a ZeRO-3
  checkpoint's for a ZeRO-1/2 engine), each with a ``manifest.json`` of its
  own (format :data:`DERIVED_FORMAT`: every file's size and SHA-256, every link's target),
  written last and checked at every resume that reuses it; ``universal.lock``, held while a
  job makes or checks them.

DeepSpeed's universal converter also leaves ``latest_universal`` in a step directory
(:data:`LATEST_UNIVERSAL`: never used, removed at the next start).

``run_dir/checkpoints/latest`` names the newest complete step directory; ``best`` (a run with
``checkpoint.keep_best``) the complete one of lowest validation loss, which pruning keeps. Either
pointer file is itself a valid ``--checkpoint`` / ``resume`` path.
"""

from __future__ import annotations

import os

FORMAT = "setdiff-ckpt/1"
LATEST = "latest"
BEST = "best"
MANIFEST = "manifest.json"
CONFIG = "config.yaml"
WEIGHTS = "weights"
EMA_WEIGHTS = "weights_ema"
UNIVERSAL = "universal"
# the universal form as a ZeRO-3 engine reads it, for a checkpoint of ZeRO 1-2 (links into
# UNIVERSAL, the few files it reads otherwise: train.universal.zero3_view)
UNIVERSAL_ZERO3 = "universal_zero3"
# the universal form of a ZeRO-3 checkpoint as a ZeRO-1/2 engine (DeepSpeed's, megatron's
# distributed optimizer) reads it: the tensors shaped, with the flags of a ZeRO-1/2 form
# (train.universal.zero12_view)
UNIVERSAL_ZERO12 = "universal_zero12"
# every form derived from a checkpoint (each with a manifest of its own)
DERIVED_FORMS = (UNIVERSAL, UNIVERSAL_ZERO3, UNIVERSAL_ZERO12)
# the manifest (MANIFEST) inside a form derived from a checkpoint: universal/, universal_zero3/
DERIVED_FORMAT = "setdiff-derived/1"
# in the step directory: held (flock) by the job that makes or checks its universal forms
UNIVERSAL_LOCK = "universal.lock"
# (a key of the client state in DeepSpeed's model-state files: the stage's parameter names ->
# their global names, which name the optimizer state since format 1 with "optimizer_names")
GLOBAL_NAMES = "setdiff_global_names"
# (DeepSpeed's universal converter's pointer, left in the step directory: junk to us)
LATEST_UNIVERSAL = "latest_universal"

# the run directory's own
CHECKPOINTS = "checkpoints"
EXIT_STATUS = "exit_status.json"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
WANDB_ID = "wandb_id"
PROFILE = "profile"
FAULTS = "faults.jsonl"
RUN_LOCK = ".setdiff.lock"
WATCHDOG = "watchdog"
PREVIOUS = ".previous"  # (a previous start's WATCHDOG: watchdog.previous)
HANG_REPORT = "hang.json"  # (in WATCHDOG)
HANG_CLAIM = "hang.claim"  # (in WATCHDOG: the rank that writes the report, first come)


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def heartbeat_file(rank: int) -> str:
    """Rank ``rank``'s heartbeat, in :data:`WATCHDOG`."""
    return f"rank{rank}.json"


def is_heartbeat_name(name: str) -> bool:
    return name.startswith("rank") and name.endswith(".json")


def stacks_file(rank: int) -> str:
    """Rank ``rank``'s Python stacks after a hang, in :data:`WATCHDOG`."""
    return f"stacks-rank{rank}.txt"


def trace_file(rank: int) -> str:
    """Rank ``rank``'s profiler trace (Chrome's format), in :data:`PROFILE`."""
    return f"rank{rank}.pt.trace.json"


def tag_of(step: int) -> str:
    return f"step_{step:07d}"


def is_step_name(name: str) -> bool:
    return name.startswith("step_")


def is_complete(path: str) -> bool:
    """Whether the step directory ``path`` holds a whole checkpoint (its manifest is written
    last)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def rng_file(rank: int) -> str:
    """Rank ``rank``'s RNG states (torch, megatron's tracker, CUDA)."""
    return f"rng_rank{rank}.pt"


def weights_name(tp: int, pp: int) -> str:
    """The weights of tensor-parallel rank ``tp`` of pipeline stage ``pp``: ``NAME.json``
    lists them; ``NAME.safetensors`` and ``NAME_partRR.safetensors`` hold them."""
    return f"tp{tp:02d}_pp{pp:02d}"


def weights_part(tp: int, pp: int, part: int) -> str:
    """The file data-parallel share ``part`` of :func:`weights_name`'s tensors is written to."""
    return weights_name(tp, pp) + (f"_part{part:02d}" if part else "") + ".safetensors"


def megatron_rank_file(rank: int) -> str:
    """Rank ``rank``'s optimizer fragments (megatron-core's distributed optimizer)."""
    return f"megatron_dp_rank{rank:05d}.pt"


def megatron_model_file(tp: int, pp: int) -> str:
    """The module and client state of tensor-parallel rank ``tp`` of stage ``pp`` (megatron-core's
    distributed optimizer)."""
    return f"megatron_dp_model_{weights_name(tp, pp)}.pt"


def megatron_files(path: str) -> tuple[list, dict]:
    """The step directory ``path``'s megatron files: the ranks' fragment files, in rank order,
    and ``{(tp, pp): model file}``; both empty for a DeepSpeed checkpoint."""
    import glob
    import re

    ranks = sorted(glob.glob(os.path.join(path, megatron_rank_file(0).replace("00000", "*"))))
    pattern = re.compile(re.escape(megatron_model_file(0, 0)).replace("00", r"(\d+)"))
    models = {}
    for f in os.listdir(path) if os.path.isdir(path) else []:
        m = pattern.fullmatch(f)
        if m:
            models[int(m.group(1)), int(m.group(2))] = os.path.join(path, f)
    return ranks, models
