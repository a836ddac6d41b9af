"""A request's text, made where it goes out (the HTTP process), not on the decoding thread: the
scheduler sends token ids (:class:`~setdiff_dist.serve.messages.Tokens`,
:class:`~setdiff_dist.serve.messages.Finished`) and the :class:`Detokenizer` of each request
turns them into text, as vLLM's output processor and SGLang's detokenizer do. The decoding
thread then spends nothing on the tokenizer, whatever the clients' number."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Callable, Optional

from setdiff_dist.inference.text import TextStream

from .messages import Failed, Finished, Text, Tokens

__all__ = ["Detokenizer", "TextStream"]


class Detokenizer:
    """One request's events as its listener takes them: :class:`Tokens` become :class:`Text`
    (none while the text is held back), :class:`Finished` gets its ``text`` and
    ``full_text``. A tokenizer that raises fails this request alone: its listener gets
    :class:`Failed` and ``on_failed(why)`` takes it out of the batch."""

    def __init__(self, stream: TextStream, listener: Callable[[object], None],
                 on_failed: Optional[Callable[[str], None]] = None, request_id: str = "?"):
        self.stream, self.listener, self.on_failed = stream, listener, on_failed
        self.request_id = request_id
        self.failed = False
        self._held: tuple = ()  # (tokens whose text is held back: they go with the next Text)
        self._handlers = {Tokens: self._tokens, Finished: self._finished, Failed: lambda e: e}

    def __call__(self, event) -> None:
        if self.failed:
            return
        try:
            out = self._handlers[type(event)](event)
        except Exception as exc:  # noqa: BLE001 (this request's failure: the others go on)
            why = f"decoding failed: {type(exc).__name__}: {exc}"
            print(f"setdiff-serve: request {self.request_id} failed alone: {why}",
                  file=sys.stderr, flush=True)
            self.failed, out = True, Failed(why)
            if not event.done and self.on_failed is not None:
                self.on_failed(why)
        if out is not None:
            self.listener(out)

    def _tokens(self, event: Tokens) -> Optional[Text]:
        piece = self.stream.push(list(event.ids))
        self._held += tuple(event.ids)
        if not piece:
            return None
        out, self._held = Text(piece, self._held), ()
        return out

    def _finished(self, event: Finished) -> Finished:
        full = self.stream.final(event.tokens)
        return replace(event, text=self.stream.rest(full), full_text=full)
