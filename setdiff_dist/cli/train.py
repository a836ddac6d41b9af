"""``setdiff-train``: train a set-diffusion (or causal) LM with megatron-core + DeepSpeed.

    setdiff-train --config configs/tiny-cpu.yaml [section.key=value ...]          # one process
    setdiff-train --nproc-per-node 4 --config ... parallel.tensor=2              # launches 4
    torchrun --nproc-per-node 4 -m setdiff_dist.cli.train --config ...           # or torchrun
    srun ... python -m setdiff_dist.cli.train --config ...                        # or Slurm

Everything goes into ``run_dir``: ``config.yaml`` (the resolved config), ``metrics.jsonl``,
``tensorboard/``, ``checkpoints/step_*/`` and ``checkpoints/latest``. ``resume=auto`` (the
default) continues from ``latest``. SIGTERM or SIGUSR1 (to every rank, as Slurm sends it, or to
this launcher) checkpoints at the next step boundary and exits with code 75, for a requeue.

Exit codes: 0 done (or stopped at ``train.exit_at_step``), 75 preempted after a checkpoint,
2 bad config, data or checkpoint, 1 a failed run.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from setdiff_dist.config import ConfigError, load_config

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpointed on a signal; requeue and resume=auto


def _parse(argv):
    ap = argparse.ArgumentParser(prog="setdiff-train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML config (see setdiff-config --keys)")
    ap.add_argument("--nproc-per-node", type=int, default=None,
                    help="launch this many local processes (not needed under torchrun / srun)")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    return ap.parse_args(argv)


def _set_parent_death_signal():
    """Runs in each child before exec: die with the launcher, even if it is SIGKILLed."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch(nproc: int, argv: list[str]) -> int:
    """Start ``nproc`` ranks of this command on this machine, forward SIGTERM / SIGUSR1 / SIGINT
    to them, and return the first non-zero exit code (or 0)."""
    from setdiff_dist.parallel import free_port

    port = str(free_port())
    children = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        children.append(subprocess.Popen([sys.executable, "-m", "setdiff_dist.cli.train"] + argv,
                                         env=env, preexec_fn=_set_parent_death_signal))

    def forward(signum, _frame):
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(s, forward)
    codes = [c.wait() for c in children]
    return next((c for c in codes if c != 0), 0)


def run(cfg) -> int:
    import torch.distributed as dist

    from setdiff_dist.data.shards import ShardError
    from setdiff_dist.data.tokenizers import TokenizerError
    from setdiff_dist.train.checkpoint import CheckpointError
    from setdiff_dist.train.loop import Trainer, TrainingError

    try:
        trainer = Trainer(cfg)
    except (ShardError, TokenizerError, TrainingError, CheckpointError) as exc:
        print(f"setdiff-train: error: {exc}", file=sys.stderr)
        return 2
    if dist.get_rank() == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as fh:
            fh.write(cfg.to_yaml())
    try:
        outcome = trainer.fit()
    except TrainingError as exc:
        print(f"setdiff-train: error: {exc}", file=sys.stderr)
        return 1
    return EXIT_PREEMPTED if outcome == "preempted" else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.nproc_per_node and "RANK" not in os.environ:
        rest = [a for i, a in enumerate(argv) if a != "--nproc-per-node" and
                (i == 0 or argv[i - 1] != "--nproc-per-node") and not a.startswith(
                    "--nproc-per-node=")]
        return launch(args.nproc_per_node, rest)
    code = run(cfg)
    from setdiff_dist.parallel import destroy_model_parallel

    destroy_model_parallel()
    return code


if __name__ == "__main__":
    sys.exit(main())
