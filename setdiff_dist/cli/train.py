"""``setdiff-train``: train a set-diffusion (or causal) LM with megatron-core + DeepSpeed.

    setdiff-train --config configs/tiny-cpu.yaml [section.key=value ...]          # one process
    setdiff-train --nproc-per-node 4 --config ... parallel.tensor=2              # launches 4
    torchrun --nproc-per-node 4 -m setdiff_dist.cli.train --config ...           # or torchrun
    srun ... python -m setdiff_dist.cli.train --config ...                        # or Slurm
    setdiff-train --dry-run --world-size 64 --config ... [--device-memory 80]    # plan only
        [--hardware h100|h200|b200]                 # ... and predict a step's time and MFU

Everything goes into ``run_dir``: ``config.yaml`` (the resolved config), ``metrics.jsonl``,
``tensorboard/``, ``checkpoints/step_*/`` and ``checkpoints/latest``. ``resume=auto`` (the
default) continues from ``latest``. SIGTERM or SIGUSR1 (to every rank, as Slurm sends it, or to
this launcher) checkpoints at the next step boundary and exits with code 75, for a requeue.

``--dry-run`` checks the config for ``--world-size`` ranks without a GPU or a process group
(megatron's layout of each pipeline stage, built on the meta device under a fake process group)
and prints per stage the parameters of each rank and its peak memory by kind; with
``--device-memory`` it flags the stages that would not fit (exit code 2 if any). See
:mod:`setdiff_dist.train.plan`. ``--hardware`` also predicts a step on those GPUs: the compute
at their peak, the bytes of every collective over the link it uses, what overlap hides, and so
the step time and MFU (:mod:`setdiff_dist.train.scale`).

Ctrl-C (SIGINT) is a clean stop too: the ranks agree on the next step boundary, save a checkpoint
and exit with code 130 (outcome ``"paused"``); a second Ctrl-C aborts at once, without one.

Exit codes (:mod:`setdiff_dist.errors`): 0 done (or stopped at ``train.exit_at_step``), 75
preempted after a checkpoint, 130 paused by Ctrl-C after a checkpoint, 2 bad config, data or
checkpoint, 3 diverged (the loss stayed non-finite), 76 a hang, 1 a failed run. Only a failed
run or a hang is restarted (``train.max_restarts``): a refusal or a divergence would fail again.
Rank 0 also writes the outcome to ``run_dir/exit_status.json`` (``{"outcome", "exit_code",
"step", "checkpoint", "restartable"}``), since under torchrun or srun the exit code a job
script sees is the launcher's, not the trainer's: the Slurm launchers requeue on
``"preempted"``, stop on ``"completed"``, and never restart a failure that is not
``"restartable"`` (``"invalid"``, ``"diverged"``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import uuid

from setdiff_dist.cli import HelpFormatter, Once, command, count
from setdiff_dist.config import ConfigError, load_config
from setdiff_dist.config_checks import world_problems
from setdiff_dist.errors import (
    EXIT_FAILED,
    EXIT_HUNG,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_USAGE,
    Diverged,
    SetdiffError,
    restartable,
)
from setdiff_dist.train.scale import HARDWARE
from setdiff_dist.train.watchdog import restart_count


class PeerLost(SetdiffError):
    """This rank's collective failed because another rank ended: a consequence, exit 1."""

    exit_code = EXIT_FAILED


EXIT_STATUS_FILE = "exit_status.json"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class _Signals:
    """The stop signals this process got, from the first line of ``main``: a signal that comes
    while the ranks still import and build (tens of seconds on a big model), or before the
    launcher has started its ranks, is kept and handed on, never lost to a default action."""

    def __init__(self):
        self.got: list[int] = []
        self.handler = None  # where they go once there is somewhere (the trainer, the ranks)
        self.original: dict = {}
        self.first_int = None

    def install(self, which=STOP_SIGNALS):
        for s in which:
            self.original.setdefault(s, signal.getsignal(s))
            signal.signal(s, self._on)

    def restore(self, which) -> None:
        """Give ``which`` back the handling this process started with."""
        for s in which:
            if s in self.original:
                signal.signal(s, self.original[s])

    def _on(self, signum, frame):
        import time

        if signum == signal.SIGINT and self.first_int is not None:
            if time.monotonic() - self.first_int < 1.0:
                return  # the same Ctrl-C, delivered twice (by the terminal and by torchrun)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if signum == signal.SIGINT:
            self.first_int = time.monotonic()
        if signum == signal.SIGINT and os.environ.get("RANK", "0") == "0" and \
                "SETDIFF_LAUNCHED" not in os.environ:  # (once: by the launcher, or rank 0)
            print("\nsetdiff-train: Ctrl-C: stopping at the next step boundary with a "
                  "checkpoint; Ctrl-C again to abort without one", file=sys.stderr, flush=True)
        self.got.append(signum)
        if self.handler is not None:
            self.handler(signum)

    def hand_to(self, handler) -> None:
        self.handler = handler
        for s in self.got:
            handler(s)


