"""What a red-team probe found giving a user a wrong number without a word, or a traceback
where a message belongs (issue 30), each shown fixed: the LR after a resume that changes the
schedule, validation that depended on the data-parallel size, weights read without their
checksums, rounded blend weights, blends identified by name and size, rewinds over newer
checkpoints, a full disk during a save, an unwritable run directory, the offline harness, an
export over a file, the dry run under context parallelism, and the smaller misleading messages.

Pure checks run in-process; the few launches reuse the session's trained runs
(``conftest.trained``) and copy them before changing anything."""

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    EMA_RUN,
    REFERENCE,
    child_env,
    copy_run,
    resume_check,
    run_cli,
    run_train,
    train_command,
    train_config,
    tree_hash,
)


def _flip(path, at=0.5):
    """Flip one byte of ``path`` (in its tensor data, past any header): its size stays."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- 1. the LR

BASE = {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "schedule": "cosine", "steps": 6}


def _schedule_config(**change):
    from setdiff_dist.config import load_config

    o = dict(BASE, **change)
    return load_config(None, [f"optimizer.lr={o['lr']}", f"optimizer.min_lr={o['min_lr']}",
                              f"optimizer.warmup_steps={o['warmup_steps']}",
                              f"optimizer.schedule={o['schedule']}", f"train.steps={o['steps']}"])


def _scheduled(cfg):
    """A torch AdamW over two groups and the trainer's LambdaLR, as the engine builds them."""
    from setdiff_dist.train.engine import lr_multiplier

    groups = [{"params": [torch.nn.Parameter(torch.ones(3))]},
              {"params": [torch.nn.Parameter(torch.ones(2))], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.optimizer.lr)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(cfg.optimizer,
                                                                      cfg.train.steps))


def _step(opt, sched):
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    sched.step()


@pytest.mark.parametrize("change", [{}, {"lr": 1e-2}, {"min_lr": 1e-3}, {"warmup_steps": 4},
                                    {"schedule": "constant"}, {"schedule": "linear"},
                                    {"steps": 9}, {"lr": 1e-3, "steps": 8}],
                         ids=["unchanged", "lr", "min_lr", "warmup", "constant", "linear",
                              "steps", "lr+steps"])
def test_after_a_resume_every_step_has_the_lr_of_a_fresh_run_with_the_new_config(change):
    """The optimizer and scheduler states of a checkpoint at step 4 (the old schedule) loaded
    as DeepSpeed loads them, then put on the run's schedule: every later step's LR is the one
    a fresh run with the new config has at that step; unchanged, bit for bit the old run's."""
    from setdiff_dist.train.engine import follow_schedule

    old, new = _schedule_config(), _schedule_config(**change)
    opt, sched = _scheduled(old)
    for _ in range(4):
        _step(opt, sched)
    resumed_opt, resumed = _scheduled(new)
    resumed_opt.load_state_dict(opt.state_dict())
    resumed.load_state_dict(sched.state_dict())
    follow_schedule(resumed, new, 4)
    fresh_opt, fresh = _scheduled(new)
    for _ in range(4):
        _step(fresh_opt, fresh)
    for step in range(4, new.train.steps):
        got = [g["lr"] for g in resumed_opt.param_groups]
        assert got == [g["lr"] for g in fresh_opt.param_groups], (step, got)
        if not change:  # bit-exact with the uninterrupted run
            assert got == [g["lr"] for g in opt.param_groups]
            _step(opt, sched)
        assert min(got) >= new.optimizer.min_lr or step < new.optimizer.warmup_steps
        _step(resumed_opt, resumed)
        _step(fresh_opt, fresh)


