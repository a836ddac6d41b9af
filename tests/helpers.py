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


# the session's reference runs (conftest.trained): one step count and schedule for all, so that
# every test that needs a trained checkpoint can share one
REFERENCE_STEPS = 6
REFERENCE_INTERVAL = 3
REFERENCE = (f"checkpoint.interval={REFERENCE_INTERVAL}",)
VOCAB = {"bytes": 257, "bpe:300": 300}
# the reference run that keeps an EMA of the weights, under ZeRO-3, with a checkpoint every step
# (all of them kept)
EMA_RUN = ("zero.stage=3", "train.ema_decay=0.5", "checkpoint.interval=1",
           "checkpoint.keep_last=0", "optimizer.warmup_steps=0")


def rewound(run, where, step=REFERENCE_INTERVAL):
    """A copy of a shared run (``where/run``) as it was after ``step``: its later checkpoints
    and metrics gone, ``latest`` at ``step``. Resuming it continues the shared run's curve."""
    import json
    import shutil

    out = copy_run(run, where)
    root = out / "checkpoints"
    for d in root.glob("step_*"):
        if int(d.name.split("_")[1]) > step:
            shutil.rmtree(d)
    (root / "latest").write_text(f"step_{step:07d}\n")
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        rows = [line for line in metrics.read_text().splitlines()
                if json.loads(line).get("step", 0) <= step]
        metrics.write_text("".join(r + "\n" for r in rows))
    for f in ("exit_status.json",):
        if (out / f).exists():
            (out / f).unlink()
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


def cli(module, argv, capsys):
    """``main(argv)`` of a command in this process: (exit code, standard error); the signal
    handlers that setdiff-train installs are given back to pytest."""
    import importlib
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    environ = dict(os.environ)  # (a command that joins a process group sets RANK, MASTER_PORT..:
    try:                        # a later child would take itself for a rank of it)
        code = importlib.import_module(module).main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        os.environ.clear()
        os.environ.update(environ)
    return code, capsys.readouterr().err


def run_cli(module, *argv):
    """A command's ``main(argv)`` in this process, its output captured: an object with
    ``returncode``, ``stdout`` and ``stderr``, as ``subprocess.run`` returns (without the start-up
    of a new interpreter importing torch, megatron-core and DeepSpeed)."""
    import io
    import types

    out, err = io.StringIO(), io.StringIO()

    class _Captured:  # (capsys's stand-in)
        @staticmethod
        def readouterr():
            return types.SimpleNamespace(out=out.getvalue(), err=err.getvalue())

    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code, _ = cli(module, [str(a) for a in argv], _Captured)
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def train_config(run_dir, shards, *overrides, **kw):
    """The config :func:`train_command` would train with (same arguments), in this process."""
    from setdiff_dist.config import load_config

    cmd = train_command(run_dir, shards, *overrides, **kw)
    at = cmd.index("--config")
    return load_config(cmd[at + 1], cmd[at + 2:])


def resume_check(run_dir, shards, *overrides, tp=1, pp=1, dp=2, **kw):
    """What setdiff-train checks before it builds a model, when ``train_command(run_dir,
    shards, *overrides, **kw)`` on ``tp x pp x dp`` ranks would resume ``run_dir``: in this
    process, no launch. Returns the manifest, or raises the error the launch prints."""
    from setdiff_dist.checkpoint.files import resume_path
    from setdiff_dist.checkpoint.manifest import check_resume
    from setdiff_dist.data.loader import TokenLoader
    from setdiff_dist.train.loop import open_data
    from setdiff_dist.train.optimizer_state import deepspeed_form_change

    cfg = train_config(run_dir, shards, *overrides, **kw)
    train_set, _, _ = open_data(cfg)
    here = {"tensor": tp, "pipeline": pp, "data": dp, "world": tp * pp * dp, "context": 1}
    stream = TokenLoader(train_set, global_batch=cfg.data.global_batch_size,
                         micro_batch=cfg.data.micro_batch_size, dp_size=dp,
                         seed=cfg.train.seed, shuffle=cfg.data.shuffle).state_dict()
    path = resume_path(cfg)
    return check_resume(path, cfg, train_set.manifest["tokenizer"], here, stream,
                        form_change=deepspeed_form_change(path, cfg) if path else None)