SIGNALS = _Signals()


def _parse(argv):
    ap = argparse.ArgumentParser(prog="setdiff-train", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--config", action=Once, required=True,
                    help="YAML config (see setdiff-config --keys)")
    ap.add_argument("--nproc-per-node", type=count(), default=None,
                    help="launch this many local processes (not needed under torchrun / srun)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the layout and per-rank memory for --world-size ranks; train "
                         "nothing")
    ap.add_argument("--world-size", type=count(), default=None,
                    help="with --dry-run: the number of ranks (GPUs) to plan for "
                         "(default: parallel.tensor x pipeline x context, one data-parallel "
                         "replica)")
    ap.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                    help="with --dry-run: memory per device, to flag stages that do not fit")
    ap.add_argument("--hardware", choices=sorted(HARDWARE), default=None,
                    help="with --dry-run: predict a step's time, communication and MFU on "
                         "these GPUs (8 per node)")
    ap.add_argument("--constants", action="store_true",
                    help="with --dry-run: also print every constant of the step-time model and "
                         "its source ($SETDIFF_EFFICIENCY: a file of refitted ones)")
    ap.add_argument("--force", action="store_true",
                    help="with resume=never: train over the checkpoints already in run_dir")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    return ap.parse_intermixed_args(argv)


def dry_run(cfg, world_size: int, device_memory, hardware=None, constants=False) -> int:
    from setdiff_dist.train.plan import PlanError, plan

    try:
        p = plan(cfg, world_size, hardware)
    except PlanError as exc:
        raise PlanError(f"the layout cannot run on {world_size} ranks:\n{exc}") from None
    print(p.table(device_memory))
    if hardware:
        print(p.predict(cfg, hardware).table())
    if constants:
        from setdiff_dist.train.scale import constants_table

        print("constants of the step-time model (setdiff_dist.train.scale):")
        print(constants_table())
    fits = device_memory is None or all(s.total <= device_memory * 2 ** 30 for s in p.stages)
    return 0 if fits else 2


def launch(nproc: int, argv: list[str], grace_s: float = 10.0, max_restarts: int = 0) -> int:
    """Start ``nproc`` ranks of this command on this machine, forward SIGTERM / SIGUSR1 / SIGINT
    to them, and return the first non-zero exit code (or 0). A rank that dies with a failure
    (a crash, a kill, a hang the watchdog ended) ends the attempt: the launcher names it, gives
    the others ``grace_s`` seconds to stop on SIGTERM, then kills them, instead of leaving them
    waiting in a collective for the process group's timeout. Then, up to ``max_restarts``
    times (``train.max_restarts``), every rank starts again and resumes from the last
    checkpoint (``SETDIFF_RESTART``: the trainer resumes with ``resume=auto``); a refusal
    (exit code 2), a divergence (3), a stop signal or a clean end is never restarted
    (:func:`setdiff_dist.errors.restartable`)."""
    from setdiff_dist.processes import threads_per_rank

    threads = {}
    if "OMP_NUM_THREADS" not in os.environ:  # (as torchrun does, but with the CPUs shared out)
        threads = {"OMP_NUM_THREADS": str(threads_per_rank(nproc))}
        print(f"setdiff-train: {threads['OMP_NUM_THREADS']} CPU thread(s) per rank "
              "(OMP_NUM_THREADS overrides)", file=sys.stderr, flush=True)
    restart, launch_id = 0, uuid.uuid4().hex  # (the starts of one launch share its id)
    while True:
        if SIGNALS.got:  # stopped before any rank started: start none
            return 128 + SIGNALS.got[0]
        code, failed = _attempt(nproc, argv, grace_s,
                                dict(threads, SETDIFF_RESTART=str(restart),
                                     SETDIFF_LAUNCH_ID=launch_id))
        if failed is None or not restartable(failed[1]) or SIGNALS.got:
            return code
        how = _how(failed[1])
        if restart >= max_restarts:
            if max_restarts:
                print(f"setdiff-train: rank {failed[0]} failed again ({how}) and no restart is "
                      f"left (train.max_restarts={max_restarts}, all used): its own output above "
                      "says why; the last checkpoint is intact, and resume=auto goes on from it",
                      file=sys.stderr, flush=True)
            return code
        restart += 1
        print(f"setdiff-train: restart {restart} of {max_restarts} (rank {failed[0]}: {how}): "
              "every rank starts again from the last checkpoint", file=sys.stderr, flush=True)


