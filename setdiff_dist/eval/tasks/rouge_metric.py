"""ROUGE and BLEU as the paper's reference scores them: Google's ``rouge-score`` (what
``evaluate``'s ROUGE runs), unstemmed unless asked, and sacrebleu's corpus BLEU (what
``evaluate``'s sacrebleu runs); infilling and summarization score with them."""

from __future__ import annotations

import functools

from setdiff_dist.eval.tasks import EvalError

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def rouge(candidate: str, reference: str) -> dict:
    """ROUGE-1, ROUGE-2 and ROUGE-L F1 of an infill, by Google's ``rouge-score`` without
    stemming (what the reference's ``evaluate.load("rouge")`` computes by default)."""
    return rouge_f1(_plain_rouge(), candidate, reference)


@functools.lru_cache(maxsize=1)
def _plain_rouge():
    return rouge_scorer(("rouge1", "rouge2", "rougeL"), stem=False)


def rouge_scorer(keys=ROUGE_KEYS, stem: bool = False):
    """Google's ``rouge-score`` (the package CNN/DailyMail results are computed with, and what
    ``evaluate``'s ROUGE runs), with the Porter stemmer only when ``stem`` (``evaluate``'s
    default, which the paper's reference keeps, has none); ``rougeLsum`` splits summaries at
    newlines."""
    try:
        from rouge_score import rouge_scorer as rs
    except ImportError:
        raise EvalError("ROUGE (--task summarize, --task infill) is scored with rouge-score, "
                        "which is not installed: pip install 'setdiff-dist[eval]'") from None
    return rs.RougeScorer(list(keys), use_stemmer=stem)


def rouge_f1(scorer, prediction: str, reference: str) -> dict:
    """ROUGE F1 of one text, per key the scorer computes."""
    return {k: s.fmeasure for k, s in scorer.score(reference, prediction).items()}


def bleu(predictions: list, references: list) -> float:
    """Corpus BLEU (0-100) of ``predictions`` against one reference each, by sacrebleu with its
    defaults (13a tokenization, exponential smoothing, case kept): what the reference's
    ``evaluate.load("sacrebleu").compute(predictions, [[ref] for ref in references])`` gives."""
    try:
        import sacrebleu
    except ImportError:
        raise EvalError("BLEU (--task summarize, --task infill) is scored with sacrebleu, "
                        "which is not installed: pip install 'setdiff-dist[eval]'") from None
    return sacrebleu.corpus_bleu(list(predictions), [list(references)]).score
