"""docs/recipes.md, end to end and shrunk: a small file in each dataset's own schema (LM1B, OWT,
GSM8K, CNN/DailyMail, ROCStories) goes through setdiff-prep (setdiff-tasks for ROCStories), two
training steps of its paper config (configs/paper/, configs/finetune/, made tiny by overrides)
and its evaluation. Slow tier: each recipe is a training launch."""

import json
import subprocess
import sys

import pytest
from helpers import child_env, run_cli

from setdiff_dist.data import sample_text

pytestmark = pytest.mark.slow

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.ffn_hidden_size=128", "data.seq_len=32", "data.micro_batch_size=2",
        "data.global_batch_size=4", "train.steps=2", "train.precision=fp32",
        "train.eval_batches=1", "checkpoint.interval=2", "train.log_interval=1",
        "data.num_workers=0"]


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


def rocstories(tmp_path):
    """Two stories in the Story Cloze CSV's own schema, through setdiff-tasks rocstories."""
    import csv

    src = tmp_path / "cloze_test_val__spring2016.csv"
    with open(src, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["InputStoryid", "InputSentence1", "InputSentence2", "InputSentence3",
                    "InputSentence4", "RandomFifthSentenceQuiz1", "RandomFifthSentenceQuiz2",
                    "AnswerRightEnding"])
        w.writerow(["a", "Ann woke up late.", "She ran.", "The bus was gone.", "She walked.",
                    "She got there at noon.", "She flew.", "1"])
        w.writerow(["b", "Bo baked bread.", "It burned.", "He laughed.", "He tried again.",
                    "It flew.", "It was good.", "2"])
    out = tmp_path / "roc.jsonl"
    res = run_cli("data_prep.tasks", "rocstories", "--input", src, "--out", out)
    assert res.returncode == 0, res.stderr[-2000:]
    return out


def test_lm1b_row_from_records_to_the_bound(tmp_path):
    """LM1B as docs/recipes.md runs it: sentences as records, BERT WordPiece from a vocab.txt
    with a BOS per chunk, the training file with no validation split and the test file as a
    validation split of its own (``--split valid``, the training shards' tokenizer), the SetDLM
    row's config validated on the test set, and the recipe's perplexity command on it."""
    lines = [s.strip() for s in sample_text().splitlines() if s.strip()]
    words = sorted({w.strip(",.;:?!'").lower() for w in sample_text().split()} - {""})
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ",", ".", "'",
                                "?", "!", ";", ":"] + words[:500]) + "\n")
    for name, part in (("train", lines[:-20]), ("test", lines[-20:])):
        (tmp_path / "lm1b" / name).mkdir(parents=True)
        (tmp_path / "lm1b" / name / "part.jsonl").write_text(
            "".join(json.dumps({"text": s}) + "\n" for s in part))
    data, test = tmp_path / "data" / "lm1b", tmp_path / "data" / "lm1b-test"
    for args in ([tmp_path / "lm1b" / "train", "--tokenizer", f"wordpiece:{vocab}",
                  "--valid-every", "0", "--out", data],
                 [tmp_path / "lm1b" / "test", "--tokenizer", data, "--split", "valid",
                  "--out", test]):
        res = run_cli("data_prep.prep", "--input", args[0], "--text-field", "text",
                      "--seq-len", "32", "--chunk-bos", "--detokenize", "lm1b", "--quiet",
                      *args[1:])
        assert res.returncode == 0, res.stderr[-2000:]
    vocab_size = json.load(open(data / "manifest.json"))["tokenizer"]["vocab_size"]
    run = tmp_path / "run"
    train("configs/paper/lm1b-110m-setdlm-s8.yaml", data, run, vocab_size,
          f"data.valid_shards={test}")
    # the row's config keeps its best checkpoint (validated on the test set): the recipe's
    # command for the rows the reference reads at their best
    assert (run / "checkpoints" / "best").is_file()
    out = evaluate("--checkpoint", run / "checkpoints" / "best", "--task", "ppl", "--shards",
                   test, "--batches", "2", "--batch-size", "2")
    assert out["ppl_bound"] > 1 and out["exact"] is False
    # ROCStories infilling by a set-diffusion checkpoint: the middle between both contexts
    roc = evaluate("--checkpoint", run, "--task", "infill", "--data", rocstories(tmp_path),
                   "--preset", "infill")
    assert roc["conditioning"] == "left and right" and roc["count"] == 2
    assert roc["tokens_per_s"] > 0 and 0 <= roc["rougeL"] <= 1


