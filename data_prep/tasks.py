"""``setdiff-tasks``: evaluation and fine-tuning task sets, made offline.

    setdiff-tasks gsm    --out gsm.jsonl    --size 2000 --seed 0
    setdiff-tasks chain  --out chain.jsonl  --size 2000 --seed 0 [--terms 2-5] [--digits 1]
    setdiff-tasks infill --out infill.jsonl [--size 2000] [--seed 0]
    setdiff-tasks rocstories --input cloze_test_val__spring2016.csv --middle 1 --out roc.jsonl
    setdiff-tasks gsm8k  --input gsm8k/test.parquet --out gsm8k-test.jsonl [--template T]

- ``gsm``: GSM8K-style grade-school problems with numeric answers, from reasoning-gym's
  ``gsm_symbolic`` generator (templated GSM8K problems). Records: ``prompt``
  (``"Question: ...\\nAnswer: "``), ``completion`` (the worked solution ending in ``#### N``),
  ``answer``. Prepare them for fine-tuning with
  ``setdiff-prep --mode padded --prompt-field prompt --text-field completion``.
- ``chain``: chains of small additions and subtractions (reasoning-gym's ``chain_sum``, the
  arithmetic family; ``--terms 2-5 --digits 1`` by default) with a worked solution that keeps
  a running total, one line per operation (``4 - 1 = 3`` / ``3 - 7 = -4`` / ``#### -4``).
  The same record fields as ``gsm``, so ``setdiff-eval --task gsm`` scores them. A model of a
  few million parameters learns it on a CPU; its solution text is formulaic, as GSM8K's is.
- ``rocstories``: the paper's infilling set from ROCStories' own CSV (``--input``): the Story
  Cloze files (``InputSentence1``-``4`` and the right ending of ``RandomFifthSentenceQuiz1`` /
  ``2`` by ``AnswerRightEnding``; the paper uses ``cloze_test_val__spring2016.csv``) or the
  story files (``sentence1``-``5``). ``--middle 1`` masks the third sentence, ``--middle 3``
  the second to fourth, as the reference does; the span's length is the reference middle's (an
  oracle length). Every story, in file order. The parts join to the story's text as they are
  (``left + middle + right``): the left context ends without a space, the middle and the right
  context begin with the one that joins them. ``"bos_eos": true`` says the record is a whole
  document, which ``setdiff-eval --task infill`` frames as the reference does, with a
  beginning-of-sequence and an end-of-text token.
- ``gsm8k``: GSM8K's own test split (``--input``: records with ``question`` and ``answer``, the
  answer's solution ending in ``#### N``; ``.jsonl`` or ``.parquet``) as the test file of
  ``setdiff-eval --task gsm``: ``{"prompt", "answer"}`` per problem, the prompt ``--template``
  over the record (Python's format: ``{question}``; a literal brace doubled), by default the
  chat turn that the GSM8K recipe fine-tunes on (:data:`GSM8K_TEMPLATE`), the answer the number
  after ``####``, commas removed. Every problem, in file order.
- ``infill``: ROCStories-style infilling on real prose: windows of five consecutive KJV verses
  (within a chapter), or with ``--unit clause`` five clauses (sentence-sized, so that a window
  fits L = 128), the middle one or three to fill. Records: ``left``, ``middle``, ``right``,
  ``n_middle``, ``source``. ``setdiff-eval --task infill`` keeps of a record longer than the
  model's context the tokens nearest the middle (counted as ``contexts_cut``).

(No summarization proxy yet: the offline candidate, the gensim enwiki sample, needs a 25 MB
wheel of an unrelated library.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
from typing import Optional

from setdiff_dist.cli import HelpFormatter, command, count

from .corpus import CorpusError, kjv_verses


def gsm(size: int, seed: int) -> list[dict]:
    try:
        import reasoning_gym
    except ImportError:
        raise CorpusError("the gsm task needs reasoning-gym (pip install -e '.[tasks]')") from None
    out = []
    for item in reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed):
        answer = str(item["answer"]).strip()
        cot = str(item["metadata"].get("answer_cot", "")).strip()
        if "####" not in cot:
            cot = f"{cot}\n#### {answer}".strip()
        out.append({"prompt": f"Question: {item['question'].strip()}\nAnswer: ",
                    "completion": cot, "answer": answer})
    return out


def chain(size: int, seed: int, terms: tuple = (2, 5), digits: int = 1) -> list[dict]:
    """``size`` chain sums of ``terms`` operands of ``digits`` digits, with a running-total
    solution; the answer is reasoning-gym's."""
    try:
        import reasoning_gym
    except ImportError:
        raise CorpusError("the chain task needs reasoning-gym (pip install -e '.[tasks]')") \
            from None
    if not 2 <= terms[0] <= terms[1]:
        raise CorpusError(f"--terms {terms[0]}-{terms[1]}: give LO-HI with 2 <= LO <= HI")
    out = []
    for item in reasoning_gym.create_dataset("chain_sum", size=size, seed=seed,
                                             min_terms=terms[0], max_terms=terms[1],
                                             min_digits=digits, max_digits=digits):
        expr = item["metadata"]["expression"].split()
        total, lines = int(expr[0]), []
        for op, x in zip(expr[1::2], expr[2::2]):
            new = total + int(x) if op == "+" else total - int(x)
            lines.append(f"{total} {op} {x} = {new}")
            total = new
        if str(total) != str(item["answer"]).strip():
            raise CorpusError(f"chain_sum item {expr}: the worked total {total} is not the "
                              f"generator's answer {item['answer']}")
        out.append({"prompt": f"Question: {' '.join(expr)} =\nAnswer: ",
                    "completion": "\n".join(lines) + f"\n#### {total}", "answer": str(total)})
    return out


