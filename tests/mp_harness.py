"""Run a function on several gloo processes (torch.multiprocessing), as torchrun would.

The processes are forked from multiprocessing's fork server, which imports what a rank imports
once a test session (torch, megatron-core, DeepSpeed, the trainer: about 3 s of CPU on this
machine) instead of once in every rank of every spawn. Each rank gets the calling process's
environment and working directory of the moment it is started, as a spawned one would."""

import faulthandler
import multiprocessing
import os
import traceback

import torch.multiprocessing as mp

from setdiff_dist.parallel import free_port

# imported once by the fork server: what a training rank imports (mp_preload: the rank
# server's list, notices filtered first) and this module (a rank that needs more imports it)
PRELOAD = ["mp_preload", "mp_harness"]


def _entry(rank, world_size, port, fn, args, environ, cwd):
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    faulthandler.enable(all_threads=True)  # (a crash in native code shows its Python stacks)
    try:
        fn(rank, *args)
    except Exception:
        traceback.print_exc()
        raise
    # as setdiff's commands do (cli.command): a gloo group left to the interpreter's exit can
    # abort the process in its destructor ("terminate called without an active exception")
    from setdiff_dist.parallel import destroy_model_parallel

    destroy_model_parallel()


def start_fork_server() -> None:
    """Start the fork server (if it is not running) with this directory on its PYTHONPATH:
    Python 3.11's fork server does not take the caller's sys.path, and a preloaded module it
    cannot find is skipped without a word."""
    from multiprocessing import forkserver

    saved = os.environ.get("PYTHONPATH")
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def spawn(fn, world_size, *args):
    """Call ``fn(rank, *args)`` on ``world_size`` processes; fails if any of them fails."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    start_fork_server()
    mp.start_processes(_entry, args=(world_size, free_port(), fn, args, dict(os.environ),
                                               os.getcwd()),
                       nprocs=world_size, join=True, start_method="forkserver")


def _measure_tp1_then_tp2(rank, measure, out):
    measure(1, out)
    measure(2, out)


def results_at_tp1_and_tp2(measure, out):
    """Run ``measure(tp, out)`` at TP=1 then TP=2 in one launch of 2 processes (start-up
    dominates on 2 cores); ``measure`` saves rank 0's results to ``out / f"tp{tp}.pt"``."""
    import torch

    spawn(_measure_tp1_then_tp2, 2, measure, out)
    return {tp: torch.load(out / f"tp{tp}.pt") for tp in (1, 2)}
