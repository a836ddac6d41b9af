"""The rank server of ``setdiff-train --nproc-per-node N`` on a CPU machine: one process imports
what a training rank imports (torch, megatron-core, DeepSpeed, the trainer: about 3 s of CPU
here, three quarters of a tiny run's rank), then forks every rank of the launch from there, and
the ranks of a restart too. N ranks cost one import instead of N.

The launcher (:mod:`setdiff_dist.launcher`, which imports no torch itself) starts the server in
a process group of its own that dies with the launcher, and becomes a *child subreaper*
(Linux's ``PR_SET_CHILD_SUBREAPER``). For each rank it writes a request on the server's standard
input; the server forks, the fork forks the rank and exits, and the rank, orphaned, is adopted
by the launcher. Each rank is then what an executed one was: a child of the launcher (which
waits for it and signals it), in a process group of its own, killed when the launcher dies
(``PR_SET_PDEATHSIG``, set once adopted), with the environment and arguments the launcher gave
it. It says its pid on the server's reply pipe, names itself ``setdiff-rankN`` (``ps``, ``top``)
and runs ``setdiff-train`` as ``python -m setdiff_dist.cli.train`` would.

Only where there is no NVIDIA driver: a process that has initialised CUDA cannot fork ranks that
use it, and DeepSpeed's import asks torch for the device count. On a GPU machine (or with
``SETDIFF_WARM_START=0``) every rank is its own interpreter, as under torchrun.
"""

from __future__ import annotations

import json
import os
import sys
import time

# what a training rank imports, imported once here (a rank imports anything else itself)
PRELOAD = ("setdiff_dist.cli.train", "setdiff_dist.parallel", "setdiff_dist.train.loop",
           "setdiff_dist.train.engine", "setdiff_dist.model.transformer", "torch._dynamo")
ADOPTION_S = 30.0  # a fork not adopted by the launcher within this is an error


def preload() -> None:
    """Import what a rank imports, the libraries' known notices filtered first (as
    ``setdiff-train`` filters them before its imports): once here for every rank."""
    import importlib

    from setdiff_dist.quiet import quiet

    quiet()
    for name in PRELOAD:
        importlib.import_module(name)


def serve(reply_fd: int) -> None:
    """Fork a rank for each request line on standard input until it closes."""
    import warnings

    # (Python 3.12 warns of any fork in a process with a thread: torch's import leaves one
    # native thread, idle; nothing of it is used in a rank before the rank's own start)
    warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded",
                            category=DeprecationWarning)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        middle = os.fork()
        if middle == 0:
            if os.fork() != 0:
                os._exit(0)  # (the rank is orphaned: the launcher adopts it)
            become_rank(request, reply_fd)  # never returns
        os.waitpid(middle, 0)


def become_rank(request: dict, reply_fd: int) -> None:
    """In the forked rank: wait for the launcher's adoption, tie the rank to it, say its pid,
    and run ``setdiff-train``; the process exits with its exit code."""
    from setdiff_dist.errors import EXIT_FAILED
    from setdiff_dist.launcher import SIGNALS
    from setdiff_dist.processes import die_with_parent, name_process

    SIGNALS.install()  # (as setdiff-train's first line: a stop signal from now on is kept)
    launcher, rank = request["launcher"], request["rank"]
    deadline = time.monotonic() + ADOPTION_S
    while os.getppid() != launcher:
        if time.monotonic() > deadline:
            print(f"setdiff-train: rank {rank}'s process was not adopted by the launcher "
                  f"(pid {launcher}) within {ADOPTION_S:.0f} s; SETDIFF_WARM_START=0 starts "
                  "each rank as its own interpreter", file=sys.stderr, flush=True)
            os._exit(EXIT_FAILED)
        time.sleep(0.001)
    os.setpgid(0, 0)
    die_with_parent()
    if os.getppid() != launcher:  # (the launcher died before the line above)
        os._exit(EXIT_FAILED)
    name_process(f"setdiff-rank{rank}")
    os.write(reply_fd, f"{rank} {os.getpid()}\n".encode())
    os.close(reply_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # (the server's standard input is the launcher's requests)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(request["env"])
    from setdiff_dist.cli import train

    sys.argv = [train.__file__] + request["argv"]
    sys.exit(train.main(request["argv"]))


def main() -> None:
    reply_fd = int(sys.argv[1])
    preload()
    serve(reply_fd)
    sys.stdout.flush()
    sys.stderr.flush()
    # (the launch is over: the interpreter's teardown of what it preloaded took 1.2 s here,
    # which the launcher would wait for before it exits; the server holds nothing to clean up)
    os._exit(0)


if __name__ == "__main__":
    main()
