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
autoregressive decoding with a KV cache. :class:`CausalDecoder` decodes a model trained as a
plain causal LM (the output at ``l - 1`` predicts ``l``), the AR baseline, with the same loop.

Generation stops on end-of-text, a stop string or regex, or a run of one repeated token, all
checked on the committed left prefix, or at ``max_new_tokens``; past the model's context the
cache is cropped from the left. Infilling puts the left and the right context in the cache first,
so the middle is conditioned on both.

The BD3LM and MDLM decoders are this one's siblings (:mod:`.baselines`); what they share is
:class:`~setdiff_dist.inference.decoding.Decoder`, and sampling and acceptance are
:mod:`.sampling`'s free functions. This module is also where the decoders' public names are
imported from.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch

from setdiff_dist.diffusion.masks import step_mask

from .baselines import BlockDecoder, MDLMDecoder
from .decoding import (
    DecodeError,
    Decoder,
    Result,
    Rules,
    Sample,
    Sampling,
    StopCriteria,
    check_prompt,
    check_text,
    check_threshold,
    model_device,
)
from .kv_cache import KVCache
from .sampling import accept, pick

__all__ = ["BlockDecoder", "CausalDecoder", "DecodeError", "Decoder", "MDLMDecoder", "Result",
           "Rules", "Sample", "Sampling", "SetDecoder", "StopCriteria", "check_text",
           "check_threshold", "decoder_for", "model_device"]


