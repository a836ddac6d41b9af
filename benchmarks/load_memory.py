"""Peak host memory of loading a checkpoint for inference (and of exporting it), in separate
processes, as a multiple of the model's fp32 bytes.

    python benchmarks/load_memory.py [--vocab 50257] [--keep DIR]

It trains the 110m shape as a Llama (vocabulary 50,257: ~124M parameters, ~0.5 GB in fp32)
for one step
at TP=2 on 2 CPU ranks (so the checkpoint holds per-rank shards that loading must merge), and
a tiny model for the baseline (Python, torch, megatron and DeepSpeed imports). Then, each in its
own process under ``/usr/bin/time -f %M``: ``setdiff-generate``, and
``setdiff-convert`` to an export and to Hugging Face. Reported: peak RSS minus the tiny
model's, divided by the model's fp32 bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _train(run_dir, shards, config, *overrides, nproc=2):
    cmd = [sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", str(nproc),
           "--config", config, f"run_dir={run_dir}", f"data.train_shards={shards}",
           "data.seq_len=32", "train.steps=1", "data.global_batch_size=2",
           "data.micro_batch_size=1", "optimizer.warmup_steps=0", "train.tensorboard=false",
           "train.eval_batches=1", *overrides]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])


def _peak_kib(*cmd) -> int:
    with tempfile.NamedTemporaryFile("r") as out:
        res = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", out.name, *cmd],
                             capture_output=True, text=True, cwd=ROOT)
        if res.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
        return int(out.read().strip().splitlines()[-1])


def _generate(checkpoint):
    return _peak_kib(sys.executable, "-m", "setdiff_dist.cli.generate", "--checkpoint",
                     checkpoint, "--prompt", "Shall I", "--max-new-tokens", "2", "--window", "1",
                     "--greedy")


def main() -> int:
    from helpers import sonnet_shards

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--keep", help="keep the runs in this directory")
    args = ap.parse_args()
    tmp = args.keep or tempfile.mkdtemp(prefix="load-memory-")
    shards = sonnet_shards(os.path.join(tmp, "data"))
    big, tiny = os.path.join(tmp, "110m-tp2"), os.path.join(tmp, "tiny")
    # the 110m shape as a Llama (RMSNorm, SwiGLU 2048 wide), so that --to-hf applies
    _train(big, shards, "configs/models/110m.yaml", f"model.vocab_size={args.vocab}",
           "model.normalization=rmsnorm", "model.activation=swiglu",
           "model.ffn_hidden_size=2048", "parallel.tensor=2", "zero.stage=1")
    _train(tiny, shards, "configs/tiny-cpu.yaml", "model.vocab_size=257", nproc=1)
    from safetensors import safe_open

    latest = open(os.path.join(big, "checkpoints", "latest")).read().strip()
    weights = os.path.join(big, "checkpoints", latest, "weights")
    params, counted = 0, set()
    for f in sorted(os.listdir(weights)):
        if f.endswith(".safetensors"):
            with open(os.path.join(weights, f[:-len(".safetensors")] + ".json")) as fh:
                meta = json.load(fh)["tensors"]
            with safe_open(os.path.join(weights, f), "pt") as fh:
                for k in fh.keys():
                    if not meta[k]["tensor_parallel"] and k in counted:
                        continue  # replicated over TP ranks: count it once
                    counted.add(k)
                    params += math.prod(fh.get_slice(k).get_shape())
    model_kib = params * 4 / 1024
    rows = [("setdiff-generate", _generate(big), _generate(tiny))]
    # (a set-diffusion model: --to-hf only with --as-causal-lm; the memory is the same)
    for what, extra in (("export", []), ("--to-hf", ["--to-hf", "--as-causal-lm"])):
        out = os.path.join(tmp, f"out-{what.strip('-')}")
        tiny_out = os.path.join(tmp, f"tiny-{what.strip('-')}")
        cmd = [sys.executable, "-m", "setdiff_dist.cli.convert", "--checkpoint"]
        b = _peak_kib(*cmd, tiny, *extra, "--out", tiny_out)
        rows.append((f"setdiff-convert {what}", _peak_kib(*cmd, big, *extra, "--out", out), b))
    print(f"model: {params / 1e6:.1f}M parameters, {model_kib / 2**20:.2f} GiB in fp32, "
          "checkpoint trained at TP=2")
    print(f"{'command':<34} {'peak RSS':>10} {'tiny baseline':>14} {'above it / model':>17}")
    for name, peak, b in rows:
        print(f"{name:<34} {peak / 2**20:8.2f} G {b / 2**20:12.2f} G "
              f"{(peak - b) / model_kib:16.2f}x")
    if not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
