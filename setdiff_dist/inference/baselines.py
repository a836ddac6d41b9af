"""The two diffusion baselines, siblings of the set decoder (:mod:`.decoder`), through the same
lean model, KV cache, sampling and acceptance rule (:class:`~.decoding.Decoder`):

- :class:`BlockDecoder` (BD3LM; :meth:`~BlockDecoder.blocks` for a batch,
  :meth:`~BlockDecoder.block` for one prompt): blocks of ``block_size`` on the training grid,
  left to right; inside a block every step re-runs the whole block as the noisy copy (decoded
  tokens as ids, the rest [MASK]) over the cache, bidirectionally. A finished block enters the
  cache as clean tokens inside the next block's first pass (and the prompt inside the first
  block's), as the reference code does: one forward per denoising step, no pass of its own.
  The cache grows once per block, not per step.
- :class:`MDLMDecoder` (MDLM, a batch of one at a time): no cache; every step runs the clean
  prompt and the whole noisy continuation again. With ``block_size`` it decodes the span
  semi-autoregressively, as the paper's MDLM rows on CNN/DailyMail and GSM8K: blocks on the
  grid ``[k B, (k + 1) B)`` left to right, the candidates of a step the masked positions of the
  current block, the stop criteria checked after each finished block.
"""

from __future__ import annotations

import math
import time
from itertools import groupby
from typing import Optional

import torch

from setdiff_dist.diffusion.masks import step_mask

from .decoding import DecodeError, Decoder, Result, Sample, Sampling, StopCriteria
from .kv_cache import KVCache


