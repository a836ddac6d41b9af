"""The Python API: a trained model in a notebook or a script.

    import setdiff_dist

    model = setdiff_dist.load("runs/tiny-cpu")           # a run, a checkpoint or an export
    out = model.generate("Shall I compare thee", max_new_tokens=32, greedy=True)
    print(out.text, out.tokens_per_step)
    model.loglikelihood([("Shall I compare thee", " to a summer's day")])
    model.score(["Shall I compare thee to a summer's day?"])

:func:`load` builds the decode-time model (:mod:`setdiff_dist.inference.lean`) at any
tensor-parallel size (under torchrun with that many ranks); at TP=1 it imports neither
megatron-core nor DeepSpeed. :meth:`Model.generate` and :meth:`Model.infill` decode as
``setdiff-generate`` does (the command runs through this class), with the same settings: the
checkpoint's ``decode`` section, then a ``preset``, then each argument given;
:meth:`Model.loglikelihood` and :meth:`Model.score` score as ``setdiff-eval`` and the
lm-evaluation-harness adapter do (:class:`setdiff_dist.eval.likelihood.Scorer`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Union

if TYPE_CHECKING:
    import torch

__all__ = ["Generation", "GenerationStream", "Model", "load"]


@dataclasses.dataclass
class Generation:
    """One decoded continuation (or infill)."""

    text: str
    tokens: list            # the generated token ids
    steps: int              # forward passes (the prefill's included)
    seconds: float          # wall time of the whole batch it decoded in
    trace: list             # per forward step: the absolute positions committed in it
    trace_confidence: list  # and the confidence of each
    seed: Optional[int] = None  # the sampling seed it ran with (give it again to repeat it)
    # "stop": it ended at an end-of-text, a stop string or a repeated run; "length": it
    # reached max_new_tokens (OpenAI's and transformers' meaning)
    finish_reason: str = "length"
    # with ``generate(logprobs=k)``: per generated token, ``(log p, [(token id, log p)] of the k
    # most likely there)`` given the prompt and the tokens before it (setdiff-serve's scores)
    logprobs: Optional[list] = None

    @property
    def tokens_per_step(self) -> float:
        return len(self.tokens) / max(self.steps, 1)


class GenerationStream:
    """What :meth:`Model.generate` returns with ``stream=True``: iterate it for the text as it
    is committed, piece by piece (each a ``str``; they add up to the final text exactly, as
    transformers' ``TextIteratorStreamer`` hands out text), then read :attr:`generation` (the
    whole :class:`Generation`, with ``finish_reason``). Set decoding commits positions out of
    order, so a piece is the part of the prefix contiguous from the prompt that its steps
    completed (a step may add none; the stops are checked on that prefix as it grows, so no
    piece is taken back); an incomplete character waits for its next token. The first step
    has run when ``generate`` returns (a bad prompt or setting raises there)."""

    def __init__(self, steps, tokenizer, seed: int, score=None):
        from setdiff_dist.inference.text import TextStream

        self.seed, self._score = seed, score
        self.generation: Optional[Generation] = None
        self._steps, self._text = steps, TextStream(tokenizer)
        self._first = next(self._steps, None)  # (a finished first step comes back below)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        while self.generation is None:
            if self._first is not None:
                ids, self._first = self._first, None
            else:
                try:
                    ids = next(self._steps)
                except StopIteration as end:
                    r = end.value
                    self.generation = _generation(r, self.seed)
                    if self._score is not None:
                        self._score([self.generation])
                    piece = self._text.finish(list(r.tokens))
                    if piece:
                        return piece
                    break
            piece = self._text.push(ids)
            if piece:
                return piece
        raise StopIteration


class Model:
    """A loaded model: its ``config``, ``tokenizer``, the decode-time ``module`` and how it
    decodes (``decoding``: "set", "causal", "block" or "mdlm")."""

    def __init__(self, module, config, tokenizer, path: str):
        from setdiff_dist.inference.decoder import decoder_for

        self.module, self.config, self.tokenizer, self.path = module, config, tokenizer, path
        self._decoder = decoder_for(module, tokenizer, config)
        self._scorer = None

    @property
    def decoding(self) -> str:
        return self._decoder.decoding

    @property
    def decoder(self):
        """The decoder (:func:`setdiff_dist.inference.decoder.decoder_for`) the calls use."""
        return self._decoder

    @property
    def context(self) -> int:
        """The model's context in tokens (the prompt and what is generated share it)."""
        return self.config.data.seq_len

    def __repr__(self) -> str:
        m = self.config.model
        return (f"Model({self.path!r}: {m.num_layers} layers x {m.hidden_size}, "
                f"{self.config.order.kind} order, {self.decoding} decoding, context "
                f"{self.context})")

    def settings(self, preset: Optional[str] = None, **flags):
        """The decoding settings a call with these arguments uses (the checkpoint's ``decode``
        section, then ``preset``, then each argument that is not None): a
        :class:`~setdiff_dist.inference.settings.DecodeSettings`."""
        from setdiff_dist.inference.settings import decode_settings

        return decode_settings(self.config, preset, **flags)

    def generate(self, prompts: Union[str, Sequence[Optional[str]], None] = None, *,
                 max_new_tokens: Optional[int] = None, window: Optional[int] = None,
                 threshold: Optional[float] = None, greedy: Optional[bool] = None,
                 temperature: Optional[float] = None, top_p: Optional[float] = None,
                 top_k: Optional[int] = None, repetition_penalty: Optional[float] = None,
                 max_repeat_run: Optional[int] = None, stop: Iterable[str] = (),
                 length_penalty: Optional[float] = None,
                 length_penalty_start: Optional[int] = None,
                 eos_stop: bool = True, seed: Optional[int] = None,
                 preset: Optional[str] = None, n: int = 1, stream: bool = False,
                 logprobs: Optional[int] = None
                 ) -> Union[Generation, list[Generation], GenerationStream]:
        """Continue each prompt (one string: one :class:`Generation`; a list: a list, decoded
        as one batch of ragged prompts; None or "": unconditional, from the end-of-text token).
        ``stop``: strings (``re:`` for a regex) added to the checkpoint's; ``eos_stop``: stop
        at end-of-text; ``seed``: the sampling seed (None: a fresh one each call, returned as
        ``Generation.seed``; give it again to repeat a sampled call); ``top_k``: sample from
        the k most likely tokens (0: all); ``length_penalty`` F and ``length_penalty_start``
        N: end-of-text's logit ``e`` raised by ``|e| (F^(n - N) - 1)`` where ``n > N``
        tokens are generated before a position (transformers' exponential decay length
        penalty); ``n``: completions per prompt, the k-th sampled with
        ``seed + k`` (as setdiff-serve's ``n``), a list prompt-major (prompt i's k-th at
        ``i * n + k``), also for one prompt when ``n`` > 1. Each :class:`Generation` says why
        it ended (``finish_reason``: "stop" or "length"). ``stream=True`` (one prompt, ``n``
        1): a :class:`GenerationStream` of the text as it is committed, step by step (block
        and MDLM checkpoints decode the span before any of it is final: one piece at the end).
        ``logprobs`` k (0-20): each Generation's ``logprobs``, the log-probability of each
        generated token and the k most likely at its place, scored after decoding with the
        prompt and the tokens before it (the causal LM's, or the set-diffusion model's under
        the autoregressive order: what setdiff-serve's ``logprobs`` return); under tensor
        parallelism every rank calls it, as it calls ``generate``.

        The horizon matters to set decoding: the window of candidates is clipped at the end of
        the ``max_new_tokens`` span, so near its end fewer positions compete, and a greedy
        continuation of 4 tokens need not be the first 4 of one of 16 (it is with ``window=1``,
        and for causal checkpoints). Compare outputs at the same ``max_new_tokens``."""
        from setdiff_dist.inference.decoder import check_text

        single = isinstance(prompts, str) or prompts is None
        texts = [prompts] if single else list(prompts)
        for what, items in (("prompt", [t for t in texts if t is not None]),
                            ("stop", list(stop))):
            for text in items:
                check_text(what, text)
        d = self.settings(preset, window=window, threshold=threshold, greedy=greedy,
                          temperature=temperature, top_p=top_p, top_k=top_k,
                          repetition_penalty=repetition_penalty,
                          max_new_tokens=max_new_tokens, max_repeat_run=max_repeat_run,
                          stop=list(stop), length_penalty=length_penalty,
                          length_penalty_start=length_penalty_start)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            from setdiff_dist.inference.decoder import DecodeError

            raise DecodeError(f"n={n!r}: completions per prompt, an integer of 1 or more")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= 20):
            from setdiff_dist.inference.decoder import DecodeError

            raise DecodeError(f"logprobs={logprobs!r}: the number of most likely tokens to "
                              "return at each place, an integer from 0 to 20 (None: none)")
        tok = self.tokenizer
        # None or "": unconditional, from end-of-text (as setdiff-serve takes an empty prompt)
        ids = [tok.encode(t) if t else [tok.eos_id] for t in texts]
        seed = _seed(seed)

        def score(generations: list, prompts: list) -> None:  # (in place)
            from setdiff_dist.objective import token_logprobs

            for g, p in zip(generations, prompts):
                per = token_logprobs(self.module, self._decoder.causal_lm, p + g.tokens,
                                     max(logprobs, 1), tok.vocab_size)
                g.logprobs = [(lp, top[:logprobs]) for lp, top in per[len(p) - 1:]]

        if stream:
            if not single or n != 1:
                from setdiff_dist.inference.decoder import DecodeError

                raise DecodeError("stream=True decodes one prompt (a string, or None) with "
                                  "n=1; for a batch call generate without stream")
            steps = self._decoder.stream(ids[0], d.max_new_tokens, window=d.window,
                                         threshold=d.threshold, sampling=d.sampling(seed),
                                         stop=d.stopping(tok.eos_id if eos_stop else None))
            return GenerationStream(steps, tok, seed, None if logprobs is None else
                                    lambda gens: score(gens, ids))
        seeds = [(seed + k) % 2 ** 63 for k in range(n)]  # (setdiff-serve's n: the same)
        runs = [[_generation(r, s) for r in self._decoder.generate(
            ids, d.max_new_tokens, window=d.window, threshold=d.threshold,
            sampling=d.sampling(s), stop=d.stopping(tok.eos_id if eos_stop else None))]
            for s in seeds]
        out = [runs[k][i] for i in range(len(ids)) for k in range(n)]
        if logprobs is not None:
            score(out, [p for p in ids for _ in range(n)])
        return out[0] if single and n == 1 else out

    def infill(self, left: Union[str, Sequence[str]], right: Union[str, Sequence[str]],
               length: Union[int, Sequence[int]], *, window: Optional[int] = None,
               threshold: Optional[float] = None, greedy: Optional[bool] = None,
               temperature: Optional[float] = None, top_p: Optional[float] = None,
               top_k: Optional[int] = None, repetition_penalty: Optional[float] = None,
               seed: Optional[int] = None, preset: Optional[str] = None
               ) -> Union[Generation, list[Generation]]:
        """Fill ``length`` tokens between ``left`` and ``right`` (strings, or lists of them
        with a list of lengths); a set-diffusion model sees both sides from the start."""
        single = isinstance(left, str)
        lefts = [left] if single else list(left)
        rights = [right] if isinstance(right, str) else list(right)
        lengths = [length] * len(lefts) if isinstance(length, int) else list(length)
        d = self.settings(preset, window=window, threshold=threshold, greedy=greedy,
                          temperature=temperature, top_p=top_p, top_k=top_k,
                          repetition_penalty=repetition_penalty)
        tok = self.tokenizer
        results = self._decoder.infill(
            [tok.encode(t) for t in lefts], [tok.encode(t) for t in rights], lengths,
            window=min(d.window or min(lengths), min(lengths)), threshold=d.threshold,
            sampling=d.sampling(seed := _seed(seed)))
        out = [_generation(r, seed) for r in results]
        return out[0] if single else out

    def loglikelihood(self, pairs: Iterable[tuple[str, str]]) -> list[tuple[float, bool]]:
        """``(log p(continuation | context) in nats, whether greedy decoding produces the
        continuation)`` for each ``(context, continuation)`` pair, as lm-evaluation-harness
        asks it (exact for causal LMs; for set-diffusion models the autoregressive-order
        log-likelihood: :attr:`exact` says which)."""
        return self.scorer.loglikelihood(pairs)

    def score(self, texts: Union[str, Iterable[str]]) -> Union[float, list[float]]:
        """The log-likelihood of each whole text (nats, after the end-of-text token, in windows
        of the context), as lm-evaluation-harness's ``loglikelihood_rolling``."""
        if isinstance(texts, str):
            return self.scorer.rolling([texts])[0]
        return self.scorer.rolling(texts)

    @property
    def exact(self) -> bool:
        """Whether :meth:`loglikelihood` and :meth:`score` are exact log-likelihoods."""
        return self.scorer.exact

    @property
    def scorer(self):
        if self._scorer is None:
            from setdiff_dist.eval.likelihood import Scorer

            self._scorer = Scorer(self.module, self.config, self.tokenizer)
        return self._scorer


