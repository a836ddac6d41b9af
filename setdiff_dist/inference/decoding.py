"""What every decoder shares: the errors and checks of its inputs, the stop criteria, one
sample's state while it decodes and the result it returns, and :class:`Decoder`, the base of the
set decoder (:mod:`.decoder`) and of its siblings, the BD3LM and MDLM baselines
(:mod:`.baselines`): the model, the vocabulary gather, choosing and recording a step's tokens
(:mod:`.sampling`), and the stop criteria on the committed prefix."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from setdiff_dist.errors import SetdiffError

from .kv_cache import DecodeStep
from .sampling import accept, pick


class DecodeError(SetdiffError, ValueError):
    """Bad decoding input; the message says what and how to fix it."""


def check_threshold(threshold: float) -> None:
    if math.isnan(threshold) or threshold < 0:
        raise DecodeError(f"threshold={threshold!r}: a confidence in [0, 1] (or inf: one token "
                          "per step)")


# The sampler computes in float32: a temperature below the smallest normal float32 number, or a
# repetition penalty whose inverse is not one, cannot be divided by (the probabilities would be
# NaN), so they are refused up front (0 is greedy; a penalty of 1 is none).
FLOAT32_TINY = 1.1754943508222875e-38   # torch.finfo(torch.float32).tiny
FLOAT32_MAX = 3.4028234663852886e+38    # torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Sampling:
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    top_k: int = 0  # the k most likely tokens only (0: all), before top_p, as transformers'
    # end-of-text's logit e raised by |e| (length_penalty^(n - start) - 1) at a candidate with
    # n > start generated tokens before it (transformers' ExponentialDecayLengthPenalty, whose
    # n is the length of the sequence before the token; set decoding's, the committed tokens
    # of the generation before the candidate's position, as the reference counts them)
    length_penalty: float = 1.0
    length_penalty_start: int = 0

    def __post_init__(self):
        if isinstance(self.length_penalty_start, bool) or \
                not isinstance(self.length_penalty_start, int) or self.length_penalty_start < 0:
            raise DecodeError(f"length_penalty_start={self.length_penalty_start!r}: the "
                              "generated tokens after which the length penalty acts, an "
                              "integer of 0 or more")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise DecodeError(f"top_k={self.top_k!r}: it must be an integer, 0 (all tokens) or "
                              "the number of most likely tokens to sample from")
        checks = (("temperature", self.temperature,
                   lambda v: v == 0 or FLOAT32_TINY <= v <= FLOAT32_MAX,
                   f"0 (greedy) or from {FLOAT32_TINY:.3g} (float32's smallest normal number: "
                   "the sampler divides by it) up"),
                  ("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
                  ("repetition_penalty", self.repetition_penalty,
                   lambda v: FLOAT32_TINY <= v <= 1 / FLOAT32_TINY,
                   f"in [{FLOAT32_TINY:.3g}, {1 / FLOAT32_TINY:.3g}] (1 = none; the sampler "
                   "divides and multiplies float32 logits by it)"),
                  ("length_penalty", self.length_penalty, lambda v: v >= 1,
                   "of 1 (none) or more: end-of-text grows likelier past "
                   "length_penalty_start"))
        for name, value, ok, want in checks:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise DecodeError(f"{name}={value!r}: it must be a number {want}")
            if not math.isfinite(value):
                raise DecodeError(f"{name}={value!r}: it must be a finite number {want}")
            if not ok(value):
                raise DecodeError(f"{name}={value!r}: it must be {want}")


def check_text(what: str, text: str) -> None:
    """Text from a command line or a file must be Unicode: bytes that are not UTF-8 reach
    Python as lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DecodeError(f"{what} is not valid UTF-8 text (character {exc.start}: "
                          f"{text[exc.start:exc.start + 1]!r}); re-encode it as UTF-8") from None


def check_prompt(i: int, prompt: list, window: int, context: int) -> None:
    """Prompt ``i`` and a window of candidates must fit the model's context together."""
    if window >= context:
        raise DecodeError(f"window {window} does not fit the model's context of {context} "
                          f"tokens beside a prompt: give a window of at most {context - 1}")
    if len(prompt) + window > context:
        raise DecodeError(f"prompt {i} has {len(prompt)} tokens; with window {window} it does "
                          f"not fit the model's context of {context} tokens: shorten it to at "
                          f"most {context - window} tokens")


def check_max_new_tokens(n, limit: Optional[int] = None, what: str = "max_new_tokens") -> None:
    """``n`` new tokens: at least 1, and at most ``limit`` (a server's cap) when given."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DecodeError(f"{what} must be an integer of at least 1, got {n!r}")
    if limit is not None and n > limit:
        raise DecodeError(f"{what}={n} is more than this server allows ({limit}, the model's "
                          f"context unless --max-completion-tokens says otherwise): ask for at "
                          f"most {limit}")


def model_device(model) -> torch.device:
    """Where a model's weights live (the lean model keeps them as buffers)."""
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


