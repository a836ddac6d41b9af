"""The OpenAI-compatible HTTP API (FastAPI) in front of the
:class:`~setdiff_dist.serve.scheduler.Scheduler` (in the decoding process):

- ``POST /v1/completions``: OpenAI's fields (``model``, ``prompt``: a string, a list of them,
  token ids or a list of those; ``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``,
  vLLM's ``top_k``, ``stream``, ``stream_options``, ``n``, ``user``, ``echo`` and
  ``logprobs``: each token's log-probability and the k most likely at its place, scored as
  setdiff-eval scores them, between decoding steps, at any tensor-parallel size; streamed too)
  and set decoding's (``window``, ``threshold``, ``repetition_penalty``, ``max_repeat_run``,
  ``ignore_eos``, ``return_token_ids``). What a request leaves out comes from the checkpoint's
  ``decode`` section, as in ``setdiff-generate``. The answer is OpenAI's completion object;
  each choice and the ``usage`` also carry ``forward_steps`` and ``tokens_per_step`` (and the
  choice ``largest_batch``: the most requests it decoded beside, itself included).
- ``stream: true``: server-sent events, one chunk per decoding step that makes new text. The
  text is the part of the completion committed and contiguous from the prompt, so the chunks
  add up to exactly the final text although set decoding commits positions out of order.
- ``POST /v1/chat/completions``: OpenAI's chat, the messages rendered by the chat template
  (``--chat-template``, or the checkpoint's), then decoded as a completion (:mod:`.chat`).
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus); vLLM's ``POST
  /tokenize`` (``{"prompt"}`` -> ``{"tokens", "count", "max_model_len"}``), ``POST
  /detokenize`` (``{"tokens"}`` -> ``{"prompt"}``) and ``GET /tokenizer_info``, under the
  model's own tokenizer (lm-eval's remote tokenizer reads these three).

Errors have OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, on every route:
400 for bad JSON, an unknown field, a value out of range (``max_tokens`` above the server's cap,
the model's context by default; a temperature or penalty the float32 sampler cannot divide by),
a prompt longer than the context or more prompts than the queue holds; 401 without the API key
(``--api-key``); 404 for another model's name or an unknown route; 413 for a body over
``--max-body-bytes``; 429 (with ``Retry-After``) when the queue is full; 500 for a request that
failed alone (the others in its batch go on). The engine's answers are awaited, never waited
for in the event loop, and prompts are tokenized in a worker thread.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import time
import uuid
from dataclasses import replace
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from starlette.exceptions import HTTPException

from setdiff_dist.inference.decoding import DecodeError, check_text
from setdiff_dist.inference.sampling import fresh_seed
from setdiff_dist.serve.chat import (
    ChatCompletionRequest,
    CompletionFields,
    chat_body,
    render,
)

from .batch import Spec, check_spec
from .guard import error_body
from .messages import Failed, Finished, Text
from .scheduler import QueueFull

DISCONNECT_POLL_S = 0.2  # how often a waiting (non-streamed) request checks for its client


# OpenAI's completion fields this server takes only at their no-op values: field -> (the values,
# what to use instead)
_NO_OPS = {"presence_penalty": ((None, 0), "repetition_penalty is this server's"),
           "frequency_penalty": ((None, 0), "repetition_penalty is this server's"),
           "logit_bias": ((None, {}), ""),
           "best_of": ((None, 1), "send the request again"),
           "suffix": ((None, ""), "setdiff-generate --infill-right infills")}


class CompletionRequest(CompletionFields):
    """The body of ``POST /v1/completions``. OpenAI's fields this server does not implement
    are taken at their no-op values (what client libraries send: ``presence_penalty=0``,
    ``logit_bias={}``, ``best_of=1``) and refused otherwise, naming them;
    fields OpenAI does not define are ignored with a warning in the server's log, as vLLM does
    (``setdiff-serve --strict``: refused, :class:`StrictCompletionRequest`)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    # OpenAI's, at their no-op values only (_only_no_ops; and the shared fields' penalties)
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    # the prompt back before the completion (with logprobs: the prompt's token log-probs too),
    # and the log-probability of each token with the ``logprobs`` most likely at its place
    # (scored as setdiff-eval scores them: the causal LM's, or the set-diffusion model's under
    # the autoregressive order); streamed: each chunk's tokens
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _only_no_ops(self):
        bad = [f"{k}={getattr(self, k)!r} is not supported by this server (only "
               f"{' or '.join(repr(v) for v in allowed)}{'; ' + instead if instead else ''})"
               for k, (allowed, instead) in _NO_OPS.items() if getattr(self, k) not in allowed]
        if bad:
            raise ValueError("; ".join(bad))
        return self

    @model_validator(mode="after")
    def _something_to_generate(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing: it goes with echo=true (the "
                             "prompt back, scored with logprobs); ask for 1 or more tokens")
        return self

    @field_validator("threshold", mode="before")
    @classmethod
    def _threshold_is_a_number(cls, v):
        if isinstance(v, float) and math.isnan(v):
            raise ValueError("threshold is NaN: give a confidence in [0, 1], or inf for one "
                             "token per step")
        return v


def eos_text(tok) -> str:
    """The end-of-text token's text (an HF tokenizer's own, else ``<|endoftext|>``)."""
    from setdiff_dist.data.tokenizers import EOT

    return getattr(tok, "eos_token", None) or EOT


def encode_with_eos(tok, text: str) -> list:
    """``text``'s ids, its end-of-text token's text as that token's id (as a Hugging Face
    tokenizer reads a special token in text)."""
    ids = []
    for k, part in enumerate(text.split(eos_text(tok))):
        if k:
            ids.append(tok.eos_id)
        if part:
            ids += tok.encode(part)
    return ids


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a text's token ids under the model's tokenizer."""

    model: Optional[str] = None
    prompt: str


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): the text of token ids."""

    model: Optional[str] = None
    tokens: list[int]


class StrictCompletionRequest(CompletionRequest):
    """``setdiff-serve --strict``: a field OpenAI does not define is an error, not ignored."""

    model_config = ConfigDict(extra="forbid")


class StrictChatCompletionRequest(ChatCompletionRequest):
    """``setdiff-serve --strict`` for chat requests."""

    model_config = ConfigDict(extra="forbid")


class Limits:
    """What the server allows a request: at most ``max_tokens`` new tokens (default: the
    model's context) and ``max_prompts`` prompts (the queue's size: more could never be
    queued)."""

    def __init__(self, max_tokens: int, max_prompts: int):
        self.max_tokens, self.max_prompts = max_tokens, max_prompts


class Service:
    """What the routes need: the model (a :class:`~setdiff_dist.serve.http_process.ModelView`),
    its name, the scheduler (the decoding process's
    :class:`~setdiff_dist.serve.pipe.EngineClient`, which answers as the
    :class:`~setdiff_dist.serve.scheduler.Scheduler` would, its events detokenized) and the
    metrics."""

    def __init__(self, model, name: str, scheduler, metrics, limits: Optional[Limits] = None,
                 chat_template: Optional[str] = None):
        self.model, self.name, self.scheduler, self.metrics = model, name, scheduler, metrics
        self.limits = limits or Limits(model.context, 1 << 30)
        self.chat_template = chat_template  # (None: /v1/chat/completions says how to give one)
        self.created = int(time.time())

    def count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.count(outcome)

    # -- a request's specs ------------------------------------------------------------------------
    def specs(self, req: CompletionRequest) -> list[Spec]:
        """``n`` :class:`Spec` per prompt (raises :class:`DecodeError`: a 400)."""
        tok = self.model.tokenizer
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts:
            raise DecodeError("prompt is an empty list: give a string or token ids")
        limits = self.limits
        rows = len(prompts) * req.n
        if rows > limits.max_prompts:
            raise DecodeError(f"the request asks for {rows} completions ({len(prompts)} "
                              f"prompt(s) x n={req.n}); this server queues at most "
                              f"{limits.max_prompts} (--max-queue): ask for at most "
                              f"{limits.max_prompts} per request")
        greedy = None if req.temperature is None else req.temperature == 0
        d = self.model.settings(None, window=req.window, threshold=req.threshold,
                                greedy=greedy, temperature=req.temperature or None,
                                top_p=req.top_p, top_k=None if req.top_k is None
                                else max(req.top_k, 0),
                                repetition_penalty=req.repetition_penalty,
                                max_new_tokens=req.max_tokens,
                                max_repeat_run=req.max_repeat_run)
        if req.max_tokens is None:  # (the checkpoint's length, within what the server allows)
            d = d.replace(max_new_tokens=min(d.max_new_tokens, limits.max_tokens))
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise DecodeError("an empty stop string would stop at once; give some text")
        for j, s in enumerate(stop):
            check_text(f"stop string {j}", s)
        # an unseeded request samples anew each time (it was seed 0: four unseeded requests gave
        # one text); the seed goes back in the response, to repeat it
        seed = req.seed if req.seed is not None else fresh_seed()
        out = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                check_text(f"prompt {i}", prompt)
                ids = tok.encode(prompt) if prompt else [tok.eos_id]  # "": unconditional
            else:
                ids = list(prompt) or [tok.eos_id]
                bad = [t for t in ids if not 0 <= t < self.model.config.model.vocab_size]
                if bad:
                    raise DecodeError(f"prompt {i} has token ids outside the vocabulary of "
                                      f"{self.model.config.model.vocab_size}: {bad[:5]}")
            # n completions of a prompt: independent rows of the batch, the k-th sampled with
            # seed + k (so that a request with seed + k alone repeats it); choice i x n + k
            for k in range(req.n):
                spec = Spec(id=f"{uuid.uuid4().hex}-{i}-{k}", prompt=tuple(ids),
                            max_tokens=d.max_new_tokens, window=d.window,
                            threshold=d.threshold, greedy=d.greedy,
                            temperature=d.temperature, top_p=d.top_p,
                            top_k=d.top_k, repetition_penalty=d.repetition_penalty,
                            seed=(seed + k) % 2 ** 63, stop=tuple(stop),
                            patterns=tuple(d.stop), eos_stop=not req.ignore_eos,
                            max_repeat_run=d.max_repeat_run,
                            length_penalty=d.length_penalty,
                            length_penalty_start=d.length_penalty_start)
                check_spec(spec, self.model.context, i, max_tokens=limits.max_tokens)
                out.append(spec)
        return out

    # -- submitting and waiting -------------------------------------------------------------------
    async def submit(self, specs: list[Spec], streamed: bool) -> asyncio.Queue:
        """Queue every prompt of one request, or none (429); their events come to one queue
        as ``(index, event)`` (:class:`~.messages.Text` after each step only when
        ``streamed``, then :class:`Finished` or :class:`Failed`)."""
        events = asyncio.Queue()
        done = []
        try:
            for i, spec in enumerate(specs):  # (listeners are called in the event loop)
                await self.scheduler.submit(spec, lambda ev, i=i: events.put_nowait((i, ev)),
                                            streamed)
                done.append(spec)
        except BaseException:  # (QueueFull, or the client gone while it waited)
            for spec in specs[:len(done) + 1]:
                self.scheduler.cancel(spec.id)
            raise
        return events

    def cancel(self, specs, finished) -> None:
        for i, spec in enumerate(specs):
            if i not in finished:
                self.scheduler.cancel(spec.id)

    def completion(self, rid: str, choices: list, usage=None, seed=None) -> dict:
        out = {"id": rid, "object": "text_completion", "created": int(time.time()),
               "model": self.name, "choices": choices}
        if seed is not None:  # (the sampling seed it ran with: send it back to repeat it)
            out["seed"] = seed
        if usage is not None:
            out["usage"] = usage
        return out

    @staticmethod
    def choice(index: int, out: Finished, token_ids: bool) -> dict:
        c = {"index": index, "text": out.full_text, "logprobs": None,
             "finish_reason": out.finish_reason, "forward_steps": out.steps,
             "tokens_per_step": out.tokens_per_step, "largest_batch": out.largest_batch}
        if token_ids:
            c["token_ids"] = out.tokens
        return c

    async def scored(self, req: CompletionRequest, specs: list, outs: list,
                     choices: list) -> None:
        """``echo`` and ``logprobs`` into ``choices`` (in place): each prompt and its completion
        scored in one pass between decoding steps (:meth:`Scheduler.score`, on every
        tensor-parallel rank); OpenAI's ``logprobs`` object (``tokens``, ``token_logprobs``,
        ``top_logprobs``, ``text_offset``) over the prompt's tokens and the completion's
        (``echo``) or the completion's; a completion that ended at end-of-text has that token
        last, as vLLM returns it."""
        tok = self.model.tokenizer
        seqs = [(list(spec.prompt), scored_tokens(spec, out, tok)) for spec, out in
                zip(specs, outs)]
        k = max(req.logprobs or 0, 1)
        scores = await self.scheduler.score([p + g for p, g in seqs], k)
        for c, (prompt, gen), per in zip(choices, seqs, scores):
            if req.echo:
                c["text"] = tok.decode(prompt) + c["text"]
            if req.logprobs is None:
                continue
            c["logprobs"], _ = logprobs_object(tok, prompt, gen, per, k, req.echo)

    @staticmethod
    def usage(outs: list) -> dict:
        prompt = sum(o.prompt_tokens for o in outs)
        completion = sum(len(o.tokens) for o in outs)
        steps = sum(o.steps for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion, "forward_steps": steps,
                "tokens_per_step": completion / max(steps, 1)}


def scored_tokens(spec, out: Finished, tok) -> list:
    """The completion's tokens as ``logprobs`` scores them: with end-of-text last when it
    stopped there (the token it chose), as vLLM returns it."""
    gen = list(out.tokens)
    if out.finish_reason == "stop" and spec.eos_stop and not spec.stop and not spec.patterns:
        gen.append(tok.eos_id)
    return gen


def logprobs_object(tok, prompt: list, new: list, per: list, k: int, echo: bool,
                    at: Optional[int] = None) -> tuple[dict, int]:
    """OpenAI's ``logprobs`` object for the tokens ``new`` at the end of a sequence that starts
    with ``prompt`` (``prompt`` first too with ``echo``), ``per`` the sequence's scores
    (:meth:`Scheduler.score`: ``(log p, top [(id, log p)])`` of each token after the first); the
    first token's text starts at character ``at`` (None: where it starts in the sequence's text,
    or 0 with ``echo``). Returns it and where the text after it starts."""
    ids = (prompt if echo else []) + new
    if at is None:
        at = 0 if echo else sum(len(tok.decode([t])) for t in prompt)
    # (the sequence's first token has no log-probability: nothing before it)
    rows = ([(None, None)] + per)[len(per) + 1 - len(ids):]
    pieces = [tok.decode([t]) for t in ids]
    offsets = []
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {"tokens": pieces, "token_logprobs": [lp for lp, _ in rows],
            "top_logprobs": [None if top is None else {tok.decode([t]): v for t, v in top[:k]}
                             for _, top in rows],
            "text_offset": offsets}, at


def create_app(service: Service, lifespan=None, strict: bool = False):
    """The FastAPI application of ``setdiff-serve`` (``lifespan``: FastAPI's, which connects
    the scheduler's events to the event loop; ``strict``: refuse fields OpenAI does not
    define rather than ignore them)."""
    app = FastAPI(title="setdiff-serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = service.metrics

    def bad_request(message: str, param=None, code=None, status=400):
        service.count("bad_request")
        return JSONResponse(error_body(message, param=param, code=code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:] if x != "body") or None
        kind = first.get("type", "")
        if kind == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        elif kind == "extra_forbidden":
            message = (f"unknown field {where!r}: this server takes OpenAI's completion fields "
                       "and window, threshold, repetition_penalty, max_repeat_run, ignore_eos, "
                       "return_token_ids")
        else:
            message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ())[1:])}: "
                                f"{e.get('msg')}" for e in errors) or "invalid request"
        return bad_request(message, param=where, code=kind or None)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):  # (an unknown route, a body that cannot be parsed...)
        if exc.status_code == 400:
            service.count("bad_request")
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the body cannot be parsed as JSON (too deeply nested, or not JSON)"
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(detail, type_=kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def crashed(request, exc):  # (a bug of ours: the traceback goes to the log)
        service.count("failed")
        return JSONResponse(error_body(f"the server failed: {type(exc).__name__}: {exc}",
                                       type_="server_error"), status_code=500)

    @app.get("/health")
    async def health():
        try:
            s = await service.scheduler.status()
        except RuntimeError as exc:  # (the decoding process does not answer)
            return JSONResponse({"status": "error", "error": str(exc)}, status_code=503)
        if not s.alive:
            return JSONResponse({"status": "error", "error": s.fatal or
                                 "the decoding thread stopped"}, status_code=503)
        return {"status": "ok", "running": s.running, "waiting": s.waiting}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = await metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": service.name, "object": "model", "created": service.created,
            "owned_by": "setdiff-dist", "max_model_len": service.model.context,
            "decoding": service.model.decoding}]}

    def unknown_model(name):
        if name is not None and name != service.name:
            return bad_request(f"the model {name!r} does not exist: this server serves "
                               f"{service.name!r} (GET /v1/models)", param="model",
                               code="model_not_found", status=404)
        return None

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        if (wrong := unknown_model(req.model)) is not None:
            return wrong
        try:
            check_text("prompt", req.prompt)
        except DecodeError as exc:
            return bad_request(str(exc), param="prompt")
        ids = await asyncio.to_thread(encode_with_eos, service.model.tokenizer, req.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": service.model.context}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        # (vLLM's: what lm-eval's remote tokenizer reads, with /tokenize and /detokenize, so
        # that lm_eval --model local-completions needs no copy of the tokenizer)
        tok = service.model.tokenizer
        return {"eos_token": eos_text(tok), "bos_token": None, "pad_token": None,
                "chat_template": service.chat_template,
                "model_max_length": service.model.context,
                "tokenizer_class": type(tok).__name__, "vocab_size": tok.vocab_size}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        if (wrong := unknown_model(req.model)) is not None:
            return wrong
        vocab = service.model.config.model.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            return bad_request(f"token ids outside the vocabulary of {vocab}: {bad[:5]}",
                               param="tokens")
        return {"prompt": service.model.tokenizer.decode(req.tokens)}

    async def chat_completions(chat: ChatCompletionRequest, request: Request):
        if chat.model_extra:
            logging.getLogger("setdiff.serve").warning(
                "fields this server does not take were ignored: %s",
                ", ".join(sorted(chat.model_extra)))
        if (wrong := unknown_model(chat.model)) is not None:
            return wrong
        try:
            prompt = render(service.chat_template, chat.messages, service.model.tokenizer)
            req = CompletionRequest(**chat.completion_fields(prompt))
        except DecodeError as exc:
            return bad_request(str(exc), param="messages")
        except ValidationError as exc:
            return bad_request("; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: "
                                         f"{e.get('msg')}" for e in exc.errors()))
        return await completions(req, request, chat=True)

    async def completions(req: CompletionRequest, request: Request, chat: bool = False):
        if req.model_extra:  # (not strict: ignored, as vLLM does, and said where it is seen)
            logging.getLogger("setdiff.serve").warning(
                "fields this server does not take were ignored: %s",
                ", ".join(sorted(req.model_extra)))
        if not service.scheduler.alive:
            return JSONResponse(error_body(f"the server cannot decode: "
                                           f"{service.scheduler.fatal}", type_="server_error"),
                                status_code=503)
        if (wrong := unknown_model(req.model)) is not None:
            return wrong
        echo_only = req.max_tokens == 0  # (the prompt scored, nothing generated: OpenAI's)
        try:  # (tokenizing a long prompt must not hold the event loop)
            specs = await asyncio.to_thread(
                service.specs, req.model_copy(update={"max_tokens": None}) if echo_only else req)
        except DecodeError as exc:
            code = "context_length_exceeded" if "context" in str(exc) else None
            return bad_request(str(exc), code=code)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if echo_only:
            return await answer(req, specs, [Finished("length", [], len(s.prompt), 0, 0, 0.0, 0.0)
                                             for s in specs], rid, chat)
        try:
            events = await service.submit(specs, req.stream)
        except QueueFull as exc:
            service.count("rejected_queue_full")
            return JSONResponse(error_body(f"too many requests: {exc}; retry later",
                                           type_="rate_limit_error",
                                           code="rate_limit_exceeded"),
                                status_code=429, headers={"Retry-After": "1"})
        if req.stream:
            return StreamingResponse(_stream(service, req, specs, events, rid, chat),
                                     media_type="text/event-stream")
        outs, finished = {}, set()
        getter = asyncio.ensure_future(events.get())
        checked = time.monotonic()
        try:
            while len(finished) < len(specs):
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():  # (its rows leave: finally)
                        return Response(status_code=499)
                if not done:
                    continue
                i, ev = getter.result()
                getter = asyncio.ensure_future(events.get())
                if ev.done:
                    finished.add(i)
                    outs[i] = ev
        finally:
            getter.cancel()
            service.cancel(specs, finished)
        failed = [o.error for o in outs.values() if isinstance(o, Failed)]
        if failed:
            service.count("failed")
            return JSONResponse(error_body(failed[0], type_="server_error"), status_code=500)
        return await answer(req, specs, [outs[i] for i in range(len(specs))], rid, chat)

    async def answer(req: CompletionRequest, specs: list, ordered: list, rid: str, chat: bool):
        """The response to a request whose completions ``ordered`` have all finished."""
        choices = [service.choice(i, o, req.return_token_ids) for i, o in enumerate(ordered)]
        if req.echo or req.logprobs is not None:
            try:
                await service.scored(req, specs, ordered, choices)
            except RuntimeError as exc:
                message = f"echo / logprobs could not be scored: {exc}"
                service.count("failed")
                return JSONResponse(error_body(message, type_="server_error"), status_code=500)
        body = service.completion(rid, choices, usage=service.usage(ordered),
                                  seed=specs[0].seed)
        return chat_body(body, False, set()) if chat else body

    # the body model chosen here (annotations are strings under __future__: FastAPI reads the
    # one set on the function)
    completions.__annotations__["req"] = StrictCompletionRequest if strict else \
        CompletionRequest
    chat_completions.__annotations__["chat"] = StrictChatCompletionRequest if strict else \
        ChatCompletionRequest

    async def text_completions(req: CompletionRequest, request: Request):
        return await completions(req, request)

    text_completions.__annotations__["req"] = completions.__annotations__["req"]
    app.post("/v1/completions")(text_completions)
    app.post("/v1/chat/completions")(chat_completions)
    return app