def _how(code: int) -> str:
    if code == EXIT_HUNG:
        return f"a hang, exit code {EXIT_HUNG}"
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def _attempt(nproc: int, argv: list[str], grace_s: float, extra_env: dict):
    """One start of every rank (see :func:`launch`): (the exit code, (rank, code) of the first
    rank that failed or None)."""
    import time

    from setdiff_dist.processes import free_port, own_group_and_die_with_parent

    port = str(free_port())
    children = []
    for rank in range(nproc):
        env = dict(os.environ, **extra_env, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, SETDIFF_LAUNCHED="1")
        children.append(subprocess.Popen([sys.executable, "-m", "setdiff_dist.cli.train"] + argv,
                                         env=env, preexec_fn=own_group_and_die_with_parent))

    def forward(signum):
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)

    SIGNALS.hand_to(forward)
    failed = None
    while None in [c.poll() for c in children]:  # (a list: every child polled, each time)
        dead = [(r, c.returncode) for r, c in enumerate(children)
                if c.returncode is not None and c.returncode not in EXIT_STOPPED]
        if dead and failed is None:
            failed = dead[0]
            if failed[1] == EXIT_HUNG:  # (the watch has named the hung rank)
                print(f"setdiff-train: rank {failed[0]} ended on a hang (exit code "
                      f"{EXIT_HUNG}); stopping the other ranks", file=sys.stderr, flush=True)
            elif restartable(failed[1]):  # (else a refusal or a divergence every rank
                # reaches; it has said why)
                print(f"setdiff-train: rank {failed[0]} died ({_how(failed[1])}); stopping the "
                      "other ranks", file=sys.stderr, flush=True)
            for c in children:
                if c.poll() is None:
                    c.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and None in [c.poll() for c in children]:
                time.sleep(0.1)
            for c in children:
                if c.poll() is None:
                    c.kill()
        time.sleep(0.2)
    codes = [c.wait() for c in children]
    if failed is None:
        # (a rank that failed as the last one ended, between two polls)
        failed = next(((r, c) for r, c in enumerate(codes) if c not in EXIT_STOPPED), None)
        if failed is not None and restartable(failed[1]):
            print(f"setdiff-train: rank {failed[0]} died ({_how(failed[1])})", file=sys.stderr,
                  flush=True)
    if failed is not None:
        return (failed[1] if failed[1] > 0 else EXIT_FAILED), failed
    return next((c for c in codes if c != 0), 0), None


def agreed_restart_count() -> int:
    """The restart count every rank agrees on (the largest): torch elastic counts restarts per
    agent, and an agent whose ranks were still healthy when another node's failed restarts
    them without counting (pytorch/pytorch#135712). One all-reduce at start-up."""
    import torch
    import torch.distributed as dist

    count = torch.tensor([restart_count()], dtype=torch.int64,
                         device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def _latest_or_none(run_dir: str):
    from setdiff_dist.checkpoint.files import CheckpointError, resolve_latest

    try:
        return resolve_latest(run_dir)
    except CheckpointError:
        return None


def _write_exit_status(run_dir: str, outcome: str, code: int, step, checkpoint,
                       last_step_at=None) -> None:
    """Rank 0's record of how this attempt ended, replaced atomically; ``restartable``: whether
    it is a failure a restart may get past (:func:`setdiff_dist.errors.restartable`), which
    the Slurm launcher reads; ``attempt``: which start wrote it; ``last_step_at``: the wall
    time of the attempt's last completed step (what a restart measures its lost time from)."""
    import time

    from setdiff_dist.train.watchdog import attempt_id

    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, EXIT_STATUS_FILE)
    with open(path + ".tmp", "w") as fh:
        json.dump({"outcome": outcome, "exit_code": code, "step": step,
                   "checkpoint": checkpoint, "restartable": restartable(code),
                   "attempt": attempt_id(), "time": time.time(),
                   "last_step_at": last_step_at}, fh)
    os.replace(path + ".tmp", path)


