"""docs/recipes.md, end to end and shrunk: a small file in each dataset's own schema (LM1B, OWT,
GSM8K, CNN/DailyMail, ROCStories) goes through setdiff-prep (setdiff-tasks for ROCStories), two
training steps of its paper config (configs/paper/, configs/finetune/, made tiny by overrides)
and its evaluation: every row of the row table in one process (tests/recipe_rows.py), and the
dataset sections' other commands as launches. Slow tier."""

import json
import os
import subprocess
import sys

import pytest
from helpers import child_env, run_cli
from recipe_rows import TINY

from setdiff_dist.data import sample_text

pytestmark = pytest.mark.slow

def train(config, shards, run_dir, vocab, *extra):
    cmd = [sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", "1", "--config",
           config, f"run_dir={run_dir}", f"data.train_shards={shards}",
           f"model.vocab_size={vocab}", *TINY, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())
    assert res.returncode == 0, res.stderr[-3000:]


def evaluate(*args):
    res = run_cli("setdiff_dist.cli.eval", *args)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout[res.stdout.index("{"):])


def test_every_row_of_the_table_trains_and_evaluates_as_written(tmp_path):
    """Each row of the table (tests/recipe_rows.py): its dataset prepared by the recipe's
    commands, two steps of its config, then its evaluation cell run on the weights it names
    (last or best, EMA or raw: the result's provenance says which were read), each with the
    numbers its task reports."""
    from recipe_rows import table_rows

    from setdiff_dist.checkpoint.weights import locate

    res = subprocess.run([sys.executable, "tests/recipe_rows.py", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=1500, env=child_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    done = json.load(open(tmp_path / "results.json"))
    rows = table_rows()
    assert len(rows) >= 37 and [d["row"]["row"] for d in done] == [r["row"] for r in rows]
    for d in done:
        row, r = d["row"], d["result"]
        where = (row["table"], row["row"])
        assert r["weights"] == ("raw" if "raw" in row["weights"] else "ema"), (where, r)
        # (the best checkpoint where the row reads it: a pointer to the step it names)
        asked = d["argv"][d["argv"].index("--checkpoint") + 1]
        assert (os.path.basename(asked) == "best") == row["weights"].startswith("best"), where
        assert r["checkpoint"] == os.path.abspath(locate(asked)[1]), (where, r)
        task = r["task"]
        if task == "ppl":
            assert r["ppl_bound"] > 1 and r["exact"] == (row["row"] == "AR"), (where, r)
        elif task == "gsm":
            want = ["inf"] if "--thresholds inf" in row["evaluation"] else ["inf", 0.9]
            assert [s["threshold"] for s in r["sweep"]] == want, (where, r)
            assert all(s["count"] == 2 and s["tokens_per_s"] > 0 for s in r["sweep"]), r
        elif task == "summarize":
            assert r["count"] == 2 and 0 <= r["rougeL"] <= 1 and "bleu" in r, (where, r)
            assert r["decode"].get("mdlm_block") == (4 if "mdlm-block" in row["evaluation"]
                                                     else None), (where, r)
        elif task == "infill":
            left = "left only" in row["evaluation"]
            assert r["conditioning"] == ("left" if left else "left and right"), (where, r)
            assert r["count"] == 2, (where, r)
        else:
            assert task == "throughput" and r["warmup_samples"] == 1, (where, r)
            assert r["batch_size"] == 1, (where, r)


def test_owt_samples_scored_by_an_exported_causal_lm_with_mauve(tmp_path):
    """The OWT section's sample-quality command (not a row of the table): a BD3LM row's samples
    scored for generative perplexity and MAUVE by a causal LM (GPT-2 Large in the paper; here a
    causal run on the same data, in the Llama form that exports to Hugging Face)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_prep.prep import prepare

    paras = [p.strip() for p in sample_text().split("\n\n") if p.strip()]
    pq.write_table(pa.Table.from_pylist([{"text": p} for p in paras]), tmp_path / "owt.parquet")
    m = prepare([str(tmp_path / "owt.parquet")], "gpt2", 32, str(tmp_path / "data"),
                valid_every=4, progress=False)
    run = tmp_path / "run"
    train("configs/paper/owt-110m-bd3lm4.yaml", tmp_path / "data", run,
          m["tokenizer"]["vocab_size"])
    causal = tmp_path / "causal"
    train("configs/paper/owt-110m-ar.yaml", tmp_path / "data", causal,
          m["tokenizer"]["vocab_size"], "model.normalization=rmsnorm", "model.activation=swiglu")
    res = run_cli("setdiff_dist.cli.convert", "--checkpoint", causal, "--to-hf", "--out",
                  tmp_path / "hf")
    assert res.returncode == 0, res.stderr[-3000:]
    refs = tmp_path / "refs.jsonl"
    refs.write_text("".join(json.dumps({"text": p}) + "\n" for p in paras[:6]))
    gen = evaluate("--checkpoint", run, "--task", "genppl", "--scorer", tmp_path / "hf",
                   "--samples", "4", "--max-new-tokens", "16", "--references", refs,
                   "--mauve-subset-size", "4")
    assert gen["gen_ppl"] > 1 and 0 < gen["mauve"] <= 1