@dataclass(frozen=True)
class StopCriteria:
    eos_id: Optional[int] = None
    stop: Sequence[str] = ()
    max_repeat_run: Optional[int] = None

    def __post_init__(self):
        for pattern in self.stop:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as exc:
                    raise DecodeError(f"stop pattern {pattern!r} is not a valid regular "
                                      f"expression: {exc}; escape special characters or "
                                      "drop the 're:' prefix for a plain string") from None
            elif not pattern:
                raise DecodeError("an empty stop string would stop at once; give some text")
        if self.max_repeat_run is not None and self.max_repeat_run < 1:
            raise DecodeError(f"max_repeat_run={self.max_repeat_run}: must be 1 or more")


@dataclass
class Rules:
    """How one sample decodes: its window, threshold, sampling, stop criteria and random
    stream. A batch of one call shares one; a server's rows each have their own, so a row
    decodes as it would alone whatever else is in the batch."""

    window: int = 16
    threshold: float = math.inf
    sampling: Sampling = Sampling()
    stop: StopCriteria = StopCriteria()
    gen: Optional[torch.Generator] = None

    def pick_key(self):
        """Rows with the same key choose their tokens in one :func:`pick`, each from its own
        random stream (greedy rows draw nothing)."""
        s = self.sampling
        greedy = s.greedy or s.temperature == 0
        return (greedy, None if greedy else s.temperature, None if greedy else s.top_p,
                None if greedy else s.top_k, s.repetition_penalty, s.length_penalty,
                s.length_penalty_start)


@dataclass
class Sample:
    tokens: list                 # token id per position, None while masked
    region: Sequence[int]        # positions to generate, in position order (a range)
    prompt_len: int
    pending: list = field(default_factory=list)  # accepted last step, not yet in the cache
    done: bool = False
    end: Optional[int] = None    # generation stops before this position
    steps: int = 0
    logits: dict = field(default_factory=dict)   # position -> logits when decoded (tests)
    trace: list = field(default_factory=list)    # per forward: [(position, confidence)] taken
    left: int = 0        # region[:left] is committed (the left prefix)
    checked: int = 0     # region[:checked] was searched for stops
    committed: int = 0   # positions of the region committed so far
    rules: Optional[Rules] = None  # how it decodes (set decoding's per-row settings)
    error: Optional[str] = None    # why this sample failed alone (a server's row; then done)
    _seen: Optional[set] = field(default=None, repr=False)

    # A step's work on a sample is proportional to its window, never to what remains of its
    # region: the positions are walked from the committed prefix on, never copied.
    @classmethod
    def continuation(cls, prompt: list, max_new_tokens: int) -> "Sample":
        """A sample that continues ``prompt`` (token ids) by up to ``max_new_tokens``."""
        n = len(prompt)
        return cls(tokens=list(prompt) + [None] * max_new_tokens,
                   region=range(n, n + max_new_tokens), prompt_len=n)

    def seen(self) -> set:
        """The token ids this sample holds (for a repetition penalty; kept up to date by
        :meth:`commit` after the first call)."""
        if self._seen is None:
            self._seen = {t for t in self.tokens if t is not None}
        return self._seen

    def advance(self) -> None:
        while self.left < len(self.region) and self.tokens[self.region[self.left]] is not None:
            self.left += 1

    def masked(self, limit: Optional[int] = None) -> list:
        """The still-masked positions of the region, in order (the first ``limit``)."""
        self.advance()
        out, region, tokens = [], self.region, self.tokens
        for j in range(self.left, len(region)):
            if tokens[region[j]] is None:
                out.append(region[j])
                if len(out) == limit:
                    break
        return out

    def window(self, width: int) -> list:
        """The masked positions in ``[f, f + width)``, ``f`` the leftmost masked position."""
        self.advance()
        if self.left == len(self.region):
            return []
        region, tokens = self.region, self.tokens
        f, out = region[self.left], []
        for j in range(self.left, len(region)):
            p = region[j]
            if p >= f + width:
                break
            if tokens[p] is None:
                out.append(p)
        return out

    def finished(self) -> bool:
        self.advance()
        return self.left == len(self.region)

    def prefix_from(self, start: int) -> list:
        """The tokens of the committed prefix contiguous from the prompt (up to a stop), from
        region index ``start`` on: what can be text so far, set decoding committing positions
        out of order (a streamed caller keeps ``start``: what it took before)."""
        self.advance()
        end = self.end if self.end is not None else math.inf
        out, j = [], start
        while j < self.left and self.region[j] < end:
            out.append(self.tokens[self.region[j]])
            j += 1
        return out

    def generated_before(self, positions: Sequence[int]) -> list:
        """For each of ``positions`` (the region's), how many of the region's tokens before it
        are committed: what a length penalty counts (walks the region from the committed
        prefix to the last of them, once)."""
        self.advance()
        region, tokens = self.region, self.tokens
        out, j, n = {}, self.left, self.left
        for p in sorted(positions):
            while j < len(region) and region[j] < p:
                n += tokens[region[j]] is not None
                j += 1
            out[p] = n
        return [out[p] for p in positions]

    def commit(self, picks) -> None:
        for pos, tok in picks:
            self.tokens[pos] = tok
            if self._seen is not None:
                self._seen.add(tok)
        self.committed += len(picks)

    def fail(self, why: str) -> None:
        """This sample alone cannot go on (a server's row: the others in its batch do)."""
        self.error, self.done = why, True

    def output(self) -> list:
        """The generated token ids, up to a stop (the stop marker excluded)."""
        end = self.end if self.end is not None else self.region[-1] + 1
        return [self.tokens[p] for p in self.region if p < end and self.tokens[p] is not None]

    def result(self, tok, seconds: float) -> "Result":
        ids = self.output()
        return Result(ids, tok.decode(ids), self.steps, seconds,
                      trace=[[p for p, _ in step] for step in self.trace],
                      trace_confidence=[[c for _, c in step] for step in self.trace],
                      finish_reason="stop" if self.end is not None else "length")


