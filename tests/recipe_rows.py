"""Every row of docs/recipes.md's row table, as a CPU-sized miniature of its whole pipeline:
the dataset's preparation (the recipe's own commands, on a few records in the dataset's
schema), two training steps of the row's config made tiny by overrides, and the row's
evaluation read from the table (its task, its flags, its weights: the last or the best
checkpoint, EMA or raw), cut to a few records.

One process runs them all in-process (each command's ``main``, one after the other: an
interpreter's start-up and imports once, not 70 times); ``tests/test_recipes.py`` starts it
and checks what it writes. Run by hand: ``python tests/recipe_rows.py --out DIR [--only
TABLE]``; each row's result goes to ``DIR/results.json`` as it finishes.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the overrides that make any row's config a CPU-sized model (the table's configs unchanged)
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.ffn_hidden_size=128", "data.seq_len=32", "data.micro_batch_size=2",
        "data.global_batch_size=4", "train.steps=2", "train.precision=fp32",
        "train.eval_batches=1", "checkpoint.interval=2", "train.log_interval=1",
        "data.num_workers=0", "parallel.tensor=1", "parallel.pipeline=1"]
QWEN = ["model.num_query_groups=2", "model.head_dim=16"]  # (Qwen3's grouped queries, shrunk)
GSM_PROMPT = ("<|im_start|>user\nPlease reason step by step, and put your final answer within "
              "$\\boxed{{}}$. {question}<|im_end|>\n<|im_start|>assistant\n")


def table_rows(path: str = os.path.join(ROOT, "docs", "recipes.md")) -> list[dict]:
    """The row table: ``{table, row, config, weights, evaluation, paper}`` per line."""
    keys = ("table", "row", "config", "weights", "evaluation", "paper")
    return [dict(zip(keys, (c.strip() for c in line.strip().strip("|").split("|"))))
            for line in open(path).read().splitlines()
            if re.match(r"\| (OWT|LM1B|GSM8K|CNN/DM|ROCStories) \|", line)]


def quietly(main, argv: list) -> tuple[int, str]:
    """A command's ``main(argv)`` in this process: its exit code and what it printed (the
    environment it sets up for a process group is put back, so the next one starts afresh)."""
    saved = dict(os.environ)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = main([str(a) for a in argv])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue()


def must(main, argv: list) -> str:
    code, out = quietly(main, argv)
    if code != 0:
        raise SystemExit(f"{getattr(main, '__module__', main)} {' '.join(map(str, argv))}: "
                         f"exit {code}\n{out[-2000:]}")
    return out


# -- the datasets, in their own schemas, through the recipes' preparation commands ---------------
def prepare_all(where: str) -> dict:
    """Each dataset's training shards (and test files), as docs/recipes.md prepares them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_prep.prep import main as prep
    from data_prep.tasks import main as tasks
    from setdiff_dist.data import sample_text

    os.makedirs(where, exist_ok=True)
    at = lambda *p: os.path.join(where, *p)  # noqa: E731
    text = sample_text()
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    data = {}

    # LM1B: sentences as records, BERT WordPiece from a vocab.txt, the test set a valid split
    words = sorted({w.strip(",.;:?!'").lower() for w in text.split()} - {""})
    with open(at("vocab.txt"), "w") as fh:
        fh.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ",", ".", "'", "?",
                            "!", ";", ":"] + words[:500]) + "\n")
    for name, part in (("train", lines[:-20]), ("test", lines[-20:])):
        os.makedirs(at("lm1b", name), exist_ok=True)
        with open(at("lm1b", name, "part.jsonl"), "w") as fh:
            fh.writelines(json.dumps({"text": s}) + "\n" for s in part)
    common = ["--text-field", "text", "--seq-len", "32", "--chunk-bos", "--detokenize", "lm1b",
              "--quiet"]
    must(prep, ["--input", at("lm1b", "train"), "--tokenizer", f"wordpiece:{at('vocab.txt')}",
                "--valid-every", "0", "--out", at("data", "lm1b"), *common])
    must(prep, ["--input", at("lm1b", "test"), "--tokenizer", at("data", "lm1b"), "--split",
                "valid", "--out", at("data", "lm1b-test"), *common])
    data["LM1B"] = {"train": at("data", "lm1b"), "test": at("data", "lm1b-test")}

    # OpenWebText: documents as Parquet, GPT-2's BPE
    pq.write_table(pa.Table.from_pylist([{"text": p} for p in paras]), at("owt.parquet"))
    must(prep, ["--input", at("owt.parquet"), "--text-field", "text", "--tokenizer", "gpt2",
                "--seq-len", "32", "--valid-every", "4", "--out", at("data", "owt"), "--quiet"])
    data["OWT"] = {"train": at("data", "owt")}

    # GSM8K: question / answer ("#### N") in the reference's chat prompt; the test file
    sums = [(2, 3), (4, 1), (5, 2), (1, 1), (3, 3), (6, 2), (2, 2), (7, 1)]
    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in sums]
    pq.write_table(pa.Table.from_pylist(rows), at("gsm-train.parquet"))
    pq.write_table(pa.Table.from_pylist(rows[:2]), at("gsm-test.parquet"))
    must(prep, ["--input", at("gsm-train.parquet"), "--tokenizer", "gpt2", "--seq-len", "128",
                "--mode", "padded", "--truncate", "--prompt-field", GSM_PROMPT, "--text-field",
                "{answer}", "--valid-every", "4", "--out", at("data", "gsm8k"), "--quiet"])
    must(tasks, ["gsm8k", "--input", at("gsm-test.parquet"), "--out", at("gsm8k-test.jsonl")])
    with open(at("gsm8k-test.jsonl")) as fh:  # (the test file in the training prompt)
        prompts = [json.loads(line)["prompt"] for line in fh]
    if prompts != [GSM_PROMPT.format(question=r["question"]) for r in rows[:2]]:
        raise SystemExit(f"setdiff-tasks gsm8k wrote other prompts than training's: {prompts}")
    data["GSM8K"] = {"train": at("data", "gsm8k"), "test": at("gsm8k-test.jsonl")}

    # CNN/DailyMail: article / highlights / id, framed [BOS] article [EOS] + "Summary: ..."
    records = [{"article": p, "highlights": p.splitlines()[0], "id": str(i)}
               for i, p in enumerate(paras)]
    pq.write_table(pa.Table.from_pylist(records), at("cnn-train.parquet"))
    pq.write_table(pa.Table.from_pylist(records[:2]), at("cnn-valid.parquet"))
    frame = ["--seq-len", "96", "--mode", "padded", "--bos-eos", "--max-prompt-tokens", "20",
             "--max-text-tokens", "10", "--prompt-field", "{article}", "--text-field",
             "Summary: {highlights}", "--quiet"]
    must(prep, ["--input", at("cnn-train.parquet"), "--tokenizer", "gpt2", "--valid-every", "0",
                "--out", at("data", "cnndm"), *frame])
    with open(at("data", "cnndm", "manifest.json")) as fh:  # (articles cut to 20 tokens)
        if not json.load(fh)["splits"]["train"]["prompts_cut"]:
            raise SystemExit("no CNN/DM article was cut at --max-prompt-tokens")
    must(prep, ["--input", at("cnn-valid.parquet"), "--tokenizer", at("data", "cnndm"),
                "--split", "valid", "--out", at("data", "cnndm-valid"), *frame])
    with open(at("cnn_dm_test.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records[:2])
    data["CNN/DM"] = {"train": at("data", "cnndm"), "valid": at("data", "cnndm-valid"),
                      "test": at("cnn_dm_test.jsonl")}

    # ROCStories: the Story Cloze CSV's schema, one middle sentence
    with open(at("cloze_test_val__spring2016.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["InputStoryid", "InputSentence1", "InputSentence2", "InputSentence3",
                    "InputSentence4", "RandomFifthSentenceQuiz1", "RandomFifthSentenceQuiz2",
                    "AnswerRightEnding"])
        w.writerow(["a", "Ann woke up late.", "She ran.", "The bus was gone.", "She walked.",
                    "She got there at noon.", "She flew.", "1"])
        w.writerow(["b", "Bo baked bread.", "It burned.", "He laughed.", "He tried again.",
                    "It flew.", "It was good.", "2"])
    must(tasks, ["rocstories", "--input", at("cloze_test_val__spring2016.csv"), "--middle", "1",
                 "--out", at("roc-1.jsonl")])
    data["ROCStories"] = {"test": at("roc-1.jsonl")}
    return data


# -- a row: its training run and its evaluation --------------------------------------------------
def training(row: dict, data: dict, where: str) -> tuple[str, list]:
    """The row's config, the run directory it trains into and the command's arguments (a
    ROCStories row evaluates an OWT run: the reference infills with its OWT checkpoints)."""
    config = os.path.join("configs", row["config"].strip("`"))
    table = "OWT" if row["table"] == "ROCStories" else row["table"]
    run = os.path.join(where, "runs", os.path.splitext(os.path.basename(config))[0])
    d = data[table]
    with open(os.path.join(d["train"], "manifest.json")) as fh:
        vocab = json.load(fh)["tokenizer"]["vocab_size"]
    argv = ["--config", config, f"run_dir={run}", f"data.train_shards={d['train']}",
            f"model.vocab_size={vocab}", *TINY]
    if table == "LM1B":  # (validated on the test set, as the recipe trains it)
        argv.append(f"data.valid_shards={d['test']}")
    if table == "CNN/DM":
        argv += [f"data.valid_shards={d['valid']}", *QWEN, "data.seq_len=96"]
    if table == "GSM8K":  # (from scratch: no Qwen3 checkpoint offline)
        argv += [*QWEN, "data.seq_len=128", "checkpoint.init_from_hf="]
    return run, argv


def evaluation(row: dict, data: dict, run: str) -> list:
    """``setdiff-eval``'s arguments for the row: the task and flags of its table cell, its
    weights, and the dataset's command cut to a few records and tokens."""
    cell = row["evaluation"]
    task = re.match(r"\w+", cell).group(0)
    flags = [f for f in re.findall(r"`([^`]+)`", cell)]
    checkpoint = os.path.join(run, "checkpoints", "best") if row["weights"].startswith("best") \
        else run
    argv = ["--checkpoint", checkpoint, "--task", task]
    for flag in flags:
        name, _, value = flag.partition(" ")
        if name == "--mdlm-block":  # (blocks of 32 for 8 new tokens: 4 here)
            value = "4"
        argv += [name] + ([value] if value else [])
    if "raw" in row["weights"]:
        argv.append("--raw-weights")
    d = data["OWT" if row["table"] == "ROCStories" else row["table"]]
    if task == "ppl":
        argv += ["--batches", "1", "--batch-size", "2"]
        if row["table"] == "LM1B":
            argv += ["--shards", d["test"]]
    elif task == "throughput":  # (the reference's protocol, its counts cut)
        argv += ["--unconditional", "--warmup", "1", "--samples", "2", "--max-new-tokens", "8",
                 "--top-p", "0.95", "--repetition-penalty", "1.05"]
    elif task == "gsm":
        argv += ["--data", d["test"], "--max-new-tokens", "8"]
        if "--thresholds" not in argv:
            argv += ["--thresholds", "inf,0.9"]
    elif task == "summarize":
        argv += ["--data", d["test"], "--template", "{article}Summary:", "--bos-eos",
                 "--max-prompt-tokens", "20", "--max-new-tokens", "8"]
    elif task == "infill":
        argv += ["--data", data["ROCStories"]["test"], "--preset", "infill"]
    return argv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a directory for the data, runs and results")
    ap.add_argument("--only", help="the rows of this table only (e.g. LM1B)")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # (the table names configs from the repository's root)
    from setdiff_dist.cli.eval import main as setdiff_eval
    from setdiff_dist.cli.train import main as setdiff_train

    rows = [r for r in table_rows() if args.only in (None, r["table"])]
    start = time.monotonic()
    data = prepare_all(os.path.join(args.out, "work"))
    print(f"[rows] data prepared in {time.monotonic() - start:.0f} s", flush=True)
    results, trained = [], {}
    for i, row in enumerate(rows):
        t0 = time.monotonic()
        if row["config"] == "any LM1B row":  # (throughput: the LM1B SetDLM S <= 8 run)
            row = dict(row, config="`paper/lm1b-110m-setdlm-s8.yaml`")
        run, train_argv = training(row, data, args.out)
        if run not in trained:
            must(setdiff_train, train_argv)
            trained[run] = True
        argv = evaluation(row, data, run)
        out = must(setdiff_eval, argv)
        result = json.loads(out[out.index("{"):])
        results.append({"row": row, "argv": argv, "result": result})
        with open(os.path.join(args.out, "results.json"), "w") as fh:
            json.dump(results, fh, indent=1)
        print(f"[rows] {i + 1}/{len(rows)} {row['table']} {row['row']}: {result['task']} in "
              f"{time.monotonic() - t0:.1f} s", flush=True)
    print(f"[rows] {len(rows)} rows in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
