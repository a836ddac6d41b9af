"""``--task genppl``: unconditional samples scored by a Hugging Face causal LM the user supplies
(GPT-2 Large in the paper; :mod:`.hf_scorer`), and MAUVE (``mauve-text``) against human texts,
featurized by the same model (:mod:`.mauve_protocol`)."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import TYPE_CHECKING, Optional

from setdiff_dist.eval.tasks import EvalError, Flag, Task, register
from setdiff_dist.eval.tasks.flags import BATCH_SIZE, MDLM_BLOCK, SAMPLES
from setdiff_dist.eval.tasks.hf_scorer import HFScorer
from setdiff_dist.eval.tasks.mauve_protocol import MAUVE_SUBSET_SIZE, MAUVE_SUBSETS, mauve_subsets

if TYPE_CHECKING:
    from setdiff_dist.inference.decoder import Sampling, SetDecoder

SCORER = Flag("--scorer", "genppl: a local Hugging Face causal LM that scores the samples (GPT-2 "
                          "Large in the paper) and featurizes them for MAUVE", metavar="HF_DIR")
REFERENCES = Flag("--references", "genppl: human texts for MAUVE (JSONL of {text} or blank-line-"
                                  "separated paragraphs); none = no MAUVE. MAUVE as the paper "
                                  "measures it: --mauve-subsets subsets of --mauve-subset-size "
                                  "texts drawn from this pool, each against the first "
                                  "generations, mean and std", metavar="FILE")
VARIABLE = Flag("--variable-length", "genppl: the paper's variable-length samples: each ends at "
                                     "its first end-of-text after 32 tokens, or where the last "
                                     "128 tokens' unigram entropy drops below 4 nats; a "
                                     "degenerate sample (unigram entropy below 4 nats, 50 tokens "
                                     "or fewer) is drawn again (default: every sample "
                                     "--max-new-tokens long)", action="store_true")
SUBSETS = Flag("--mauve-subsets", "genppl: reference subsets MAUVE is averaged over (the paper: "
                                  "5)", count=1, default=MAUVE_SUBSETS, metavar="K")
SUBSET_SIZE = Flag("--mauve-subset-size", "genppl: human texts per subset, drawn without "
                                          "replacement (the paper: 1000; --references must hold "
                                          "at least N)",
                   count=1, default=MAUVE_SUBSET_SIZE, metavar="N")
DEFAULT_SAMPLES = 64


@register
class GenerativePerplexity(Task):
    name = "genppl"
    flags = (SCORER, REFERENCES, SUBSETS, SUBSET_SIZE, VARIABLE, SAMPLES, BATCH_SIZE,
             MDLM_BLOCK)
    greedy = False  # (the paper's unconditional samples are drawn, not greedy)

    def check(self) -> None:
        args = self.args
        if not args.scorer:
            raise EvalError("--task genppl needs --scorer HF_DIR (a local Hugging Face causal "
                            "LM: GPT-2 Large in the paper)")
        self.references = read_texts(args.references, None) if args.references else None
        if self.references and len(self.references) < args.mauve_subset_size:
            raise EvalError(
                f"--references {args.references}: {len(self.references)} texts, but MAUVE "
                f"draws subsets of {args.mauve_subset_size} (--mauve-subset-size; the paper: "
                "1000)")
        self.scorer = HFScorer(args.scorer)  # (loads: a bad judge is said before the model)

    def run(self, loaded, decode, flags, publish) -> dict:
        args, d = self.args, decode
        samples = DEFAULT_SAMPLES if args.samples is None else args.samples
        result = generative_perplexity(loaded.decoder, loaded.tokenizer, self.scorer, samples,
                                       d.max_new_tokens, d.window, d.threshold, d.sampling(),
                                       args.batch_size, self.references,
                                       mauve_protocol={"subsets": args.mauve_subsets,
                                                       "size": args.mauve_subset_size},
                                       variable=args.variable_length)
        result["scorer"] = args.scorer
        return result


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