async def _stream(service: Service, req: CompletionRequest, specs, events, rid,
                  chat: bool = False):
    """The server-sent events of a streamed completion (``chat``: chat completion chunks; the
    client going away cancels this generator: its rows leave the batch). With ``echo`` the
    first chunk of each choice starts with its prompt; with ``logprobs`` each chunk carries
    the scores of the tokens it adds (:class:`_StreamScores`)."""
    finished, outs, backlog, first = set(), {}, collections.deque(), set()
    tok = service.model.tokenizer
    scores = _StreamScores(service, req, specs) if req.logprobs is not None else None
    begun = set()

    def chunk(choices, usage=None):
        body = service.completion(rid, choices, usage, specs[0].seed)
        return f"data: {json.dumps(chat_body(body, True, first) if chat else body)}\n\n"

    try:
        while len(finished) < len(specs):
            i, ev = await _coalesced(events, backlog)
            if isinstance(ev, Failed):
                finished.add(i)
                body = error_body(ev.error, type_="server_error")
                yield f"data: {json.dumps(body)}\n\n"
                continue
            c = {"index": i, "text": ev.text, "logprobs": None, "finish_reason": None}
            echoed = req.echo and i not in begun
            if echoed:
                c["text"] = tok.decode(list(specs[i].prompt)) + c["text"]
            begun.add(i)
            if scores is not None:
                try:
                    c["logprobs"] = await scores.chunk(i, ev, echoed)
                except RuntimeError as exc:
                    body = error_body(f"logprobs could not be scored: {exc}",
                                      type_="server_error")
                    service.count("failed")
                    yield f"data: {json.dumps(body)}\n\n"
                    return
            if isinstance(ev, Finished):
                finished.add(i)
                outs[i] = ev
                c.update(finish_reason=ev.finish_reason, forward_steps=ev.steps,
                         tokens_per_step=ev.tokens_per_step, largest_batch=ev.largest_batch)
                if req.return_token_ids:
                    c["token_ids"] = ev.tokens
            yield chunk([c])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=service.usage([outs[i] for i in sorted(outs)]))
        yield "data: [DONE]\n\n"
    finally:
        service.cancel(specs, finished)