def curve(run_dir):
    """``(training losses, validation rows)`` from a run's ``metrics.jsonl``."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return [r["loss"] for r in rows if "loss" in r], [r for r in rows if "valid_loss" in r]


# Layouts trained in-process, several per spawn of ranks (start-up dominates on 2 cores): the
# reference run's config (train_command's, REFERENCE_STEPS steps, no checkpoint unless asked)
# plus these overrides, by the number of ranks they need. test_train, test_precision,
# test_context_parallel.
_DIVERGE = ["optimizer.lr=1e30", "optimizer.grad_clip=0", "train.max_nonfinite_steps=2",
            "optimizer.warmup_steps=0", "optimizer.schedule=constant", "optimizer.min_lr=0"]
_QK = ["model.qk_norm=true", "checkpoint.save_at_end=true"]
LAYOUTS = {
    1: [("dp1", []), ("bf16-dp1", ["train.precision=bf16"]), ("qk-tp1", _QK),
        ("causal-dp1", ["order.kind=causal"])],
    2: [("zero0", ["zero.stage=0"]), ("zero0-pp2", ["zero.stage=0", "parallel.pipeline=2"]),
        ("zero2", ["zero.stage=2"]), ("zero3", ["zero.stage=3"]),
        ("tp2", ["parallel.tensor=2"]), ("pp2", ["parallel.pipeline=2"]),
        ("tp2-sp", ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
        ("bf16", ["train.precision=bf16"]),
        ("bf16-zero2", ["train.precision=bf16", "zero.stage=2"]),
        ("bf16-zero3", ["train.precision=bf16", "zero.stage=3"]),
        ("bf16-tp2", ["train.precision=bf16", "parallel.tensor=2"]),
        ("bf16-pp2", ["train.precision=bf16", "parallel.pipeline=2"]),
        ("qk-tp2", [*_QK, "parallel.tensor=2"]),
        ("qk-tp2-sp", [*_QK, "parallel.tensor=2", "parallel.sequence_parallel=true"]),
        # (the same on FSDP's ZeRO-2, whose new parameters carry none of the originals' hooks)
        ("qk-tp2-sp-fsdp", [*_QK, "parallel.tensor=2", "parallel.sequence_parallel=true",
                            "zero.stage=2"]),
        ("pp-diverges", [*_DIVERGE, "zero.stage=0", "parallel.pipeline=2"]),
        # weight decay on megatron's engine, DeepSpeed's at ZeRO-3 (partitioned parameters)
        # and at PP=2 (the last stage's tied output weight)
        ("decay", ["optimizer.weight_decay=0.5"]),
        ("decay-zero3", ["zero.stage=3", "optimizer.weight_decay=0.5"]),
        ("decay-pp2-deepspeed", ["zero.implementation=deepspeed", "parallel.pipeline=2",
                                 "optimizer.weight_decay=0.5", "checkpoint.save_at_end=true"]),
        ("cp2", ["parallel.context=2"]),
        ("bf16-cp2", ["train.precision=bf16", "parallel.context=2"]),
        ("causal-cp2", ["order.kind=causal", "parallel.context=2"])],
    4: [("tp2xpp2", ["parallel.tensor=2", "parallel.pipeline=2"]),
        ("cp2-tp2", ["parallel.context=2", "parallel.tensor=2"]),
        ("cp2-pp2", ["parallel.context=2", "parallel.pipeline=2"]),
        ("causal-cp2-pp2", ["order.kind=causal", "parallel.context=2", "parallel.pipeline=2"]),
        ("bf16-tp2xpp2", ["train.precision=bf16", "parallel.tensor=2", "parallel.pipeline=2"]),
        ("bf16-tp2xpp2-sp", ["train.precision=bf16", "parallel.tensor=2", "parallel.pipeline=2",
                             "parallel.sequence_parallel=true"])],
}


def fit_layouts(rank, shards, root, layouts, out):
    """(In a spawned rank.) ``Trainer.fit`` for each ``(name, overrides)`` of ``layouts``,
    quiet as setdiff-train is; rank 0 saves {name: curve, or (error type, message)}. Every
    rank also writes, per layout, the bytes its collectives sent in each step (a recording
    wrapper of torch.distributed, tests/comm_record.py) to ``root/comm/<name>.rank<R>.json``:
    test_scale_model holds the scale model to them."""
    import torch
    from comm_record import CommRecorder

    recorder = CommRecorder().__enter__()  # before DeepSpeed and megatron start
    from setdiff_dist.quiet import quiet

    quiet()
    from setdiff_dist.errors import SetdiffError
    from setdiff_dist.train.loop import Trainer

    found = {}
    os.makedirs(f"{root}/comm", exist_ok=True)
    for name, overrides in layouts:
        run_dir = f"{root}/{name}"
        cfg = train_config(run_dir, shards, "checkpoint.save_at_end=false", *overrides,
                           steps=REFERENCE_STEPS)
        try:
            t = Trainer(cfg)
            starts = mark_steps(t)
            first = len(recorder.calls)
            t.fit()
            found[name] = curve(run_dir) if rank == 0 else None
            with open(f"{root}/comm/{name}.rank{rank}.json", "w") as fh:
                json.dump(_bytes_per_step(recorder.calls[first:], starts), fh)
        except SetdiffError as exc:
            found[name] = (type(exc).__name__, str(exc))
    if rank == 0:
        torch.save(found, out)


def mark_steps(trainer) -> list:
    """The times the trainer's steps start, appended as they do."""
    import time

    starts, start_step = [], trainer.timers.start_step

    def marked():
        if trainer.timers._step_start is None:  # (a step starts once)
            starts.append(time.perf_counter())
        start_step()

    trainer.timers.start_step = marked
    return starts


