"""The HTTP process of ``setdiff-serve``: uvicorn serving :func:`~setdiff_dist.serve.app.create_app`
against the decoding process (rank 0), which spawns it. A production server splits them so
(vLLM's engine core and front end): in one process they would share one GIL, and at 16
streaming clients on 2 CPUs the event loop's work stalled the decoding thread, which then
reached about 75% of what the engine decodes alone. The two talk over a pipe
(:mod:`.pipe`); the text of each request is made here (:mod:`.text`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

from setdiff_dist.errors import EXIT_FAILED, EXIT_USAGE

from .pipe import EngineClient


class ModelView:
    """What the HTTP process needs of the model (no weights): its config, tokenizer, how it
    decodes and its context; :meth:`settings` as :meth:`setdiff_dist.api.Model.settings`."""

    def __init__(self, model):
        self.config, self.tokenizer = model.config, model.tokenizer
        self.decoding, self.context = model.decoding, model.context

    def settings(self, preset: Optional[str] = None, **flags):
        from setdiff_dist.inference.settings import decode_settings

        return decode_settings(self.config, preset, **flags)


def http_main(conn, view: ModelView, name: str, options: dict) -> None:
    """The HTTP process: uvicorn serving :func:`~setdiff_dist.serve.app.create_app` against
    the decoding process at the other end of ``conn``, behind :mod:`.guard`. Exits 0 after a
    drain (SIGTERM or SIGINT: stop taking connections, finish every request taken, for at most
    ``options["shutdown_timeout"]`` seconds: then what is left is cancelled), 1 when the
    decoding process is gone, 2 when it cannot listen."""
    import contextlib

    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from setdiff_dist.processes import die_with_parent

    from .app import Limits, Service, create_app
    from .guard import Guard, guarded_protocol, raise_open_files_limit

    os.setsid()  # (a terminal's Ctrl-C goes to rank 0 alone, which passes it on once)
    die_with_parent()
    raise_open_files_limit()
    client = EngineClient(conn, view.tokenizer)
    service = Service(view, name, client, client,
                      Limits(options["max_tokens"], options["max_prompts"]),
                      chat_template=options.get("chat_template"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        import asyncio

        client.attach(asyncio.get_running_loop())
        yield

    app = Guard(create_app(service, lifespan=lifespan, strict=options.get("strict", False)),
                api_key=options["api_key"],
                max_body_bytes=options["max_body_bytes"], idle_s=options["timeout_idle"],
                on_refused=client.count)
    config = uvicorn.Config(app, host=options["host"], port=options["port"],
                            log_level=options["log_level"], lifespan="on",
                            http=guarded_protocol(AutoHTTPProtocol, options["timeout_header"],
                                                  options["max_connections"]),
                            timeout_keep_alive=options["timeout_keep_alive"],
                            timeout_graceful_shutdown=options["shutdown_timeout"])
    server = uvicorn.Server(config)

    def stop(why: str) -> None:
        server.should_exit = True

    client.on_fatal = stop
    _announce_when_ready(server, options.get("ready_file"))
    # uvicorn drains on either signal, then raises it again under the handler it found: these
    # no-ops, so that a drained server exits 0
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    server.run()
    conn.close()
    sys.exit(EXIT_USAGE if not server.started else EXIT_FAILED if client.fatal else 0)


def _announce_when_ready(server, path: Optional[str]) -> None:
    """Once uvicorn listens: say where, with the port it bound (``--port 0`` takes any free
    one: the command line's 0 is not where to connect), and write ``host:port`` to ``path``
    when given (``--ready-file``, for tests and scripts)."""
    import time

    def watch():
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            sock = server.servers[0].sockets[0].getsockname()
            print(f"setdiff-serve: listening on http://{sock[0]}:{sock[1]}/v1", file=sys.stderr,
                  flush=True)
            if path:
                tmp = f"{path}.tmp"
                with open(tmp, "w") as f:
                    f.write(f"{sock[0]}:{sock[1]}\n")
                os.replace(tmp, path)

    threading.Thread(target=watch, daemon=True).start()
