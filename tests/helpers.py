"""Shared by the end-to-end tests: small real shards, and the setdiff-train command line."""

import json
import os
import subprocess
import sys

from data_prep.prep import prepare
from setdiff_dist.data import sample_text


def sonnet_shards(directory, tokenizer="bytes", seq_len=32, valid_every=4):
    """Shards of the built-in sonnets (one document per stanza), made by setdiff-prep."""
    os.makedirs(directory, exist_ok=True)
    src = os.path.join(directory, "sonnets.txt")
    with open(src, "w") as fh:
        fh.write(sample_text())
    out = os.path.join(directory, "shards")
    prepare([src], tokenizer, seq_len, out, split_paragraphs=True, valid_every=valid_every,
            workers=1, progress=False)
    return out


def train_command(run_dir, shards, *overrides, nproc=2, steps=4, seq_len=32, vocab=257,
                  global_batch=8, micro_batch=2):
    """``setdiff-train --nproc-per-node N`` on the tiny config; later overrides win."""
    return [sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", str(nproc),
            "--config", "configs/tiny-cpu.yaml", f"run_dir={run_dir}",
            f"data.train_shards={shards}", f"data.seq_len={seq_len}",
            f"model.vocab_size={vocab}", f"train.steps={steps}", "train.log_interval=1",
            f"data.global_batch_size={global_batch}", f"data.micro_batch_size={micro_batch}",
            "optimizer.warmup_steps=2", "train.tensorboard=false", *overrides]


def run_train(*args, env=None, **kw):
    return subprocess.run(train_command(*args, **kw), capture_output=True, text=True,
                          timeout=600, env=env)


def losses(run_dir):
    """Training losses by step from ``metrics.jsonl``."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