def _bytes_per_step(calls, starts) -> list:
    """``[{kind: bytes sent}]`` for each step that ``starts`` bound."""
    bounds = list(starts) + [float("inf")]
    steps = []
    for a, b in zip(bounds, bounds[1:]):
        sent = {}
        for c in calls:
            if a <= c.t < b:
                sent[c.kind] = sent.get(c.kind, 0.0) + c.wire
        steps.append(sent)
    return steps


def run_layouts(shards, root, layouts=None):
    """Every layout of ``layouts`` (default :data:`LAYOUTS`), one spawn per world size, each in
    a child process whose standard error is kept: ``({name: result}, {name: stderr of its
    spawn})``; run dirs under ``root``."""
    import torch

    found, stderr = {}, {}
    for world, group in (layouts or LAYOUTS).items():
        out = os.path.join(root, f"world{world}.pt")
        code = ("import pathlib, sys; sys.path.insert(0, 'tests')\n"
                "from helpers import fit_layouts\n"
                "from mp_harness import spawn\n"
                f"spawn(fit_layouts, {world}, {str(shards)!r}, {str(root)!r}, {group!r}, "
                f"{out!r})\n")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=1800, env=child_env())
        assert res.returncode == 0, res.stderr[-3000:]
        found.update(torch.load(out))
        stderr.update({name: res.stderr for name, _ in group})
    return found, stderr


# What torchrun (or our own init) puts in the environment. A child that inherits them from a
# test process that joined a process group would take itself for a rank of that group: it would
# skip its own launcher and bind the parent's MASTER_PORT.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_MAX_RESTARTS")


def noise(stderr: str) -> list:
    """The lines of a command's standard error that are a library's warning (a quiet command
    prints none), but for coverage's own, where ``pytest --cov`` measures the command."""
    lines = stderr.splitlines()
    return [line for i, line in enumerate(lines)
            if any(word in line for word in ("Warning", "[WARNING]", "warnings.warn"))
            and "CoverageWarning" not in line and not (i and "CoverageWarning" in lines[i - 1])]


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