class BlockDecoder(Decoder):
    """BD3LM's decoder for a checkpoint trained with the block order: its window is its block
    (``order.block_size``), and it cannot condition on a right context."""

    decoding = "block"

    def __init__(self, model, tokenizer, *, context: int, block_size: int = 4,
                 keep_logits: bool = False):
        super().__init__(model, tokenizer, context=context, keep_logits=keep_logits)
        self.block_size = block_size

    @classmethod
    def for_config(cls, model, tokenizer, cfg, keep_logits: bool = False) -> "BlockDecoder":
        """Blocks of the checkpoint's ``order.block_size``."""
        return cls(model, tokenizer, context=cfg.data.seq_len, block_size=cfg.order.block_size,
                   keep_logits=keep_logits)

    def check_infill(self) -> None:
        raise DecodeError("a block-diffusion (BD3LM) checkpoint decodes left to right and "
                          "cannot condition on the right context: infilling needs a "
                          "staggered (SetDLM) or masked (MDLM) checkpoint")

    def generate(self, prompts: list[list[int]], max_new_tokens: int, window: int = 16,
                 threshold: float = math.inf, sampling: Sampling = Sampling(),
                 stop: StopCriteria = StopCriteria()) -> list[Result]:
        """Blocks of the checkpoint's ``block_size``: ``window`` must be that size (the
        order's sets are its blocks)."""
        if window != self.block_size:
            raise DecodeError(f"window {window}: a block-diffusion (BD3LM) checkpoint decodes "
                              f"its own blocks of order.block_size = {self.block_size}; use "
                              f"--window {self.block_size} or leave it unset")
        return self.blocks(prompts, max_new_tokens, self.block_size, threshold, sampling, stop)

    def infill(self, left, right, middle_len, window: int = 16, threshold: float = math.inf,
               sampling: Sampling = Sampling()) -> list[Result]:
        self.check_infill()

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
            samples.append(Sample(tokens=list(p) + [None] * N, region=list(range(P, P + N)),
                                   prompt_len=P))
            # the region's positions grouped by their block k = p // B; and the clean tokens
            # waiting to enter the cache, with their sets: the prompt (a set each: causal),
            # then each finished block (one set)
            plan.append({"blocks": [list(g) for _, g in groupby(range(P, P + N),
                                                                 key=lambda p: p // bs)],
                         "k": 0, "pending": list(range(P)), "sets": list(range(P))})
        B = len(samples)
        gen = torch.Generator().manual_seed(sampling.seed)
        cache = KVCache(self.model.config.num_layers, B, self.device)
        start = time.perf_counter()
        while not all(s.done for s in samples):
            rows = [([], [], []) if s.done else (st["pending"], st["sets"], st["blocks"][st["k"]])
                    for s, st in zip(samples, plan)]
            C = max(len(r[0]) for r in rows)
            Q = max(len(r[2]) for r in rows)
            n = C + Q
            tok_rows, pos_rows, val_rows = [], [], []
            own = torch.zeros(B, n, n, dtype=torch.bool)
            for b, (s, (pend, sets, block)) in enumerate(zip(samples, rows)):
                c, q = len(pend), len(block)
                tok_rows.append([s.tokens[p] for p in pend] + [self.mask_id] * (C - c)
                                + [self.mask_id if s.tokens[p] is None else s.tokens[p]
                                   for p in block] + [self.mask_id] * (Q - q))
                pos_rows.append(pend + [0] * (C - c) + block + [0] * (Q - q))
                val_rows.append([True] * c + [False] * (C - c) + [True] * q + [False] * (Q - q))
                # the set-causal rule over the step: the pending clean tokens see the cache and
                # their sets; the noisy block, one set after them, sees them and itself,
                # bidirectionally; only the clean ones are cached
                rule = step_mask(torch.tensor(sets + [max(sets, default=-1) + 1] * q,
                                              dtype=torch.long),
                                 torch.tensor([False] * c + [True] * q, dtype=torch.bool))
                own[b, :c, :c] = rule[:c, :c]
                own[b, C:C + q, :c] = rule[c:, :c]
                own[b, C:C + q, C:C + q] = rule[c:, c:]
            own |= torch.eye(n, dtype=torch.bool)  # (a padded slot attends itself: no empty row)
            dev = self.device
            tokens = torch.tensor(tok_rows, dtype=torch.long, device=dev)
            positions = torch.tensor(pos_rows, dtype=torch.long, device=dev)
            valid = torch.tensor(val_rows, dtype=torch.bool, device=dev)
            logits = self._cached_pass(cache, tokens, positions, valid, own.to(dev), C,
                                       logits_from=C).float().cpu()  # [B, Q, V]
            for b, (s, st) in enumerate(zip(samples, plan)):
                if s.done:
                    continue
                block = st["blocks"][st["k"]]
                st["pending"], st["sets"] = [], []
                masked = [j for j, p in enumerate(block) if s.tokens[p] is None]
                picks = self._choose(logits[b, masked], [block[j] for j in masked], s, sampling,
                                     gen, threshold)
                s.commit([(p, t) for p, t, _ in picks])
                s.trace.append(sorted((p, c) for p, _, c in picks))
                s.steps += 1
                self._check_stop(s, stop)
                if all(s.tokens[p] is not None for p in block):
                    st["k"] += 1
                    st["pending"], st["sets"] = block, [0] * len(block)
                    s.done = s.done or st["k"] == len(st["blocks"])
        seconds = time.perf_counter() - start
        return [s.result(self.tok, seconds) for s in samples]


class MDLMDecoder(Decoder):
    """MDLM's sampler for a checkpoint trained with the masked order: no window (every masked
    position is a candidate at every step), and infilling sees both contexts.

    ``block_size`` (None: the whole span at once) makes :meth:`generate` decode
    semi-autoregressively in blocks of that many positions (see :meth:`mdlm`)."""

    decoding = "mdlm"

    def __init__(self, model, tokenizer, *, context: int, keep_logits: bool = False,
                 block_size: Optional[int] = None):
        super().__init__(model, tokenizer, context=context, keep_logits=keep_logits)
        self.block_size = block_size

    def use_blocks(self, block_size: int) -> None:
        """:meth:`generate` in blocks of ``block_size`` from now on (the paper's MDLM rows on
        CNN/DailyMail and GSM8K)."""
        if block_size < 1:
            raise DecodeError(f"MDLM blocks must hold at least one position, got {block_size}")
        self.block_size = block_size

    def generate(self, prompts: list[list[int]], max_new_tokens: int, window=None,
                 threshold: float = math.inf, sampling: Sampling = Sampling(),
                 stop: StopCriteria = StopCriteria()) -> list[Result]:
        """Each prompt in turn (``window`` is unused: MDLM has none), in blocks of
        :attr:`block_size` when it is set."""
        return [self.mdlm(p, max_new_tokens, threshold, sampling, stop=stop,
                          block_size=self.block_size) for p in prompts]

    def infill(self, left: list[list[int]], right: list[list[int]], middle_len: list[int],
               window=None, threshold: float = math.inf, sampling: Sampling = Sampling()
               ) -> list[Result]:
        """Fills each span seeing both its contexts (the whole span at once, whatever
        :attr:`block_size` says)."""
        for i, n in enumerate(middle_len):
            if n < 1:
                raise DecodeError(f"infill {i}: the middle must have at least one token")
        return [self.mdlm(lt, n, threshold, sampling, right=rt)
                for lt, rt, n in zip(left, right, middle_len)]

    def mdlm(self, prompt: list[int], max_new_tokens: int, threshold: float = math.inf,
             sampling: Sampling = Sampling(), right: Optional[list[int]] = None,
             stop: StopCriteria = StopCriteria(), block_size: Optional[int] = None) -> Result:
        """MDLM's sampler; with ``right`` it infills ``max_new_tokens`` between ``prompt`` and
        ``right``, both given as context (revealed first, causal in position order, as the
        training order treats context), which the masked span sees in full.

        ``block_size`` None: every masked position of the span is a candidate at every step,
        and the whole span is decoded before ``stop`` is applied to it (MDLM has no
        left-to-right prefix to check earlier). ``block_size`` B: semi-autoregressive, as the
        reference sampler decodes an MDLM checkpoint with a block size below the generation
        length: the span is cut on the grid ``[k B, (k + 1) B)`` of absolute positions (after
        a prompt of ``P`` tokens the first block is ``[P, ceil(P / B) B)``, the rest of the
        block the prompt ends in, as the reference's ``align_inputs_to_blocks``), and the
        blocks are decoded left to right, each to the end before the next starts: a step's
        candidates are the current block's masked positions (the same acceptance rule), and
        ``stop`` is checked after each finished block, so a stop inside a block ends the
        generation there. Every step's input is the one of whole-span decoding (the reference
        runs the whole sequence too): the prompt as clean context, the span one noisy set in
        which the finished blocks show their tokens and the current and later blocks [MASK]
        (a masked-order model trained on such a set, any of its positions revealed)."""
        if not prompt:
            raise DecodeError("the prompt is empty")
        if block_size is not None:
            if isinstance(block_size, bool) or not isinstance(block_size, int) \
                    or block_size < 1:
                raise DecodeError(f"block_size={block_size!r}: MDLM's blocks must be an "
                                  "integer of at least 1 (or None: the whole span at once)")
            if right:
                raise DecodeError("MDLM decodes an infill's span at once: block_size goes with "
                                  "plain continuation, not with a right context")
        gen = torch.Generator().manual_seed(sampling.seed)
        right = list(right or [])
        P, N, R = len(prompt), max_new_tokens, len(right)
        if P + N + R > self.context:
            raise DecodeError(f"{P} + {N} + {R} tokens exceed the model's context of "
                              f"{self.context}")
        s = Sample(tokens=list(prompt) + [None] * N + right, region=list(range(P, P + N)),
                    prompt_len=P)
        # the set-causal rule: the context a set each, in position order (causal), never seeing
        # the span; the span one noisy set after it, seeing all of the context and itself
        T = P + N + R
        span = torch.zeros(T, dtype=torch.bool)
        span[P:P + N] = True
        sets = torch.where(span, T, torch.arange(T))
        dev = self.device
        own = step_mask(sets, span)[None].to(dev)
        positions = torch.arange(T, device=dev)[None]
        valid = torch.ones(1, T, dtype=torch.bool, device=dev)
        # the blocks decoded in turn: the whole span as one, or the grid's
        blocks = ([list(s.region)] if block_size is None else
                  [list(g) for _, g in groupby(s.region, key=lambda p: p // block_size)])
        start = time.perf_counter()
        for block in blocks:
            while masked := [p for p in block if s.tokens[p] is None]:
                cache = KVCache(self.model.config.num_layers, 1, dev)  # nothing is kept
                ids = torch.tensor([[self.mask_id if t is None else t for t in s.tokens]],
                                   device=dev)
                logits = self._cached_pass(cache, ids, positions, valid, own, 0)[0].float().cpu()
                picks = self._choose(logits[masked], masked, s, sampling, gen, threshold)
                s.commit([(p, t) for p, t, _ in picks])
                s.trace.append(sorted((p, c) for p, _, c in picks))
                s.steps += 1
            self._check_stop(s, stop)  # (on the committed prefix: through this block)
            if s.done:
                break
        return s.result(self.tok, time.perf_counter() - start)
