"""Shared by the end-to-end tests: small real shards, the setdiff-train command line, an
in-process process group, and one tiny NELBO step (the GPU tests and tests/gpu/smoke.py)."""

import contextlib
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


def copy_run(run, where):
    """A copy of a shared run directory (``where/run``, without its lock) that a test may
    change."""
    import shutil
    from pathlib import Path

    out = Path(where) / "run"
    shutil.copytree(run, out, ignore=shutil.ignore_patterns(".setdiff.lock"))
    return out


def tree_hash(directory) -> str:
    """One SHA-256 over every file under ``directory``, names and contents: equal before and
    after a command that must write nothing."""
    import hashlib

    h = hashlib.sha256()
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for f in sorted(files):
            path = os.path.join(root, f)
            h.update(path.encode())
            with open(path, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def train_command(run_dir, shards, *overrides, nproc=2, steps=4, seq_len=32, vocab=257,
                  global_batch=8, micro_batch=2):
    """``setdiff-train --nproc-per-node N`` on the tiny config; later overrides win."""
    return [sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", str(nproc),
            "--config", "configs/tiny-cpu.yaml", f"run_dir={run_dir}",
            f"data.train_shards={shards}", f"data.seq_len={seq_len}",
            f"model.vocab_size={vocab}", f"train.steps={steps}", "train.log_interval=1",
            f"data.global_batch_size={global_batch}", f"data.micro_batch_size={micro_batch}",
            "optimizer.warmup_steps=2", "train.tensorboard=false", *overrides]


# What torchrun (or our own init) puts in the environment. A child that inherits them from a
# test process that joined a process group would take itself for a rank of that group: it would
# skip its own launcher and bind the parent's MASTER_PORT.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_MAX_RESTARTS")


def child_env(env=None):
    """``env`` (default: this process's environment) without the launch variables."""
    env = dict(os.environ if env is None else env)
    for key in LAUNCH_VARIABLES:
        env.pop(key, None)
    return env


def run_train(*args, env=None, **kw):
    """``setdiff-train`` as a child with its own ranks, whatever group this process is in."""
    return subprocess.run(train_command(*args, **kw), capture_output=True, text=True,
                          timeout=600, env=child_env(env))


@contextlib.contextmanager
def process_group(backend, seed=0):
    """This process as a world of one (megatron's groups on top), as the GPU tests and the GPU
    smoke stage use it; the environment is restored afterwards."""
    from setdiff_dist.parallel import destroy_model_parallel, initialize_model_parallel

    saved = dict(os.environ)
    initialize_model_parallel(seed=seed, backend=backend)
    try:
        yield
    finally:
        destroy_model_parallel()
        os.environ.clear()
        os.environ.update(saved)


def tiny_nelbo_step(backend="sdpa", layer_spec="local", device="cuda", L=64, B=2, V=512,
                    overrides=(), **config_kwargs):
    """One forward and backward of the staggered NELBO on a 2-layer model: (per-token NLL,
    {name: grad}). Needs a process group (``process_group``). ``overrides`` are more model.*
    keys, ``config_kwargs`` go to ``transformer_config``."""
    import torch

    from setdiff_dist.config import load_config
    from setdiff_dist.diffusion import make_schedule, nelbo, sample_orders
    from setdiff_dist.model.forward import set_diffusion_inputs, set_diffusion_nll
    from setdiff_dist.model.transformer import build_model, transformer_config

    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=64",
                             "model.num_attention_heads=4", f"model.vocab_size={V}",
                             f"model.attention_backend={backend}",
                             f"model.layer_spec={layer_spec}", *overrides]).model
    model = build_model(cfg, transformer_config(cfg, **config_kwargs), seed=3).to(device)
    x = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(0)).to(device)
    o = sample_orders(make_schedule("staggered", L, mean_set_size=4), L, range(B), 0)
    inp = set_diffusion_inputs(x, o, model.mask_id, backend)
    nll = set_diffusion_nll(model(inp.tokens, inp.positions, inp.attention_mask,
                                  inp.logits_from), x, inp)
    nelbo(nll, o.to(device)).per_token.backward()
    return nll.detach(), {n: p.grad for n, p in model.named_parameters()}


def losses(run_dir):
    """Training losses by step from ``metrics.jsonl``."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
