"""Checkpoints, exact resume, preemption signals and crash consistency. Through setdiff-train
where a process must start, stop, die or resume; in this process where what is tested is a
check setdiff-train makes before it builds a model (``helpers.resume_check``). A resume starts
from a copy of a session reference run rewound to its step-3 checkpoint
(``helpers.rewound``), and must reproduce that run's curve."""

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from helpers import (
    EMA_RUN,
    REFERENCE,
    REFERENCE_STEPS,
    child_env,
    copy_run,
    losses,
    process_group,
    resume_check,
    rewound,
    run_train,
    train_command,
    tree_hash,
)

from setdiff_dist.checkpoint.files import CheckpointError

EXIT_PREEMPTED = 75


def command(run_dir, shards, steps, *overrides):
    return train_command(run_dir, shards, "train.eval_batches=1", *overrides, steps=steps)


def train(run_dir, shards, *overrides, env=None, nproc=2):
    """Resume (or start) a run as the session's reference runs were trained."""
    return run_train(run_dir, shards, *REFERENCE, *overrides, steps=REFERENCE_STEPS, env=env,
                     nproc=nproc)


def check(run_dir, shards, *overrides, **layout):
    """What setdiff-train checks before building a model, for that resume (no launch)."""
    return resume_check(run_dir, shards, *REFERENCE, *overrides, steps=REFERENCE_STEPS,
                        **layout)


def latest(run_dir):
    return open(os.path.join(run_dir, "checkpoints", "latest")).read().strip()


def test_a_background_save_killed_mid_write_leaves_latest_and_the_next_one_is_exact(
        trained, sonnets, tmp_path):
    """checkpoint.async_save: SIGKILL in the background write of step 6's checkpoint (DeepSpeed's
    files written, the weights not): latest stays at step 3, and the next start removes the
    partial directory, resumes and ends with the uninterrupted losses; its own background save
    of step 6 is complete, verified, and its weights are the blocking save's, byte for byte."""
    from setdiff_dist.checkpoint.files import checkpoint_files, file_problems
    from setdiff_dist.checkpoint.manifest import read_manifest

    ref = trained("zero.stage=2")
    run = rewound(ref, tmp_path)
    env = dict(os.environ, SETDIFF_FAULT="async_write:6")
    res = train(run, sonnets, "zero.stage=2", "checkpoint.async_save=true", env=env)
    assert res.returncode != 0
    assert latest(run) == "step_0000003"
    assert not (run / "checkpoints" / "step_0000006" / "manifest.json").exists()
    res = train(run, sonnets, "zero.stage=2", "checkpoint.async_save=true")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step_0000006 (an incomplete save)" in res.stdout
    assert "resumed from" in res.stdout and "step_0000003" in res.stdout
    assert losses(run) == losses(ref)
    saved = run / "checkpoints" / "step_0000006"
    assert latest(run) == "step_0000006"
    table = read_manifest(str(saved))["files"]
    assert sorted(table) == checkpoint_files(str(saved))
    assert file_problems(str(saved), table, table) == []
    blocking = ref / "checkpoints" / "step_0000006" / "weights"
    names = sorted(p.name for p in blocking.iterdir())
    assert names and sorted(p.name for p in (saved / "weights").iterdir()) == names
    for name in names:
        assert (saved / "weights" / name).read_bytes() == (blocking / name).read_bytes(), name


# (on the ranks' path: each rank counts the process groups it creates, at start-up and inside
# Trainer.fit, and lists the save keys left in the default group's store as it leaves)
COUNT_GROUPS = """
import json, os, sys
import torch.distributed as dist

_made, _new_group, _destroy = [], dist.new_group, dist.destroy_process_group

def _in_fit():
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "fit" and code.co_filename.endswith(os.path.join("train", "loop.py")):
            return True
        frame = frame.f_back
    return False

def new_group(*args, **kwargs):
    _made.append(_in_fit())
    return _new_group(*args, **kwargs)

def destroy_process_group(group=None):
    if group is None and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        keys = [k for k in store.list_keys() if k.startswith("setdiff/save")]
        path = os.path.join(os.environ["COUNT_GROUPS"], "rank%d.json" % dist.get_rank())
        with open(path, "w") as fh:
            json.dump({"at_start": _made.count(False), "in_training": _made.count(True),
                       "keys": keys}, fh)
    return _destroy(group)

dist.new_group = new_group
dist.destroy_process_group = destroy_process_group
"""


