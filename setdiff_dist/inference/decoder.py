"""KV-cached set decoding (docs/method.md §5), batched, on any tensor-parallel size.

Each step is one forward over ``[tokens committed by the previous step, as clean ; [MASK] at
the candidate positions]``: committed tokens attend the cache and the earlier committed tokens
of the step (causal); mask queries attend the cache, all committed tokens of the step, and
themselves. The committed tokens' keys and values are then appended to the cache, so the cache
grows after *every* step and committing costs no extra forward.

Candidates are the masked positions in the positional window ``[f, f + window)``, ``f`` the
leftmost masked position (where earlier steps left holes it holds fewer than ``window``: it
never reaches past what trained orders reveal), or, with ``order=[...]``, the next positions of
a given order. Each candidate is sampled (greedy, or
temperature / top-p, with a repetition penalty); the most confident one and every one with
confidence ``>= threshold`` are accepted, the rest stay masked. ``window=1, threshold=inf`` is
autoregressive decoding with a KV cache. ``mode="causal"`` decodes a model trained as a plain
causal LM (the output at ``l - 1`` predicts ``l``), the AR baseline.

Generation stops on end-of-text, a stop string or regex, or a run of one repeated token, all
checked on the committed left prefix, or at ``max_new_tokens``; past the model's context the
cache is cropped from the left. Infilling puts the left and the right context in the cache first,
so the middle is conditioned on both.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from itertools import groupby
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from setdiff_dist.errors import SetdiffError
from setdiff_dist.inference.kv_cache import DecodeStep, KVCache


def model_device(model) -> torch.device:
    """Where a model's weights live (the lean model keeps them as buffers)."""
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


class DecodeError(SetdiffError, ValueError):
    """Bad decoding input; the message says what and how to fix it."""


def check_threshold(threshold: float) -> None:
    if math.isnan(threshold) or threshold < 0:
        raise DecodeError(f"threshold={threshold!r}: a confidence in [0, 1] (or inf: one token "
                          "per step)")


@dataclass(frozen=True)
class Sampling:
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0

    def __post_init__(self):
        checks = (("temperature", self.temperature, lambda v: v >= 0, "0 or more"),
                  ("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
                  ("repetition_penalty", self.repetition_penalty, lambda v: v > 0,
                   "above 0 (1 = none)"))
        for name, value, ok, want in checks:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and ok(value)):
                raise DecodeError(f"{name}={value!r}: it must be a finite number {want}")