CLAUSE_END = re.compile(r"(?<=[.;:?!])\s+")


def _units(verses: list[dict], unit: str) -> list[tuple[str, str]]:
    """A chapter's verses as (text, citation) units: the verses themselves, or their clauses
    (split after . ; : ? !, at least three words), which are sentence-sized like ROCStories'
    sentences, so that five of them fit a short context (L = 128)."""
    if unit == "verse":
        return [(v["text"].strip(), v["citation"]) for v in verses]
    out = []
    for v in verses:
        for part in CLAUSE_END.split(v["text"].strip()):
            if len(part.split()) >= 3:
                out.append((part, v["citation"]))
            elif out:  # a fragment joins the clause before it
                out[-1] = (out[-1][0] + " " + part, out[-1][1])
    return out


def infill(size: int, seed: int, chapters: Optional[set] = None,
           unit: str = "verse") -> list[dict]:
    """``size`` windows of five consecutive units of one chapter (all windows when fewer), the
    middle one or three to fill. ``unit`` is ``verse`` or ``clause``; ``chapters`` restricts the
    windows to chapters named as ``setdiff-corpus`` names its KJV documents (``"Genesis 1"``),
    e.g. a held-out split."""
    if unit not in ("verse", "clause"):
        raise ValueError(f"unit must be verse or clause, got {unit!r}")
    rng = random.Random(seed)
    by_chapter: dict = {}
    for v in kjv_verses():
        name = f"{v['book']} {v['chapter']}"
        if chapters is None or name in chapters:
            by_chapter.setdefault(name, []).append(v)
    windows = []
    for verses in by_chapter.values():
        units = _units(verses, unit)
        windows += [units[i:i + 5] for i in range(0, len(units) - 4, 5)]
    rng.shuffle(windows)
    out = []
    for w in windows[:size]:
        n = rng.choice((1, 3))
        s = [text for text, _ in w]
        lo = (5 - n) // 2
        out.append({"left": " ".join(s[:lo]), "middle": " ".join(s[lo:lo + n]),
                    "right": " ".join(s[lo + n:]), "n_middle": n, "unit": unit,
                    "source": f"{w[0][1]}-{w[-1][1].rsplit(':', 1)[1]}"})
    return out


CLOZE = ("InputSentence1", "InputSentence2", "InputSentence3", "InputSentence4",
         "RandomFifthSentenceQuiz1", "RandomFifthSentenceQuiz2", "AnswerRightEnding")
STORY = ("sentence1", "sentence2", "sentence3", "sentence4", "sentence5")