@dataclass
class Result:
    tokens: list        # generated token ids (stop marker excluded)
    text: str
    steps: int          # forward passes, every one (the prefill's included: it is fused)
    seconds: float
    trace: Optional[list] = None  # per forward step: the absolute positions committed in it
    trace_confidence: Optional[list] = None  # and the confidence of each
    finish_reason: str = "length"  # "stop": a stop criterion ended it; "length": the budget

    @property
    def tokens_per_step(self) -> float:
        """Tokens per forward pass: what decides the speed."""
        return len(self.tokens) / max(self.steps, 1)


class Decoder:
    """The base of every decoder: the model (the lean decode-time model, any tensor-parallel
    size), its tokenizer and context, and the steps all of them take alike."""

    #: what :meth:`generate` runs, for people (results, logs, errors): "set", "causal" (AR),
    #: "block" (BD3LM) or "mdlm". Code asks the attributes and methods below instead of
    #: comparing it (``tests/test_layers.py`` holds that outside ``inference/``).
    decoding = ""
    #: the model is a plain causal LM: the output at ``l - 1`` predicts ``l``, one token a step,
    #: no right context (its scores are a causal LM's; a window means nothing to it)
    causal_lm = False
    #: rows may join and leave between steps, each with its own settings (what a server's
    #: continuous batch needs: :mod:`setdiff_dist.serve.batch`)
    batchable = False

    def __init__(self, model, tokenizer, *, context: int, keep_logits: bool = False):
        self.model, self.tok, self.context = model, tokenizer, context
        self.mask_id = model.mask_id
        self.device = model_device(model)
        self.keep_logits = keep_logits
        self._last_logits: dict = {}  # position -> logits of the last call (keep_logits=True)
        self.vocab = model.vocab_size

    @classmethod
    def for_config(cls, model, tokenizer, cfg, keep_logits: bool = False) -> "Decoder":
        """This decoder for a checkpoint of config ``cfg`` (its context; a subclass reads what
        else it needs of the config)."""
        return cls(model, tokenizer, context=cfg.data.seq_len, keep_logits=keep_logits)

    def check_infill(self) -> None:
        """Raise if this decoder cannot condition on a right context (before any decoding)."""

    @property
    def eos_id(self):
        """The tokenizer's end-of-text id (what a length penalty raises), or None."""
        return getattr(self.tok, "eos_id", None)

    def stream(self, prompt: list[int], max_new_tokens: int, window=None,
               threshold: float = math.inf, sampling: Sampling = Sampling(),
               stop: StopCriteria = StopCriteria()):
        """:meth:`generate` for one prompt as a generator of the token ids that join the
        committed prefix (:meth:`SetDecoder.stream`), returning the :class:`Result`. This
        decoder (blocks, MDLM) yields them all at the end: set decoding is the one whose
        steps commit a prefix as they go."""
        result = self.generate([prompt], max_new_tokens, window=window, threshold=threshold,
                               sampling=sampling, stop=stop)[0]
        yield list(result.tokens)
        return result

    def room(self, max_new_tokens: int, window: int) -> int:
        """Positions a generation of ``max_new_tokens`` needs past its prompt: as many as it
        writes here (blocks and MDLM decode inside the span); set decoding also needs its first
        window of candidates in the context (:meth:`SetDecoder.room`)."""
        return max_new_tokens

    def speed_points(self, window: int) -> list:
        """The ``(window, threshold)`` points a throughput measurement sweeps by default: the
        checkpoint's window at thresholds inf, 0.9 and 0.5."""
        return [(window, math.inf), (window, 0.9), (window, 0.5)]

    def use_blocks(self, block_size: int) -> None:
        """Decode :meth:`generate` semi-autoregressively in blocks of ``block_size`` (MDLM's
        sampler only: :meth:`MDLMDecoder.use_blocks`); any other decoder refuses."""
        raise DecodeError(f"blocks of {block_size}: this checkpoint decodes as "
                          f"'{self.decoding}', not with MDLM's sampler; semi-autoregressive "
                          "blocks are for a masked (MDLM) checkpoint")

    def _cached_pass(self, cache, tokens, positions, valid, own, commits: int,
                     logits_from=0):
        """One forward of a step's padded rows (``tokens``, ``positions``, ``valid [B, n]``,
        on the device) over ``cache``: each token attends the cache's valid entries and, among
        the step's tokens, what ``own [B, n, n]`` allows; the cache then keeps each row's first
        ``commits`` slots. Returns the logits ``[B, n - logits_from, V]`` (``[B, 1, V]`` for a
        tensor ``logits_from [B]``: one position per row) (the real vocabulary,
        gathered over tensor-parallel ranks), on the device."""
        B, n = tokens.shape
        cache.reserve(n)  # (may squeeze out cropped slots: before the mask is built)
        allowed = torch.cat([cache.valid[:, None, :].expand(B, n, cache.length)
                             & valid[:, :, None], own], dim=2)
        with torch.no_grad():
            logits = self.model(tokens, positions, None, logits_from=logits_from,
                                step=DecodeStep(cache, allowed))
        # (the commits are each row's leading slots)
        cache.commit(valid[:, :commits], positions[:, :commits], leading=True)
        return self._full_vocab(logits).transpose(0, 1)

    def _full_vocab(self, logits):
        """Gather vocab-parallel logits ``[s, b, V/TP]`` and keep the real vocabulary."""
        tp = getattr(self.model, "tp_size", 1)  # (the lean model's tensor-parallel group)
        if tp > 1:
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=self.model.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.vocab]

    def _choose(self, logits, cands, s, sampling, gen, threshold):
        """One sample's choices for ``logits [M, V]`` (recorded with ``keep_logits``); accept
        the most confident and all above the threshold."""
        if self.keep_logits:
            for j, pos in enumerate(cands):
                s.logits[pos] = logits[j].clone()
                self._last_logits[pos] = logits[j].clone()
        lengths = [s.generated_before(cands)] if sampling.length_penalty != 1.0 else None
        toks, conf = pick(logits[None], sampling, gen, [s.seen()], lengths=lengths,
                          eos_id=self.eos_id)
        return accept(toks[0], conf[0], cands, threshold)

    def _check_stop(self, s, stop):
        """End-of-text, stop strings / regex and repeated runs, on the committed left prefix;
        generation ends at the earliest of them. Only the part of the prefix committed since
        the last check is searched for end-of-text and runs (the rest was searched before)."""
        s.advance()
        lo, hi = s.checked, s.left  # region indices of the newly committed prefix
        if hi == lo:
            return
        s.checked = hi
        tok = lambda j: s.tokens[s.region[j]]  # noqa: E731
        ends = []  # candidate end positions (exclusive)
        if stop.eos_id is not None:
            hit = next((j for j in range(lo, hi) if tok(j) == stop.eos_id), None)
            if hit is not None:
                ends.append(s.region[hit])
        k = stop.max_repeat_run
        if k:
            for j in range(max(lo, k - 1), hi):  # the earliest run of k equal tokens
                if all(tok(i) == tok(j) for i in range(j - k + 1, j)):
                    ends.append(s.region[j] + 1)
                    break
        if stop.stop:
            ids = [tok(j) for j in range(hi)]
            text = self.tok.decode(ids)
            for pattern in stop.stop:
                if pattern.startswith("re:"):
                    m = re.search(pattern[3:], text)
                    hit = m.end() if m else -1
                else:
                    hit = text.find(pattern) + len(pattern) if pattern in text else -1
                if hit >= 0:  # the shortest prefix whose text contains the match
                    k_tokens = next(k for k in range(1, len(ids) + 1)
                                    if len(self.tok.decode(ids[:k])) >= hit)
                    ends.append(s.region[k_tokens - 1] + 1)
        if ends:
            s.end = min(ends)
            s.done = True
