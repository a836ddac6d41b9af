"""The run directory's housekeeping, on rank 0 (its names: :mod:`setdiff_dist.checkpoint.format`):
the claim (a lock, and a refusal to train over newer checkpoints), what interrupted work left,
the record of how each start ended (``exit_status.json``), and what a restart reads of the
start before it."""

from __future__ import annotations

import json
import os
import sys

from setdiff_dist.checkpoint.format import (
    EXIT_STATUS,
    LATEST_UNIVERSAL,
    METRICS,
    PREVIOUS,
    WATCHDOG,
)
from setdiff_dist.errors import EXIT_FAILED, EXIT_HUNG, restartable
from setdiff_dist.train.watchdog import restart_count


def latest_or_none(run_dir: str):
    from setdiff_dist.checkpoint.files import CheckpointError, resolve_latest

    try:
        return resolve_latest(run_dir)
    except CheckpointError:
        return None


def write_exit_status(run_dir: str, outcome: str, code: int, step, checkpoint,
                       last_step_at=None) -> None:
    """Rank 0's record of how this attempt ended, replaced atomically; ``restartable``: whether
    it is a failure a restart may get past (:func:`setdiff_dist.errors.restartable`), which
    the Slurm launcher reads; ``attempt``: which start wrote it; ``last_step_at``: the wall
    time of the attempt's last completed step (what a restart measures its lost time from)."""
    import time

    from setdiff_dist.train.watchdog import attempt_id

    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, EXIT_STATUS)
    with open(path + ".tmp", "w") as fh:
        json.dump({"outcome": outcome, "exit_code": code, "step": step,
                   "checkpoint": checkpoint, "restartable": restartable(code),
                   "attempt": attempt_id(), "time": time.time(),
                   "last_step_at": last_step_at}, fh)
    os.replace(path + ".tmp", path)


def read_json(path: str):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def previous_attempt(run_dir: str):
    """How the start before this one in the same allocation ended, as its rank 0 recorded it
    (``exit_status.json``), or None: no record, a record of another job or allocation, or a
    process no launcher will restart (no job id)."""
    from setdiff_dist.train.watchdog import attempt_id

    status = read_json(os.path.join(run_dir, EXIT_STATUS))
    here = attempt_id()
    if not isinstance(status, dict) or here["job"] is None or status.get("attempt") != here:
        return None
    return status


def refuse_pointless_restart(run_dir: str):
    """torch elastic restarts the workers after any non-zero exit, but a refusal, a
    divergence or a stop on a signal would only end the same way again (or train past a
    preemption): the restarted ranks end at once, with the previous attempt's exit code, before
    they build anything. Returns that code, or None to go on."""
    status = previous_attempt(run_dir) if restart_count() else None
    if status is None or status.get("restartable", True):
        return None
    code = int(status.get("exit_code", EXIT_FAILED))
    if os.environ.get("RANK", "0") == "0":
        print(f"setdiff-train: restart {restart_count()}: not starting again: the previous "
              f"attempt ended {status.get('outcome')} (exit code {code}, "
              f"{os.path.join(run_dir, EXIT_STATUS)}), which a restart would meet again; "
              "ending with its code", file=sys.stderr, flush=True)
    return code


def fault_before_this_start(run_dir: str, restart: int):
    """When this start follows another of the same job (an in-job restart, ``restart`` > 0,
    or a Slurm requeue): (which, the wall time of the last step the previous start finished,
    that step), from its rank 0's exit status or, when rank 0 died without one (a kill, a lost
    node), the later of its last heartbeat and its last line of metrics.jsonl; else None. The
    first step of this start reports the time lost from there (``Trainer._report_restart``)."""
    from setdiff_dist.train.watchdog import attempt_id, heartbeat_path

    here = attempt_id()
    if here["job"] is None or not (restart or here["allocation"]):
        return None
    found = []
    status = read_json(os.path.join(run_dir, EXIT_STATUS))
    if isinstance(status, dict) and (status.get("attempt") or {}).get("job") == here["job"] \
            and status.get("last_step_at"):
        found.append((status["last_step_at"], status.get("step")))
    beat = read_json(heartbeat_path(run_dir, 0))
    if isinstance(beat, dict) and (beat.get("attempt") or {}).get("job") == here["job"] and \
            beat.get("progress_at") and beat.get("pid") != os.getpid():
        # (its step is the one in progress)
        found.append((beat["progress_at"], max(int(beat.get("step") or 1) - 1, 0)))
    logged = last_logged_step(os.path.join(run_dir, METRICS))
    if logged and (found or restart):  # (a requeue's metrics may be another job's)
        found.append(logged)
    if not found:
        return None
    which = f"restart {restart}" if restart else f"requeue {here['allocation']}"
    return (which, *max(found, key=lambda f: f[0]))