def test_a_resume_on_another_schedule_logs_the_fresh_runs_lr_and_says_so(trained, sonnets,
                                                                         tmp_path):
    """The red team's case, through setdiff-train: the reference run (6 steps) resumed to 9
    with another LR, floor, warm-up and schedule logs, at steps 7-9, exactly the LR of a fresh
    run with the new config, and says once what changed. ``checkpoint.init_from`` given to a
    run directory that already has a checkpoint is named as unused."""
    from setdiff_dist.train.engine import lr_multiplier

    source = trained()
    run = copy_run(source, tmp_path)
    change = ("optimizer.lr=1e-2", "optimizer.min_lr=1e-3", "optimizer.warmup_steps=3",
              "optimizer.schedule=linear")
    res = run_train(run, sonnets, *REFERENCE, *change, f"checkpoint.init_from={source}",
                    steps=9)
    assert res.returncode == 0, res.stderr[-3000:]
    note = [line for line in res.stdout.splitlines() if "optimizer settings differ" in line]
    assert len(note) == 1, res.stdout
    for words in ("optimizer.lr 0.003 -> 0.01", "optimizer.min_lr 0.0003 -> 0.001",
                  "optimizer.warmup_steps 2 -> 3", "optimizer.schedule cosine -> linear",
                  "train.steps 6 -> 9", "from step 7 on"):
        assert words in note[0], note[0]
    assert f"checkpoint.init_from={source} only starts a new run and is not used" in res.stdout
    cfg = _schedule_config(lr=1e-2, min_lr=1e-3, warmup_steps=3, schedule="linear", steps=9)
    f = lr_multiplier(cfg.optimizer, 9)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r and r["step"] > 6}
    assert lrs == {s: 1e-2 * f(s - 1) for s in (7, 8, 9)}


# ----------------------------------------------------------------------------- 2. validation

def _validation(rank, shards, root, out, layouts):
    from setdiff_dist.config import load_config
    from setdiff_dist.train.loop import Trainer

    found = {}
    for name, overrides in layouts:
        trainer = Trainer(load_config("configs/tiny-cpu.yaml", [
            f"run_dir={root}/{name}", "resume=never", f"data.train_shards={shards}",
            "data.seq_len=32", "model.vocab_size=257", "data.global_batch_size=8",
            "data.micro_batch_size=2", "train.tensorboard=false", "train.eval_batches=2",
            *overrides]))
        found[name] = trainer.evaluate()
    if rank == 0:
        torch.save(found, out)


def test_validation_gives_the_same_numbers_on_every_layout(sonnets, tmp_path):
    """The same weights (every layout draws them from the seed) on 1 rank and, in one spawn of
    2, at DP2, TP2 and PP2: the same validation samples, orders and loss (fp32), 16 samples
    of the split (2 global batches)."""
    from mp_harness import spawn

    from setdiff_dist.data.shards import ShardSet

    spawn(_validation, 1, sonnets, str(tmp_path), tmp_path / "one.pt", [("dp1", [])])
    spawn(_validation, 2, sonnets, str(tmp_path), tmp_path / "two.pt",
          [("dp2", []), ("tp2", ["parallel.tensor=2"]), ("pp2", ["parallel.pipeline=2"])])
    found = {**torch.load(tmp_path / "one.pt"), **torch.load(tmp_path / "two.pt")}
    valid = ShardSet(sonnets, "valid")
    want_tokens = sum(int(valid[i][1]) - 1 for i in range(min(16, len(valid))))
    for name, got in found.items():
        assert got["valid_tokens"] == want_tokens, (name, got)
        assert got["valid_loss"] == pytest.approx(found["dp1"]["valid_loss"], rel=2e-6), name


# ----------------------------------------------------------------------------- 3. checksums