class SetDecoder(Decoder):
    """KV-cached set decoding (the module's doc)."""

    decoding = "set"
    batchable = True

    def __init__(self, model, tokenizer, *, context: int, keep_logits: bool = False):
        super().__init__(model, tokenizer, context=context, keep_logits=keep_logits)
        self._patterns: dict = {}  # (commits, tokens) -> a step's own-token mask pattern

    def room(self, max_new_tokens: int, window: int) -> int:
        """The generation, and at least the first window of candidates."""
        return max(max_new_tokens, window)

    def speed_points(self, window: int) -> list:
        """Autoregression (window 1) first, as the baseline of the sweep, then the window at
        thresholds inf, 0.9 and 0.5."""
        return [(1, math.inf)] + super().speed_points(window)

    # -- the public calls ------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, window: int = 16,
                 threshold: float = math.inf, sampling: Sampling = Sampling(),
                 stop: StopCriteria = StopCriteria(), order: Optional[list[list[int]]] = None
                 ) -> list[Result]:
        """Continue each prompt (token ids) by up to ``max_new_tokens``."""
        self._check_prompts(prompts, max_new_tokens, window)
        samples = [Sample.continuation(p, max_new_tokens) for p in prompts]
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
            if window > n and order is None:
                raise DecodeError(f"infill {i}: window {window} is larger than the masked span "
                                  f"of {n} tokens; use --window {n} or less")
            if len(lt) + n + len(rt) > self.context:
                raise DecodeError(f"infill {i}: {len(lt)} + {n} + {len(rt)} tokens exceed the "
                                  f"model's context of {self.context}")
            samples.append(Sample(tokens=list(lt) + [None] * n + list(rt),
                                   region=list(range(len(lt), len(lt) + n)), prompt_len=len(lt)))
            prefill.append(list(lt) + list(rt))
        return self._run(samples, prefill, window, threshold, sampling, StopCriteria(), order,
                         infill=True)

    def stream(self, prompt: list[int], max_new_tokens: int, window: int = 16,
               threshold: float = math.inf, sampling: Sampling = Sampling(),
               stop: StopCriteria = StopCriteria()):
        """:meth:`generate` for one prompt, step by step: yields, after each step, the token
        ids that joined the committed prefix contiguous from the prompt (up to a stop; often
        none: set decoding commits positions out of order), and returns the
        :class:`Result` (``StopIteration.value``)."""
        self._check_prompts([prompt], max_new_tokens, window)
        s = Sample.continuation(prompt, max_new_tokens)
        start, taken = time.perf_counter(), 0
        for _ in self._steps([s], [list(prompt)], window, threshold, sampling, stop, None,
                             infill=False):
            new = s.prefix_from(taken)
            taken += len(new)
            yield new
        return s.result(self.tok, time.perf_counter() - start)

    def _check_prompts(self, prompts, max_new_tokens: int, window: int) -> None:
        if max_new_tokens < 1:
            raise DecodeError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if not p:
                raise DecodeError(f"prompt {i} is empty: give some text (unconditional "
                                  "generation starts from the end-of-text token)")
            check_prompt(i, p, window, self.context)

    # -- the loop --------------------------------------------------------------------------------
    def _run(self, samples, prefill, window, threshold, sampling, stop, order, infill):
        start = time.perf_counter()
        for _ in self._steps(samples, prefill, window, threshold, sampling, stop, order, infill):
            pass
        seconds = time.perf_counter() - start
        return [s.result(self.tok, seconds) for s in samples]

    def _steps(self, samples, prefill, window, threshold, sampling, stop, order, infill):
        """Decode ``samples`` to the end, yielding after each step."""
        if window < 1:
            raise DecodeError(f"window must be at least 1, got {window}")
        check_threshold(threshold)
        B = len(samples)
        self._last_logits = {}
        cache = KVCache(self.model.config.num_layers, B, self.device)
        rules = Rules(window, threshold, sampling, stop, self.generator(sampling.seed))
        # prefill: the context as clean tokens, causal in position order (left, then right)
        for s, ids in zip(samples, prefill):
            positions = list(range(s.prompt_len))
            if infill:
                positions += list(range(s.region[-1] + 1, s.region[-1] + 1 + len(ids)
                                        - s.prompt_len))
            s.pending = list(zip(positions, ids))
            s.rules = rules
        while not all(s.done for s in samples):
            self.step(samples, cache, order, infill)
            yield

    def generator(self, seed: int) -> torch.Generator:
        """A sampling stream: where the logits are (one draw per step for all rows that share
        it), or on the host when logits are kept for tests (drawn per sample)."""
        return torch.Generator(device=self.device if not self.keep_logits else "cpu") \
            .manual_seed(seed)

    def _candidates(self, s, window, order, b):
        """Row ``b``'s candidate positions this step (``s`` not done)."""
        if s.finished():
            return []
        if order is not None:
            return [order[b][s.committed]]
        return s.window(window)

    def _queries(self, cands: list) -> list:
        """The positions a step asks the model about as [MASK] queries: the candidates."""
        return cands

    def _logits_from(self, commits: list, C: int):
        """Where a step's logits start: after the ``C`` commit slots (the queries')."""
        return C

    def step(self, samples, cache, order=None, infill=False, isolate=False):
        """One forward for every row of ``samples`` (each with its :class:`Rules`) over
        ``cache`` (one cache row per sample): their pending commits go into the cache, their
        candidates are chosen and accepted, stops are checked. A row's result does not depend
        on the other rows: rows may join (with their prompt as pending commits) and leave
        between steps (:mod:`setdiff_dist.serve.batch`). ``isolate`` (a server's batch): a
        row whose own work fails (its logits not finite, its choice or stop check raising) is
        failed alone (:meth:`Sample.fail`) and the others go on; the forward itself is every
        row's, and its failure raises."""
        B = len(samples)
        commits = [s.pending for s in samples]
        cands = [[] if s.done else self._candidates(s, s.rules.window, order, b)
                 for b, s in enumerate(samples)]
        queries = [self._queries(c) for c in cands]
        C = max(len(c) for c in commits)
        M = max(len(q) for q in queries)
        n = C + M
        if n == 0:
            for s in samples:
                s.done = True
            return
        # the step's inputs, built as host lists and sent in one copy each: per sample its
        # commits (first C slots), then its candidates ([MASK] queries, next M slots)
        tok_rows, pos_rows, val_rows = [], [], []
        for b in range(B):
            c, q = commits[b], queries[b]
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
        # [B, s, V], on the device; the cache keeps the first C (the commits)
        logits = self._cached_pass(cache, tokens, positions, valid, own, C,
                                   logits_from=self._logits_from(commits, C))
        failed = [] if isolate else None
        fast = None if self.keep_logits else self._pick(logits, samples, cands, failed)
        if self.keep_logits:  # chosen per sample, which records them
            logits = logits.float().cpu()
        for b, s in enumerate(samples):
            s.pending = []
            if s.done:
                continue
            s.steps += 1
            if not cands[b]:
                s.done = True
                continue
            if failed and b in failed:
                s.fail("the model's output for this request is not a finite number (NaN or "
                       "inf): its weights or its input are broken")
                continue
            try:
                self._take(s, b, cands[b], fast, logits, infill)
            except Exception as exc:
                if not isolate:
                    raise
                s.pending = []
                s.fail(f"{type(exc).__name__}: {exc}")
        if not infill:  # (an infill fits the context by construction: never crop its left side)
            # (a failed row has nothing pending: it leaves the batch before the next step)
            # past the model's context, forget a row's oldest cache entries: its next step's
            # tokens (pending commits and up to its window of queries) must fit beside them
            need = [len(s.pending) + s.rules.window for s in samples]
            live = cache.valid.sum(1).tolist()
            if any(h + k > self.context for h, k in zip(live, need)):
                cache.crop(torch.tensor([[self.context - k] for k in need],
                                        device=cache.valid.device))

    def _take(self, s, b, cands, fast, logits, infill):
        """Row ``b``'s choice among its candidates ``cands``, committed, and its stops."""
        r = s.rules
        if fast is not None:
            picks = accept(fast[b][0], fast[b][1], cands, r.threshold)
        else:
            picks = self._choose(logits[b, :len(cands)], cands, s, r.sampling, r.gen,
                                 r.threshold)
        s.trace.append(sorted((p, c) for p, _, c in picks))
        picks = [(p, t) for p, t, _ in picks]
        s.commit(picks)
        s.pending = sorted(picks)
        if not infill:
            self._check_stop(s, r.stop)
        if s.finished():
            s.done = True

    def _pick(self, logits, samples, cands, failed=None):
        """Each row's ``(tokens, confidences)`` for its candidate rows of ``logits [B, M, V]``:
        rows that decode alike (sampling settings) choose in one :func:`pick`. Rows that share
        a random stream (one ``generate`` call) draw from it together; rows with streams of
        their own (a server's requests) each draw for their own candidates only, as they would
        alone, in the same batched pick. ``failed``: a list the rows whose logits are not
        finite are appended to (else they raise)."""
        groups: dict = {}
        for b, s in enumerate(samples):
            groups.setdefault(s.rules.pick_key(), []).append(b)
        out = [None] * len(samples)
        for rows in groups.values():
            r = samples[rows[0]].rules
            if len(rows) == len(samples):
                part = logits
            elif len(rows) == 1:
                part = logits[rows[0]:rows[0] + 1, :max(len(cands[rows[0]]), 1)]
            else:
                part = logits[torch.tensor(rows, device=logits.device)]
            seen = ([samples[b].seen() for b in rows]
                    if r.sampling.repetition_penalty != 1.0 else None)
            gens = [samples[b].rules.gen for b in rows]
            shared = all(g is gens[0] for g in gens)
            bad = None if failed is None else []
            lengths = ([samples[b].generated_before(cands[b]) for b in rows]
                       if r.sampling.length_penalty != 1.0 else None)
            toks, conf = pick(part, r.sampling, gens[0] if shared else gens, seen,
                              counts=None if shared else [len(cands[b]) for b in rows],
                              failed=bad, lengths=lengths, eos_id=self.eos_id)
            if bad:
                failed += [rows[j] for j in bad]
            for j, b in enumerate(rows):
                out[b] = (toks[j], conf[j])
        return out

    def _step_pattern(self, C: int, n: int):
        """The step's own-token mask for ``C`` commits among ``n`` tokens, before validity, by
        the set-causal rule (:func:`setdiff_dist.diffusion.masks.step_mask`): the commits are
        clean singleton sets in commit order (causal among themselves), each [MASK] query a
        noisy singleton after them (it sees every commit and itself; the identity also keeps a
        padded row from attending nothing)."""
        key = (C, n)
        if key not in self._patterns:
            i = torch.arange(n)
            pattern = step_mask(i, i >= C)
            self._patterns[key] = (pattern[None].to(self.device),
                                   torch.eye(n, dtype=torch.bool, device=self.device)[None])
        return self._patterns[key]