def _read_json(path: str):
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

    status = _read_json(os.path.join(run_dir, EXIT_STATUS_FILE))
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
              f"{os.path.join(run_dir, EXIT_STATUS_FILE)}), which a restart would meet again; "
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
    status = _read_json(os.path.join(run_dir, EXIT_STATUS_FILE))
    if isinstance(status, dict) and (status.get("attempt") or {}).get("job") == here["job"] \
            and status.get("last_step_at"):
        found.append((status["last_step_at"], status.get("step")))
    beat = _read_json(heartbeat_path(run_dir, 0))
    if isinstance(beat, dict) and (beat.get("attempt") or {}).get("job") == here["job"] and \
            beat.get("progress_at") and beat.get("pid") != os.getpid():
        # (its step is the one in progress)
        found.append((beat["progress_at"], max(int(beat.get("step") or 1) - 1, 0)))
    logged = _last_logged_step(os.path.join(run_dir, "metrics.jsonl"))
    if logged and (found or restart):  # (a requeue's metrics may be another job's)
        found.append(logged)
    if not found:
        return None
    which = f"restart {restart}" if restart else f"requeue {here['allocation']}"
    return (which, *max(found, key=lambda f: f[0]))


def _last_logged_step(path: str):
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


def _record_hang(run_dir: str, trainer):
    """Rank 0's ``on_hang``: the outcome ``"hung"`` at the trainer's own step (its last
    completed one, as every outcome records), not the hang report's, which is the culprit's
    last heartbeat (another rank's, written seconds before, or none)."""
    return lambda report: _write_exit_status(run_dir, "hung", EXIT_HUNG, trainer.step,
                                             _latest_or_none(run_dir), trainer.last_step_at)


_RUN_LOCK = None  # rank 0's hold on the run directory, for the life of the process


def _claim_run_dir(cfg, force: bool):
    """Rank 0: lock the run directory; the reason to refuse this run, or None."""
    global _RUN_LOCK
    from setdiff_dist.checkpoint.files import (
        CheckpointError,
        RunLock,
        check_writable,
        complete_checkpoints,
    )

    try:
        _RUN_LOCK = RunLock(cfg.run_dir)
    except CheckpointError as exc:  # (another trainer holds it; or it cannot be written)
        return str(exc)
    existing = complete_checkpoints(cfg.run_dir)
    refusal = None
    if cfg.resume == "never" and existing and not force:
        refusal = (f"resume=never would train over the {len(existing)} checkpoint(s) in "
                   f"{cfg.run_dir}/checkpoints (newest {os.path.basename(existing[-1])}): give "
                   "a new run_dir, resume (resume=auto), or add --force to overwrite them")
    elif cfg.resume not in ("auto", "never") and existing and not force:
        newer = _newer_checkpoints(cfg.resume, existing)
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
        _RUN_LOCK.release()
    else:
        _clean_leftovers(cfg.run_dir)
        _set_aside_watchdog(cfg.run_dir)
    return refusal


def _set_aside_watchdog(run_dir: str) -> None:
    """A previous attempt's hang watch files (its report would end this attempt at once) move
    to ``watchdog.previous/`` (replacing an older one), for whoever looks into that hang."""
    import shutil

    from setdiff_dist.train.watchdog import DIRECTORY

    path = os.path.join(run_dir, DIRECTORY)
    if os.path.isdir(path):
        shutil.rmtree(path + ".previous", ignore_errors=True)
        os.replace(path, path + ".previous")


def _newer_checkpoints(resume: str, existing: list[str]) -> list[str]:
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


def _clean_leftovers(run_dir: str) -> None:
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
                                "latest_universal")  # (the last: DeepSpeed's)
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


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker crash",
              "Broken pipe", "NCCL communicator was aborted", "remote process exited")