def test_a_flipped_byte_in_any_weights_file_is_refused_by_every_reader(trained, sonnets,
                                                                       tmp_path, capsys):
    """Raw weights, the EMA and an export: one flipped byte (the size unchanged) is named by
    every read: open_weights, setdiff-convert, -generate, -eval and setdiff-train's
    checkpoint.init_from."""
    from setdiff_dist.checkpoint.weights import LoadError, open_weights
    from setdiff_dist.cli.convert import main as convert

    run = copy_run(trained(*EMA_RUN), tmp_path)
    export = tmp_path / "export"
    assert convert(["--checkpoint", str(run), "--out", str(export)]) == 0
    step = run / "checkpoints" / "step_0000006"
    targets = [(step / "weights" / "tp00_pp00_part01.safetensors", run, True),
               (step / "weights_ema" / "tp00_pp00.safetensors", run, False),
               (export / "model.safetensors", export, False)]
    for file, path, raw in targets:
        open_weights(str(path), raw=raw)  # (intact)
        original = file.read_bytes()
        _flip(file)
        with pytest.raises(LoadError) as err:
            open_weights(str(path), raw=raw)
        name = os.path.relpath(file, step if path == run else export)
        assert f"{name} does not match its SHA-256 checksum" in str(err.value), str(err.value)
        if path == run:
            file.write_bytes(original)
    # every command, on the raw weights file damaged
    _flip(targets[0][0])
    name = "weights/tp00_pp00_part01.safetensors does not match its SHA-256"
    capsys.readouterr()
    assert convert(["--checkpoint", str(run), "--raw-weights", "--out",
                    str(tmp_path / "x")]) == 2
    assert name in capsys.readouterr().err and not (tmp_path / "x").exists()
    for module, args in (("setdiff_dist.cli.generate", ["--prompt", "Shall I",
                                                        "--max-new-tokens", "4"]),
                         ("setdiff_dist.cli.eval", ["--task", "ppl", "--batches", "1"])):
        res = run_cli(module, "--checkpoint", run, "--raw-weights", *args)
        assert res.returncode == 2 and name in res.stderr, res.stderr[-2000:]
        assert "Traceback" not in res.stderr
    res = run_train(tmp_path / "new", sonnets, f"checkpoint.init_from={run}", steps=2, nproc=1)
    assert res.returncode == 2 and name in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


# ----------------------------------------------------------------------------- 4, 5. blends

@pytest.mark.parametrize("weights", [("0.00001", "0.99999"), ("0.3", "0.7"), ("1", "2", "4"),
                                     ("0.001", "0.25", "0.749"), ("5", "0.5", "1e-3", "2")])
def test_a_blend_draws_each_corpus_within_one_sample_of_its_weight(sonnets, weights):
    """After any number n of samples drawn (two periods of the blend, every prefix), each
    corpus has been drawn within one sample of n x its weight; each corpus's draws are the
    consecutive positions of its own stream."""
    from fractions import Fraction

    from setdiff_dist.data.blend import Blend
    from setdiff_dist.data.shards import ShardSet

    s = ShardSet(sonnets, "train")
    blend = Blend([s] * len(weights), list(weights), [f"c{i}" for i in range(len(weights))])
    shares = [Fraction(w) / sum(Fraction(x) for x in weights) for w in weights]
    taken, worst = [0] * len(weights), 0.0
    for n in range(1, 2 * blend.period + 1):
        d, k = blend.locate(n - 1)
        assert k == taken[d]
        taken[d] += 1
        worst = max(worst, max(abs(taken[j] - n * shares[j]) for j in range(len(weights))))
    assert worst < 1, worst
    assert taken == [int(2 * blend.period * w) for w in shares]


def test_weights_the_blend_cannot_draw_exactly_are_refused_with_the_smallest_it_can():
    from setdiff_dist.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny-cpu.yaml", ["data.train_shards=1e-7 data/a 1 data/b"])
    text = str(err.value)
    assert "cannot draw these weights exactly" in text and "data/a has a share of 1e-07" in text
    assert "the smallest the blend honours, 1e-06" in text
    with pytest.raises(ConfigError, match="at most 6 decimal places"):
        load_config("configs/tiny-cpu.yaml", ["data.train_shards=0.1234567 data/a 0.5 data/b"])


def _rot13_corpus(directory, sonnets_text):
    """Shards of the sonnets in rot13: the same sizes, other bytes (same basename)."""
    import codecs

    from data_prep.prep import prepare

    os.makedirs(directory, exist_ok=True)
    src = os.path.join(directory, "text.txt")
    with open(src, "w") as fh:
        fh.write(codecs.encode(sonnets_text, "rot13"))
    out = os.path.join(directory, "shards")
    prepare([src], "bytes", 32, out, split_paragraphs=True, valid_every=4, workers=1,
            progress=False)
    return out


