"""One error type for everything a user can fix.

Every error that is the user's to fix (a config key, a flag, a shard, a checkpoint, the launch
environment) derives from :class:`SetdiffError`. Each command-line entry point catches it once
(:func:`setdiff_dist.cli.command`), prints its message as ``prog: error: ...`` and exits with
code 2; anything else is a bug of ours and keeps its traceback (exit code 1). The exit codes of
every command are listed below (``EXIT_*``).

The module imports nothing heavy: the data-prep tools and the launcher use it before torch.
"""

from __future__ import annotations

import os

# The exit codes of every command, in one place. A launcher restarts (and Slurm requeues
# without the node it failed on) only a failure that may go away: a crash, a kill, a hang. A
# refusal (EXIT_USAGE) or a divergence (EXIT_DIVERGED) is deterministic: the same start fails
# the same way, on any node, so it is never restarted (:func:`restartable`).
EXIT_FAILED = 1  # a bug of ours, a crash, a lost peer: restarted (train.max_restarts)
EXIT_USAGE = 2  # bad input: config, flag, data, checkpoint (argparse's code too)
EXIT_DIVERGED = 3  # the loss stayed non-finite (Diverged): not restarted
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpointed on a signal; requeue and resume=auto
EXIT_HUNG = 76  # a rank made no progress for train.hang_timeout_s (EX_PROTOCOL)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader went away (`setdiff-config --keys | head`)
# the exits that are no failure: a clean end, a stop on a signal after a checkpoint
EXIT_STOPPED = (0, EXIT_PREEMPTED, EXIT_INTERRUPTED)
# the failures a restart would meet again
EXIT_NOT_RESTARTED = (EXIT_USAGE, EXIT_DIVERGED)


def restartable(code: int) -> bool:
    """Whether a rank's exit ``code`` (negative: killed by that signal) is a failure that a
    restart may get past; a clean end, a stop, a refusal or a divergence is not."""
    return code not in EXIT_STOPPED and code not in EXIT_NOT_RESTARTED


# What a collective raises on a rank whose peer went away (gloo's and NCCL's own words)
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker crash",
             "Broken pipe", "NCCL communicator was aborted", "remote process exited")


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank went away (its own
    message says why): this rank then stops with one line, not a traceback."""
    return any(s in str(exc) for s in PEER_LOST)


def collective_failed(exc: BaseException) -> bool:
    """Whether ``exc`` came from torch.distributed rather than this rank's own computation: a
    peer lost (:func:`peer_lost`), a timeout, or any other error of the process group (gloo,
    NCCL): the ranks can no longer be assumed to be in step."""
    import sys

    dist = sys.modules.get("torch.distributed")  # (only a process that has one can raise it)
    text = str(exc).lower()
    return peer_lost(exc) or (dist is not None and isinstance(exc, getattr(dist, "DistError",
                                                                           ()))) \
        or "gloo" in text or "nccl" in text


class SetdiffError(Exception):
    """A problem the user can fix; the message says what is wrong and how to fix it.

    ``every_rank``: every rank of a job reaches this error alike (a config key, a checkpoint),
    so rank 0 alone prints it. Set it False for an error one rank meets on its own (a shard
    only that rank reads): then the rank that met it prints it, named.
    """

    every_rank = True
    exit_code = EXIT_USAGE

    def __init__(self, *args, every_rank: bool | None = None):
        super().__init__(*args)
        if every_rank is not None:
            self.every_rank = every_rank


class TrainingError(SetdiffError, RuntimeError):
    """A run that cannot go on; the message says why and what to do."""


class Diverged(TrainingError):
    """The loss stayed non-finite: a failed run, not bad input, but as deterministic as a
    refusal (exit code :data:`EXIT_DIVERGED`, outcome ``"diverged"``): never restarted."""

    exit_code = EXIT_DIVERGED


def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size: the process group's when there is one, else the
    launcher's environment (torchrun, our launcher, Slurm), else (0, 1)."""
    import sys

    dist = sys.modules.get("torch.distributed")  # (never import torch just to print an error)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env = os.environ
    for rank, world in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank in env:
            try:
                return int(env[rank]), int(env.get(world, 1))
            except ValueError:
                pass
    return 0, 1


def report(prog: str, exc: SetdiffError) -> None:
    """Print ``exc`` for the user, once per job: from rank 0, or from the rank that met it."""
    import sys

    rank, world = rank_and_world()
    if rank == 0 or not exc.every_rank:
        where = f"[rank {rank}] " if world > 1 and rank != 0 else ""
        print(f"{prog}: error: {where}{exc}", file=sys.stderr, flush=True)
