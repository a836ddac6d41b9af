"""``setdiff-tasks``: evaluation and fine-tuning task sets, made offline.

    setdiff-tasks gsm    --out gsm.jsonl    --size 2000 --seed 0
    setdiff-tasks infill --out infill.jsonl [--size 2000] [--seed 0]

- ``gsm``: GSM8K-style grade-school problems with numeric answers, from reasoning-gym's
  ``gsm_symbolic`` generator (templated GSM8K problems). Records: ``prompt``
  (``"Question: ...\\nAnswer: "``), ``completion`` (the worked solution ending in ``#### N``),
  ``answer``. Prepare them for fine-tuning with
  ``setdiff-prep --mode padded --prompt-field prompt --text-field completion``.
- ``infill``: ROCStories-style infilling on real prose: windows of five consecutive KJV verses
  (within a chapter), the middle one or three to fill. Records: ``left``, ``middle``, ``right``,
  ``n_middle``, ``source``.

(No summarization proxy yet: the offline candidate, the gensim enwiki sample, needs a 25 MB
wheel of an unrelated library.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

from .corpus import kjv_verses


def gsm(size: int, seed: int) -> list[dict]:
    try:
        import reasoning_gym
    except ImportError:
        raise RuntimeError("the gsm task needs reasoning-gym (pip install -e '.[tasks]')") from None
    out = []
    for item in reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed):
        answer = str(item["answer"]).strip()
        cot = str(item["metadata"].get("answer_cot", "")).strip()
        if "####" not in cot:
            cot = f"{cot}\n#### {answer}".strip()
        out.append({"prompt": f"Question: {item['question'].strip()}\nAnswer: ",
                    "completion": cot, "answer": answer})
    return out


def infill(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    windows, chapter, verses = [], None, []
    for v in kjv_verses():
        key = (v["book"], v["chapter"])
        if key != chapter:
            verses, chapter = [], key
        verses.append(v)
        if len(verses) == 5:
            windows.append(verses)
            verses = []
    rng.shuffle(windows)
    out = []
    for w in windows[:size]:
        n = rng.choice((1, 3))
        s = [v["text"].strip() for v in w]
        lo = (5 - n) // 2
        out.append({"left": " ".join(s[:lo]), "middle": " ".join(s[lo:lo + n]),
                    "right": " ".join(s[lo + n:]), "n_middle": n,
                    "source": f"{w[0]['citation']}-{w[-1]['verse']}"})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-tasks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", choices=("gsm", "infill"))
    ap.add_argument("--out", required=True, help="output .jsonl")
    ap.add_argument("--size", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        records = (gsm if args.task == "gsm" else infill)(args.size, args.seed)
    except RuntimeError as exc:
        print(f"setdiff-tasks: error: {exc}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(args.out + ".tmp", args.out)
    print(f"setdiff-tasks: {len(records)} {args.task} records -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