def test_another_corpus_with_the_same_name_and_size_does_not_resume(trained, sonnets,
                                                                    tmp_path):
    """A checkpoint records each corpus's manifest digest (every shard's SHA-256): other data
    under the same name and sample count is refused, by the loader and by setdiff-train, which
    checks it from the manifest before building a model."""
    from setdiff_dist.data import sample_text
    from setdiff_dist.data.loader import TokenLoader
    from setdiff_dist.data.shards import ShardError, ShardSet

    other = _rot13_corpus(tmp_path / "rot13", sample_text())
    ours, theirs = ShardSet(sonnets, "train"), ShardSet(other, "train")
    assert len(ours) == len(theirs) and os.path.basename(other) == os.path.basename(sonnets)
    saved = TokenLoader(ours, global_batch=8, micro_batch=2).state_dict()
    with pytest.raises(ShardError, match="holds other data than the checkpoint's"):
        TokenLoader(theirs, global_batch=8, micro_batch=2).load_state_dict(saved)
    run = trained()
    manifest = json.loads((run / "checkpoints" / "step_0000006" / "manifest.json").read_text())
    assert manifest["data"]["corpora"][0]["manifest_sha256"]
    # what setdiff-train checks before it builds a model (in this process)
    with pytest.raises(ShardError, match="holds other data than the checkpoint's"):
        resume_check(run, other, *REFERENCE, steps=8, dp=1)


# ----------------------------------------------------------------------------- 6. rewinds

def test_a_rewind_over_newer_checkpoints_is_refused_without_force(trained, sonnets, tmp_path):
    """What setdiff-train's rank 0 decides first (train.run_dir.claim_run_dir), in this
    process."""
    from setdiff_dist.train.run_dir import claim_run_dir

    run = copy_run(trained(), tmp_path)
    before = tree_hash(run / "checkpoints")
    cfg = train_config(run, sonnets, *REFERENCE, f"resume={run}/checkpoints/step_0000003")
    refusal = claim_run_dir(cfg, force=False)
    assert "would overwrite the 1 newer checkpoint(s)" in refusal, refusal
    assert "step_0000006" in refusal and "--force" in refusal
    assert tree_hash(run / "checkpoints") == before
    assert claim_run_dir(cfg, force=True) is None  # (--force: the run may go on)
    from setdiff_dist.train import run_dir as housekeeping

    housekeeping.RUN_LOCK.release()


# ----------------------------------------------------------------------------- 7. a full disk

