"""OpenAI's chat completions (``POST /v1/chat/completions``) on top of the completions path:
the messages rendered into one prompt by the model's chat template (a Jinja template, as a
Hugging Face tokenizer's ``chat_template``), decoded as a completion of it, the answer reshaped
into OpenAI's chat objects (``chat.completion``, ``chat.completion.chunk`` with ``delta``).

The template: ``setdiff-serve --chat-template FILE``, else one that ships with the checkpoint
or export (``chat_template.jinja``, or ``tokenizer_config.json``'s ``chat_template``, beside
its tokenizer). A checkpoint without one answers 400, saying how to give one: a base model has
no chat format to guess, and a made-up one would decode a prompt it never saw."""

from __future__ import annotations

import functools
import json
import os
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from setdiff_dist.inference.decoding import DecodeError


class TextPart(BaseModel):
    type: str = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[TextPart]]] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        bad = [p.type for p in self.content if p.type != "text"]
        if bad:
            raise DecodeError(f"message content of type {bad[0]!r}: this model reads text only")
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionFields(BaseModel):
    """The fields ``/v1/completions`` (:class:`~.app.CompletionRequest`, which adds the prompt
    and its own checks) and ``/v1/chat/completions`` (:class:`ChatCompletionRequest`) share,
    defined once: OpenAI's, vLLM's ``top_k`` and set decoding's."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: Optional[int] = Field(None, ge=0)  # (0: with echo only, the prompt scored)
    temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    # (vLLM's extension: the k most likely tokens only; 0 or -1: all)
    top_k: Optional[int] = Field(None, ge=-1)
    stop: Optional[Union[str, list[str]]] = Field(None)
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 63)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=128)  # (completions per prompt: independent rows)
    user: Optional[str] = None
    # OpenAI's, at their no-op values only (CompletionRequest's checks)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    # set decoding's own
    window: Optional[int] = Field(None, ge=1)
    threshold: Optional[float] = Field(None, ge=0)  # (inf: one token per step)
    repetition_penalty: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    max_repeat_run: Optional[int] = Field(None, ge=1)
    ignore_eos: bool = False
    return_token_ids: bool = False


class ChatCompletionRequest(CompletionFields):
    """OpenAI's chat completion request: ``messages`` instead of a prompt, ``max_tokens`` or
    ``max_completion_tokens``; the other fields as :class:`~.app.CompletionRequest` takes
    them (checked again there: no-op values of OpenAI's fields accepted, unknown fields
    ignored with a warning)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None

    @model_validator(mode="after")
    def _no_logprobs(self):
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs / top_logprobs are not supported by this server (only "
                             "false / null)")
        return self

    def completion_fields(self, prompt: str) -> dict:
        """The equivalent :class:`~.app.CompletionRequest`'s fields, ``prompt`` the rendered
        messages."""
        fields = {k: getattr(self, k) for k in CompletionFields.model_fields
                  if getattr(self, k) is not None}
        fields["max_tokens"] = self.max_completion_tokens or self.max_tokens
        return dict(fields, prompt=prompt)


def find_chat_template(checkpoint: str, flag: Optional[str] = None) -> Optional[str]:
    """The chat template a server uses: ``--chat-template FILE`` (its text), else one shipped
    beside the model's tokenizer (``chat_template.jinja``, or ``tokenizer_config.json``'s
    ``chat_template``) in the checkpoint or export directory; None without one."""
    if flag is not None:
        try:
            with open(flag, encoding="utf-8") as fh:
                return fh.read()
        except OSError as exc:
            raise DecodeError(f"--chat-template {flag}: {exc.strerror}") from None
    from setdiff_dist.checkpoint.files import step_directory

    for where in dict.fromkeys((checkpoint, step_directory(checkpoint))):
        path = os.path.join(where, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                return fh.read()
        path = os.path.join(where, "tokenizer_config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                template = json.load(fh).get("chat_template")
            if isinstance(template, str):
                return template
    return None


@functools.lru_cache(maxsize=4)
def _compiled(template: str):
    """``template`` compiled once (a server has one; compiling it per request would be
    wasted), in transformers' sandbox settings."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render(template: Optional[str], messages: list[ChatMessage], tok) -> str:
    """The prompt of ``messages`` under ``template`` (Jinja, sandboxed, as transformers renders
    a ``chat_template``: ``messages``, ``add_generation_prompt``, ``bos_token``,
    ``eos_token``, ``raise_exception``)."""
    if template is None:
        raise DecodeError("this checkpoint has no chat template, so chat messages cannot be "
                          "put into its prompt format: start setdiff-serve with "
                          "--chat-template FILE (a Jinja template, as a Hugging Face "
                          "tokenizer's chat_template), or use /v1/completions")
    from jinja2 import TemplateError

    eos = getattr(tok, "eos_token", None) or tok.decode([tok.eos_id])
    try:
        return _compiled(template).render(
            messages=[{"role": m.role, "content": m.text()} for m in messages],
            add_generation_prompt=True, bos_token="", eos_token=eos)
    except TemplateError as exc:
        raise DecodeError(f"the chat template refused the messages: {exc}") from None


def chat_body(body: dict, streamed: bool, first: set) -> dict:
    """A completion object (or chunk) as OpenAI's chat one: ``message`` (or ``delta``, with
    the role in each choice's first chunk: ``first`` holds the indexes already sent)."""
    body = dict(body, object="chat.completion.chunk" if streamed else "chat.completion")
    choices = []
    for c in body.get("choices", []):
        c = dict(c)
        text = c.pop("text", "")
        c.pop("logprobs", None)
        if streamed:
            delta = {"content": text}
            if c["index"] not in first:
                first.add(c["index"])
                delta = {"role": "assistant", **delta}
            c["delta"] = delta
        else:
            c["message"] = {"role": "assistant", "content": text}
        c["logprobs"] = None
        choices.append(c)
    body["choices"] = choices
    return body