def test_owt_and_cnn_dm_rows_from_records_to_their_numbers(tmp_path):
    """OWT: documents as Parquet, GPT-2 BPE, the BD3LM row's config, then the
    bound and generative perplexity with MAUVE under an exported causal model; CNN/DailyMail
    records summarized and scored with rouge-score by the same checkpoint."""
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
    ppl = evaluate("--checkpoint", run, "--task", "ppl", "--batches", "2", "--batch-size", "2")
    assert ppl["ppl_bound"] > 1
    # the scorer (GPT-2 Large in the paper): a causal LM on the same data, in the Llama form
    # that exports to Hugging Face
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
    cnn = tmp_path / "cnn.jsonl"
    cnn.write_text("".join(json.dumps({"article": p, "highlights": p.splitlines()[0],
                                       "id": str(i)}) + "\n" for i, p in enumerate(paras[:3])))
    summ = evaluate("--checkpoint", run, "--task", "summarize", "--data", cnn,
                    "--max-new-tokens", "8")
    assert summ["count"] == 3 and 0 <= summ["rougeL"] <= 1
    # ROCStories' AR and BD3LM rows: infilled from the left context, as the reference scores them
    roc = rocstories(tmp_path)
    for checkpoint in (run, causal):
        out = evaluate("--checkpoint", checkpoint, "--task", "infill", "--data", roc,
                       "--preset", "infill")
        assert out["conditioning"] == "left" and out["count"] == 2, out


SHRINK_QWEN = ["model.num_query_groups=2", "model.head_dim=16", "parallel.tensor=1"]


def test_gsm8k_rows_from_records_to_the_tau_sweep(tmp_path):
    """GSM8K: records in its schema (question / answer ending "#### N") as Parquet, prepared in
    the paper's chat prompt, a few steps of the SetDLM fine-tune config (from scratch here: no
    Qwen3 checkpoint offline), then the tau sweep of accuracy, tokens/step and tokens/s."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_prep.prep import prepare

    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in ((2, 3), (4, 1), (5, 2), (1, 1), (3, 3), (6, 2), (2, 2), (7, 1))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    prompt = ("<|im_start|>user\nPlease reason step by step, and put your final answer within "
              "$\\boxed{{}}$. {question}<|im_end|>\n<|im_start|>assistant\n")
    m = prepare([str(tmp_path / "train.parquet")], "gpt2", 64, str(tmp_path / "data"),
                mode="padded", prompt_field=prompt, text_field="{answer}", valid_every=4,
                progress=False)
    run = tmp_path / "run"
    train("configs/finetune/qwen3-1.7b-gsm.yaml", tmp_path / "data", run,
          m["tokenizer"]["vocab_size"], *SHRINK_QWEN, "data.seq_len=64",
          "checkpoint.init_from_hf=")
    # the test file as the recipe builds it, from GSM8K's own schema, in the training prompt
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "test.parquet")
    test = tmp_path / "test.jsonl"
    res = run_cli("data_prep.tasks", "gsm8k", "--input", tmp_path / "test.parquet", "--out",
                  test)
    assert res.returncode == 0, res.stderr[-2000:]
    assert [json.loads(line)["prompt"] for line in open(test)] == [
        prompt.format(question=r["question"]) for r in rows[:2]]
    out = evaluate("--checkpoint", run / "checkpoints" / "best", "--task", "gsm", "--data", test,
                   "--thresholds", "inf,0.9", "--max-new-tokens", "8")
    assert [r["threshold"] for r in out["sweep"]] == ["inf", 0.9]
    for r in out["sweep"]:
        assert r["count"] == 2 and 0 <= r["accuracy"] <= 1 and r["tokens_per_s"] > 0


def test_cnn_dailymail_row_from_records_to_rouge(tmp_path):
    """CNN/DailyMail: records in its schema (article / highlights / id) as Parquet, framed as
    the reference frames them ([BOS] article [EOS] cut to N, "Summary: ..." [EOS] the target cut
    to M), a few steps of the MDLM row's config, then ROUGE
    of summaries cued with "Summary:", decoded in blocks (``--mdlm-block``) from the best
    checkpoint, as the reference evaluates that row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_prep.prep import prepare

    paras = [p.strip() for p in sample_text().split("\n\n") if p.strip()][:12]
    records = [{"article": p, "highlights": p.splitlines()[0], "id": str(i)}
               for i, p in enumerate(paras)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "train.parquet")
    m = prepare([str(tmp_path / "train.parquet")], "gpt2", 32, str(tmp_path / "data"),
                mode="padded", prompt_field="{article}", text_field="Summary: {highlights}",
                bos_eos=True, max_prompt_tokens=20, max_text_tokens=10, valid_every=4,
                progress=False)
    assert m["splits"]["train"]["prompts_cut"] > 0
    run = tmp_path / "run"
    train("configs/paper/cnndm-qwen3s-mdlm.yaml", tmp_path / "data", run,
          m["tokenizer"]["vocab_size"], *SHRINK_QWEN)
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    out = evaluate("--checkpoint", run / "checkpoints" / "best", "--task", "summarize", "--data",
                   test, "--template", "{article}Summary:", "--bos-eos", "--max-prompt-tokens",
                   "20", "--max-new-tokens", "8", "--mdlm-block", "4")
    assert out["count"] == 2 and 0 <= out["rougeL"] <= 1 and out["tokens_per_s"] > 0