def test_a_save_that_cannot_be_written_keeps_the_run_resumable(trained, sonnets, tmp_path):
    """A file-size limit smaller than the largest file of a save (as a full disk fails the
    write): one line naming the cause, exit 2, no partial checkpoint, `latest` where it was;
    and the same command without the limit resumes."""
    run = copy_run(trained(), tmp_path)
    step = run / "checkpoints" / "step_0000006"
    largest = max(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(step) for f in fs)

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (largest - 1, largest - 1))

    cmd = train_command(run, sonnets, *REFERENCE, steps=7)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env(),
                         preexec_fn=limit)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "cannot save checkpoint step_0000007: a file of the save is larger than this " \
           "process may write" in res.stderr, res.stderr[-3000:]
    assert "latest still points at step_0000006" in res.stderr
    assert "Traceback" not in res.stderr, res.stderr[-5000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000006"
    assert not (run / "checkpoints" / "step_0000007" / "manifest.json").exists()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "step_0000006" in res.stdout
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000007"


def test_a_full_disk_is_named_with_what_the_save_needs(tmp_path):
    from setdiff_dist.checkpoint.saving import save_failed

    root = tmp_path / "checkpoints"
    (root / "step_0000004" / "weights").mkdir(parents=True)
    (root / "step_0000004" / "weights" / "part.safetensors").write_bytes(b"x" * 100)
    (root / "latest.tmp-123").write_text("step_0000004")
    exc = save_failed(OSError(errno.ENOSPC, "No space left on device"), str(root),
                       "step_0000004", 5 * 2**20)
    assert "cannot save checkpoint step_0000004: the disk is full" in str(exc)
    assert "the save needs about 5.0 MiB" in str(exc)
    assert "there is no earlier checkpoint" in str(exc) and exc.exit_code == 2
    assert os.listdir(root) == []  # the partial save is gone


# ----------------------------------------------------------------------------- 8. run_dir

@pytest.mark.parametrize("where", ["/sys/fs/setdiff-run", "README.md/run"],
                         ids=["kernel-filesystem", "under-a-file"])
def test_an_unwritable_run_dir_is_one_line(where):
    from setdiff_dist.checkpoint.files import CheckpointError, RunLock

    with pytest.raises(CheckpointError, match=f"cannot write to run_dir={where} .*give a "
                                              "writable run_dir"):
        RunLock(where)


# ----------------------------------------------------------------------------- 9-12. commands

def test_harness_flags_and_counts_are_checked(trained, capsys):
    from setdiff_dist.cli.eval import main as evaluate

    run = str(trained())
    assert evaluate(["--checkpoint", run, "--task", "ppl", "--num-fewshot", "2",
                     "--log-samples"]) == 2
    assert "--num-fewshot, --log-samples go with --task harness" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        evaluate(["--checkpoint", run, "--task", "harness", "--harness-tasks", "x",
                  "--num-fewshot", "-1"])
    assert exit_.value.code == 2 and "must be 0 or more" in capsys.readouterr().err


def test_an_export_over_an_existing_file_is_refused_before_reading(trained, capsys):
    from setdiff_dist.cli.convert import main as convert

    before = open("README.md", "rb").read()
    assert convert(["--checkpoint", str(trained()), "--out", "README.md"]) == 2
    err = capsys.readouterr().err
    assert "--out README.md is a file, not a directory" in err and "Traceback" not in err
    assert open("README.md", "rb").read() == before


def test_the_dry_run_counts_context_parallel_ranks(capsys):
    from setdiff_dist.cli.train import main as train

    assert train(["--config", "configs/tiny-cpu.yaml", "--dry-run", "parallel.context=2"]) == 0
    out = capsys.readouterr().out
    assert "CP 2" in out or "context 2" in out, out


def test_a_missing_init_from_is_named_as_the_config_key():
    from setdiff_dist.checkpoint.weights import LoadError
    from setdiff_dist.config import load_config
    from setdiff_dist.model.load import init_from_weights

    cfg = load_config("configs/tiny-cpu.yaml", ["checkpoint.init_from=runs/nope"])
    with pytest.raises(LoadError, match=r"^checkpoint.init_from=runs/nope: no such directory"):
        init_from_weights(None, cfg, "runs/nope")


def test_an_interrupted_conversion_leaves_nothing_behind(trained, tmp_path):
    """kill -9 during a layout-changing resume: the ranks convert in their own processes (no
    other process goes on writing), and what they left (universal.tmp/, latest_universal),
    like a crashed save's step directory, goes at the next start in that run directory,
    whatever its layout."""
    from setdiff_dist.train.run_dir import clean_leftovers

    run = copy_run(trained(), tmp_path)
    step = run / "checkpoints" / "step_0000006"
    (step / "universal.tmp" / "zero").mkdir(parents=True)
    (step / "latest_universal").write_text("universal.tmp")
    (run / "checkpoints" / "step_0000009" / "weights").mkdir(parents=True)  # a crashed save
    clean_leftovers(str(run))
    assert not (step / "universal.tmp").exists() and not (step / "latest_universal").exists()
    assert not (run / "checkpoints" / "step_0000009").exists()
    assert (step / "manifest.json").exists() and (run / "checkpoints" / "step_0000003").exists()
    # a child started as the converter is dies with its parent, even on SIGKILL
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from setdiff_dist.processes import die_with_parent\n"
        "c = subprocess.Popen(['sleep', '60'], preexec_fn=die_with_parent)\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True, env=child_env())
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:  # (gone, or a zombie that nobody has reaped yet: dead either way)
            with open(f"/proc/{child}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the converter outlived its rank")


def test_a_directory_removed_under_a_rank_by_another_ranks_failed_save_is_a_write_failure():
    """A rank whose peer's save failed finds the partial directory gone under its own write
    (torch: "Parent directory ... does not exist."): the same one-line save failure, exit 2,
    not a traceback."""
    from setdiff_dist.checkpoint.saving import write_failure

    assert write_failure(RuntimeError("Parent directory /run/checkpoints/step_0000007 does "
                                      "not exist."))
    assert not write_failure(RuntimeError("Connection closed by peer"))