def test_background_saves_create_no_process_group_and_leave_no_key_in_the_store(sonnets,
                                                                                  tmp_path):
    """checkpoint.async_save at every step (issue 50): the ranks agree on each save through the
    default group's store, so no process group is created once training runs (a world-wide
    gloo group was, at the first save: N - 1 connections per rank at N ranks); every save is
    complete, latest moves to the last, and the store keeps no key of any save."""
    from setdiff_dist.checkpoint.files import checkpoint_files, file_problems
    from setdiff_dist.checkpoint.manifest import read_manifest

    site, counts, run = tmp_path / "site", tmp_path / "counts", tmp_path / "run"
    site.mkdir()
    counts.mkdir()
    (site / "sitecustomize.py").write_text(COUNT_GROUPS)
    env = dict(os.environ, COUNT_GROUPS=str(counts),
               PYTHONPATH=os.pathsep.join(filter(None, [str(site),
                                                        os.environ.get("PYTHONPATH")])))
    res = run_train(run, sonnets, "zero.stage=2", "checkpoint.async_save=true",
                    "checkpoint.interval=1", "checkpoint.keep_last=2", steps=4, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((counts / f"rank{rank}.json").read_text())
        assert seen["at_start"] > 0  # (the count works: megatron's groups)
        assert seen["in_training"] == 0, seen
        assert seen["keys"] == [], seen
    assert latest(run) == "step_0000004"
    saves = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step"))
    assert saves == ["step_0000003", "step_0000004"]  # (keep_last: the rank 0 of each save)
    for name in saves:
        saved = str(run / "checkpoints" / name)
        table = read_manifest(saved)["files"]
        assert sorted(table) == checkpoint_files(saved)
        assert file_problems(saved, table, table) == []


def test_a_failed_background_write_ends_every_rank_at_the_next_step_boundary(sonnets,
                                                                             tmp_path):
    """checkpoint.async_save with a checkpoint every 3 steps; rank 1's write of step 6 fails as
    a full disk does (SETDIFF_FAULT=write_fails:6:1). The failed writer tells the others in the
    save's first round and the stop all-reduce of every step carries it: every rank ends within
    a step or two of the save, long before the next one (step 9; the failure used to surface
    there, two intervals late on Slurm), with the disk's message; latest stays at step 3."""
    run = tmp_path / "run"
    env = dict(os.environ, SETDIFF_FAULT="write_fails:6:1")
    res = run_train(run, sonnets, "checkpoint.async_save=true", "checkpoint.interval=3",
                    steps=12, env=env)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "cannot save checkpoint step_0000006: the disk is full" in res.stderr, \
        res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert 6 <= max(steps) <= 8, steps
    assert latest(run) == "step_0000003"
    assert not (run / "checkpoints" / "step_0000006" / "manifest.json").exists()


def test_a_failed_background_write_is_saved_again_with_a_retry_left(sonnets, tmp_path):
    """The same failure (rank 1's write of step 6, ENOSPC) with checkpoint.save_retries=1:
    every rank learns of it at a step boundary (or at the next save), the partial save goes,
    the ranks save again at that step and train on to the end (exit 0); the retried
    checkpoint is complete and ``latest`` moves on from step 3 as the run goes on."""
    from setdiff_dist.checkpoint.manifest import read_manifest

    run = tmp_path / "run"
    env = dict(os.environ, SETDIFF_FAULT="write_fails:6:1")
    res = run_train(run, sonnets, "checkpoint.async_save=true", "checkpoint.interval=3",
                    "checkpoint.save_retries=1", "checkpoint.keep_last=0", steps=9, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    said = [line for line in res.stderr.splitlines() if "Saving again now, at step" in line]
    assert len(said) == 1 and "rank 1 could not write its files" in said[0], res.stderr[-3000:]
    retried = int(said[0].split("at step ")[1].split(" ")[0])
    assert 6 <= retried <= 9, said  # (the boundary after the save, or the next save's)
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert saved == sorted({"step_0000003", f"step_{retried:07d}", "step_0000009"}), saved
    for name in saved:
        assert read_manifest(str(run / "checkpoints" / name))["step"] == int(name[5:])
    assert latest(run) == "step_0000009"


@pytest.mark.parametrize("layout", [
    pytest.param(("zero.stage=2",), id="zero2"),
    # the default bf16 path: ZeRO-1, the reduction overlapped with the backward
    pytest.param(("train.precision=bf16",), id="bf16-zero1", marks=pytest.mark.slow)])
def test_stop_and_resume_reproduces_the_uninterrupted_curve_bit_exactly(trained, sonnets,
                                                                          tmp_path, layout):
    """Two ranks: from step 3, to ``train.exit_at_step=5`` (a checkpoint, then exit 0), then on
    to the end: every step's loss is the uninterrupted run's, bit for bit. The last part runs
    its ranks as interpreters of their own (``SETDIFF_WARM_START=0``), the others forked by the
    rank server: the two starts train alike."""
    ref = trained(*layout)
    run = rewound(ref, tmp_path)
    res = train(run, sonnets, *layout, "train.exit_at_step=5")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and latest(run) == "step_0000005"
    res = train(run, sonnets, *layout, env=dict(os.environ, SETDIFF_WARM_START="0"))  # auto
    assert res.returncode == 0, res.stderr[-3000:]
    assert losses(run) == losses(ref)  # every step, bit for bit


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_pipeline_parallel_resume_is_bit_exact_too(trained, sonnets, tmp_path, precision):
    # megatron's distributed optimizer (the ZeRO-1 default) under megatron's schedule, with the
    # tied embedding's fp32 gradient buffers summed across the stages
    from setdiff_dist.checkpoint.format import megatron_files, megatron_model_file

    layout = ("parallel.pipeline=2", f"train.precision={precision}")
    ref = trained(*layout)
    # each pipeline stage's files and weights are its own
    ckpt = ref / "checkpoints" / "step_0000003"
    assert sorted(megatron_files(str(ckpt))[1]) == [(0, 0), (0, 1)]
    assert (ckpt / megatron_model_file(0, 1)).exists()
    assert (ckpt / "weights" / "tp00_pp01.safetensors").exists()
    run = rewound(ref, tmp_path)
    res = train(run, sonnets, *layout)
    assert res.returncode == 0, res.stderr[-3000:]
    assert losses(run) == losses(ref)


@pytest.mark.slow
@pytest.mark.parametrize("resumed", [
    pytest.param(("zero.implementation=deepspeed",), id="deepspeed-overlapped"),
    pytest.param((), id="the-default-megatron")])
def test_a_bf16_checkpoint_saved_before_the_overlap_default_resumes_with_it(trained, sonnets,
                                                                           tmp_path, resumed):
    """Saved by DeepSpeed's BF16_Optimizer (``zero.overlap_comm=false``, the bf16 ZeRO-1 of
    before), resumed with DeepSpeed's overlapped ZeRO optimizer or with today's default
    (megatron's distributed optimizer): the optimizer state goes through DeepSpeed's universal
    form and the curve goes on (bf16: the same fp32 sums in another order)."""
    before = ("train.precision=bf16", "zero.overlap_comm=false", "zero.implementation=deepspeed")
    ref = trained(*before)
    run = rewound(ref, tmp_path)
    res = train(run, sonnets, "train.precision=bf16", *resumed)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (run / "checkpoints" / "step_0000003" / "universal" / "zero").is_dir()
    got, want = losses(run), losses(ref)
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-3), step


def test_a_change_of_optimizer_state_form_is_converted_or_refused(tmp_path):
    """Pure logic: bf16 ZeRO-1 with and without overlap keep different optimizer states; without
    pipeline parallelism the resume converts it, with it the refusal names the setting."""
    import yaml

    from setdiff_dist.checkpoint.format import FORMAT
    from setdiff_dist.checkpoint.manifest import check_compatible
    from setdiff_dist.config import load_config
    from setdiff_dist.train.optimizer_state import (
        deepspeed_form_change,
        optimizer_changes,
        optimizer_form,
        saved_form,
    )

    assert optimizer_form({}) == "zero"  # fp32
    assert optimizer_form({"train": {"precision": "bf16"}}) == "bf16_optimizer"  # before
    assert optimizer_form({"train": {"precision": "bf16"}, "zero": {"overlap_comm": True}}) \
        == "zero"
    cfg = load_config("configs/tiny-cpu.yaml", ["train.precision=bf16", "parallel.pipeline=2",
                                                "zero.implementation=deepspeed"])
    saved = cfg.to_dict()
    saved["zero"]["overlap_comm"] = False
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert optimizer_changes(str(tmp_path), cfg) == \
        "zero.overlap_comm: checkpoint false, this run true"
    manifest = {"format": FORMAT, "layout": {"tensor": 1, "pipeline": 2,
                "data": 1, "world": 2, "context": 1}, "zero_stage": 1, "model": saved["model"],
                "order": saved["order"], "seq_len": cfg.data.seq_len, "seed": cfg.train.seed,
                "tokenizer": {"sha256": "x", "spec": "bytes"}}
    with pytest.raises(CheckpointError) as err:
        check_compatible(manifest, str(tmp_path), cfg, {"sha256": "x", "spec": "bytes"},
                         dict(manifest["layout"]), deepspeed_form_change(str(tmp_path), cfg))
    assert "resume with zero.overlap_comm=false" in str(err.value)
    # saved since the optimizer state is named by global names: converted, as without PP
    check_compatible(dict(manifest, optimizer_names="global"), str(tmp_path), cfg,
                     {"sha256": "x", "spec": "bytes"}, dict(manifest["layout"]),
                     deepspeed_form_change(str(tmp_path), cfg))
    saved["zero"]["overlap_comm"] = True
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert deepspeed_form_change(str(tmp_path), cfg) is None
    check_compatible(manifest, str(tmp_path), cfg, {"sha256": "x", "spec": "bytes"},
                     dict(manifest["layout"]))
    # megatron's distributed optimizer: to and from DeepSpeed's, and to other buckets, through
    # the universal form (accepted, with the change said)
    mega = load_config("configs/tiny-cpu.yaml", ["zero.implementation=auto"])  # (megatron)
    assert optimizer_form(mega.to_dict()) == "megatron"
    for deepspeeds in (["zero.stage=2", "zero.implementation=deepspeed"],
                       ["zero.offload_optimizer=cpu"], ["zero.implementation=deepspeed"]):
        other = load_config("configs/tiny-cpu.yaml", deepspeeds).to_dict()
        assert optimizer_form(other) == "zero", deepspeeds
    # ZeRO-2 is FSDP's now; a ZeRO-2 checkpoint whose manifest does not name who ran it is
    # DeepSpeed's (auto picked it then): the change goes through the universal form
    fsdp = load_config("configs/tiny-cpu.yaml", ["zero.stage=2"])
    assert optimizer_form(fsdp.to_dict()) == "fsdp"
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.yaml").write_text(yaml.safe_dump(fsdp.to_dict()))
    assert saved_form(str(legacy)) == "zero"
    assert optimizer_changes(str(legacy), fsdp) == \
        "zero.implementation: checkpoint deepspeed, this run fsdp"
    (legacy / "manifest.json").write_text(json.dumps({"zero_implementation": "fsdp"}))
    assert saved_form(str(legacy)) == "fsdp" and optimizer_changes(str(legacy), fsdp) is None
    assert optimizer_changes(str(tmp_path), mega) == \
        "zero.implementation: checkpoint deepspeed, this run megatron"
    saved = mega.to_dict()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert optimizer_changes(str(tmp_path), mega) is None
    assert optimizer_changes(str(tmp_path), cfg) == \
        "zero.implementation: checkpoint megatron, this run deepspeed"
    assert deepspeed_form_change(str(tmp_path), cfg) is None  # (megatron's: converted)
    check_compatible(dict(manifest, layout=dict(manifest["layout"], pipeline=1)),
                     str(tmp_path), cfg, {"sha256": "x", "spec": "bytes"},
                     dict(manifest["layout"]))
    smaller = load_config("configs/tiny-cpu.yaml", ["zero.implementation=auto",
                                                    "zero.min_bucket_per_rank=5"])
    assert optimizer_changes(str(tmp_path), smaller) == \
        f"zero.min_bucket_per_rank: checkpoint {mega.zero.min_bucket_per_rank}, this run 5"


def test_a_checkpoint_saved_with_the_old_weight_decay_groups_resumes_in_them(tmp_path):
    """Pure logic: DeepSpeed's weight-decay groups decay every matrix but the embedding, by its
    global name and whole shape, except in the run of a DeepSpeed checkpoint whose manifest
    predates ``decay_rule`` and that loads as saved (DeepSpeed refuses optimizer state of
    other groups): at ZeRO-3 nothing was decayed, under pipeline parallelism with tied
    embeddings the last stage's copy was. Through the universal form any groups load."""
    import yaml

    from setdiff_dist.config import load_config
    from setdiff_dist.train.checkpoint import decay_rule

    here = load_config("configs/tiny-cpu.yaml", ["zero.implementation=deepspeed",
                                                 "parallel.pipeline=2"])
    saved = here.to_dict()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    old = {"layout": {"tensor": 1, "pipeline": 2, "data": 1, "world": 2, "context": 1},
           "model": saved["model"], "zero_implementation": "deepspeed", "zero_stage": 1}

    def rule(manifest, cfg=here, universal=False):
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        return decay_rule(str(tmp_path), manifest, cfg, universal)

    assert decay_rule(None, None, here) == "global"  # a fresh run
    assert rule(old) == "local"
    assert rule(old, universal=True) == "global"
    assert rule(dict(old, decay_rule="local")) == "local"  # (that run's later checkpoints)
    assert rule(dict(old, decay_rule="global")) == "global"
    assert rule(dict(old, layout=dict(old["layout"], pipeline=1))) == "global"
    assert rule(dict(old, model=dict(saved["model"], tie_embeddings=False))) == "global"
    assert rule(dict(old, zero_implementation="megatron")) == "global"  # (by global names)
    assert rule(old, load_config("configs/tiny-cpu.yaml", ["parallel.pipeline=2"])) \
        == "global"  # (megatron's optimizer: through the universal form, by name)
    zero3 = load_config("configs/tiny-cpu.yaml", ["zero.stage=3"])
    flat = dict(old, zero_stage=3, layout=dict(old["layout"], pipeline=1, data=2))
    assert rule(flat, zero3) == "none"
    assert rule(flat, zero3, universal=True) == "global"
    assert rule(dict(flat, decay_rule="global"), zero3) == "global"


def test_which_layout_changes_resume_and_which_are_refused():
    """Pure logic: any pipeline, tensor, data and context-parallel size can change (the
    optimizer state goes through the universal form) but for a pipeline-parallel checkpoint
    saved before its optimizer state was named globally, and at ZeRO-0; the refusal says how
    to go on from the weights."""
    from setdiff_dist.checkpoint.manifest import layout_differences, needs_universal

    def layout(tp=1, pp=1, dp=1, cp=1):
        return {"tensor": tp, "pipeline": pp, "data": dp, "context": cp,
                "world": tp * pp * dp * cp}

    moves = [(layout(tp=2, pp=2), layout(dp=2)), (layout(tp=2, pp=2), layout(pp=4)),
             (layout(pp=2, dp=2), layout(tp=2, dp=2)), (layout(dp=2), layout(tp=2, pp=2)),
             (layout(cp=2), layout()), (layout(), layout(cp=2)), (layout(dp=2), layout())]
    for saved, here in moves:
        assert layout_differences(saved, here, 1, 1, "ckpt") == [], (saved, here)
        assert needs_universal(saved, here, False), (saved, here)
    # data x context-parallel ranks hold the ZeRO partitions: 2 x 1 -> 1 x 2 keeps them
    assert not needs_universal(layout(dp=2), layout(cp=2), False)
    assert not needs_universal(layout(pp=2), layout(pp=2), False)
    assert needs_universal(layout(pp=2), layout(pp=2), True)  # (another optimizer form)
    old = layout_differences(layout(pp=2), layout(dp=2), 1, 1, "ckpt", global_names=False)
    assert len(old) == 1 and "saved before the optimizer state was named by global layer" \
        in old[0] and "checkpoint.init_from=ckpt" in old[0], old
    assert layout_differences(layout(pp=2), layout(pp=2), 1, 1, "ckpt", global_names=False) \
        == []  # (in its own layout it resumes as ever)
    zero0 = layout_differences(layout(dp=2), layout(), 0, 0, "ckpt")
    assert len(zero0) == 1 and "zero.stage=0 has no ZeRO state" in zero0[0]
    # ZeRO stages: 1-3 resume at 1-3 (the stage change goes through the universal form too;
    # ZeRO-3 to 1/2 from TP=1), ZeRO-0 has none; ZeRO-3 at TP > 1 keeps its layout (DeepSpeed's
    # ZeRO-3 load takes whole tensors)
    for saved, here in ((1, 3), (2, 3), (1, 2), (2, 1), (3, 1), (3, 2)):
        assert layout_differences(layout(dp=2), layout(dp=2), saved, here, "ckpt") == []
    assert layout_differences(layout(dp=2), layout(tp=2), 3, 1, "ckpt") == []
    assert "from parallel.tensor=1 only" in \
        layout_differences(layout(tp=2), layout(dp=2), 3, 1, "ckpt")[0]
    assert "no ZeRO state" in layout_differences(layout(dp=2), layout(dp=2), 0, 1, "ckpt")[0]
    assert "resumes in its own layout" in \
        layout_differences(layout(tp=2, dp=2), layout(tp=2), 3, 3, "ckpt")[0]
    assert layout_differences(layout(tp=2, dp=2), layout(tp=2, dp=2), 3, 3, "ckpt") == []


def test_a_checkpoint_of_another_shape_or_layout_is_refused(trained, sonnets, tmp_path):
    ref = trained("zero.stage=2")
    with pytest.raises(CheckpointError) as err:
        check(ref, sonnets, "zero.stage=2", "model.hidden_size=32",
              "model.num_attention_heads=2")
    assert "model.hidden_size: checkpoint 64, this run 32" in str(err.value)
    assert "model.num_attention_heads: checkpoint 4, this run 2" in str(err.value)
    # another global batch would not go on exactly: the reason, and how to start from the
    # weights instead
    with pytest.raises(CheckpointError) as err:
        check(ref, sonnets, "zero.stage=2", "data.global_batch_size=16")
    said = str(err.value)
    assert "data.global_batch_size: checkpoint 8, this run 16" in said
    assert "data.global_batch_size=8" in said and "checkpoint.init_from=" in said
    # ZeRO-3 state is re-sliced for another data-parallel size only, not another TP size
    with pytest.raises(CheckpointError) as err:
        check(ref, sonnets, "zero.stage=3", "parallel.tensor=2", tp=2, dp=1)
    assert "parallel.tensor: checkpoint 1, this run 2 (DeepSpeed re-slices ZeRO-3" in \
        str(err.value)
    # setdiff-train says it in one line, exit code 2, and changes nothing
    run = copy_run(ref, tmp_path)
    before = tree_hash(run / "checkpoints")
    res = train(run, sonnets, "zero.stage=2", "model.hidden_size=32",
                "model.num_attention_heads=2")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "model.hidden_size: checkpoint 64, this run 32" in res.stderr
    assert tree_hash(run / "checkpoints") == before


def test_sigkill_during_a_save_leaves_latest_at_the_previous_checkpoint(trained, sonnets,
                                                                        tmp_path):
    ref = trained("zero.stage=2")
    run = rewound(ref, tmp_path)
    env = dict(os.environ, SETDIFF_FAULT="after_shards:6")
    res = train(run, sonnets, "zero.stage=2", env=env)
    assert res.returncode != 0
    assert latest(run) == "step_0000003"
    assert not (run / "checkpoints" / "step_0000006" / "manifest.json").exists()
    res = train(run, sonnets, "zero.stage=2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "step_0000003" in res.stdout
    # (the killed save's directory was removed first, and said)
    assert "step_0000006 (an incomplete save)" in res.stdout
    assert losses(run) == losses(ref)


def _wait_for_step(proc, step):
    for line in proc.stdout:
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= step:
            return
    raise AssertionError("the run ended before the signal")


@pytest.mark.parametrize("target,signum", [
    pytest.param("launcher", signal.SIGUSR1, id="SIGUSR1 to the launcher",
                 marks=pytest.mark.slow),
    pytest.param("every rank", signal.SIGTERM, id="SIGTERM to every rank"),
    pytest.param("launcher", signal.SIGINT, id="Ctrl-C", marks=pytest.mark.slow)])
def test_a_stop_signal_checkpoints_and_exits_with_its_outcome(sonnets, tmp_path, target, signum):
    """SIGTERM / SIGUSR1 (preemption) checkpoint and exit 75 for a requeue; SIGINT (Ctrl-C)
    checkpoints and exits 130, outcome "paused"; resume=auto goes on from either."""
    proc = subprocess.Popen(command(tmp_path, sonnets, 12, "zero.stage=2",
                                    "train.steps=400", "optimizer.schedule=constant"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(proc, 2)
    if target == "launcher":
        proc.send_signal(signum)
    else:  # as Slurm does: every process of the job
        for pid in [proc.pid] + _children(proc.pid):
            os.kill(pid, signum)
    out, err = proc.communicate(timeout=300)
    code, outcome = (130, "paused") if signum == signal.SIGINT else (EXIT_PREEMPTED, "preempted")
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err
    step = int(latest(tmp_path).split("_")[1])
    assert 2 <= step < 400 and f"({outcome})" in out
    # what a Slurm job script reads to decide on a requeue (launchers/slurm/train.sbatch)
    with open(os.path.join(tmp_path, "exit_status.json")) as fh:
        status = json.load(fh)
    assert status["outcome"] == outcome and status["exit_code"] == code
    assert status["step"] == step and status["checkpoint"].endswith(latest(tmp_path))


def _children(pid):
    kids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(p))
    return kids


def _ranks(pid):
    """{rank: pid} of the launcher ``pid``'s children named ``setdiff-rankN`` (forked ranks)."""
    ranks = {}
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/comm") as fh:
                name = fh.read().strip()
        except OSError:
            continue
        if name.startswith("setdiff-rank"):
            ranks[int(name.removeprefix("setdiff-rank"))] = child
    return ranks


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_no_rank_outlives_a_killed_launcher(sonnets, tmp_path):
    proc = subprocess.Popen(command(tmp_path, sonnets, 100000), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    _wait_for_step(proc, 1)
    children = _children(proc.pid)  # the two ranks and the rank server that forked them
    assert sorted(_ranks(proc.pid)) == [0, 1] and len(children) == 3
    proc.kill()
    proc.wait()
    deadline = time.time() + 30
    while any(_alive(r) for r in children) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(r) for r in children)


def _layout_weights(rank, shards, root, layouts, out):
    """Build each layout's trainer from the seed and save it at step 0 (each rank writes its
    own part); rank 0 reads the files back as full tensors."""
    from setdiff_dist.checkpoint.weights import read_full_state_dict
    from setdiff_dist.config import load_config
    from setdiff_dist.train.loop import Trainer

    found = {}
    for name, overrides in layouts:
        t = Trainer(load_config("configs/tiny-cpu.yaml", [
            f"run_dir={root}/{name}", "resume=never", f"data.train_shards={shards}",
            "data.seq_len=32", "model.vocab_size=257", "data.global_batch_size=8",
            "data.micro_batch_size=2", "train.tensorboard=false", *overrides]))
        path = t.save()
        if rank == 0:
            found[name] = read_full_state_dict(path)[0]
    if rank == 0:
        torch.save(found, out)


def test_every_layout_starts_from_the_same_weights(sonnets, tmp_path):
    """TP=1 on one rank, TP=2 and ZeRO-3 over two ranks draw bitwise the same full weights,
    each rank only its own part: each layout's per-rank files merge to the same tensors."""
    from mp_harness import spawn

    spawn(_layout_weights, 1, sonnets, str(tmp_path), [("tp1", [])], tmp_path / "one.pt")
    spawn(_layout_weights, 2, sonnets, str(tmp_path),
          [("tp2", ["parallel.tensor=2"]), ("zero3", ["zero.stage=3"])], tmp_path / "two.pt")
    ref = torch.load(tmp_path / "one.pt")["tp1"]
    for name, state in torch.load(tmp_path / "two.pt").items():
        assert sorted(state) == sorted(ref), name
        for k in ref:
            assert torch.equal(state[k], ref[k]), (name, k)


@pytest.mark.parametrize("stage,resumed", [
    pytest.param(1, {"nproc": 1}, id="zero1-dp2-to-dp1"),
    pytest.param(3, {"nproc": 1}, id="zero3-dp2-to-dp1", marks=pytest.mark.slow),
    pytest.param(2, {"nproc": 2, "tp": 2}, id="zero2-tp1-to-tp2", marks=pytest.mark.slow)])
def test_resume_in_another_layout_continues_the_same_curve(trained, sonnets, tmp_path, stage,
                                                           resumed):
    """Saved at DP=2, resumed at DP=1 (or at TP=2): the optimizer state is re-partitioned
    through DeepSpeed's universal checkpoint (converted once, inside the step directory), the
    data order and the loss are global, so the curve is the uninterrupted DP=2 run's."""
    ref = trained(*([f"zero.stage={stage}"] if stage != 1 else []))
    run = rewound(ref, tmp_path)
    res = train(run, sonnets, f"zero.stage={stage}", f"parallel.tensor={resumed.get('tp', 1)}",
                nproc=resumed["nproc"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert (run / "checkpoints" / "step_0000003" / "universal" / "zero").is_dir()
    got, want = losses(run), losses(ref)
    assert sorted(got) == sorted(want)
    for step, loss in want.items():  # (layouts differ by fp32 rounding only)
        assert got[step] == pytest.approx(loss, abs=1e-5), step


def _partitioned_build(rank, out):
    from megatron.core import parallel_state as ps

    from setdiff_dist.config import load_config
    from setdiff_dist.model.transformer import build_model, transformer_config
    from setdiff_dist.parallel import initialize_model_parallel
    from setdiff_dist.train.engine import partitioned_construction

    initialize_model_parallel(seed=0)
    cfg = load_config("configs/tiny-cpu.yaml", ["zero.stage=3", "model.vocab_size=257"])
    construct, gathered = partitioned_construction(cfg)
    model = build_model(cfg.model, transformer_config(cfg.model), 0, construct, gathered)
    held = sum(p.ds_tensor.numel() for p in model.parameters())
    whole = sum(p.ds_numel for p in model.parameters())
    empty = all(p.data.numel() == 0 for p in model.parameters())
    assert ps.get_data_parallel_world_size() == 2
    if rank == 0:
        torch.save({"held": held, "whole": whole, "empty": empty}, out / "zero3.pt")


def test_zero3_partitions_each_parameter_as_it_is_built(tmp_path):
    """Under ZeRO-3 each of 2 data-parallel ranks holds half of every parameter from the moment
    it is created: the model is never whole on a rank."""
    from mp_harness import spawn

    spawn(_partitioned_build, 2, tmp_path)
    r = torch.load(tmp_path / "zero3.pt")
    assert r["empty"] and r["held"] <= r["whole"] / 2 + 64 * 100


class _Payload:
    """What an attacker plants: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rehash(step, file):
    """Make the manifest's size and checksum of ``file`` match what is there now."""
    from setdiff_dist.checkpoint.files import describe_files

    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"].update(describe_files(str(step), [file]))
    (step / "manifest.json").write_text(json.dumps(manifest))


def _plant(step, file, marker):
    state = torch.load(step / file, weights_only=False)
    state["extra"] = _Payload(marker)
    torch.save(state, step / file)
    _rehash(step, file)  # (an attacker can rewrite the manifest's checksums too)
    return state


def test_a_pickle_payload_in_a_checkpoint_is_not_run_on_resume(trained, sonnets, tmp_path):
    """A class or function planted in a pickled file is found from the pickle's opcodes
    before anything loads it, and the loads themselves read with weights_only."""
    from setdiff_dist.train.checkpoint import no_unpickling

    run = copy_run(trained("zero.stage=2"), tmp_path)
    step = run / "checkpoints" / latest(run)
    marker = tmp_path / "pwned"
    # (ZeRO-2 runs on FSDP: its model-state and rank-fragment files)
    for file in ("megatron_dp_model_tp00_pp00.pt", "megatron_dp_rank00001.pt"):
        state = _plant(step, file, marker)
        with pytest.raises(CheckpointError) as err:
            check(run, sonnets, "zero.stage=2")
        assert "would run code when loaded (posix.system)" in str(err.value)
        assert file in str(err.value)
        with no_unpickling(), pytest.raises(CheckpointError, match="would run code"):
            torch.load(step / file)  # (what DeepSpeed's load would do)
        assert not marker.exists()
        state.pop("extra")
        torch.save(state, step / file)  # (the next file is tried on a clean checkpoint)
        _rehash(step, file)
    assert check(run, sonnets, "zero.stage=2")["step"] == 6


def test_a_checkpoint_saved_with_null_widths_resumes(trained, sonnets, tmp_path):
    """Checkpoints from before the model's widths were resolved at load hold null there
    (num_query_groups, ffn_hidden_size, head_dim): they stand for the values they meant, and a
    width that really differs is still refused."""
    run = copy_run(trained("zero.stage=2"), tmp_path)
    step = run / "checkpoints" / latest(run)
    manifest = json.loads((step / "manifest.json").read_text())
    m = manifest["model"]
    assert m["num_query_groups"] == m["num_attention_heads"]  # (the tiny model's defaults)
    assert m["head_dim"] == m["hidden_size"] // m["num_attention_heads"]
    m["num_query_groups"] = m["head_dim"] = None
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert check(run, sonnets, "zero.stage=2")["step"] == 6
    with pytest.raises(CheckpointError, match=r"model.num_query_groups: checkpoint 4, this run 2"):
        check(run, sonnets, "zero.stage=2", "model.num_query_groups=2")


def _truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_named_with_the_checkpoint_to_go_back_to(trained, sonnets,
                                                                         tmp_path):
    """Every file of a checkpoint has its size and SHA-256 in the manifest; a resume checks
    them first (the ranks share the hashing) and refuses a damaged one, naming the file and
    the previous complete checkpoint, with nothing loaded and nothing written."""
    run = copy_run(trained("zero.stage=2"), tmp_path)
    root = run / "checkpoints"
    step = root / "step_0000006"
    table = json.loads((step / "manifest.json").read_text())["files"]
    # (ZeRO-2 runs on FSDP: its model-state and rank-fragment files)
    assert {"config.yaml", "megatron_dp_model_tp00_pp00.pt", "rng_rank1.pt",
            "weights/tp00_pp00.safetensors", "weights/tp00_pp00_part01.safetensors",
            "megatron_dp_rank00001.pt"} <= set(table)
    assert all(v["bytes"] == os.path.getsize(step / k) and len(v["sha256"]) == 64
               for k, v in table.items())
    for file, damage, words in (
            ("megatron_dp_model_tp00_pp00.pt", _truncate, "(truncated)"),
            ("megatron_dp_rank00001.pt", _flip,
             "does not match its SHA-256 checksum"),
            ("rng_rank1.pt", _truncate, "(truncated)"),
            ("weights/tp00_pp00_part01.safetensors", _flip, "does not match its SHA-256"),
            ("manifest.json", _truncate, "is damaged (not JSON")):
        original = (step / file).read_bytes()
        damage(step / file)
        before = tree_hash(root)
        with pytest.raises(CheckpointError) as err:
            check(run, sonnets, "zero.stage=2")
        assert file in str(err.value) and words in str(err.value), str(err.value)
        if file != "manifest.json":
            assert f"resume={root / 'step_0000003'}" in str(err.value), str(err.value)
        assert tree_hash(root) == before, file
        (step / file).write_bytes(original)
    # setdiff-train: one line, exit code 2, nothing written (the ranks share the hashing)
    original = (step / "weights/tp00_pp00_part01.safetensors").read_bytes()
    _flip(step / "weights/tp00_pp00_part01.safetensors")
    before = tree_hash(root)
    res = train(run, sonnets, "zero.stage=2")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "weights/tp00_pp00_part01.safetensors does not match its SHA-256" in res.stderr
    assert f"resume={root / 'step_0000003'}" in res.stderr and "Traceback" not in res.stderr
    assert tree_hash(root) == before
    (step / "weights/tp00_pp00_part01.safetensors").write_bytes(original)
    assert check(run, sonnets, "zero.stage=2")["step"] == 6  # repaired: it resumes


def test_a_run_directory_belongs_to_one_trainer(sonnets, tmp_path):
    from helpers import train_config

    from setdiff_dist.checkpoint.files import RunLock
    from setdiff_dist.train.run_dir import claim_run_dir

    lock = RunLock(str(tmp_path))  # another trainer holds it
    try:
        refusal = claim_run_dir(train_config(tmp_path, sonnets), force=False)
    finally:
        lock.release()
    assert f"is in use by pid {os.getpid()}" in refusal
    assert sorted(os.listdir(tmp_path)) == [".setdiff.lock"]  # nothing else was written


def test_a_resume_that_would_change_or_lose_the_run_is_refused(trained, sonnets, tmp_path,
                                                               capsys):
    from helpers import train_config

    from setdiff_dist.train.run_dir import claim_run_dir

    run = copy_run(trained("zero.stage=2"), tmp_path)
    before = tree_hash(run / "checkpoints")
    refusal = claim_run_dir(train_config(run, sonnets, *REFERENCE, "resume=never"), False)
    assert "resume=never would train over the 2 checkpoint(s)" in refusal
    for overrides, words in (
            (("order.kind=block",), "order.kind: checkpoint 'staggered', this run 'block'"),
            (("train.seed=7",), "train.seed: checkpoint"),
            (("train.steps=1", "optimizer.warmup_steps=0"), "is at step 6, past train.steps=1")):
        with pytest.raises(CheckpointError) as err:
            check(run, sonnets, "zero.stage=2", *overrides)
        assert words in str(err.value), str(err.value)
        assert tree_hash(run / "checkpoints") == before, overrides
    # a lost `latest` is recovered from the newest complete checkpoint, not a silent restart
    os.remove(run / "checkpoints" / "latest")
    capsys.readouterr()
    assert check(run, sonnets, "zero.stage=2")["step"] == 6
    assert "resuming from the newest complete checkpoint" in capsys.readouterr().out


def test_a_rank_killed_during_start_up_ends_the_job_within_seconds(sonnets, tmp_path):
    """The launcher notices a dead rank, names it, and stops the others (they would otherwise
    wait in a collective for the process group's 30-minute timeout). The ranks, forked by the
    rank server, are the launcher's children, named ``setdiff-rankN``."""
    proc = subprocess.Popen(command(tmp_path, sonnets, 4, "zero.stage=2"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(None))
    ranks = {}
    deadline = time.monotonic() + 60
    while len(ranks) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        ranks = _ranks(proc.pid)
    assert sorted(ranks) == [0, 1], "the launcher did not start two ranks"
    time.sleep(0.5)  # in start-up: the process group, the model
    os.kill(ranks[1], signal.SIGKILL)
    killed = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed < 30
    assert proc.returncode != 0
    assert "rank 1 died (signal 9); stopping the other ranks" in err


def test_a_new_run_starts_from_a_checkpoints_weights_in_another_layout(trained, sonnets,
                                                                       tmp_path):
    """checkpoint.init_from: the weights of a TP=1 checkpoint start a PP=2 run (what a layout
    change that cannot resume is told to do); a step at learning rate 0 keeps them, bitwise."""
    from setdiff_dist.checkpoint.weights import read_full_state_dict

    source = trained()
    fresh = tmp_path / "fresh"
    res = run_train(fresh, sonnets, "parallel.pipeline=2", f"checkpoint.init_from={source}",
                    "optimizer.lr=0", "optimizer.min_lr=0", "optimizer.warmup_steps=0",
                    "train.eval_batches=1", steps=1)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "initialized from the weights of" in res.stdout
    a = read_full_state_dict(str(source / "checkpoints" / "step_0000006"))[0]
    b = read_full_state_dict(str(fresh / "checkpoints" / latest(fresh)))[0]
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_non_finite_weights_in_a_checkpoint_are_refused_at_resume_and_at_load(trained, sonnets,
                                                                                tmp_path):
    from safetensors.torch import load_file, save_file

    from setdiff_dist.checkpoint.weights import LoadError
    from setdiff_dist.inference.weights import build_inference_model

    run = copy_run(trained("zero.stage=2"), tmp_path)
    step = run / "checkpoints" / latest(run)
    model_file = "megatron_dp_model_tp00_pp00.pt"  # (ZeRO-2 runs on FSDP)
    state = torch.load(step / model_file, weights_only=False)
    name = next(k for k in state["module"] if k.endswith("linear_fc1.weight"))
    state["module"][name] = state["module"][name].detach().clone()
    state["module"][name][0, 0] = float("nan")
    torch.save(state, step / model_file)
    # (as a diverged run writes them: the manifest's checksums are those of the NaNs)
    _rehash(step, model_file)
    # (FSDP restores the weights from its fp32 shards, each rank's fragments: poison those too)
    for r in (0, 1):
        file = step / f"megatron_dp_rank{r:05d}.pt"
        mine = torch.load(file, weights_only=False)
        for frag in mine["fragments"].values():
            frag["param"] = frag["param"].detach().clone()
            frag["param"][0] = float("nan")
        torch.save(mine, file)
        _rehash(step, file.name)
    res = train(run, sonnets, "zero.stage=2")
    assert res.returncode == 2 and "holds non-finite weights" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    for weights in sorted((step / "weights").glob("tp00_pp00*.safetensors")):  # (DP parts)
        tensors = load_file(weights)
        if name in tensors:
            tensors[name] = tensors[name] * float("nan")
            save_file(tensors, weights)
            _rehash(step, f"weights/{weights.name}")
    with process_group("gloo"), pytest.raises(LoadError, match="non-finite values"):
        build_inference_model(str(step), pack=False)


def _convert_on_two_ranks(rank, steps, out):
    """Each of ``steps`` converted by both ranks together, into ``out/split-<i>``; then the
    first again with rank 1's merge failing."""
    import torch.distributed as dist
    from deepspeed.checkpoint import ds_to_universal

    from setdiff_dist.train.universal import convert, dist_agree

    dist.init_process_group("gloo")
    agree = dist_agree()
    for i, step in enumerate(steps):
        convert(step, f"{out}/split-{i}", rank, 2, agree)
    if rank == 1:
        def broken(*args):
            raise OSError("No space left on device")
        ds_to_universal.merge_tp_slices = broken
    try:
        convert(steps[0], f"{out}/failing", rank, 2, agree)
        said = "no error"
    except CheckpointError as exc:
        said = str(exc)
    with open(f"{out}/said-{rank}.txt", "w") as fh:
        fh.write(said)
    dist.barrier()  # (neither leaves while the other still talks)


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and (a == b or repr(a) == repr(b))  # (a loss scaler: its repr)


def test_the_universal_conversion_split_over_the_ranks_writes_what_one_process_writes(
        trained, tmp_path):
    """ZeRO-1 and ZeRO-3 checkpoints of the session's DP=2 runs, converted by 2 ranks sharing
    the work, and by one process alone: the same files, each tensor equal. A rank whose share
    fails makes both ranks raise the same error, naming it (no rank left at a barrier)."""
    from mp_harness import spawn

    from setdiff_dist.train.universal import convert

    steps = [str(trained() / "checkpoints" / "step_0000003"),
             str(trained(*EMA_RUN) / "checkpoints" / "step_0000003")]
    spawn(_convert_on_two_ranks, 2, steps, str(tmp_path))
    for i, step in enumerate(steps):
        alone = tmp_path / f"alone-{i}"
        convert(step, str(alone))
        split = tmp_path / f"split-{i}"
        files = sorted(str(p.relative_to(alone)) for p in alone.rglob("*") if p.is_file())
        assert files == sorted(str(p.relative_to(split)) for p in split.rglob("*")
                               if p.is_file())
        assert sum(f.endswith("exp_avg.pt") for f in files) > 10  # (each parameter's moments)
        assert not (split / "tmp").exists()
        for f in files:
            if f.endswith(".pt") and "/" in f:
                a, b = (torch.load(d / f, weights_only=False) for d in (alone, split))
                assert _same(a, b), f
    said = [(tmp_path / f"said-{r}.txt").read_text() for r in (0, 1)]
    assert said[0] == said[1]
    assert said[0].startswith("the conversion to DeepSpeed's universal form failed: rank 1 "
                              "could not merge each parameter's fragments"), said[0]
    assert "No space left on device" in said[0]


FOUR_LAYERS = "model.num_layers=4"  # (a pipeline of 4 stages)


MEGATRON = "zero.implementation=megatron"


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [
    pytest.param(({"nproc": 4}, FOUR_LAYERS, "parallel.tensor=2", "parallel.pipeline=2"),
                 ({"nproc": 2}, FOUR_LAYERS), id="tp2xpp2-to-pp1xdp2"),
    pytest.param(({"nproc": 4}, FOUR_LAYERS, "parallel.tensor=2", "parallel.pipeline=2"),
                 ({"nproc": 4}, FOUR_LAYERS, "parallel.pipeline=4"), id="tp2xpp2-to-pp4"),
    pytest.param(({"nproc": 4}, "parallel.pipeline=2"), ({"nproc": 4}, "parallel.tensor=2"),
                 id="pp2xdp2-to-tp2xdp2"),
    pytest.param(({"nproc": 2},), ({"nproc": 4}, "parallel.tensor=2", "parallel.pipeline=2"),
                 id="pp1xdp2-to-tp2xpp2"),
    pytest.param(({"nproc": 2}, "train.precision=bf16"), ({"nproc": 1}, "train.precision=bf16"),
                 id="bf16-dp2-to-dp1"),
    pytest.param(({"nproc": 2},), ({"nproc": 2}, "zero.stage=3"), id="zero1-to-zero3"),
    pytest.param(({"nproc": 1},), ({"nproc": 2}, "parallel.context=2"), id="cp1-to-cp2"),
    # ZeRO-2 runs on FSDP (the fragments of megatron's form, cut by rows) to and from the others
    pytest.param(({"nproc": 2}, "zero.stage=2"), ({"nproc": 1},), id="fsdp-dp2-to-zero1-dp1"),
    pytest.param(({"nproc": 2}, "zero.stage=2"), ({"nproc": 2}, "zero.stage=3"),
                 id="fsdp-dp2-to-zero3"),
    pytest.param(({"nproc": 2}, MEGATRON), ({"nproc": 2}, "zero.stage=2", "parallel.tensor=2"),
                 id="megatron-dp2-to-fsdp-tp2"),
    # megatron-core's distributed optimizer (zero.implementation=megatron) to and from
    # DeepSpeed's engines and other layouts
    pytest.param(({"nproc": 2},), ({"nproc": 2}, MEGATRON, "parallel.tensor=2"),
                 id="deepspeed-dp2-to-megatron-tp2"),
    pytest.param(({"nproc": 2}, MEGATRON), ({"nproc": 1},), id="megatron-dp2-to-deepspeed-dp1"),
    pytest.param(({"nproc": 4}, MEGATRON, "parallel.pipeline=2"),
                 ({"nproc": 4}, MEGATRON, "parallel.tensor=2"),
                 id="megatron-pp2xdp2-to-megatron-tp2xdp2"),
    pytest.param(({"nproc": 2}, MEGATRON), ({"nproc": 2}, "zero.stage=3"),
                 id="megatron-dp2-to-zero3"),
    pytest.param(({"nproc": 2}, MEGATRON, "train.precision=bf16"),
                 ({"nproc": 4}, MEGATRON, "train.precision=bf16"), id="megatron-bf16-dp2-to-dp4"),
    # ZeRO-3 to ZeRO-1/2 (universal_zero12/): prototyped on ZeRO-3, trained on at TP + ZeRO-1
    pytest.param(({"nproc": 2}, "zero.stage=3"), ({"nproc": 2}, "parallel.tensor=2"),
                 id="zero3-dp2-to-tp2-default"),
    pytest.param(({"nproc": 2}, "zero.stage=3"), ({"nproc": 1}, "zero.stage=2"),
                 id="zero3-dp2-to-fsdp-dp1")])
def test_resume_on_any_layout_continues_the_same_curve(trained, sonnets, tmp_path, saved,
                                                       resumed):
    """A checkpoint of one pipeline x tensor x data-parallel layout and ZeRO stage resumes in
    another: the optimizer state (named by the parameters' global names, so that pipeline
    stages do not share them) goes through DeepSpeed's universal form (read by a ZeRO-3 engine
    through universal_zero3/), and steps 4-6 are the uninterrupted run's within fp32 rounding
    (1e-5; bf16: 1e-4)."""
    (saved_at, *saved), (resumed_at, *resumed) = saved, resumed
    ref = trained(*saved, nproc=saved_at["nproc"])
    run = rewound(ref, tmp_path)
    res = train(run, sonnets, *resumed, nproc=resumed_at["nproc"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "universal form" in res.stdout and "resumed from" in res.stdout
    got, want = losses(run), losses(ref)
    assert sorted(got) == sorted(want)
    tolerance = 1e-4 if "train.precision=bf16" in resumed else 1e-5
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, abs=tolerance), step


def _flip(path, at=None):
    """Flip one bit of the file ``path`` (its middle byte by default); returns the undo."""
    data = path.read_bytes()
    at = len(data) // 2 if at is None else at
    path.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])
    return lambda: path.write_bytes(data)


def test_a_damaged_universal_form_is_refused_on_resume_naming_the_file(trained, sonnets,
                                                                       tmp_path):
    """The universal form (and its ZeRO-3 view) gets a manifest of its own when made, checked
    by every resume that reuses it: one flipped bit in any of its files, the manifest
    included, is refused naming that file and how to have it made again; a form without a
    manifest (an older version's) is made again; and setdiff-train refuses the damaged form
    with exit code 2 before DeepSpeed reads it."""
    from setdiff_dist.train.universal import prepare

    run = rewound(trained(), tmp_path)
    step = run / "checkpoints" / "step_0000003"
    said = []
    # (the view of a ZeRO-1 checkpoint for a ZeRO-3 run: its vocabulary rows padded to 264)
    assert prepare(str(step), zero3_rows=264, say=said.append) == "universal_zero3"
    assert sum("converting" in line for line in said) == 1
    for form in ("universal", "universal_zero3"):
        files = sorted(p for p in (step / form).rglob("*") if p.is_file() and not p.is_symlink())
        assert (step / form / "manifest.json") in files and len(files) > 3
        for file in files:
            undo = _flip(file)
            with pytest.raises(CheckpointError) as err:
                prepare(str(step), zero3_rows=264)
            undo()
            message = str(err.value)
            assert f"{step / form} (" in message and "is damaged" in message, message
            assert str(file.relative_to(step / form)) in message, message
            assert f"Remove {step / form} (rm -r)" in message, message
    link = next(p for p in (step / "universal_zero3" / "zero").iterdir() if p.is_symlink())
    target = os.readlink(link)
    link.unlink()
    link.symlink_to(os.path.join(os.path.dirname(target), "elsewhere"))
    with pytest.raises(CheckpointError, match=f"{link.name} is not the link to"):
        prepare(str(step), zero3_rows=264)
    link.unlink()
    link.symlink_to(target)
    said.clear()
    assert prepare(str(step), zero3_rows=264, say=said.append) == "universal_zero3"
    assert said == []  # (checked, not made again)
    # a form without its manifest is not trusted: made again (and the view derived from it)
    (step / "universal" / "manifest.json").unlink()
    assert prepare(str(step), zero3_rows=264, say=said.append) == "universal_zero3"
    assert "has no manifest" in said[0] and sum("converting" in line for line in said) == 1
    assert (step / "universal" / "manifest.json").is_file()
    # setdiff-train, resuming at DP=1: refused before DeepSpeed reads it, named, exit code 2
    damaged = step / "universal" / "zero" / "embedding.weight" / "exp_avg.pt"
    _flip(damaged)
    res = train(run, sonnets, nproc=1)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "zero/embedding.weight/exp_avg.pt" in res.stderr
    assert f"Remove {step / 'universal'} (rm -r)" in res.stderr, res.stderr[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000003"


def test_two_jobs_resuming_one_checkpoint_take_turns_at_its_conversion(trained, tmp_path):
    """Two jobs (here: two threads, each a job of one rank) resume one checkpoint in a new
    layout at once: one converts under the step's lock, the other waits for it, then finds
    the form made and checks it instead of converting again; no error, one conversion. The
    next start of the run that owns the checkpoint leaves a locked conversion's temporary
    directory alone."""
    import threading

    from setdiff_dist.checkpoint.files import ConversionLock
    from setdiff_dist.train.run_dir import clean_leftovers
    from setdiff_dist.train.universal import prepare

    run = copy_run(trained(), tmp_path)
    step = run / "checkpoints" / "step_0000003"
    start = threading.Barrier(2)
    said, results = [[], []], [None, None]

    def job(i):
        start.wait()
        try:
            results[i] = prepare(str(step), say=said[i].append, poll_s=0.05)
        except Exception as exc:  # noqa: BLE001 (the test reports it)
            results[i] = exc

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == ["universal", "universal"], (results, said)
    converted = [any("converting" in line for line in s) for s in said]
    waited = [any(line.startswith("waiting for ") for line in s) for s in said]
    assert sorted(converted) == [False, True] and waited == [not c for c in converted], said
    said[0].clear()
    assert prepare(str(step), say=said[0].append) == "universal" and said[0] == []
    # a conversion in flight (its lock held) keeps its temporary directory
    (step / "universal.tmp").mkdir()
    lock = ConversionLock(str(step))
    assert lock.acquire()
    clean_leftovers(str(run))
    assert (step / "universal.tmp").is_dir()
    lock.release()
    clean_leftovers(str(run))
    assert not (step / "universal.tmp").exists()


def test_the_fresh_start_a_refusal_suggests_asks_for_the_stage_and_layout_of_this_run():
    """Pure logic: a refusal's suggestion (a new run from the checkpoint's weights, with its
    config) sets what this run asked for and the checkpoint's config lacks: the ZeRO stage
    (``zero.stage: 3`` kept from the config was refused again) and the parallel sizes."""
    from setdiff_dist.checkpoint.manifest import layout_differences

    def layout(tp=1, pp=1, dp=1):
        return {"tensor": tp, "pipeline": pp, "data": dp, "context": 1, "world": tp * pp * dp}

    # (ZeRO-3 at TP=2 into ZeRO-1 is refused: DeepSpeed's ZeRO-3 form of TP slices)
    [zero3_to_1] = layout_differences(layout(tp=2), layout(tp=2), 3, 1, "ckpt")
    assert "checkpoint.init_from=ckpt zero.stage=1 ..." in zero3_to_1, zero3_to_1
    [zero0] = layout_differences(layout(pp=2), layout(tp=2), 0, 0, "ckpt")
    assert "checkpoint.init_from=ckpt parallel.pipeline=1 parallel.tensor=2 ..." in zero0, zero0
    assert "zero.stage" not in zero0.split("checkpoint.init_from=")[1]
    [tp2] = layout_differences(layout(tp=2, dp=2), layout(tp=2), 1, 3, "ckpt")
    assert "checkpoint.init_from=ckpt zero.stage=3 ..." in tp2, tp2


def test_the_checkpoint_of_lowest_validation_loss_is_kept_as_best(sonnets, tmp_path):
    """``checkpoint.keep_best``: a validation that beats every earlier one saves its step and
    points ``checkpoints/best`` at it; pruning (keep_last=1) never takes it; the lowest loss is
    carried through a resume (at lr 0 the later validations only tie it, and a tie moves
    nothing); the pointer file reads as a checkpoint; a run without a validation split is
    refused before it starts."""
    from helpers import sonnet_shards, train_config

    from setdiff_dist.checkpoint.files import step_directory
    from setdiff_dist.config import ConfigError
    from setdiff_dist.train.loop import open_data

    run = tmp_path / "run"
    best = ("checkpoint.keep_best=true", "checkpoint.keep_last=1", "checkpoint.interval=0",
            "train.eval_interval=2", "train.eval_batches=1")
    res = run_train(run, sonnets, *best, nproc=1, steps=4)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 2: validation loss" in res.stdout and "checkpoints/best" in res.stdout
    res = run_train(run, sonnets, *best, "optimizer.lr=0", "optimizer.min_lr=0", nproc=1, steps=8)
    assert res.returncode == 0, res.stderr[-3000:]
    valid = {r["step"]: r["valid_loss"] for r in map(json.loads, open(run / "metrics.jsonl"))
             if "valid_loss" in r}
    assert sorted(valid) == [2, 4, 6, 8] and valid[4] == valid[6] == valid[8]  # (lr 0: ties)
    lowest = min(valid, key=lambda s: (valid[s], s))  # (the first of equals)
    root = run / "checkpoints"
    assert open(root / "best").read().strip() == f"step_{lowest:07d}"
    assert sorted(d for d in os.listdir(root) if d.startswith("step_")) == sorted(
        {f"step_{lowest:07d}", "step_0000008"})
    assert step_directory(str(root / "best")) == str(root / f"step_{lowest:07d}")
    assert step_directory(str(root / "latest")) == str(root / "step_0000008")
    # without a validation split there is nothing to choose by
    bare = sonnet_shards(tmp_path / "bare", valid_every=0)
    with pytest.raises(ConfigError, match="data has no validation split"):
        open_data(train_config(tmp_path / "r2", bare, "checkpoint.keep_best=true"))
