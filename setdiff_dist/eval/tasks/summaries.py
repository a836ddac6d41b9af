"""``--task summarize``: summaries of CNN/DailyMail-style records scored by ROUGE-1/2/L/Lsum
F1 (Google's ``rouge-score`` without the stemmer, as the paper's reference scores with
``evaluate``'s ROUGE; ``--rouge-stemmer`` for the stemmed variant some CNN/DailyMail tables
report) against the highlights."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Optional

from setdiff_dist.eval.tasks import EvalError, Flag, register
from setdiff_dist.eval.tasks.flags import DATA, LIMIT, MDLM_BLOCK
from setdiff_dist.eval.tasks.records import RecordTask, _records
from setdiff_dist.eval.tasks.rouge_metric import ROUGE_KEYS, bleu, rouge_f1, rouge_scorer

if TYPE_CHECKING:
    from setdiff_dist.inference.decoder import Sampling, SetDecoder

SUMMARY_TEMPLATE = "{article}\n\nTL;DR:\n"

TEMPLATE = Flag("--template", "summarize: the prompt around {article} (default: the article, a "
                              "blank line, 'TL;DR:' and a newline)")
BOS_EOS = Flag("--bos-eos", "summarize: frame the article (with the template's text before the "
                            "cue) as [BOS] ... [EOS] before the cue, as setdiff-prep --bos-eos "
                            "frames the training prompts (the reference's CNN/DailyMail)",
               action="store_true")
MAX_PROMPT_TOKENS = Flag("--max-prompt-tokens", "summarize: the framed article keeps at most N "
                                                "tokens (the reference: 512), its text cut, "
                                                "never the frame or the cue",
                         count=1, metavar="N")
ROUGE_STEMMER = Flag("--rouge-stemmer", "summarize: ROUGE with the Porter stemmer (the paper's "
                                        "reference scores without it, as evaluate's ROUGE does "
                                        "by default)", action="store_true")


@register
class Summarize(RecordTask):
    name = "summarize"
    flags = (DATA, LIMIT, TEMPLATE, ROUGE_STEMMER, BOS_EOS, MAX_PROMPT_TOKENS, MDLM_BLOCK)
    fields = ("article", "highlights")
    make = 'CNN/DailyMail\'s records, one JSON object per line: {"article": str, ' \
        '"highlights": str (the reference summary, a sentence a line)}'

    def check(self) -> None:
        rouge_scorer()  # (installed: said before the model loads)
        super().check()

    def run(self, loaded, decode, flags, publish) -> dict:
        args, d = self.args, decode
        return summarize(loaded.decoder, loaded.tokenizer, args.data, args.limit,
                         d.max_new_tokens, d.window, d.threshold, d.sampling(),
                         args.template or SUMMARY_TEMPLATE, args.rouge_stemmer, args.bos_eos,
                         args.max_prompt_tokens)


def summarize(decoder: SetDecoder, tok, path: str, limit: int, max_new_tokens: int,
              window: int, threshold: float, sampling: Sampling,
              template: str = SUMMARY_TEMPLATE, stem: bool = False, bos_eos: bool = False,
              max_prompt_tokens: Optional[int] = None) -> dict:
    """Summaries of CNN/DailyMail-style records (``{"article", "highlights"}``): the prompt is
    ``template`` around the article, cut at the end of the article's text (never the
    template's cue) so that the prompt, the window and the summary fit the context; ROUGE
    F1 (:func:`rouge_f1`) means over the records, with tokens/step and tokens/s.
    ``bos_eos``: the part of the template up to the cue (its head and the article) is framed
    as ``[BOS] ... [EOS]`` (the end-of-text where the tokenizer has no BOS) before the cue, as
    ``setdiff-prep --bos-eos`` frames the training prompts and the reference its sources;
    ``max_prompt_tokens``: that part keeps at most this many tokens (the reference: 512)."""
    if "{article}" not in template:
        raise EvalError(f"--template {template!r} has no {{article}} field")
    scorer = rouge_scorer(stem=stem)
    head, tail = template.split("{article}", 1)
    cue = tok.encode(tail)
    frame = []
    if bos_eos:
        if tok.eos_id is None:
            raise EvalError("--bos-eos frames the article with an end-of-text token, which this "
                            "tokenizer does not have")
        frame = [tok.eos_id if getattr(tok, "bos_id", None) is None else tok.bos_id, tok.eos_id]
    # (MDLM and BD3LM decode with no window: window None)
    budget = decoder.context - (window or 0) - min(max_new_tokens, decoder.context // 2) \
        - len(cue) - len(frame)
    if max_prompt_tokens is not None:
        budget = min(budget, max_prompt_tokens - len(frame))
    if budget < 8:
        raise EvalError(f"a context of {decoder.context} tokens leaves no room for the article "
                        f"next to --max-new-tokens {max_new_tokens} and the window {window}")
    from setdiff_dist.inference.decoder import StopCriteria

    stop = StopCriteria(eos_id=tok.eos_id)
    totals, rates, per_step, examples, cut = Counter(), [], [], [], 0
    summaries = []
    records = _records(path, limit, "summarize")
    for rec in records:
        ids = tok.encode(head + rec["article"])
        if len(ids) > budget:
            ids, cut = ids[:budget], cut + 1
        if frame:
            ids = frame[:1] + ids + frame[1:]
        r = decoder.generate([ids + cue], max_new_tokens, window=window, threshold=threshold,
                             sampling=sampling, stop=stop)[0]
        rates.append(len(r.tokens) / max(r.seconds, 1e-9))
        per_step.append(r.tokens_per_step)
        scores = rouge_f1(scorer, r.text.strip(), rec["highlights"])
        summaries.append(r.text.strip())
        totals.update(scores)
        if len(examples) < 3:
            examples.append({"summary": r.text, "highlights": rec["highlights"], **scores})
    n = len(records)
    return {**{k: totals[k] / n for k in ROUGE_KEYS},
            "bleu": bleu(summaries, [rec["highlights"] for rec in records]),
            "count": n, "articles_cut": cut,
            "template": template, "bos_eos": bos_eos, "max_prompt_tokens": max_prompt_tokens,
            "tokens_per_step": sum(per_step) / n,
            "tokens_per_s": sum(rates) / n,
            "scorer": f"rouge-score, use_stemmer={stem}",
            "examples": examples}
