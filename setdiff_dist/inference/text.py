"""Text from token ids as they are committed: the committed prefix, contiguous from the prompt,
turned into pieces that add up to exactly the final text (:class:`TextStream`). The server's
streamed responses (:mod:`setdiff_dist.serve.text`) and :meth:`setdiff_dist.api.Model.generate`
with ``stream=True`` both hand out its pieces."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TextStream:
    """The text a request can send so far, so that the pieces sent add up to exactly the final
    text although set decoding commits positions out of order: only the prefix committed and
    contiguous from the prompt is text (:meth:`~.decoding.Sample.prefix_from`); a
    trailing incomplete character (U+FFFD) and anything that could still turn out to start a
    stop string are held back.

    The prefix's text is built incrementally (as vLLM detokenizes): each step decodes only the
    tokens committed since the last stable point and a few before it (for tokenizers whose
    text of a token depends on its neighbours), so a step's work does not grow with the length
    of the text; the final text is decoded whole once."""

    tokenizer: object
    stop: tuple = ()
    hold: int = field(init=False, default=0)
    ids: list = field(init=False, default_factory=list)  # the committed prefix's tokens
    stable: int = field(init=False, default=0)  # ids[:stable] are in text
    text: str = field(init=False, default="")
    sent: str = field(init=False, default="")  # the text handed out so far

    CONTEXT = 6  # tokens decoded again before the stable point

    def __post_init__(self):
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    def final(self, tokens: list) -> str:
        """The whole completion's text (cut before the first stop string, as OpenAI's)."""
        text = self.tokenizer.decode(tokens)
        cuts = [text.find(s) for s in self.stop if s in text]
        return text[:min(cuts)] if cuts else text

    def push(self, ids: list) -> str:
        """What to send now that the committed prefix grew by ``ids``: its new stable part."""
        self.ids += ids
        if len(self.ids) > self.stable:
            anchor = max(self.stable - self.CONTEXT, 0)
            head = self.tokenizer.decode(self.ids[anchor:self.stable]) if anchor < self.stable \
                else ""
            tail = self.tokenizer.decode(self.ids[anchor:])
            if tail.startswith(head) and not tail.endswith("\ufffd"):
                self.text += tail[len(head):]
                self.stable = len(self.ids)
        text = self.text
        if self.hold:
            text = text[:max(len(text) - self.hold, 0)]
        return self.rest(text)

    def finish(self, tokens: list) -> str:
        """What to send at the end (the completion's ``tokens``): the rest of the final text."""
        return self.rest(self.final(tokens))

    def rest(self, text: str) -> str:
        """The part of ``text`` not sent yet (now marked sent); nothing if ``text`` does not
        continue what was sent."""
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece
