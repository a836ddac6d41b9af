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
import os
import signal
import sys

from setdiff_dist.checkpoint.format import (
    CONFIG,
    EXIT_STATUS,
)
from setdiff_dist.cli import HelpFormatter, Once, command, count
from setdiff_dist.config import ConfigError, load_config
from setdiff_dist.config_checks import world_problems
from setdiff_dist.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    Diverged,
    SetdiffError,
    peer_lost,
)
from setdiff_dist.launcher import SIGNALS, STOP_SIGNALS, launch
from setdiff_dist.train.run_dir import (
    claim_run_dir,
    fault_before_this_start,
    latest_or_none,
    record_hang,
    refuse_pointless_restart,
    write_exit_status,
)
from setdiff_dist.train.scale import HARDWARE
from setdiff_dist.train.watchdog import restart_count


class PeerLost(SetdiffError):
    """This rank's collective failed because another rank ended: a consequence, exit 1."""

    exit_code = EXIT_FAILED


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
    return 0 if fits else EXIT_USAGE  # (the plan does not fit the memory asked for)


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
    verdict = [claim_run_dir(cfg, force) if rank0 else None]
    dist.broadcast_object_list(verdict, src=0)  # every rank stops, or none
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])
    if rank0 and os.path.exists(os.path.join(cfg.run_dir, EXIT_STATUS)):
        os.remove(os.path.join(cfg.run_dir, EXIT_STATUS))  # a previous attempt's
    outcome, code, trainer = "failed", EXIT_FAILED, None
    try:
        trainer = Trainer(cfg)
        trainer.restarted_after = fault
        SIGNALS.hand_to(trainer.request_stop)
        if rank0:  # (a hang ends the process from the watch's thread: no finally runs)
            trainer.on_hang = record_hang(cfg.run_dir, trainer)
        if rank0:
            os.makedirs(cfg.run_dir, exist_ok=True)
            with open(os.path.join(cfg.run_dir, CONFIG), "w") as fh:
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
        if not peer_lost(exc):
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
            write_exit_status(cfg.run_dir, outcome, code, trainer.step if trainer else None,
                              latest_or_none(cfg.run_dir),
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
