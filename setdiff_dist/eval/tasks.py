"""The evaluation tasks of ``setdiff-eval``. Each returns a JSON-able dict of results.

- :func:`perplexity`: NELBO per token and the PPL bound (``PPL <=``) on validation shards, over
  fixed orders seeded by ``order.eval_seed`` and the sample index (reproducible numbers), for
  the model's own order schedule (or the causal LM's exact perplexity).
- :func:`infilling`: ROUGE-1/2/L F1 of infilled middles against the references
  (``setdiff-tasks infill`` records), the middle length given by the reference's tokens.
- :func:`gsm`: exact-match accuracy of the number after ``####`` (``setdiff-tasks gsm``).
- :func:`summarize`: ROUGE-1/2/L/Lsum F1 (Google's ``rouge-score`` without the stemmer, as the
  paper's reference scores with ``evaluate``'s ROUGE; ``stem=True`` for the stemmed variant some
  CNN/DailyMail tables report) of generated summaries against the highlights.
- :func:`generative_perplexity`: unconditional samples scored by a Hugging Face causal LM the
  user supplies (GPT-2 Large in the paper), and MAUVE (``mauve-text``) against reference texts,
  featurized by the same model.
- :func:`throughput`: tokens/s and tokens/step of set decoding at several (W, tau), next to
  cached AR decoding.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from collections import Counter
from typing import Optional

from setdiff_dist.data.blend import Blend
from setdiff_dist.data.loader import TokenLoader
from setdiff_dist.errors import SetdiffError
from setdiff_dist.inference.decoder import (
    DecodeError,
    Sampling,
    SetDecoder,
    StopCriteria,
    model_device,
)
from setdiff_dist.objective import Objective


class EvalError(SetdiffError, ValueError):
    """A task file that cannot be evaluated, or an evaluation that evaluated nothing."""


def perplexity(model, cfg, shards_dir: str, batches: int = 16, batch_size: int = 8) -> dict:
    shards = Blend.open(shards_dir, "valid", seq_len=cfg.data.seq_len)
    objective = Objective(cfg, seed=cfg.order.eval_seed, stream=1, evaluation=True)
    n = min(batches, max(1, len(shards) // batch_size))
    loader = TokenLoader(shards, global_batch=batch_size, micro_batch=batch_size, shuffle=False,
                         num_workers=0)
    total, tokens = objective.evaluate(model, (b for _, (b,) in zip(range(n), loader)),
                                       model_device(model))
    if not tokens:
        raise EvalError(f"{shards_dir}: the validation split gave no batch of {batch_size} "
                        "sequences; lower --batch-size or prepare more validation data")
    per_token = total / tokens
    return {"nelbo_per_token": per_token, "ppl_bound": math.exp(min(per_token, 50.0)),
            "tokens": tokens, "sequences": n * batch_size, "order": cfg.order.kind,
            "exact": objective.order.exact_likelihood}


def rouge(candidate: str, reference: str) -> dict:
    """ROUGE-1, ROUGE-2 and ROUGE-L F1 of an infill, by Google's ``rouge-score`` without
    stemming (what the reference's ``evaluate.load("rouge")`` computes by default)."""
    return rouge_f1(_plain_rouge(), candidate, reference)


@functools.lru_cache(maxsize=1)
def _plain_rouge():
    return rouge_scorer(("rouge1", "rouge2", "rougeL"), stem=False)


TASK_FIELDS = {"infill": ("left", "middle", "right"), "gsm": ("prompt", "answer"),
               "choice": ("context", "choices", "gold"), "summarize": ("article", "highlights")}
# how to make each task's file
TASK_MAKE = {"infill": "setdiff-tasks infill --out FILE.jsonl",
             "gsm": "setdiff-tasks gsm --out FILE.jsonl",
             "choice": 'one JSON object per line: {"context": str, "choices": [str, ...], '
                       '"gold": index of the right choice}',
             "summarize": 'CNN/DailyMail\'s records, one JSON object per line: {"article": '
                          'str, "highlights": str (the reference summary, a sentence a line)}'}


def _records(path: str, limit: int, task: str) -> list[dict]:
    """The first ``limit`` records of a ``setdiff-tasks`` JSONL file, each checked for the
    task's fields."""
    fields, make = TASK_FIELDS[task], TASK_MAKE[task]
    out = []
    try:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if len(out) == limit:
                    break
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise EvalError(f"{path}, line {number}: not JSON ({exc.msg}); a task "
                                    f"file has one JSON object per line ({make})") from None
                missing = [f for f in fields if not isinstance(rec, dict) or f not in rec]
                if missing:
                    article = "an" if task[0] in "aeiou" else "a"
                    raise EvalError(f"{path}, line {number}: no {', '.join(map(repr, missing))} "
                                    f"field: not {article} {task} task file? ({make})")
                if task == "choice":
                    _check_choice(rec, f"{path}, line {number}")
                out.append(rec)
    except FileNotFoundError:
        raise EvalError(f"--data {path}: no such file ({make})") from None
    except UnicodeDecodeError as exc:
        raise EvalError(f"{path}: byte {exc.start} is not UTF-8: not a task file") from None
    if not out:
        raise EvalError(f"{path} has no records ({make})")
    return out


def _check_choice(rec: dict, where: str) -> None:
    choices, gold = rec["choices"], rec["gold"]
    if not isinstance(choices, list) or len(choices) < 2 or \
            not all(isinstance(c, str) and c for c in choices):
        raise EvalError(f"{where}: 'choices' must be a list of at least two non-empty strings")
    if not isinstance(rec["context"], str):
        raise EvalError(f"{where}: 'context' must be a string")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise EvalError(f"{where}: 'gold' must be the index of the right choice, 0 to "
                        f"{len(choices) - 1}; got {gold!r}")


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


def check_task_file(path: str, task: str, limit: int) -> None:
    """Refuse a task file that is missing, not JSONL, or of another task, before any model
    is loaded."""
    _records(path, limit, task)


def _nothing_evaluated(path: str, skipped: int, decoder: SetDecoder) -> EvalError:
    return EvalError(f"all {skipped} records of {path} were skipped: each is longer than the "
                     f"model's context of {decoder.context} tokens; give shorter records")


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
    scores, examples, skipped, cut, rates, per_step = [], [], 0, 0, [], []
    if left_only and decoder.decoding == "causal":
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
        rates.append(len(r.tokens) / max(r.seconds, 1e-9))
        per_step.append(r.tokens_per_step)
        if len(examples) < 3:
            examples.append({"left": rec["left"], "infill": text, "reference": rec["middle"]})
    if not scores:
        raise _nothing_evaluated(path, skipped, decoder)
    n = len(scores)
    mean = {k: sum(s[k] for s in scores) / n for k in ("rouge1", "rouge2", "rougeL")}
    return {**mean, "count": n, "skipped_too_long": skipped, "contexts_cut": cut,
            "conditioning": "left" if left_only else "left and right",
            "tokens_per_step": sum(per_step) / n, "tokens_per_s": sum(rates) / n,
            "examples": examples}


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
        raise _nothing_evaluated(path, skipped, decoder)
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


# the GSM8K tau grid of the paper's reference runner (scripts/eval/repro_suite_runner.py: 1e6 is
# its one-token-a-step point): ``setdiff-eval --task gsm --thresholds paper``
PAPER_TAUS = [math.inf, 0.99, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6]

SUMMARY_TEMPLATE = "{article}\n\nTL;DR:\n"
ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")


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
    stop = StopCriteria(eos_id=tok.eos_id)
    totals, rates, per_step, examples, cut = Counter(), [], [], [], 0
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
        totals.update(scores)
        if len(examples) < 3:
            examples.append({"summary": r.text, "highlights": rec["highlights"], **scores})
    n = len(records)
    return {**{k: totals[k] / n for k in ROUGE_KEYS}, "count": n, "articles_cut": cut,
            "template": template, "bos_eos": bos_eos, "max_prompt_tokens": max_prompt_tokens,
            "tokens_per_step": sum(per_step) / n,
            "tokens_per_s": sum(rates) / n,
            "scorer": f"rouge-score, use_stemmer={stem}",
            "examples": examples}


class HFScorer:
    """A local Hugging Face causal LM (``transformers``), as the paper scores samples with GPT-2
    Large: the per-token NLL of texts (after the model's BOS, or its end-of-text when it has no
    BOS) and MAUVE's features (the last layer's hidden state at each text's last token)."""

    def __init__(self, path: str, device: Optional[str] = None, max_length: int = 1024):
        import os

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise EvalError(f"--scorer {path}: not a Hugging Face model directory (no "
                            "config.json); give a local causal LM, e.g. GPT-2 Large saved with "
                            "save_pretrained, or a setdiff-convert --to-hf export")
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError:
            raise EvalError("--task genppl scores with transformers, which is not installed: "
                            "pip install transformers") from None
        import torch

        self.torch = torch
        # the judge on the GPU when there is one, in bf16; on the CPU in fp32
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(device)
        self.model.eval()
        self.device, self.max_length = device, max_length
        bos = self.tok.bos_token_id if self.tok.bos_token_id is not None else \
            self.tok.eos_token_id
        if bos is None:
            raise EvalError(f"--scorer {path}: its tokenizer has neither a BOS nor an "
                            "end-of-text token to condition the first token on")
        self.bos = bos

    def ids(self, text: str) -> list:
        return [self.bos] + self.tok.encode(text, add_special_tokens=False)[:self.max_length - 1]

    def score(self, texts: list, nll: bool = True, features: bool = False):
        """``(sum of -log p over every text token, tokens, MAUVE's features [n, hidden] or
        None)`` (``nll=False``: the features only). The NLL conditions the first token on the
        BOS; the features are mauve-text's own (``featurize_tokens_from_model``): the text as
        its tokenizer encodes it (no token added, cut at ``max_length``), the last layer's
        hidden state at its last token, so that MAUVE is the number mauve-text computes from
        the texts with this model."""
        import numpy as np

        total, count, rows = 0.0, 0, []
        with self.torch.no_grad():
            for text in texts:
                ids = self.ids(text)
                if nll and len(ids) >= 2:
                    x = self.torch.tensor([ids], device=self.device)
                    total += self.model(x, labels=x).loss.item() * (len(ids) - 1)
                    count += len(ids) - 1
                if features:
                    own = self.tok.encode(text, truncation=True, max_length=self.max_length)
                    x = self.torch.tensor([own or [self.bos]], device=self.device)
                    out = self.model(x, output_hidden_states=True)
                    rows.append(out.hidden_states[-1][0, -1].float().cpu().numpy())
        return total, count, (np.stack(rows) if features else None)


# the paper's MAUVE protocol (the reference's scripts/eval/robust_mauve_bootstrap.py): 5 subsets
# of 1,000 human texts, drawn without replacement by numpy's default_rng(20260701), each
# against the first min(1000, samples) generations, subset k's MAUVE seeded 1234 + k; the mean
# and the standard deviation (ddof 0) over the subsets
MAUVE_SUBSETS, MAUVE_SUBSET_SIZE, MAUVE_REFERENCE_SEED, MAUVE_SEED = 5, 1000, 20260701, 1234


def mauve_subsets(p_features, q_features, subsets: int = MAUVE_SUBSETS,
                  size: int = MAUVE_SUBSET_SIZE, reference_seed: int = MAUVE_REFERENCE_SEED,
                  seed: int = MAUVE_SEED) -> dict:
    """MAUVE of generations (``q_features``) against ``subsets`` subsets of ``size`` human
    texts drawn from ``p_features`` (the pool), as the reference measures it: ``{"mauve": mean,
    "mauve_std", "mauve_per_subset", ...}``."""
    import numpy as np

    try:
        import mauve
    except ImportError:
        raise EvalError("MAUVE needs mauve-text: pip install 'setdiff-dist[eval]'") from None
    pool = len(p_features)
    if size > pool:
        raise EvalError(f"MAUVE draws {subsets} subsets of {size} reference texts, but "
                        f"--references has {pool}: give more texts or a smaller "
                        "--mauve-subset-size (the paper: 1000)")
    rng = np.random.default_rng(reference_seed)
    scores = []
    for k in range(subsets):
        pick = rng.choice(pool, size=size, replace=False)
        n = min(size, len(q_features))
        m = mauve.compute_mauve(p_features=p_features[pick][:n], q_features=q_features[:n],
                                seed=seed + k, verbose=False)
        scores.append(float(m.mauve))
    values = np.asarray(scores, dtype=np.float64)
    return {"mauve": float(values.mean()), "mauve_std": float(values.std(ddof=0)),
            "mauve_per_subset": scores, "mauve_subsets": subsets, "mauve_subset_size": size,
            "mauve_compared": min(size, len(q_features))}


# the reference's variable-length unconditional samples (its EntropyEosStoppingCriteria as the
# OWT runs configure it, and uncond_gen_ppl.py's filter): a sample ends at its first end-of-text
# after at least 32 generated tokens, or where the last 128 tokens' unigram entropy falls
# below 4 nats (the last 128 then dropped); a sample whose own unigram entropy is below 4 nats
# or that keeps fewer than 50 tokens is drawn again
VARIABLE_LENGTH = {"min_tokens": 32, "block": 128, "entropy": 4.0, "reject_entropy": 4.0,
                   "reject_length": 50}


def unigram_entropy(ids) -> float:
    """The entropy (nats) of the token counts of ``ids``."""
    if not ids:
        return 0.0
    counts = Counter(ids).values()
    n = sum(counts)
    return -sum(c / n * math.log(c / n) for c in counts)


def variable_length(ids: list, eos: Optional[int], rules: dict = VARIABLE_LENGTH
                    ) -> tuple[list, str]:
    """Where the reference's stopping rule ends a sample of generated tokens ``ids`` (after a
    prompt of one BOS): ``(the tokens kept, "eos" | "low_entropy" | "length")``. The reference
    checks it at every length as its sampler grows the sample (the sequence: the BOS and the
    sample); every decoder here commits each token for good, so checking it on the finished
    sample ends it where the reference's sampler would have stopped. The end-of-text is kept;
    a low-entropy stop drops the last ``block`` tokens (never below ``min_tokens``)."""
    floor, block = rules["min_tokens"], rules["block"]
    seq = [None] + list(ids)  # (the BOS: a token of the sequence the reference checks)
    for n in range(1, len(ids) + 1):
        if eos is not None and ids[n - 1] == eos and n >= floor:
            return list(ids[:n]), "eos"
        if n + 1 >= block and n >= floor and \
                unigram_entropy(seq[n + 1 - block:n + 1]) < rules["entropy"]:
            keep = max(n + 1 - block, floor + 1)  # (sequence tokens, the BOS among them)
            return list(ids[:keep - 1]), "low_entropy"
    return list(ids), "length"


def degenerate(ids: list, eos: Optional[int], rules: dict = VARIABLE_LENGTH) -> bool:
    """The first half of the reference's filter of a sample (uncond_gen_ppl.py; the second: 50
    tokens or fewer kept with the BOS): the unigram entropy of the sample as drawn, its
    padding (GPT-2's end-of-text) left out, below 4 nats."""
    return unigram_entropy([t for t in ids if t != eos]) < rules["reject_entropy"]


def generative_perplexity(decoder: SetDecoder, tok, scorer: HFScorer, samples: int,
                          max_new_tokens: int, window: int, threshold: float,
                          sampling: Sampling, batch_size: int = 8,
                          references: list = None, seed: int = 0,
                          mauve_protocol: Optional[dict] = None,
                          variable: bool = False, max_draws: Optional[int] = None) -> dict:
    """``samples`` unconditional generations of ``max_new_tokens`` (from end-of-text), their
    perplexity under ``scorer`` (token-weighted over all samples: generative perplexity, an
    extra beside the paper's MAUVE), and, with ``references`` (human texts), MAUVE by the
    paper's protocol (:func:`mauve_subsets`; ``mauve_protocol``: its keyword arguments).
    ``variable``: the reference's variable-length samples (:func:`variable_length`, and a
    degenerate sample drawn again, at most ``max_draws`` draws in all, default 10 per
    sample); otherwise every sample is ``max_new_tokens`` long."""
    import dataclasses

    texts, per_step, seconds, lengths, stops = [], [], 0.0, [], Counter()
    draws, cap = 0, max_draws or 10 * samples
    while len(texts) < samples:
        if draws >= cap:
            raise EvalError(f"{len(texts)} of {samples} samples passed the reference's filter "
                            f"(unigram entropy >= {VARIABLE_LENGTH['reject_entropy']} nats, "
                            f"at least {VARIABLE_LENGTH['reject_length']} tokens) in {draws} "
                            "draws; --max-new-tokens may be too short for --variable-length "
                            "(the paper: 1024)")
        n = min(batch_size, samples - len(texts)) if not variable else \
            min(batch_size, cap - draws)
        out = decoder.generate([[tok.eos_id]] * n, max_new_tokens, window=window,
                               threshold=threshold,
                               sampling=dataclasses.replace(sampling, seed=seed + draws))
        draws += n
        seconds += out[0].seconds  # (the batch's wall time)
        for r in out:
            if len(texts) == samples:
                break
            ids = list(r.tokens)
            if variable:
                drawn = ids
                ids, why = variable_length(drawn, tok.eos_id)
                if degenerate(drawn, tok.eos_id) \
                        or len(ids) + 1 <= VARIABLE_LENGTH["reject_length"]:
                    stops["drawn_again"] += 1
                    continue
                stops[why] += 1
                texts.append(tok.decode([t for t in ids if t != tok.eos_id]))
            else:
                texts.append(r.text)
            lengths.append(len(ids))
            per_step.append(r.tokens_per_step)
    nll, count, feats = scorer.score(texts, features=bool(references))
    result = {"gen_ppl": math.exp(nll / max(count, 1)), "samples": samples,
              "scored_tokens": count, "tokens_per_step": sum(per_step) / samples,
              "tokens_per_s": draws * max_new_tokens / max(seconds, 1e-9),
              "mean_length": sum(lengths) / samples, "examples": texts[:3]}
    if variable:
        result.update(variable_length=True, draws=draws, stops=dict(stops))
    if references:
        refs = scorer.score(references, nll=False, features=True)[2]
        result.update(mauve_subsets(refs, feats, **(mauve_protocol or {})),
                      mauve_references=len(references))
    result["scorer_dtype"] = str(scorer.dtype).replace("torch.", "")
    return result


def read_texts(path: str, limit: int) -> list:
    """Reference texts for MAUVE: a JSONL file of ``{"text": ...}`` records, or plain text with
    one text per blank-line-separated paragraph."""
    try:
        raw = open(path, encoding="utf-8").read()
    except FileNotFoundError:
        raise EvalError(f"--references {path}: no such file") from None
    if path.endswith(".jsonl"):
        texts = [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
    else:
        texts = [p.strip() for p in raw.split("\n\n") if p.strip()]
    if len(texts) < 2:
        raise EvalError(f"--references {path}: MAUVE needs at least 2 texts, found "
                        f"{len(texts)}")
    return texts[:limit]


THROUGHPUT_METHOD = ("batch 1; per setting, the mean over the prompts of each sample's "
                     "generated tokens / wall seconds, after warm-up samples of every setting "
                     "(the paper's measure); median_tokens_per_s beside it")


def throughput(decoder: SetDecoder, tok, prompts: list, max_new_tokens: int,
               settings: list[tuple[int, float]], sampling: Sampling, warmup: int = 1,
               samples: Optional[int] = None) -> dict:
    """Batch-1 tokens/s as the paper measures it (the mean of per-sample tokens/s over
    ``samples`` generations, the prompts taken in turn; default one per prompt), after
    ``warmup`` generations of each setting, which are not counted, and tokens/step, per
    (W, tau). A prompt of None is unconditional (from the end-of-text token), as the paper's
    OWT and LM1B throughput (its protocol: 50 warm-ups, 200 samples)."""
    ids = [[tok.eos_id] if p is None else tok.encode(p) for p in prompts]
    measured = [ids[i % len(ids)] for i in range(len(ids) if samples is None else samples)]
    rows = []
    for window, tau in settings:
        for i in range(warmup):  # (allocations, kernels, caches of this shape)
            decoder.generate([ids[i % len(ids)]], max_new_tokens, window=window,
                             threshold=tau, sampling=sampling)
        rates, per_step = [], []
        for p in measured:
            t = time.perf_counter()
            r = decoder.generate([p], max_new_tokens, window=window, threshold=tau,
                                 sampling=sampling)[0]
            rates.append(len(r.tokens) / (time.perf_counter() - t))
            per_step.append(r.tokens_per_step)
        rows.append({"window": window, "threshold": tau,
                     "tokens_per_s": sum(rates) / len(rates),
                     "median_tokens_per_s": sorted(rates)[len(rates) // 2],
                     "tokens_per_step": sum(per_step) / len(per_step)})
    return {"batch_size": 1, "max_new_tokens": max_new_tokens, "warmup_samples": warmup,
            "samples": len(measured), "method": THROUGHPUT_METHOD, "settings": rows}