def last_logged_step(path: str):
    """(when ``metrics.jsonl`` was last written, the step of its last line), or None."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(os.fstat(fh.fileno()).st_size - 65536, 0))
            at = os.fstat(fh.fileno()).st_mtime
            for line in reversed(fh.read().splitlines()):
                try:
                    return at, int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    continue
    except OSError:
        pass
    return None


def record_hang(run_dir: str, trainer):
    """Rank 0's ``on_hang``: the outcome ``"hung"`` at the trainer's own step (its last
    completed one, as every outcome records), not the hang report's, which is the culprit's
    last heartbeat (another rank's, written seconds before, or none)."""
    return lambda report: write_exit_status(run_dir, "hung", EXIT_HUNG, trainer.step,
                                             latest_or_none(run_dir), trainer.last_step_at)


RUN_LOCK = None  # rank 0's hold on the run directory, for the life of the process


def claim_run_dir(cfg, force: bool):
    """Rank 0: lock the run directory; the reason to refuse this run, or None."""
    global RUN_LOCK
    from setdiff_dist.checkpoint.files import (
        CheckpointError,
        RunLock,
        check_writable,
        complete_checkpoints,
    )

    try:
        RUN_LOCK = RunLock(cfg.run_dir)
    except CheckpointError as exc:  # (another trainer holds it; or it cannot be written)
        return str(exc)
    existing = complete_checkpoints(cfg.run_dir)
    refusal = None
    if cfg.resume == "never" and existing and not force:
        refusal = (f"resume=never would train over the {len(existing)} checkpoint(s) in "
                   f"{cfg.run_dir}/checkpoints (newest {os.path.basename(existing[-1])}): give "
                   "a new run_dir, resume (resume=auto), or add --force to overwrite them")
    elif cfg.resume not in ("auto", "never") and existing and not force:
        newer = newer_checkpoints(cfg.resume, existing)
        if newer:
            refusal = (f"resume={cfg.resume} goes back to an earlier step, and training on "
                       f"would overwrite the {len(newer)} newer checkpoint(s) in "
                       f"{cfg.run_dir}/checkpoints ({', '.join(newer[:3])}"
                       f"{' ...' if len(newer) > 3 else ''}): give the rewound run a new "
                       "run_dir, resume=auto to go on from the newest, or add --force to "
                       "train over them")
    if refusal is None:
        try:
            check_writable(cfg.run_dir)  # (or its first save fails, after all the work)
        except CheckpointError as exc:
            refusal = str(exc)
    if refusal:
        RUN_LOCK.release()
    else:
        clean_leftovers(cfg.run_dir)
        set_aside_watchdog(cfg.run_dir)
    return refusal


def set_aside_watchdog(run_dir: str) -> None:
    """A previous attempt's hang watch files (its report would end this attempt at once) move
    to ``watchdog.previous/`` (replacing an older one), for whoever looks into that hang."""
    import shutil

    path = os.path.join(run_dir, WATCHDOG)
    if os.path.isdir(path):
        shutil.rmtree(path + PREVIOUS, ignore_errors=True)
        os.replace(path, path + PREVIOUS)


def newer_checkpoints(resume: str, existing: list[str]) -> list[str]:
    """The complete checkpoints of ``existing`` past the step ``resume`` points at (which a run
    resumed from it would overwrite as it saves); [] when it cannot tell (the trainer then
    says what is wrong with ``resume``)."""
    from setdiff_dist.checkpoint.files import CheckpointError, step_directory
    from setdiff_dist.checkpoint.manifest import read_manifest

    try:
        step = read_manifest(step_directory(resume))["step"]
        return [os.path.basename(p) for p in existing if read_manifest(p)["step"] > step]
    except (CheckpointError, KeyError, TypeError):
        return []


def clean_leftovers(run_dir: str) -> None:
    """Remove what interrupted saves and conversions left in the run's checkpoints (this
    process holds the run directory, so nothing else writes there): step directories without
    a manifest (a save that crashed or found the disk full), a layout-changing conversion's
    ``universal.tmp/`` and the converter's ``latest_universal`` (never used; as large as the
    optimizer state), temporary ``latest`` files. Says what it removed. A step directory whose
    conversion lock another job holds (it resumes from this checkpoint) is left alone."""
    import shutil

    from setdiff_dist.checkpoint.files import ConversionLock
    from setdiff_dist.checkpoint.format import (
        DERIVED_FORMS,
        LATEST,
        checkpoint_root,
        is_complete,
        is_step_name,
    )

    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if is_step_name(name) and os.path.isdir(path):
            if not is_complete(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(f"{name} (an incomplete save)")
                continue
            junk = [j for j in (*(f"{form}.tmp" for form in DERIVED_FORMS),
                                LATEST_UNIVERSAL)  # (the last: DeepSpeed's)
                    if os.path.exists(os.path.join(path, j))]
            lock = ConversionLock(path)
            if not junk or not lock.acquire(blocking=False):
                continue  # (nothing to remove, or another job converts there now)
            try:
                for j in junk:
                    where = os.path.join(path, j)
                    shutil.rmtree(where) if os.path.isdir(where) else os.remove(where)
                    removed.append(f"{name}/{j} (an interrupted conversion)")
            finally:
                lock.release()
        elif name.startswith(f"{LATEST}.tmp-"):
            os.remove(path)
    if removed:
        print(f"note: removed what interrupted work left in {root}: {', '.join(removed)}",
              flush=True)
