#!/usr/bin/env bash
# GPU checks, for a machine with NVIDIA GPUs, CUDA torch and no internet. Needs wheels/ from
# tests/gpu/fetch_wheels.sh. Installs setdiff-dist next to the machine's torch, then runs the
# GPU tests (FlexAttention and permuted_causal gradients, TE attention and an FP8 step when
# Transformer Engine is present, an NCCL run) and the bf16 throughput / MFU benchmark of the
# 110M and 1.3B configs. Results go to $OUT (default: gpu-results/). Budget: under 8 minutes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-gpu-results}
WHEELS=${WHEELS:-wheels}
mkdir -p "$OUT"
start=$(date +%s)
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name(), 'x', torch.cuda.device_count())"
# the machine's torch stays; everything else comes from the carried wheels
python3 -m venv --system-site-packages .venv-gpu
. .venv-gpu/bin/activate
pip install --quiet --no-index --no-deps "$WHEELS"/*.whl
pip install --quiet --no-index --no-deps --no-build-isolation -e .
python -c "import deepspeed, megatron.core, setdiff_dist; print('installed in', $(date +%s) - $start, 's')"
status=0
timeout 240 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
    --junitxml "$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log" || status=1
timeout 300 python benchmarks/train_throughput.py --models 110m 1.3b --precision bf16 \
    --steps 20 --warmup 5 --micro-batch 8 --json "$OUT/throughput.json" 2>&1 \
    | grep -v -i warning | tee "$OUT/throughput.log" || status=1
echo "total $(( $(date +%s) - start )) s"
exit $status