class _StreamScores:
    """The ``logprobs`` of a streamed completion, chunk by chunk: the tokens a chunk adds,
    scored with everything before them (one scoring pass per chunk, between decoding steps;
    a token's score depends only on the tokens left of it, so the chunks' objects add up to
    the unstreamed response's)."""

    def __init__(self, service: Service, req: CompletionRequest, specs: list):
        self.service, self.specs = service, specs
        self.tok = service.model.tokenizer
        self.k = max(req.logprobs or 0, 1)
        self.sent = collections.defaultdict(list)  # choice -> its tokens scored so far
        self.at = {}  # choice -> where the text after them starts

    async def chunk(self, i: int, ev, echoed: bool) -> dict:
        spec, tok = self.specs[i], self.tok
        prompt, done = list(spec.prompt), self.sent[i]
        if isinstance(ev, Finished):
            new = scored_tokens(spec, ev, tok)[len(done):]
        else:
            new = list(ev.ids)
        per = []  # (nothing to score: an empty object)
        if new or echoed:
            (per,) = await self.service.scheduler.score([prompt + done + new], self.k)
        obj, self.at[i] = logprobs_object(tok, prompt, new, per, self.k, echoed,
                                          self.at.get(i))
        done.extend(new)
        return obj


async def _coalesced(events: asyncio.Queue, backlog: collections.deque):
    """The next event of a stream, with the text of every later event of the same prompt that
    is already waiting folded into it (a client slower than the decoding steps gets fewer,
    larger chunks instead of a growing backlog; the text adds up the same). ``backlog``, the
    stream's own, holds what was taken from ``events`` and not yet sent."""
    if not backlog:
        backlog.append(await events.get())
    while not events.empty():
        backlog.append(events.get_nowait())
    i, ev = backlog.popleft()
    while not ev.done and backlog and backlog[0][0] == i and \
            not isinstance(backlog[0][1], Failed):
        _, nxt = backlog.popleft()  # (a Text, or the Finished after it: its tokens are all)
        ev = replace(nxt, text=ev.text + nxt.text,
                     **({"ids": ev.ids + nxt.ids} if isinstance(nxt, Text) else {}))
    return i, ev
