"""Continuous batching of set decoding: requests join and leave the running batch between
decoding steps.

Every row of the batch is one request with its own :class:`~setdiff_dist.inference.decoding.Rules`
(window, threshold, sampling with its own seeded stream, stop criteria). A request that joins
puts its prompt in as the next step's commits, so its prefill is fused with its first candidates
(as ``setdiff-generate`` does): in the batch's step when its prompt is short, or in a forward of
the joining rows alone beside it when a long prompt would pad every running row to its length
(then its cache rows join the batch's after the step); a request
that finishes (or is cancelled) leaves right after the step, and its cache row with it. A row's
tokens do not depend on what else is in the batch: each step is
:meth:`~setdiff_dist.inference.decoder.SetDecoder.step`, whose rows attend only their own cache
entries and draw from their own streams.

Nothing here knows about HTTP or threads: :mod:`setdiff_dist.serve.scheduler` drives it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Optional

from setdiff_dist.inference.decoding import (
    DecodeError,
    Rules,
    Sample,
    StopCriteria,
    check_max_new_tokens,
    check_prompt,
)
from setdiff_dist.inference.kv_cache import KVCache
from setdiff_dist.inference.settings import sampling_of


@dataclass(frozen=True)
class Spec:
    """One request as the batch needs it: plain values only, so that rank 0 can send it to
    the other tensor-parallel ranks."""

    id: str
    prompt: tuple          # token ids (not empty)
    max_tokens: int
    window: int
    threshold: float
    greedy: bool
    temperature: float
    top_p: float
    repetition_penalty: float
    seed: int
    top_k: int = 0
    stop: tuple = ()       # literal stop strings (OpenAI's meaning: the text ends before one)
    patterns: tuple = ()   # the checkpoint's decode.stop (setdiff-generate's meaning)
    eos_stop: bool = True
    max_repeat_run: Optional[int] = None
    length_penalty: float = 1.0  # the checkpoint's decode.length_penalty (and its start)
    length_penalty_start: int = 0


def check_spec(spec: Spec, context: int, index: int = 0,
               max_tokens: Optional[int] = None) -> None:
    """What a request (its prompt number ``index``) can get wrong that decoding would only find
    later (raises :class:`DecodeError`, whose message the server returns as a 400);
    ``max_tokens``: the server's cap on a request's new tokens."""
    check_max_new_tokens(spec.max_tokens, max_tokens, what="max_tokens")
    check_prompt(index, spec.prompt, spec.window, context)
    sampling_of(spec, spec.seed)


@dataclass
class Row:
    """A request in the batch: its spec, its decoding state and what the server has sent."""

    spec: Spec
    sample: Sample
    joined: float                      # when it joined the batch (time.monotonic)
    first_token: Optional[float] = None  # when its first generated token was committed
    taken: int = 0                     # region[:taken]'s tokens were handed out (new_prefix)
    largest_batch: int = 0             # the most rows it decoded beside (itself included)
    cancelled: bool = False
    fresh: bool = True                 # admitted, not yet stepped (no cache row yet)

    @property
    def done(self) -> bool:
        return self.sample.done or self.cancelled

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "stop" at end-of-text or a stop string, "length" at max_tokens."""
        return "stop" if self.sample.end is not None else "length"

    def new_prefix(self) -> list:
        """The tokens committed and contiguous from the prompt (up to a stop) since the last
        call: what can be text so far, set decoding committing positions out of order. Token
        ids only, so that the decoding thread does no detokenization."""
        out = self.sample.prefix_from(self.taken)
        self.taken += len(out)
        return out


