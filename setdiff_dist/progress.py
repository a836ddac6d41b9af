"""Progress reports from long work (a save's files, an evaluation's batches, the phases of a
step) to this process's hang watch (:mod:`setdiff_dist.train.watchdog`), which registers itself
here while the training loop runs: the layers below training report without importing it."""

from __future__ import annotations

import threading
from typing import Callable, Optional

_BEAT: Optional[Callable[[Optional[str]], None]] = None


def watch(beat: Optional[Callable[[Optional[str]], None]]) -> None:
    """Send progress to ``beat(phase)`` from now on (None: to nothing)."""
    global _BEAT
    _BEAT = beat


def watched_by(beat) -> bool:
    return _BEAT == beat


def progress(phase: Optional[str] = None) -> None:
    """Progress (in ``phase``, when it says where) of the training thread; a no-op without a
    watch, and from any other thread (a background save's writer reports through the training
    thread that waits for it: :mod:`setdiff_dist.train.async_save`)."""
    if _BEAT is not None and threading.current_thread() is threading.main_thread():
        _BEAT(phase)


#: seconds between a progress bar's updates when its stream is not a terminal (a file, a pipe,
#: a Slurm log): a redraw there is a new line, not a line drawn over
LOG_INTERVAL_S = 10.0


def bar(*, file=None, **kwargs):
    """A ``tqdm`` progress bar for people: on a terminal as tqdm draws it; written to a file or
    a Slurm log (anything not a terminal), one line every :data:`LOG_INTERVAL_S` seconds at
    most, where tqdm would write dozens a second."""
    import sys

    from tqdm import tqdm

    stream = file if file is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    if not (callable(isatty) and isatty()):
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
        kwargs.setdefault("maxinterval", max(LOG_INTERVAL_S, kwargs["mininterval"]))
    return tqdm(file=stream, **kwargs)