def rocstories(path: str, middle: int = 1, size: Optional[int] = None) -> list[dict]:
    """ROCStories' five-sentence stories from its CSV, as infill records: ``middle`` = 1 masks
    the third sentence, 3 the second to fourth (the reference's two spans). ``left + middle +
    right`` is the story: the middle and the right context begin with their joining space."""
    from .csv_records import CsvRecords

    if middle not in (1, 3):
        raise CorpusError(f"--middle {middle}: the paper's spans are 1 (the third sentence) or "
                          "3 (the second to fourth)")
    try:
        fh = open(path, newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise CorpusError(f"--input {path}: {exc.strerror}; give ROCStories' CSV file") from None
    out = []
    with fh:
        reader = CsvRecords(path, fh, CorpusError)  # (a quote never closed: an error)
        columns = set(reader.fieldnames or ())
        cloze = set(CLOZE) <= columns
        if not cloze and not set(STORY) <= columns:
            raise CorpusError(
                f"{path}: not a ROCStories CSV: its header has {sorted(columns)[:8]}; expected "
                f"the Story Cloze columns {', '.join(CLOZE)} or the story columns "
                f"{', '.join(STORY)}")
        for number, row in reader:
            if size is not None and len(out) == size:
                break
            if cloze:
                ending = str(row["AnswerRightEnding"]).strip()
                if ending not in ("1", "2"):
                    raise CorpusError(f"{path}, line {number}: AnswerRightEnding is "
                                      f"{ending!r}, not 1 or 2")
                s = [row[f"InputSentence{i}"] for i in range(1, 5)]
                s.append(row[f"RandomFifthSentenceQuiz{ending}"])
                ident = row.get("InputStoryid") or str(number)
            else:
                s = [row[c] for c in STORY]
                ident = row.get("storyid") or str(number)
            s = [(x or "").strip() for x in s]
            if not all(s):
                raise CorpusError(f"{path}, line {number}: a story needs five sentences; "
                                  f"sentence {s.index('') + 1} is empty")
            lo = 2 if middle == 1 else 1
            # (the reference encodes "s1 s2", "s3" and " s4 s5" each on its own: no space
            # ends the left context; the middle's joining space is here so that the parts
            # join to the story, and the eval encodes the middle without it, as the reference)
            out.append({"left": " ".join(s[:lo]), "middle": " " + " ".join(s[lo:lo + middle]),
                        "right": " " + " ".join(s[lo + middle:]), "n_middle": middle,
                        "unit": "sentence", "bos_eos": True, "source": f"rocstories:{ident}"})
    if not out:
        raise CorpusError(f"{path}: no stories")
    return out


# The prompt of the GSM8K recipe (docs/recipes.md): Qwen's chat turn around the reference's
# instruction, a Python format over a GSM8K record (the braces of \boxed{} doubled)
GSM8K_TEMPLATE = ("<|im_start|>user\nPlease reason step by step, and put your final answer "
                  "within $\\boxed{{}}$. {question}<|im_end|>\n<|im_start|>assistant\n")
_GSM8K_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def gsm8k(path: str, template: str = GSM8K_TEMPLATE, size: Optional[int] = None) -> list[dict]:
    """GSM8K's records (``question``, ``answer`` ending in ``#### N``) from a JSONL or Parquet
    file, read as ``setdiff-prep`` reads records, as ``{"prompt", "answer"}``: the prompt
    ``template`` over the record, the answer N without its commas."""
    import string

    from .prep import TABLES, _json_records, _read_text, _table_records, field

    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise CorpusError(f"--template {template!r}: not a valid template ({exc}); write a "
                          "literal brace as {{ or }}") from None
    if any(name == "" or name.isdigit() for name in names):
        raise CorpusError(f"--template {template!r}: fields are named ({{question}}); write a "
                          "literal brace as {{ or }} (\\boxed{{}})")
    if not os.path.isfile(path):
        raise CorpusError(f"--input {path}: no such file; give GSM8K's test split (.jsonl or "
                          ".parquet)")
    base = path[:-3] if path.endswith(".gz") else path
    if path.endswith(TABLES):
        records = _table_records(path)
    elif base.endswith((".jsonl", ".json")):
        records = _json_records(path, _read_text(path))
    else:
        raise CorpusError(f"--input {path}: give GSM8K's test split as .jsonl or .parquet")
    out = []
    for where, rec in records:
        if size is not None and len(out) == size:
            break
        prompt = field(rec, template, where, "--template")
        solution = rec.get("answer")
        if not isinstance(solution, str):
            raise CorpusError(f"{where}: no string field 'answer' (GSM8K's solution, ending in "
                              f"'#### N'); fields: {', '.join(map(str, rec))}")
        if "####" not in solution:
            raise CorpusError(f"{where}: its answer has no '#### N' (GSM8K's solutions end with "
                              f"the number after ####): {solution[-80:]!r}")
        answer = solution.rpartition("####")[2].strip().replace(",", "")
        if not _GSM8K_NUMBER.fullmatch(answer):
            raise CorpusError(f"{where}: the answer after '####' is {answer!r}, not a number")
        out.append({"prompt": prompt, "answer": answer})
    if not out:
        raise CorpusError(f"{path}: no records")
    return out


def held_out(make, size: int, exclude: list[str]) -> list[dict]:
    """``size`` records of ``make(n)`` (the first n of a seeded stream) whose questions are not
    in the ``exclude`` task files and not repeated, drawing more until there are enough (a
    generator's question space may be small: chain sums of 2 one-digit operands have 200)."""
    seen = set()
    for path in exclude:
        try:
            with open(path, encoding="utf-8") as fh:
                seen.update(json.loads(line)["prompt"] for line in fh if line.strip())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorpusError(f"--exclude {path}: not a gsm / chain task file "
                             f"({type(exc).__name__}: {exc})") from None
    n = size
    while True:
        out, taken = [], set(seen)
        drawn = make(n)
        for r in drawn:
            if r["prompt"] not in taken:
                taken.add(r["prompt"])
                out.append(r)
                if len(out) == size:
                    return out
        if n >= 64 * size + 10_000:
            raise CorpusError(f"only {len(out)} of {n} drawn questions are not "
                             f"in --exclude: ask for fewer than {size}, or a wider generator")
        n *= 4


@command("setdiff-tasks")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-tasks", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("task", choices=("gsm", "chain", "infill", "rocstories", "gsm8k"),
                    help="which task set to make (see above)")
    ap.add_argument("--out", required=True, help="output .jsonl")
    ap.add_argument("--size", type=count(), default=None,
                    help="records (default: 2000; rocstories / gsm8k: every record of "
                         "--input, or its first N)")
    ap.add_argument("--input", default=None,
                    help="rocstories: ROCStories' CSV file; gsm8k: GSM8K's test split "
                         "(.jsonl or .parquet)")
    ap.add_argument("--template", default=None,
                    help="gsm8k: the prompt, a template of the record's fields ({question}; "
                         "a literal brace doubled); default: the GSM8K recipe's chat turn")
    ap.add_argument("--middle", type=int, choices=(1, 3), default=1,
                    help="rocstories: sentences to fill, the third (1) or second to fourth (3)")
    ap.add_argument("--seed", type=int, default=0,
                    help="gsm / chain / infill: the generator's seed")
    ap.add_argument("--unit", choices=("verse", "clause"), default="verse",
                    help="infill: five verses, or five clauses (sentence-sized; fit L = 128)")
    ap.add_argument("--terms", default="2-5", help="chain: operands per problem, LO-HI")
    ap.add_argument("--digits", type=count(), default=1, help="chain: digits per operand")
    ap.add_argument("--exclude", metavar="JSONL", action="append", default=[],
                    help="gsm / chain: a held-out set: drop every record whose question "
                         "(prompt) is in this task file (the training set), and repeated "
                         "questions, drawing more until --size are left (repeatable)")
    args = ap.parse_args(argv)
    if args.exclude and args.task not in ("gsm", "chain"):
        ap.error(f"--exclude is for gsm and chain (their questions repeat); {args.task} "
                 "records are distinct by construction")
    reads = {"rocstories": "ROCStories' CSV file", "gsm8k": "GSM8K's test split (.jsonl or "
             ".parquet)"}
    if (args.task in reads) != bool(args.input):
        ap.error(f"{args.task} needs --input: {reads[args.task]}" if args.task in reads
                 else f"--input is for rocstories and gsm8k; {args.task} makes its records "
                      "itself")
    if args.template is not None and args.task != "gsm8k":
        ap.error(f"--template is for gsm8k; {args.task} writes its own prompts")
    size = 2000 if args.size is None else args.size
    if args.task == "rocstories":
        records = rocstories(args.input, args.middle, args.size)
    elif args.task == "gsm8k":
        records = gsm8k(args.input, GSM8K_TEMPLATE if args.template is None else args.template,
                        args.size)
    elif args.task in ("gsm", "chain"):
        if args.task == "chain":
            try:
                lo, _, hi = args.terms.partition("-")
                terms = (int(lo), int(hi or lo))
            except ValueError:
                ap.error(f"--terms {args.terms!r}: give LO-HI, e.g. 2-5")
            make = lambda n: chain(n, args.seed, terms, args.digits)  # noqa: E731
        else:
            make = lambda n: gsm(n, args.seed)  # noqa: E731
        if args.exclude:
            records = held_out(make, size, args.exclude)
        else:
            records = make(size)
    else:
        records = infill(size, args.seed, unit=args.unit)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(args.out + ".tmp", args.out)
    print(f"setdiff-tasks: {len(records)} {args.task} records -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