class ContinuousBatch:
    """The running batch on a :class:`~setdiff_dist.inference.decoder.SetDecoder` (set or
    causal decoding): :meth:`admit` rows, :meth:`step`, and the finished rows come back."""

    def __init__(self, decoder):
        if not getattr(decoder, "batchable", False):
            raise DecodeError(
                f"continuous batching serves set-diffusion and causal checkpoints; this one "
                f"decodes with the {getattr(decoder, 'decoding', '?')} baseline's sampler, "
                "which setdiff-generate runs")
        self.decoder = decoder
        self.rows: list[Row] = []
        self.cache = KVCache(decoder.model.config.num_layers, 0, decoder.device)

    def __len__(self) -> int:
        return len(self.rows)

    def admit(self, specs: list) -> tuple[list[Row], list[tuple[Spec, str]]]:
        """Add these requests; their prompts are the next step's commits. Returns the rows
        added and ``(spec, why)`` for each request that could not be (it alone fails: the
        others, and the rows already running, are not touched)."""
        now, new, refused = time.monotonic(), [], []
        for spec in specs:
            try:
                new.append(Row(spec, self._sample(spec), now))
            except Exception as exc:  # noqa: BLE001 (the request's own failure, reported)
                refused.append((spec, f"the request could not join the batch: "
                                      f"{type(exc).__name__}: {exc}"))
        self.rows += new  # (their cache rows come with their first step)
        return new, refused

    def _sample(self, spec: Spec) -> Sample:
        check_max_new_tokens(spec.max_tokens, what="max_tokens")
        sample = Sample.continuation(spec.prompt, spec.max_tokens)
        sample.pending = list(enumerate(spec.prompt))
        sampling = sampling_of(spec, spec.seed)
        stop = StopCriteria(eos_id=self.decoder.tok.eos_id if spec.eos_stop else None,
                            stop=list(spec.patterns) + [literal(s) for s in spec.stop],
                            max_repeat_run=spec.max_repeat_run)
        sample.rules = Rules(spec.window, spec.threshold, sampling, stop,
                             self.decoder.generator(spec.seed))
        return sample

    def cancel(self, ids) -> list[Row]:
        """Take these requests out of the batch now (a client that went away)."""
        ids = set(ids)
        gone = [r for r in self.rows if r.spec.id in ids]
        for r in gone:
            r.cancelled = True
        self._retire()
        return gone

    def step(self) -> list[Row]:
        """One decoding step of every row; returns the rows that finished in it (they have
        left the batch)."""
        if not self.rows:
            return []
        new = [r for r in self.rows if r.fresh]  # (admitted last: the batch's last rows)
        old = self.rows[:len(self.rows) - len(new)]
        if old and new and self._prefill_apart(old, new):
            self.decoder.step([r.sample for r in old], self.cache, isolate=True)
            cache = KVCache(self.decoder.model.config.num_layers, len(new), self.decoder.device)
            self.decoder.step([r.sample for r in new], cache, isolate=True)
            self.cache.append(cache)
        else:
            if new:
                self.cache.add_rows(len(new))
            self.decoder.step([r.sample for r in self.rows], self.cache, isolate=True)
        for r in new:
            r.fresh = False
        now, size = time.monotonic(), len(self.rows)
        for r in self.rows:
            r.largest_batch = max(r.largest_batch, size)
            if r.first_token is None and r.sample.left > 0:
                r.first_token = now
        return self._retire()

    @staticmethod
    def _prefill_apart(old: list, new: list) -> bool:
        """Whether joining rows should take their first step (their prompt, fused with their
        first candidates) in a forward of their own: one step pads every row to the longest
        prompt, so a 60-token prompt joining 15 running rows that each need a commit and a
        window of 8 would make that step about 6x the work. Apart costs a second forward:
        worth it once the longest prompt is wider than the running rows' step."""
        widest = max(len(r.sample.pending) + r.sample.rules.window for r in old)
        return max(len(r.sample.pending) for r in new) > widest

    def _retire(self) -> list[Row]:
        done = [r for r in self.rows if r.done]
        if done:
            cached = [r for r in self.rows if not r.fresh]  # (the cache's rows, in order)
            keep = [i for i, r in enumerate(cached) if not r.done]
            if len(keep) < len(cached):
                self.cache.keep_rows(keep)
            self.rows = [r for r in self.rows if not r.done]
        return done


def literal(text: str) -> str:
    """A stop string as the decoder's stop criteria take it, matched literally (they read a
    ``re:`` prefix as a regular expression; an OpenAI client means the characters)."""
    return "re:" + re.escape(text) if text.startswith("re:") else text
