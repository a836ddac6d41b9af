"""``--task infill``: ROUGE-1/2/L F1 of infilled middles against the references
(``setdiff-tasks infill`` records), the middle's length given by the reference's tokens. A
model that cannot see a right context (AR, BD3LM) infills from the left one, as the paper's
rows of those models are scored."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from setdiff_dist.eval.tasks import register
from setdiff_dist.eval.tasks.records import RecordTask, _records, nothing_evaluated
from setdiff_dist.eval.tasks.rouge_metric import bleu, rouge

if TYPE_CHECKING:
    from setdiff_dist.inference.decoder import Sampling, SetDecoder


@register
class Infill(RecordTask):
    name = "infill"
    preset = "infill"
    fields = ("left", "middle", "right")
    make = "setdiff-tasks infill --out FILE.jsonl"

    def run(self, loaded, decode, flags, publish) -> dict:
        from setdiff_dist.inference.decoder import DecodeError

        left_only = False
        try:
            loaded.decoder.check_infill()
        except DecodeError as exc:
            left_only = True
            print(f"setdiff-eval: {exc}; it infills from the left context only, as the "
                  "paper's AR and BD3LM rows are scored", file=sys.stderr)
        return infilling(loaded.decoder, loaded.tokenizer, self.args.data, self.args.limit,
                         decode.window, decode.threshold, decode.sampling(), left_only)


def infill_window(tok, rec: dict) -> tuple[list[int], list[int], list[int]]:
    """The token ids ``(left, middle, right)`` of an infill record. A record with ``"bos_eos":
    true`` (``setdiff-tasks rocstories``) is encoded as the reference encodes ROCStories: each
    part on its own, the left context as it is, the middle without its leading space (its
    length is the reference middle's), the right context after its joining space, framed by a
    beginning-of-sequence token (end-of-text where the tokenizer has no BOS, as the
    reference's GPT-2) and an end-of-text. Any other record (``setdiff-tasks infill``) keeps
    its text exactly: the separating spaces go with the contexts."""
    if not rec.get("bos_eos"):
        return (tok.encode(rec["left"] + " "), tok.encode(rec["middle"]),
                tok.encode(" " + rec["right"]))
    right = rec["right"]
    if right and not right[:1].isspace():
        right = " " + right
    left, middle, right = tok.encode(rec["left"]), tok.encode(rec["middle"].lstrip()), \
        tok.encode(right)
    eos = getattr(tok, "eos_id", None)
    if eos is not None:
        bos = getattr(tok, "bos_id", None)
        left, right = [eos if bos is None else bos] + left, right + [eos]
    return left, middle, right


def fit_context(left: list, n: int, right: list, context: int):
    """``(left, right)`` cut to fit ``n`` masked tokens between them in ``context`` tokens:
    each keeps the tokens nearest the middle, the budget shared evenly unless one side needs
    less; None when the middle alone does not fit."""
    if len(left) + n + len(right) <= context:
        return left, right
    budget = context - n
    if budget < 0:
        return None
    keep_left = min(len(left), max(budget - len(right), budget // 2))
    keep_right = min(len(right), budget - keep_left)
    return left[len(left) - keep_left:], right[:keep_right]


def infilling(decoder: SetDecoder, tok, path: str, limit: int, window: int, threshold: float,
              sampling: Sampling, left_only: bool = False) -> dict:
    """ROUGE of each record's infill against its middle, with tokens/step and tokens/s (the
    mean of per-record rates). A record longer than the model's context keeps the context
    nearest the middle (counted: ``contexts_cut``), and one whose middle alone does not fit
    is skipped (``skipped_too_long``).

    ``left_only`` is how the reference scores the rows of models that cannot see a right
    context (AR, BD3LM): the left context is the prompt and the model writes as many tokens as
    the middle has, with no stop; its text up to an end-of-text is the infill."""
    from setdiff_dist.inference.decoder import DecodeError, StopCriteria

    scores, examples, skipped, cut, rates, per_step = [], [], 0, 0, [], []
    pairs = []  # (the infill, the true middle): BLEU's corpus
    if left_only and decoder.causal_lm:
        window = 1  # (one token per step: an infill preset's window means nothing to AR)
    for rec in _records(path, limit, "infill"):
        left, middle, right = infill_window(tok, rec)
        n = len(middle)
        fitted = fit_context(left, n + (window if left_only else 0), [] if left_only else right,
                             decoder.context)
        if fitted is None:
            skipped += 1
            continue
        cut += fitted != (left, [] if left_only else right)
        left, right = fitted
        try:
            if left_only:
                r = decoder.generate([left], n, window=window, threshold=threshold,
                                     sampling=sampling, stop=StopCriteria())[0]
                ids = r.tokens[:r.tokens.index(tok.eos_id)] if tok.eos_id in r.tokens \
                    else r.tokens
                text = tok.decode(ids)
            else:
                r = decoder.infill([left], [right], [n], window=min(window or n, n),
                                   threshold=threshold, sampling=sampling)[0]
                text = r.text
        except DecodeError:  # longer than the model's context
            skipped += 1
            continue
        scores.append(rouge(text, rec["middle"]))
        pairs.append((text, rec["middle"]))
        rates.append(len(r.tokens) / max(r.seconds, 1e-9))
        per_step.append(r.tokens_per_step)
        if len(examples) < 3:
            examples.append({"left": rec["left"], "infill": text, "reference": rec["middle"]})
    if not scores:
        raise nothing_evaluated(path, skipped, decoder)
    n = len(scores)
    mean = {k: sum(s[k] for s in scores) / n for k in ("rouge1", "rouge2", "rougeL")}
    return {**mean, "bleu": bleu(*zip(*pairs)), "count": n, "skipped_too_long": skipped,
            "contexts_cut": cut,
            "conditioning": "left" if left_only else "left and right",
            "tokens_per_step": sum(per_step) / n, "tokens_per_s": sum(rates) / n,
            "examples": examples}