def _seed(seed: Optional[int]) -> int:
    """The call's sampling seed: the one given, else a fresh one (an unseeded call samples
    anew, as transformers' generate does; it was seed 0, so that four unseeded calls gave one
    text), returned in each :class:`Generation`."""
    from setdiff_dist.inference.sampling import fresh_seed

    return fresh_seed() if seed is None else seed


def _generation(r, seed: int) -> Generation:
    return Generation(text=r.text, tokens=list(r.tokens), steps=r.steps, seconds=r.seconds,
                      trace=r.trace or [], trace_confidence=r.trace_confidence or [], seed=seed,
                      finish_reason=r.finish_reason)


def load(path: Union[str, os.PathLike], tensor_parallel: int = 1,
         dtype: Union[str, torch.dtype] = "auto", device: Optional[str] = None,
         raw_weights: bool = False) -> Model:
    """The model of a training run directory, a checkpoint or an export, for inference.

    Args:
        path: a training run directory (its latest checkpoint), a checkpoint directory
            (``checkpoints/step_N``) or a ``setdiff-convert`` export, as a string or a path.
        tensor_parallel: the tensor-parallel size N, an integer of 1 or more; with N > 1, call
            ``load`` on each of N ranks (``torchrun --nproc-per-node N``).
        dtype: "auto" (bfloat16 on a GPU, float32 on CPUs), "float32" (or "fp32"),
            "bfloat16" (or "bf16"), or ``torch.float32`` / ``torch.bfloat16``; float16 is not
            supported.
        device: where the model runs ("cpu", "cuda", "cuda:1", ...); default: a GPU when there
            is one, else the CPU.
        raw_weights: read the raw weights rather than their exponential moving average, which
            is read by default when the run kept one (``train.ema_decay``).

    Returns a :class:`Model`. A bad argument or a missing or damaged checkpoint raises
    :class:`setdiff_dist.checkpoint.weights.LoadError` (a
    :class:`~setdiff_dist.errors.SetdiffError`), whose message names the argument as it was
    given (``load(path='runs/x')``; from a command, its flag: ``--checkpoint runs/x``) and says
    what to give instead.
    """
    from setdiff_dist.inference.weights import (
        build_inference_model,
        check_model_path,
        model_dtype,
        tensor_parallel_size,
    )

    names = _argument_names()
    tensor = tensor_parallel_size(tensor_parallel, names["tensor_parallel"])
    torch_dtype = model_dtype(dtype, names["dtype"])
    path = check_model_path(path, names["path"])
    module, cfg, tok = build_inference_model(path, tensor=tensor, device=device,
                                             dtype=torch_dtype, raw=bool(raw_weights),
                                             what=names["path"])
    return Model(module, cfg, tok, path)


def _argument_names() -> dict:
    """How :func:`load`'s errors name its arguments: as a command's flags when a command (whose
    ``--checkpoint`` and ``--tensor-parallel`` flags these are) is running, else as Python
    arguments."""
    from setdiff_dist.cli import running

    if running() is not None:
        return {"path": "--checkpoint", "tensor_parallel": "--tensor-parallel",
                "dtype": "--dtype"}
    return {k: f"load({k})" for k in ("path", "tensor_parallel", "dtype")}
