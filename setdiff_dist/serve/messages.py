"""What the server's parts say to each other, one class per message: the HTTP process's
requests to the decoding process (:class:`Submit`, :class:`Cancel`, ...), the decoding
process's answers (:class:`Events`, :class:`Reply`, :class:`Fatal`), and the events of one
request (:class:`Tokens`, :class:`Finished`, :class:`Failed`; :class:`Text` once detokenized).

A reader dispatches on the class (a table from class to handler), never on a string tag: a new
message is a new class here, and each reader's table says what it can receive. The pipe
pickles them, so every field is a plain value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional


# -- the HTTP process -> the decoding process -----------------------------------------------------
@dataclass(frozen=True)
class Submit:
    """Queue ``spec`` (a :class:`~setdiff_dist.serve.batch.Spec`); answered :class:`Reply`
    with ``error`` set when the queue is full (a 429). ``streamed``: send its new tokens after
    every step, not only its end."""

    n: int
    spec: object
    streamed: bool


@dataclass(frozen=True)
class Cancel:
    """Take this request out (its client went away: ``outcome`` "cancelled"; its text could
    not be decoded: "failed")."""

    id: str
    outcome: str = "cancelled"


@dataclass(frozen=True)
class Count:
    """A request the HTTP process answered itself (400, 401, 429...), for the metrics."""

    outcome: str


@dataclass(frozen=True)
class Status:
    """``GET /health``: answered :class:`Reply` with a :class:`Health`."""

    n: int


@dataclass(frozen=True)
class Score:
    """Token log-probabilities of ``seqs`` (echo / logprobs), between decoding steps: answered
    :class:`Reply` with the scores, or with ``error``."""

    n: int
    seqs: list
    k: int


@dataclass(frozen=True)
class Exposition:
    """``GET /metrics``: answered :class:`Reply` with ``(body, content type)``."""

    n: int


# -- the decoding process -> the HTTP process -----------------------------------------------------
@dataclass(frozen=True)
class Events:
    """One decoding step's events: ``[(request id, event)]``."""

    items: list


@dataclass(frozen=True)
class Reply:
    """The answer to request ``n``: its ``value``, or ``error`` (why it could not be done)."""

    n: int
    value: object = None
    error: Optional[str] = None


@dataclass(frozen=True)
class Fatal:
    """Decoding stopped for good (a tensor-parallel rank is gone): the HTTP process stops."""

    why: str


@dataclass(frozen=True)
class Health:
    """What ``GET /health`` reports of the decoding thread."""

    alive: bool
    fatal: Optional[str]
    running: int
    waiting: int


# -- the events of one request --------------------------------------------------------------------
@dataclass(frozen=True)
class Tokens:
    """The tokens a step added to the request's committed prefix (contiguous from the prompt:
    what can be text so far); sent for streamed requests only. Not yet text: the
    detokenization runs where the text goes out (:class:`~setdiff_dist.serve.text.Detokenizer`),
    not on the decoding thread."""

    ids: tuple
    done: ClassVar[bool] = False


@dataclass(frozen=True)
class Text:
    """New text of a streamed request (:class:`Tokens` detokenized); ``ids``: the tokens
    committed since the last :class:`Text` (the text lags them by what is held back)."""

    text: str
    ids: tuple = ()
    done: ClassVar[bool] = False


@dataclass(frozen=True)
class Finished:
    """A request's end and its numbers. ``text`` (the rest of the text not yet streamed) and
    ``full_text`` (the completion's) are empty as the scheduler sends it, and filled in by the
    :class:`~setdiff_dist.serve.text.Detokenizer`."""

    finish_reason: str          # OpenAI's: "stop" or "length"
    tokens: list                # the generated token ids, up to a stop
    prompt_tokens: int
    steps: int                  # forward steps it decoded in
    largest_batch: int          # the most rows it decoded beside (itself included)
    seconds: float              # from arrival to its end
    time_to_first_token: float
    text: str = ""
    full_text: str = ""
    done: ClassVar[bool] = True

    @property
    def tokens_per_step(self) -> float:
        return len(self.tokens) / max(self.steps, 1)


@dataclass(frozen=True)
class Failed:
    """A request's end with an error (it alone failed, or decoding did)."""

    error: str
    done: ClassVar[bool] = True
