"""``--task gsm``: exact-match accuracy of the number after ``####`` (``setdiff-tasks gsm``),
one problem at a time, with tokens/step and tokens/s; ``--thresholds`` sweeps tau (accuracy
against speed, the paper's GSM8K figure)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from setdiff_dist.eval.tasks import register
from setdiff_dist.eval.tasks.flags import DATA, LIMIT, MDLM_BLOCK, THRESHOLDS, thresholds
from setdiff_dist.eval.tasks.records import RecordTask, _records, nothing_evaluated
from setdiff_dist.eval.tasks.speed import THROUGHPUT_METHOD

if TYPE_CHECKING:
    from setdiff_dist.inference.decoder import Sampling, SetDecoder, StopCriteria


@register
class Gsm(RecordTask):
    name = "gsm"
    flags = (DATA, LIMIT, THRESHOLDS, MDLM_BLOCK)
    preset = "gsm"
    fields = ("prompt", "answer")
    make = "setdiff-tasks gsm --out FILE.jsonl"

    def check(self) -> None:
        self.thresholds = thresholds(self.args)
        super().check()

    def run(self, loaded, decode, flags, publish) -> dict:
        args, d = self.args, decode
        if self.thresholds:
            return gsm_sweep(loaded.decoder, loaded.tokenizer, args.data, args.limit,
                             d.max_new_tokens, d.window, self.thresholds, d.sampling())
        return gsm(loaded.decoder, loaded.tokenizer, args.data, args.limit, d.max_new_tokens,
                   d.window, d.threshold, d.sampling())


# A GSM answer is "#### <number>" (GSM8K's own solutions) or "\boxed{<number>}" (the distilled
# solutions the paper fine-tunes on). "####" is complete only once something that cannot continue
# the number is committed after it (a newline, a space, a letter, end of text): with a tokenizer
# that splits digits, "#### 4" is a prefix of "#### 42". A period or comma ends it only when a
# non-digit follows ("42." then a newline; "1,234" goes on). "\boxed{...}" is complete at its
# closing brace.
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_HASH = rf"####\s*({_NUMBER})(?=[^\d.,]|[.,]\D)"
_BOXED = rf"\\boxed\{{\s*({_NUMBER})\s*\}}"
GSM_STOP = rf"{_HASH}|{_BOXED}"


# the reference's GSM8K stop on a degenerate solution (its RepeatingTokenStoppingCriteria with
# min_run_length 8, run_lm_eval_harness.sh): a run of 8 equal tokens
GSM_REPEAT_RUN = 8


def gsm_stop(tok) -> StopCriteria:
    """Where a solution ends: its answer closed (:data:`GSM_STOP`), end-of-text, or a run of
    :data:`GSM_REPEAT_RUN` equal tokens, as the reference stops GSM8K generations."""
    from setdiff_dist.inference.decoder import StopCriteria

    return StopCriteria(eos_id=tok.eos_id, stop=["re:" + GSM_STOP], max_repeat_run=GSM_REPEAT_RUN)


def _answer(text: str):
    """The whole number of the first closed answer marker, ``#### N`` (end of text closes it
    too) or ``\\boxed{N}`` (commas dropped), or None."""
    found = [m for m in (re.search(rf"####\s*({_NUMBER})", text), re.search(_BOXED, text)) if m]
    if not found:
        return None
    return min(found, key=lambda m: m.start()).group(1).replace(",", "")


def gsm(decoder: SetDecoder, tok, path: str, limit: int, max_new_tokens: int, window: int,
        threshold: float, sampling: Sampling, warmup: int = 0) -> dict:
    """Accuracy by the ``####`` answer rule, one problem at a time (batch 1, the paper's
    setting), with tokens/step and tokens/s (the mean of per-problem rates, as
    :func:`throughput`); ``warmup`` first problems are decoded once before, not counted."""
    from setdiff_dist.inference.decoder import DecodeError

    correct, total, skipped, examples, generated = 0, 0, 0, [], 0
    rates, per_step = [], []
    stop = gsm_stop(tok)
    records = _records(path, limit, "gsm")
    for rec in records[:warmup]:  # (allocations, kernels, caches of this shape)
        try:
            decoder.generate([tok.encode(rec["prompt"])], max_new_tokens, window=window,
                             threshold=threshold, sampling=sampling, stop=stop)
        except DecodeError:
            pass
    for rec in records:
        try:
            r = decoder.generate([tok.encode(rec["prompt"])], max_new_tokens, window=window,
                                 threshold=threshold, sampling=sampling, stop=stop)[0]
        except DecodeError:  # longer than the model's context
            skipped += 1
            continue
        got = _answer(r.text)
        correct += int(got is not None and got == str(rec["answer"]).replace(",", ""))
        total += 1
        rates.append(len(r.tokens) / max(r.seconds, 1e-9))  # (the decoder's own timing)
        per_step.append(r.tokens_per_step)
        generated += len(r.tokens)
        if len(examples) < 3:
            examples.append({"prompt": rec["prompt"], "output": r.text, "answer": rec["answer"],
                             "extracted": got})
    if not total:
        raise nothing_evaluated(path, skipped, decoder)
    return {"accuracy": correct / total, "count": total, "skipped_too_long": skipped,
            "tokens_per_step": sum(per_step) / total, "tokens_per_s": sum(rates) / total,
            "tokens": generated / total, "examples": examples}


def gsm_sweep(decoder: SetDecoder, tok, path: str, limit: int, max_new_tokens: int,
              window: int, thresholds: list[float], sampling: Sampling) -> dict:
    """The paper's tau sweep (accuracy against speed): :func:`gsm` at each threshold, one
    warm-up problem each; one row per tau."""
    rows = []
    for tau in thresholds:
        r = gsm(decoder, tok, path, limit, max_new_tokens, window, tau, sampling, warmup=1)
        rows.append({"threshold": tau, **{k: r[k] for k in (
            "accuracy", "tokens_per_step", "tokens_per_s", "tokens", "count",
            "skipped_too_long")},
            "examples": r["examples"][:1]})
    return {"sweep": rows, "method": THROUGHPUT_METHOD}
