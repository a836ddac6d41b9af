"""``--task choice``: multiple-choice records ``{"context", "choices", "gold"}`` scored by
log-likelihood (accuracy, and per character of the choice), as lm-evaluation-harness scores
them, without it (:mod:`setdiff_dist.eval.likelihood`)."""

from __future__ import annotations

from setdiff_dist.eval.tasks import EvalError, register
from setdiff_dist.eval.tasks.flags import BATCH_SIZE, DATA, LIMIT
from setdiff_dist.eval.tasks.records import RecordTask, _records


@register
class MultipleChoice(RecordTask):
    name = "choice"
    flags = (DATA, LIMIT, BATCH_SIZE)
    generates = False
    fields = ("context", "choices", "gold")
    make = 'one JSON object per line: {"context": str, "choices": [str, ...], "gold": index ' \
        'of the right choice}'

    @classmethod
    def check_record(cls, rec: dict, where: str) -> None:
        choices, gold = rec["choices"], rec["gold"]
        if not isinstance(choices, list) or len(choices) < 2 or \
                not all(isinstance(c, str) and c for c in choices):
            raise EvalError(f"{where}: 'choices' must be a list of at least two non-empty strings")
        if not isinstance(rec["context"], str):
            raise EvalError(f"{where}: 'context' must be a string")
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
            raise EvalError(f"{where}: 'gold' must be the index of the right choice, 0 to "
                            f"{len(choices) - 1}; got {gold!r}")

    def run(self, loaded, decode, flags, publish) -> dict:
        from setdiff_dist.eval.likelihood import Scorer

        scorer = Scorer(loaded.module, loaded.config, loaded.tokenizer, self.args.batch_size)
        return multiple_choice(scorer, self.args.data, self.args.limit)


def multiple_choice(scorer, path: str, limit: int, delimiter: str = " ") -> dict:
    """Accuracy of picking the most likely choice (``acc``; ``acc_norm`` per character of the
    choice), each choice scored as ``delimiter + choice`` after the context: the multiple-choice
    scoring of lm-evaluation-harness, here without it (:mod:`setdiff_dist.eval.likelihood`)."""
    recs = _records(path, limit, "choice")
    pairs = [(r["context"], delimiter + c) for r in recs for c in r["choices"]]
    scores = iter(scorer.loglikelihood(pairs))
    per, acc, acc_norm = [], 0, 0
    for r in recs:
        got = [next(scores) for _ in r["choices"]]
        lls = [ll for ll, _ in got]
        pred = max(range(len(lls)), key=lambda j: (lls[j], -j))
        norm = [ll / len(c) for ll, c in zip(lls, r["choices"])]
        pred_norm = max(range(len(norm)), key=lambda j: (norm[j], -j))
        acc += pred == r["gold"]
        acc_norm += pred_norm == r["gold"]
        per.append({"loglikelihoods": lls, "greedy": [g for _, g in got], "pred": pred,
                    "gold": r["gold"]})
    return {"records": len(recs), "acc": acc / len(recs), "acc_norm": acc_norm / len(recs),
            "likelihood": scorer.likelihood, "exact_likelihood": scorer.exact, "scores": per}