def check_text(what: str, text: str) -> None:
    """Text from a command line or a file must be Unicode: bytes that are not UTF-8 reach
    Python as lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DecodeError(f"{what} is not valid UTF-8 text (character {exc.start}: "
                          f"{text[exc.start:exc.start + 1]!r}); re-encode it as UTF-8") from None


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
class _Sample:
    tokens: list                 # token id per position, None while masked
    region: list                 # positions to generate, in position order
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

    def advance(self) -> None:
        while self.left < len(self.region) and self.tokens[self.region[self.left]] is not None:
            self.left += 1

    def masked(self, limit: Optional[int] = None) -> list:
        """The still-masked positions of the region, in order (the first ``limit``)."""
        self.advance()
        out = []
        for p in self.region[self.left:]:
            if self.tokens[p] is None:
                out.append(p)
                if len(out) == limit:
                    break
        return out

    def window(self, width: int) -> list:
        """The masked positions in ``[f, f + width)``, ``f`` the leftmost masked position."""
        self.advance()
        if self.left == len(self.region):
            return []
        f, out = self.region[self.left], []
        for p in self.region[self.left:]:
            if p >= f + width:
                break
            if self.tokens[p] is None:
                out.append(p)
        return out

    def finished(self) -> bool:
        self.advance()
        return self.left == len(self.region)

    def commit(self, picks) -> None:
        for pos, tok in picks:
            self.tokens[pos] = tok
        self.committed += len(picks)

    def output(self) -> list:
        """The generated token ids, up to a stop (the stop marker excluded)."""
        end = self.end if self.end is not None else self.region[-1] + 1
        return [self.tokens[p] for p in self.region if p < end and self.tokens[p] is not None]

    def result(self, tok, seconds: float) -> "Result":
        ids = self.output()
        return Result(ids, tok.decode(ids), self.steps, seconds,
                      trace=[[p for p, _ in step] for step in self.trace],
                      trace_confidence=[[c for _, c in step] for step in self.trace])


@dataclass
class Result:
    tokens: list        # generated token ids (stop marker excluded)
    text: str
    steps: int          # forward passes, every one (the prefill's included: it is fused)
    seconds: float
    trace: Optional[list] = None  # per forward step: the absolute positions committed in it
    trace_confidence: Optional[list] = None  # and the confidence of each

    @property
    def tokens_per_step(self) -> float:
        """Tokens per forward pass: what decides the speed."""
        return len(self.tokens) / max(self.steps, 1)


class SetDecoder:
    def __init__(self, model, tokenizer, *, context: int, mode: str = "set",
                 keep_logits: bool = False):
        if mode not in ("set", "causal"):
            raise ValueError(f"unknown decoding mode {mode!r}")
        self.model, self.tok, self.context, self.mode = model, tokenizer, context, mode
        self.mask_id = model.mask_id
        self.device = model_device(model)
        self.keep_logits = keep_logits
        self._last_logits: dict = {}  # position -> logits of the last call (keep_logits=True)
        self._patterns: dict = {}  # (commits, tokens) -> a step's own-token mask pattern
        self.vocab = model.vocab_size

    @property
    def decoding(self) -> str:
        """What :meth:`generate` runs: "set", "causal" (AR), "block" (BD3LM) or "mdlm"."""
        return self.mode

    def check_infill(self) -> None:
        """Raise if this model cannot condition on a right context (before any decoding)."""
        if self.mode == "causal":
            raise DecodeError("a causal LM cannot condition on the right context: infilling "
                              "needs a set-diffusion model")

    # -- the public calls ------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, window: int = 16,
                 threshold: float = math.inf, sampling: Sampling = Sampling(),
                 stop: StopCriteria = StopCriteria(), order: Optional[list[list[int]]] = None
                 ) -> list[Result]:
        """Continue each prompt (token ids) by up to ``max_new_tokens``."""
        if max_new_tokens < 1:
            raise DecodeError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if not p:
                raise DecodeError(f"prompt {i} is empty: give some text (unconditional "
                                  "generation starts from the end-of-text token)")
            if len(p) + window > self.context:
                raise DecodeError(f"prompt {i} has {len(p)} tokens; with window {window} it "
                                  f"does not fit the model's context of {self.context} tokens")
        samples = [_Sample(tokens=list(p) + [None] * max_new_tokens,
                           region=list(range(len(p), len(p) + max_new_tokens)),
                           prompt_len=len(p)) for p in prompts]
        return self._run(samples, [list(p) for p in prompts], window, threshold, sampling, stop,
                         order, infill=False)

    def infill(self, left: list[list[int]], right: list[list[int]], middle_len: list[int],
               window: int = 16, threshold: float = math.inf, sampling: Sampling = Sampling(),
               order=None) -> list[Result]:
        """Fill ``middle_len`` masked tokens between ``left`` and ``right``; both contexts are
        in the cache before the first step, and given tokens are never overwritten."""
        self.check_infill()
        samples, prefill = [], []
        for i, (lt, rt, n) in enumerate(zip(left, right, middle_len)):
            if n < 1:
                raise DecodeError(f"infill {i}: the middle must have at least one token")
            if window > n and self.mode == "set" and order is None:
                raise DecodeError(f"infill {i}: window {window} is larger than the masked span "
                                  f"of {n} tokens; use --window {n} or less")
            if len(lt) + n + len(rt) > self.context:
                raise DecodeError(f"infill {i}: {len(lt)} + {n} + {len(rt)} tokens exceed the "
                                  f"model's context of {self.context}")
            samples.append(_Sample(tokens=list(lt) + [None] * n + list(rt),
                                   region=list(range(len(lt), len(lt) + n)), prompt_len=len(lt)))
            prefill.append(list(lt) + list(rt))
        return self._run(samples, prefill, window, threshold, sampling, StopCriteria(), order,
                         infill=True, right=[list(r) for r in right])

    # -- the loop --------------------------------------------------------------------------------
    def _run(self, samples, prefill, window, threshold, sampling, stop, order, infill,
             right=None):
        if window < 1:
            raise DecodeError(f"window must be at least 1, got {window}")
        check_threshold(threshold)
        B = len(samples)
        self._last_logits = {}
        cache = KVCache(self.model.config.num_layers, B, self.device)
        # the sampling stream lives where the logits do (one draw per step for all rows; the
        # per-sample path, used when logits are kept for tests, draws on the host)
        gen = torch.Generator(device=self.device if not self.keep_logits else "cpu") \
            .manual_seed(sampling.seed)
        start = time.perf_counter()
        # prefill: the context as clean tokens, causal in position order (left, then right)
        for s, ids in zip(samples, prefill):
            positions = list(range(s.prompt_len))
            if infill:
                positions += list(range(s.region[-1] + 1, s.region[-1] + 1 + len(ids)
                                        - s.prompt_len))
            s.pending = list(zip(positions, ids))
        while not all(s.done for s in samples):
            self._step(samples, cache, window, threshold, sampling, stop, order, gen, infill)
        seconds = time.perf_counter() - start
        return [s.result(self.tok, seconds) for s in samples]

    def _candidates(self, s, window, order, b):
        if s.finished():
            return []
        if order is not None:
            return [order[b][s.committed]]
        return s.window(window)

    def _step(self, samples, cache, window, threshold, sampling, stop, order, gen, infill):
        B = len(samples)
        commits = [s.pending for s in samples]
        if self.mode == "causal":
            cands = [[] if s.done else s.masked(1) for s in samples]
        else:
            cands = [[] if s.done else self._candidates(s, window, order, b)
                     for b, s in enumerate(samples)]
        C = max(len(c) for c in commits)
        M = 0 if self.mode == "causal" else max(len(c) for c in cands)
        n = C + M
        if n == 0:
            for s in samples:
                s.done = True
            return
        # the step's inputs, built as host lists and sent in one copy each: per sample its
        # commits (first C slots), then its candidates ([MASK] queries, next M slots)
        tok_rows, pos_rows, val_rows = [], [], []
        for b in range(B):
            c, q = commits[b], cands[b] if self.mode == "set" else []
            gap_c, gap_q = C - len(c), M - len(q)
            tok_rows.append([t for _, t in c] + [self.mask_id] * (n - len(c)))
            pos_rows.append([p for p, _ in c] + [0] * gap_c + list(q) + [0] * gap_q)
            val_rows.append([True] * len(c) + [False] * gap_c + [True] * len(q)
                            + [False] * gap_q)
        dev = self.device
        tokens = torch.tensor(tok_rows, dtype=torch.long, device=dev)
        positions = torch.tensor(pos_rows, dtype=torch.long, device=dev)
        valid = torch.tensor(val_rows, dtype=torch.bool, device=dev)
        # what each new token may attend: valid cache entries, then the step's own tokens
        pattern, eye = self._step_pattern(C, n)
        own = (pattern & valid[:, None, :] & valid[:, :, None]) | eye
        cache.reserve(n)  # (may squeeze out cropped slots: before the mask is built)
        allowed = torch.cat([cache.valid[:, None, :].expand(B, n, cache.length)
                             & valid[:, :, None], own], dim=2)
        with torch.no_grad():
            logits = self.model(tokens, positions, None, logits_from=0 if self.mode == "causal"
                                else C, step=DecodeStep(cache, allowed))
        # the commits are each row's leading slots: the cache keeps the first C
        cache.commit(valid[:, :C], positions[:, :C], leading=True)
        logits = self._full_vocab(logits).transpose(0, 1)  # [B, s, V], on the device
        if self.mode == "causal":  # each sample's prediction comes from its last commit
            last = [max(len(c) - 1, 0) for c in commits]
            if min(last) == max(last):
                logits = logits[:, last[0]:last[0] + 1]
            else:
                logits = logits[torch.arange(B, device=logits.device),
                                torch.tensor(last, device=logits.device)][:, None]
        if self.keep_logits:  # chosen per sample, which records them
            fast, logits = None, logits.float().cpu()
        else:
            fast = self._pick(logits, samples, sampling, gen)
        for b, s in enumerate(samples):
            s.pending = []
            if s.done:
                continue
            s.steps += 1
            if self.mode == "causal":
                if not cands[b]:
                    s.done = True
                    continue
            else:
                if not cands[b]:
                    s.done = True
                    continue
            if fast is not None:
                picks = self._accept(fast[0][b], fast[1][b], cands[b], threshold)
            else:
                picks = self._choose(logits[b, :len(cands[b])], cands[b], s, sampling, gen,
                                     threshold)
            s.trace.append(sorted((p, c) for p, _, c in picks))
            picks = [(p, t) for p, t, _ in picks]
            s.commit(picks)
            s.pending = sorted(picks)
            if not infill:
                self._check_stop(s, stop)
            if s.finished():
                s.done = True
        if not infill:  # (an infill fits the context by construction: never crop its left side)
            # past the model's context, forget the oldest cache entries: the next step's tokens
            # (pending commits and up to `window` queries) must fit next to the cache
            need = max(len(s.pending) for s in samples) + window
            if int(cache.valid.sum(1).max()) + need > self.context:
                cache.crop(self.context - need)

    def _step_pattern(self, C: int, n: int):
        """The step's own-token mask for ``C`` commits among ``n`` tokens, before validity:
        commits causal among themselves, [MASK] queries see every commit (and themselves,
        through the identity, which also keeps a padded row from attending nothing)."""
        key = (C, n)
        if key not in self._patterns:
            i = torch.arange(n)
            is_commit = i < C
            pattern = (is_commit[:, None] & is_commit[None, :] & (i[None, :] <= i[:, None])) \
                | (~is_commit[:, None] & is_commit[None, :])
            self._patterns[key] = (pattern[None].to(self.device),
                                   torch.eye(n, dtype=torch.bool, device=self.device)[None])
        return self._patterns[key]

    def _full_vocab(self, logits):
        """Gather vocab-parallel logits ``[s, b, V/TP]`` and keep the real vocabulary."""
        tp = getattr(self.model, "tp_size", 1)  # (the lean model's tensor-parallel group)
        if tp > 1:
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=self.model.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.vocab]

    @staticmethod
    def _pick(logits, samples, sampling, gen):
        """Every sample's choices for its candidate rows of ``logits [B, M, V]`` in a few
        batched ops where the logits are (repetition penalty over each sample's seen tokens,
        temperature, top-p, greedy or one multinomial draw for all rows); only ``[B, M]`` token
        ids and confidences go to the host."""
        logits = logits.float()
        B, _, V = logits.shape
        if sampling.repetition_penalty != 1.0:
            rows, cols = [], []
            for b, s in enumerate(samples):
                ids = {t for t in s.tokens if t is not None}
                rows += [b] * len(ids)
                cols += sorted(ids)
            seen = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
            index = torch.tensor([rows, cols], dtype=torch.long, device=logits.device)
            seen[index[0], index[1]] = True
            p = sampling.repetition_penalty
            logits = torch.where(seen[:, None], torch.where(logits > 0, logits / p, logits * p),
                                 logits)
        if sampling.greedy or sampling.temperature == 0:
            conf, toks = torch.softmax(logits, -1).max(-1)
            return toks.tolist(), conf.tolist()
        probs = torch.softmax(logits / sampling.temperature, -1)
        if sampling.top_p < 1.0:
            sorted_p, idx = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > sampling.top_p
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
        toks = torch.multinomial(probs.view(-1, V), 1, generator=gen).view(B, -1)
        conf = probs.gather(-1, toks[..., None])[..., 0]
        return toks.tolist(), conf.tolist()

    @staticmethod
    def _accept(toks, conf, cands, threshold):
        """The most confident candidate, and every one at or above the threshold, as
        ``(position, token, confidence)``."""
        conf = conf[:len(cands)]
        best = max(range(len(cands)), key=lambda j: (conf[j], -j))
        return [(pos, int(toks[j]), float(conf[j])) for j, pos in enumerate(cands)
                if j == best or conf[j] >= threshold]

    def _choose(self, logits, cands, s, sampling, gen, threshold):
        """One sample's choices for ``logits [M, V]`` (recorded with ``keep_logits``); accept
        the most confident and all above the threshold."""
        if self.keep_logits:
            for j, pos in enumerate(cands):
                s.logits[pos] = logits[j].clone()
                self._last_logits[pos] = logits[j].clone()
        toks, conf = self._pick(logits[None], [s], sampling, gen)
        return self._accept(toks[0], conf[0], cands, threshold)

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


class BaselineDecoder(SetDecoder):
    """The two diffusion baselines, through the same model, sampling and acceptance rule:

    - :meth:`blocks` (BD3LM; a batch, :meth:`block` for one prompt): blocks of
      ``block_size`` on the training grid, left to right; inside a block every step re-runs the
      whole block as the noisy copy (decoded tokens as ids, the rest [MASK]) over the cache,
      bidirectionally. A finished block enters the cache as clean tokens inside the next
      block's first pass (and the prompt inside the first block's), as the reference code does:
      one forward per denoising step, no pass of its own. The cache grows once per block, not
      per step.
    - :meth:`mdlm` (MDLM, a batch of one): no cache; every step runs the clean prompt and the
      whole noisy continuation again.

    With ``trained_as`` ("block" or "mdlm": the decoder of the checkpoint's order), :meth:`generate`
    and :meth:`infill` decode as that order trained (:func:`decoder_for`): blocks of
    ``block_size`` on the grid, or MDLM's sampler; without it they are set decoding.
    """

    def __init__(self, model, tokenizer, *, context: int, trained_as: Optional[str] = None,
                 block_size: int = 4, keep_logits: bool = False):
        super().__init__(model, tokenizer, context=context, keep_logits=keep_logits)
        if trained_as not in (None, "block", "mdlm"):
            raise ValueError(f"unknown baseline {trained_as!r}")
        self.trained_as, self.block_size = trained_as, block_size

    @property
    def decoding(self) -> str:
        return self.trained_as or self.mode

    def check_infill(self) -> None:
        if self.trained_as == "block":
            raise DecodeError("a block-diffusion (BD3LM) checkpoint decodes left to right and "
                              "cannot condition on the right context: infilling needs a "
                              "staggered (SetDLM) or masked (MDLM) checkpoint")
        super().check_infill()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, window: int = 16,
                 threshold: float = math.inf, sampling: Sampling = Sampling(),
                 stop: StopCriteria = StopCriteria(), order: Optional[list[list[int]]] = None
                 ) -> list[Result]:
        """As the checkpoint's order decodes: ``window`` must be the block size for a block
        model (its blocks are its sets) and is unused by MDLM (every masked position is a
        candidate at every step)."""
        if self.trained_as is None or order is not None:
            return super().generate(prompts, max_new_tokens, window, threshold, sampling, stop,
                                    order)
        if self.trained_as == "block":
            if window != self.block_size:
                raise DecodeError(f"window {window}: a block-diffusion (BD3LM) checkpoint "
                                  f"decodes its own blocks of order.block_size = "
                                  f"{self.block_size}; use --window {self.block_size} or leave "
                                  "it unset")
            return self.blocks(prompts, max_new_tokens, self.block_size, threshold, sampling,
                               stop)
        return [self.mdlm(p, max_new_tokens, threshold, sampling, stop=stop) for p in prompts]

    def infill(self, left: list[list[int]], right: list[list[int]], middle_len: list[int],
               window: int = 16, threshold: float = math.inf, sampling: Sampling = Sampling(),
               order=None) -> list[Result]:
        """MDLM fills the span seeing both contexts; a block model cannot see the right one."""
        if self.trained_as is None or order is not None:
            return super().infill(left, right, middle_len, window, threshold, sampling, order)
        self.check_infill()
        for i, n in enumerate(middle_len):
            if n < 1:
                raise DecodeError(f"infill {i}: the middle must have at least one token")
        return [self.mdlm(lt, n, threshold, sampling, right=rt)
                for lt, rt, n in zip(left, right, middle_len)]

    def _forward(self, cache, tokens, positions, own, commit):
        """One pass over ``tokens``; ``commit``: whether the cache keeps them (a bool, or one
        per token: the leading ones, in a fused pass)."""
        n = len(tokens)
        cache.reserve(n)
        allowed = torch.cat([cache.valid.cpu()[:, None, :].expand(1, n, cache.length),
                             own[None]], dim=2).to(self.device)
        tokens = torch.tensor(tokens, device=self.device)[None]
        positions = torch.tensor(positions, device=self.device)[None]
        with torch.no_grad():
            logits = self.model(tokens, positions, None, step=DecodeStep(cache, allowed))
        keep = [commit] * n if isinstance(commit, bool) else list(commit)
        cache.commit(torch.tensor([keep], dtype=torch.bool, device=self.device), positions)
        return self._full_vocab(logits)[:, 0].float().cpu()  # [n, V]

    def block(self, prompt: list[int], max_new_tokens: int, block_size: int,
              threshold: float = math.inf, sampling: Sampling = Sampling(),
              stop: StopCriteria = StopCriteria()) -> Result:
        """:meth:`blocks` for one prompt."""
        return self.blocks([prompt], max_new_tokens, block_size, threshold, sampling, stop)[0]

    def blocks(self, prompts: list[list[int]], max_new_tokens: int, block_size: int,
               threshold: float = math.inf, sampling: Sampling = Sampling(),
               stop: StopCriteria = StopCriteria()) -> list[Result]:
        """Block decoding of a batch. Blocks lie on the training grid, ``[k B, (k + 1) B)`` in
        absolute positions (the block order's sets): after a prompt of ``P`` tokens the first
        block is ``[P, ceil(P / B) B)``, the rest of the block the prompt occupies. Each row
        keeps its own blocks (prompts may differ in length); one forward per step serves all
        rows, padded. Stop criteria are checked on each row's committed prefix after every
        step; a stopped row idles while the others finish."""
        N, bs = max_new_tokens, block_size
        if N < 1 or bs < 1:
            raise DecodeError(f"max_new_tokens ({N}) and block_size ({bs}) must be at least 1")
        samples, plan = [], []
        for i, p in enumerate(prompts):
            if not p:
                raise DecodeError(f"prompt {i} is empty")
            P = len(p)
            if P + N > self.context:
                raise DecodeError(f"prompt {i}: {P} + {N} tokens exceed the model's context of "
                                  f"{self.context}")
            samples.append(_Sample(tokens=list(p) + [None] * N, region=list(range(P, P + N)),
                                   prompt_len=P))
            # the region's positions grouped by their block k = p // B; and the clean tokens
            # waiting to enter the cache, with their own attention pattern: the prompt
            # (causal), then each finished block (a set)
            plan.append({"blocks": [list(g) for _, g in groupby(range(P, P + N),
                                                                 key=lambda p: p // bs)],
                         "k": 0, "pending": list(range(P)),
                         "own": torch.ones(P, P).tril().bool()})
        B = len(samples)
        gen = torch.Generator().manual_seed(sampling.seed)
        cache = KVCache(self.model.config.num_layers, B, self.device)
        start = time.perf_counter()
        while not all(s.done for s in samples):
            rows = [([], torch.ones(0, 0, dtype=torch.bool), []) if s.done else
                    (st["pending"], st["own"], st["blocks"][st["k"]])
                    for s, st in zip(samples, plan)]
            C = max(len(r[0]) for r in rows)
            Q = max(len(r[2]) for r in rows)
            n = C + Q
            tok_rows, pos_rows, val_rows = [], [], []
            own = torch.zeros(B, n, n, dtype=torch.bool)
            for b, (s, (pend, pend_own, block)) in enumerate(zip(samples, rows)):
                c, q = len(pend), len(block)
                tok_rows.append([s.tokens[p] for p in pend] + [self.mask_id] * (C - c)
                                + [self.mask_id if s.tokens[p] is None else s.tokens[p]
                                   for p in block] + [self.mask_id] * (Q - q))
                pos_rows.append(pend + [0] * (C - c) + block + [0] * (Q - q))
                val_rows.append([True] * c + [False] * (C - c) + [True] * q + [False] * (Q - q))
                # the pending clean tokens see the cache and their own pattern; the noisy block
                # sees them and itself, bidirectionally; only the clean ones are cached
                own[b, :c, :c] = pend_own
                own[b, C:C + q, :c] = True
                own[b, C:C + q, C:C + q] = True
            own |= torch.eye(n, dtype=torch.bool)  # (a padded slot attends itself: no empty row)
            dev = self.device
            tokens = torch.tensor(tok_rows, dtype=torch.long, device=dev)
            positions = torch.tensor(pos_rows, dtype=torch.long, device=dev)
            valid = torch.tensor(val_rows, dtype=torch.bool, device=dev)
            cache.reserve(n)
            allowed = torch.cat([cache.valid[:, None, :].expand(B, n, cache.length)
                                 & valid[:, :, None], own.to(dev)], dim=2)
            with torch.no_grad():
                logits = self.model(tokens, positions, None, logits_from=C,
                                    step=DecodeStep(cache, allowed))
            cache.commit(valid[:, :C], positions[:, :C], leading=True)
            logits = self._full_vocab(logits).transpose(0, 1).float().cpu()  # [B, Q, V]
            for b, (s, st) in enumerate(zip(samples, plan)):
                if s.done:
                    continue
                block = st["blocks"][st["k"]]
                st["pending"], st["own"] = [], torch.ones(0, 0, dtype=torch.bool)
                masked = [j for j, p in enumerate(block) if s.tokens[p] is None]
                picks = self._choose(logits[b, masked], [block[j] for j in masked], s, sampling,
                                     gen, threshold)
                s.commit([(p, t) for p, t, _ in picks])
                s.trace.append(sorted((p, c) for p, _, c in picks))
                s.steps += 1
                self._check_stop(s, stop)
                if all(s.tokens[p] is not None for p in block):
                    st["k"] += 1
                    st["pending"], st["own"] = block, torch.ones(len(block), len(block),
                                                                 dtype=torch.bool)
                    s.done = s.done or st["k"] == len(st["blocks"])
        seconds = time.perf_counter() - start
        return [s.result(self.tok, seconds) for s in samples]

    def mdlm(self, prompt: list[int], max_new_tokens: int, threshold: float = math.inf,
             sampling: Sampling = Sampling(), right: Optional[list[int]] = None,
             stop: StopCriteria = StopCriteria()) -> Result:
        """MDLM's sampler; with ``right`` it infills ``max_new_tokens`` between ``prompt`` and
        ``right``, both given as context (revealed first, causal in position order, as the
        training order treats context), which the masked span sees in full. The whole span is
        decoded before ``stop`` is applied to it (MDLM has no left-to-right prefix to check
        earlier)."""
        if not prompt:
            raise DecodeError("the prompt is empty")
        gen = torch.Generator().manual_seed(sampling.seed)
        right = list(right or [])
        P, N, R = len(prompt), max_new_tokens, len(right)
        if P + N + R > self.context:
            raise DecodeError(f"{P} + {N} + {R} tokens exceed the model's context of "
                              f"{self.context}")
        s = _Sample(tokens=list(prompt) + [None] * N + right, region=list(range(P, P + N)),
                    prompt_len=P)
        # the context is causal in position order and never sees the span; the span is one
        # set: it sees all of the context and itself
        T = P + N + R
        own = torch.ones(T, T).tril().bool()
        own[:, P:P + N] = False
        own[P:P + N, :] = True
        start = time.perf_counter()
        while s.masked():
            cache = KVCache(self.model.config.num_layers, 1, self.device)  # nothing is reused
            ids = [self.mask_id if t is None else t for t in s.tokens]
            logits = self._forward(cache, ids, list(range(T)), own, False)
            masked = s.masked()
            picks = self._choose(logits[masked], masked, s, sampling, gen, threshold)
            s.commit([(p, t) for p, t, _ in picks])
            s.trace.append(sorted((p, c) for p, _, c in picks))
            s.steps += 1
        self._check_stop(s, stop)
        return s.result(self.tok, time.perf_counter() - start)


def decoder_for(model, tokenizer, cfg, keep_logits: bool = False) -> SetDecoder:
    """The decoder of the order a checkpoint trained with, as the order says
    (:attr:`setdiff_dist.diffusion.kinds.Order.decoder`): cached AR for ``causal``, blocks on
    the training grid for ``block`` (BD3LM), MDLM's sampler for ``masked``, set decoding for
    the set orders (staggered, autoregressive, ...)."""
    from setdiff_dist.diffusion.kinds import order_of

    decoding, context = order_of(cfg.order).decoder, cfg.data.seq_len
    if decoding in ("block", "mdlm"):
        return BaselineDecoder(model, tokenizer, context=context, trained_as=decoding,
                               block_size=cfg.order.block_size, keep_logits=keep_logits)
    return SetDecoder(model, tokenizer, context=context, keep_logits=keep_logits,
                      mode=decoding)