class CausalDecoder(SetDecoder):
    """A model trained as a plain causal LM (the AR baseline), decoded autoregressively with the
    set decoder's cache and loop: each step's candidate is the next position, predicted from
    the row's last commit (no [MASK] query), one token a step whatever the window says."""

    decoding = "causal"
    causal_lm = True

    def check_infill(self) -> None:
        raise DecodeError("a causal LM cannot condition on the right context: infilling "
                          "needs a set-diffusion model")

    def room(self, max_new_tokens: int, window: int) -> int:
        return max_new_tokens

    def speed_points(self, window: int) -> list:
        return [(1, math.inf)]

    def _candidates(self, s, window, order, b):
        return s.masked(1)

    def _queries(self, cands: list) -> list:
        return []  # (the prediction comes from the last commit)

    def _logits_from(self, commits: list, C: int):
        # one prediction per row, from its last commit: the head runs for that one only
        return torch.tensor([max(len(c) - 1, 0) for c in commits], device=self.device)


def decoder_for(model, tokenizer, cfg, keep_logits: bool = False) -> Decoder:
    """The decoder of the order a checkpoint trained with, as the order says
    (:attr:`setdiff_dist.diffusion.kinds.Order.decoder`): cached AR for ``causal``, blocks on
    the training grid for ``block`` (BD3LM), MDLM's sampler for ``masked``, set decoding for
    the set orders (staggered, autoregressive, ...)."""
    from setdiff_dist.diffusion.kinds import order_of

    decoders = {d.decoding: d for d in (SetDecoder, CausalDecoder, BlockDecoder, MDLMDecoder)}
    return decoders[order_of(cfg.order).decoder].for_config(model, tokenizer, cfg, keep_logits)