def _peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank went away."""
    return any(s in str(exc) for s in _PEER_LOST)


def run(cfg, force: bool = False) -> int:
    if not cfg.checkpoint.save_on_signal:
        # the Slurm launchers start the ranks with SIGTERM / SIGUSR1 ignored: let SIGTERM end
        # them again (SIGINT still stops cleanly)
        SIGNALS.restore((signal.SIGUSR1,))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    import torch.distributed as dist

    from setdiff_dist.checkpoint.files import CheckpointError
    from setdiff_dist.parallel import init_distributed
    from setdiff_dist.train.loop import Trainer

    # idempotent; rank 0 is known before any error
    init_distributed(cfg.parallel.backend, cfg.train.collective_timeout_s, cfg.run_dir)
    restart = agreed_restart_count()
    if restart and cfg.resume != "auto":
        # a restart goes on from this run's last checkpoint, not from where the first start did
        if dist.get_rank() == 0:
            print(f"restart {restart}: resume={cfg.resume} -> resume=auto", flush=True)
        cfg.resume = "auto"
    problems = world_problems(cfg, dist.get_world_size())
    if problems:
        raise ConfigError(problems, "the launch")
    rank0 = dist.get_rank() == 0
    # (read before the claim sets the previous start's heartbeats aside)
    fault = fault_before_this_start(cfg.run_dir, restart) if rank0 else None
    verdict = [_claim_run_dir(cfg, force) if rank0 else None]
    dist.broadcast_object_list(verdict, src=0)  # every rank stops, or none
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])
    if rank0 and os.path.exists(os.path.join(cfg.run_dir, EXIT_STATUS_FILE)):
        os.remove(os.path.join(cfg.run_dir, EXIT_STATUS_FILE))  # a previous attempt's
    outcome, code, trainer = "failed", EXIT_FAILED, None
    try:
        trainer = Trainer(cfg)
        trainer.restarted_after = fault
        SIGNALS.hand_to(trainer.request_stop)
        if rank0:  # (a hang ends the process from the watch's thread: no finally runs)
            trainer.on_hang = _record_hang(cfg.run_dir, trainer)
        if rank0:
            os.makedirs(cfg.run_dir, exist_ok=True)
            with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as fh:
                fh.write(cfg.to_yaml())
        outcome = trainer.fit()
        code = {"preempted": EXIT_PREEMPTED, "paused": EXIT_INTERRUPTED if
                trainer.stop_requested == "paused" else 0}.get(outcome, 0)
        return code
    except SetdiffError as exc:
        code = exc.exit_code
        outcome = "diverged" if isinstance(exc, Diverged) else \
            "invalid" if trainer is None and code == EXIT_USAGE else "failed"
        raise
    except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint
        outcome, code = "interrupted", EXIT_INTERRUPTED
        raise
    except RuntimeError as exc:
        if not _peer_lost(exc):
            raise
        # another rank ended (its own message says why): stop with one line, not a traceback,
        # and a moment later than that rank, so that whoever watches the ranks' exits (our
        # launcher, torchrun's agent, srun's first failed task) names it, not this consequence
        import time

        time.sleep(2.0)
        raise PeerLost("stopped: another rank ended while this one waited for it in a "
                       "collective; that rank's message says why", every_rank=False) from None
    finally:
        if rank0:
            _write_exit_status(cfg.run_dir, outcome, code, trainer.step if trainer else None,
                               _latest_or_none(cfg.run_dir),
                               trainer.last_step_at if trainer else None)
        if outcome in ("completed", "paused", "preempted"):
            # no rank exits before rank 0 has recorded the outcome: under `srun
            # --kill-on-bad-exit` the first rank to exit 75 would take rank 0 down with it
            dist.barrier()


@command("setdiff-train")
def main(argv: list[str] | None = None) -> int:
    SIGNALS.install()  # first: a signal during the imports and the build is kept, not fatal
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    cfg = load_config(args.config, args.overrides)
    if args.device_memory is not None and not 0 < args.device_memory < float("inf"):
        raise ConfigError([f"--device-memory {args.device_memory}: a positive number of GiB"],
                          "the flags")
    if args.dry_run:
        SIGNALS.restore(STOP_SIGNALS)  # (nothing to checkpoint: Ctrl-C just stops it)
        p = cfg.parallel
        return dry_run(cfg, args.world_size or p.tensor * p.pipeline * p.context,
                       args.device_memory, args.hardware, args.constants)
    if args.world_size or args.device_memory or args.hardware or args.constants:
        raise ConfigError(["--world-size, --device-memory, --hardware and --constants go with "
                           "--dry-run"],
                          "the flags")
    if args.nproc_per_node and "RANK" not in os.environ:
        problems = world_problems(cfg, args.nproc_per_node)
        if problems:  # (said once, here, rather than by every rank it would start)
            raise ConfigError(problems, f"the launch of {args.nproc_per_node} ranks")
        rest = [a for i, a in enumerate(argv) if a != "--nproc-per-node" and
                (i == 0 or argv[i - 1] != "--nproc-per-node") and not a.startswith(
                    "--nproc-per-node=")]
        return launch(args.nproc_per_node, rest, max_restarts=cfg.train.max_restarts)
    pointless = refuse_pointless_restart(cfg.run_dir)
    if pointless is not None:
        return pointless
    from setdiff_dist.parallel import destroy_model_parallel

    try:
        return run(cfg, force=args.force)
    finally:
        destroy_model_parallel()


if __name__ == "__main__":
    sys.exit(main())
