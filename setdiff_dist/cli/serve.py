"""``setdiff-serve``: an OpenAI-compatible HTTP server with continuous batching of set decoding.

    setdiff-serve --checkpoint runs/tiny-cpu [--host 127.0.0.1 --port 8000]
    torchrun --nproc-per-node 2 -m setdiff_dist.cli.serve --checkpoint DIR --tensor-parallel 2

    curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny-cpu", "prompt": "Shall I compare thee", "max_tokens": 32}'

or any OpenAI client (``base_url="http://127.0.0.1:8000/v1"``). ``POST /v1/completions``,
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus); the fields are in
:mod:`setdiff_dist.serve.app`. Requests join the running batch between decoding steps and leave
it when they finish (continuous batching): a long request never holds a short one back. At most
``--max-batch-size`` decode at once and ``--max-queue`` wait; past that a request gets 429 with
``Retry-After``. SIGTERM stops taking connections, finishes every request already taken
(queued ones too, within ``--shutdown-timeout``) and exits 0; Ctrl-C does the same and exits
130; a second Ctrl-C stops at once.

Exposed beyond this machine, give ``--api-key`` (or ``SETDIFF_API_KEY``): a public bind without
one is warned about. Requests are bounded at the door (``--max-completion-tokens``,
``--max-body-bytes``, headers within ``--timeout-header``, ``--max-connections``), and one
request that fails, while joining the batch or in a step, fails alone.

Rank 0 decodes, and a process it starts serves HTTP (:mod:`setdiff_dist.serve.http_process`:
the two do not share a GIL); if either ends, so does the other. Under torchrun with
``--tensor-parallel N`` (N ranks), rank 0 sends each step's plan (who joins, who leaves) to the
other ranks; every rank decodes its shard of the model.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from setdiff_dist.cli import HelpFormatter, add_dtype_argument, add_weights_argument, command, count
from setdiff_dist.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, SetdiffError


class ServeError(SetdiffError):
    """A server that cannot start as asked (exit 2)."""


@command("setdiff-serve", process_group=True)
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-serve", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="a training run directory, a checkpoint directory, or an export")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    ap.add_argument("--served-model-name", default=None,
                    help="the model's name in the API (default: the checkpoint's directory name)")
    ap.add_argument("--max-batch-size", type=count(), default=16,
                    help="requests decoded together at most (rows of the running batch)")
    ap.add_argument("--max-queue", type=count(0), default=64,
                    help="requests waiting for a row at most; more get 429")
    ap.add_argument("--tensor-parallel", type=count(), default=1,
                    help="shard the model over this many ranks (under torchrun)")
    ap.add_argument("--threads", type=count(), default=None,
                    help="CPU threads of each rank's decoding (default: OMP_NUM_THREADS, else "
                         "the rank's share of the CPUs less one for the HTTP server on rank 0)")
    add_dtype_argument(ap)
    add_weights_argument(ap)
    ap.add_argument("--api-key", default=os.environ.get("SETDIFF_API_KEY"),
                    help="require this key on every /v1 route, as OpenAI's 'Authorization: "
                         "Bearer KEY' header (default: $SETDIFF_API_KEY; /health and /metrics "
                         "stay open)")
    ap.add_argument("--max-completion-tokens", type=count(), default=None,
                    help="the largest max_tokens a request may ask for, 400 above it (default: "
                         "the model's context; decoding past the context slides its cache)")
    ap.add_argument("--max-body-bytes", type=count(), default=4 << 20,
                    help="the largest request body taken (413 above it)")
    ap.add_argument("--max-connections", type=count(), default=1000,
                    help="open connections at most; a new one past it is closed at once (the "
                         "soft limit of open files is raised to the hard one)")
    ap.add_argument("--timeout-header", type=float, default=10.0,
                    help="seconds a connection may take to send a request's headers before it "
                         "is closed (slow clients cannot hold connections)")
    ap.add_argument("--timeout-idle", type=float, default=30.0,
                    help="seconds a request's body may pause before the request is dropped "
                         "(408)")
    ap.add_argument("--timeout-keep-alive", type=float, default=5.0,
                    help="seconds an idle kept-alive connection stays open")
    ap.add_argument("--shutdown-timeout", type=float, default=120.0,
                    help="on SIGTERM, seconds to finish the requests in flight; what is left "
                         "then is cancelled and the server exits")
    ap.add_argument("--chat-template", metavar="FILE", default=None,
                    help="the Jinja template /v1/chat/completions renders messages with (as a "
                         "Hugging Face tokenizer's chat_template; default: chat_template.jinja "
                         "or tokenizer_config.json's beside the checkpoint's tokenizer; none: "
                         "chat requests get a 400 saying so)")
    ap.add_argument("--strict", action="store_true",
                    help="refuse a request with a field OpenAI's completions do not define "
                         "(default: ignore it with a warning in this log, as vLLM does)")
    ap.add_argument("--log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug"],
                    help="uvicorn's log level (each request is logged at info)")
    ap.add_argument("--ready-file", default=None,
                    help="write 'host:port' here once the server listens (with --port 0)")
    args = ap.parse_args(argv)

    for flag in ("timeout_header", "timeout_idle", "timeout_keep_alive", "shutdown_timeout"):
        value = getattr(args, flag)
        if not (value > 0 and value != float("inf")):
            raise ServeError(f"--{flag.replace('_', '-')} {value}: give a positive number of "
                             "seconds")
    if args.api_key is not None and not args.api_key.strip():
        raise ServeError("--api-key is empty: give a key, or leave the flag (and "
                         "SETDIFF_API_KEY) out to serve without one")
    from setdiff_dist.errors import rank_and_world

    if args.api_key is None and not _loopback(args.host) and rank_and_world()[0] == 0:
        print(f"setdiff-serve: warning: listening on {args.host} without an API key: anyone "
              "who reaches this port can use the server; give --api-key (or SETDIFF_API_KEY)",
              file=sys.stderr, flush=True)
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if not _importable(m)]
    if missing:
        raise ServeError(f"setdiff-serve needs {', '.join(missing)}: pip install "
                         "'setdiff-dist[serve]'")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tensor_parallel:
        raise ServeError(f"{world} ranks were launched for --tensor-parallel "
                         f"{args.tensor_parallel}: run one server per model replica, with as "
                         "many ranks as its tensor-parallel size (torchrun --nproc-per-node N "
                         "... --tensor-parallel N)")

    from setdiff_dist.inference.decoding import DecodeError
    from setdiff_dist.serve.chat import find_chat_template

    try:  # (before the model loads: a wrong path costs nothing)
        args.chat_template = find_chat_template(args.checkpoint, args.chat_template)
    except DecodeError as exc:
        raise ServeError(str(exc)) from None
    _set_threads(args.threads)
    from setdiff_dist.api import load

    model = load(args.checkpoint, tensor_parallel=args.tensor_parallel, dtype=args.dtype,
                 raw_weights=args.raw_weights)
    from setdiff_dist.serve.batch import ContinuousBatch
    from setdiff_dist.serve.scheduler import PlanChannel, follow

    ContinuousBatch(model.decoder)  # (a checkpoint that cannot be served says so on every rank)
    channel = PlanChannel() if args.tensor_parallel > 1 else None
    import torch.distributed as dist

    if dist.get_rank() != 0:
        # rank 0 decides when to stop (after draining); a SIGTERM torchrun forwards here must
        # not end this rank's shard under the requests still in flight
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        follow(model.decoder, channel)
        return 0
    return serve(model, args, channel)


def serve(model, args, channel) -> int:
    """Rank 0: decode here (the scheduler's thread) and serve HTTP from a process of its own
    (:mod:`setdiff_dist.serve.http_process`); SIGTERM and SIGINT go on to it, it drains, then the
    scheduler finishes and the other ranks stop."""
    import multiprocessing as mp
    import threading

    from setdiff_dist.serve.http_process import ModelView, http_main
    from setdiff_dist.serve.messages import Fatal
    from setdiff_dist.serve.metrics import Metrics
    from setdiff_dist.serve.pipe import EngineHost
    from setdiff_dist.serve.scheduler import Scheduler

    name = args.served_model_name or _model_name(args.checkpoint)
    metrics = Metrics(name, max_batch=args.max_batch_size)
    scheduler = Scheduler(model.decoder, max_batch=args.max_batch_size,
                          max_queue=args.max_queue, metrics=metrics, channel=channel)
    ctx = mp.get_context("spawn")  # (not fork: this process has torch's and gloo's threads)
    here, there = ctx.Pipe()
    host = EngineHost(scheduler, here)
    cap = args.max_completion_tokens or model.context
    options = {"host": args.host, "port": args.port, "log_level": args.log_level,
               "strict": args.strict, "chat_template": args.chat_template,
               "ready_file": args.ready_file, "api_key": args.api_key,
               "max_tokens": cap, "max_prompts": max(args.max_queue, 1),
               "max_body_bytes": args.max_body_bytes, "max_connections": args.max_connections,
               "timeout_header": args.timeout_header, "timeout_idle": args.timeout_idle,
               "timeout_keep_alive": args.timeout_keep_alive,
               "shutdown_timeout": args.shutdown_timeout}
    http = ctx.Process(target=http_main, args=(there, ModelView(model), name, options),
                       name="setdiff-http")
    got = []

    def forward(signum, frame):  # (a second Ctrl-C: uvicorn stops at once, and so do we)
        got.append(signum)
        if http.pid is not None:
            try:
                os.kill(http.pid, signum)
            except ProcessLookupError:
                pass

    def fatal(why: str) -> None:  # (a broken tensor-parallel group: exit 1, to be restarted)
        host.send(Fatal(why))
        forward(signal.SIGTERM, None)

    scheduler.on_fatal = fatal
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    scheduler.start()
    http.start()
    there.close()
    threading.Thread(target=host.serve, name="setdiff-http-link", daemon=True).start()
    print(f"setdiff-serve: {name} ({model.decoding} decoding, context {model.context}, "
          f"TP={args.tensor_parallel})",
          file=sys.stderr, flush=True)
    http.join()
    if got.count(signal.SIGINT) >= 2:
        return EXIT_INTERRUPTED
    # what the HTTP process took is done, unless its drain ran out of time: nobody waits for
    # what is left then
    left = scheduler.abandon()
    if left:
        print(f"setdiff-serve: {left} request(s) were still decoding at the end of the drain "
              f"(--shutdown-timeout {args.shutdown_timeout:g}): cancelled", file=sys.stderr)
    scheduler.stop()
    here.close()
    if http.exitcode == EXIT_USAGE:  # (it could not listen)
        raise ServeError(f"could not listen on {args.host}:{args.port} (see the error above): "
                         "pick another --port or stop what uses it")
    if scheduler.fatal:
        print(f"setdiff-serve: stopped: {scheduler.fatal}", file=sys.stderr)
        return EXIT_FAILED
    if http.exitcode != 0:
        print(f"setdiff-serve: the HTTP process ended with exit code {http.exitcode}",
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_INTERRUPTED if signal.SIGINT in got else 0


def _set_threads(threads) -> None:
    """The decoding thread's CPU threads. Rank 0's HTTP process wants a core: torch's default
    (every core) leaves it none, and torch's OpenMP threads then wait on a preempted one (on 2
    CPUs the tiny model served 1.3x the tokens/s with one decoding thread as with two, at 1
    and at 16 concurrent clients)."""
    import torch

    from setdiff_dist.processes import threads_per_rank

    if threads is None:
        if "OMP_NUM_THREADS" in os.environ:  # (torchrun sets it: its choice, or the user's)
            return
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        http = 1 if int(os.environ.get("LOCAL_RANK", "0")) == 0 else 0
        threads = max(1, threads_per_rank(local) - http)
    torch.set_num_threads(threads)


def _model_name(path: str) -> str:
    from pathlib import Path

    from setdiff_dist.checkpoint.format import CHECKPOINTS

    p = Path(path).resolve()
    return p.parent.parent.name if p.parent.name == CHECKPOINTS else p.name


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    sys.exit(main())
