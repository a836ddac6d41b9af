"""docs/recipes.md, end to end and shrunk: a small file in each dataset's own schema goes through
setdiff-prep, two training steps of its paper config (configs/paper/, made tiny by overrides)
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


def test_lm1b_row_from_records_to_the_bound(tmp_path):
    """LM1B: sentences as records, BERT WordPiece from a vocab.txt with a BOS per chunk, the
    SetDLM row's config, the perplexity bound."""
    from data_prep.prep import prepare

    words = sorted({w.strip(",.;:?!'").lower() for w in sample_text().split()} - {""})
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ",", ".", "'",
                                "?", "!", ";", ":"] + words[:500]) + "\n")
    src = tmp_path / "lm1b.jsonl"
    src.write_text("".join(json.dumps({"text": s.strip()}) + "\n"
                           for s in sample_text().splitlines() if s.strip()))
    m = prepare([str(src)], f"wordpiece:{vocab}", 32, str(tmp_path / "data"), chunk_bos=True,
                valid_every=4, progress=False)
    run = tmp_path / "run"
    train("configs/paper/lm1b-110m-setdlm-s8.yaml", tmp_path / "data", run,
          m["tokenizer"]["vocab_size"])
    out = evaluate("--checkpoint", run, "--task", "ppl", "--batches", "2", "--batch-size", "2")
    assert out["ppl_bound"] > 1 and out["exact"] is False


def test_owt_and_cnn_dm_rows_from_records_to_their_numbers(tmp_path):
    """OWT: documents as Parquet, GPT-2 BPE, the BD3LM row's config (stratified times), then the
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
                   "--samples", "4", "--max-new-tokens", "16", "--references", refs)
    assert gen["gen_ppl"] > 1 and 0 < gen["mauve"] <= 1
    cnn = tmp_path / "cnn.jsonl"
    cnn.write_text("".join(json.dumps({"article": p, "highlights": p.splitlines()[0],
                                       "id": str(i)}) + "\n" for i, p in enumerate(paras[:3])))
    summ = evaluate("--checkpoint", run, "--task", "summarize", "--data", cnn,
                    "--max-new-tokens", "8")
    assert summ["count"] == 3 and 0 <= summ["rougeL"] <= 1
