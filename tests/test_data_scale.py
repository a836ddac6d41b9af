"""Data at real scale: a global shuffle in O(1) memory, thousands of shards under a small file
limit, blended corpora in exact proportions, and exact resume of all of it."""

import json
import os
import resource
import shutil
import subprocess
import time
import tracemalloc

import pytest
from helpers import child_env, losses, run_train, train_command

from data_prep.prep import prepare
from setdiff_dist.data import sample_text

# ----------------------------------------------------------------------------- the permutation

@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4099])
def test_the_permutation_is_a_bijection_fixed_by_seed_and_epoch(n):
    from setdiff_dist.data.permutation import Permutation

    p = Permutation(n, seed=11, epoch=2)
    values = [p[i] for i in range(n)]
    assert sorted(values) == list(range(n))
    assert values == [Permutation(n, seed=11, epoch=2)[i] for i in range(n)]  # nothing else
    if n >= 64:  # another epoch or seed: another order
        assert values != [Permutation(n, seed=11, epoch=3)[i] for i in range(n)]
        assert values != [Permutation(n, seed=12, epoch=2)[i] for i in range(n)]
        assert values != list(range(n))


def test_a_billion_sample_epoch_starts_at_once_in_constant_memory():
    from setdiff_dist.data.permutation import Permutation

    n = 10 ** 9
    tracemalloc.start()
    try:
        start = time.perf_counter()
        p = Permutation(n, seed=1234, epoch=7)
        first = [p[i] for i in range(1000)]
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0  # torch.randperm(10**9): ~30 s and 7.5 GiB
    assert peak < 256 * 1024  # (the 1000 values themselves included)
    assert all(0 <= v < n for v in first) and len(set(first)) == 1000


# ----------------------------------------------------------------------------- blends

def _corpus(directory, tokenizer="bytes", seq_len=32, copies=1, samples_per_shard=64):
    """Shards of the sonnets, repeated ``copies`` times (documents numbered apart)."""
    os.makedirs(directory, exist_ok=True)
    src = os.path.join(directory, "text.txt")
    with open(src, "w") as fh:
        for c in range(copies):
            fh.write(f"{c}\n\n".join(sample_text().split("\n\n")) + "\n\n")
    out = os.path.join(directory, "shards")
    prepare([src], tokenizer, seq_len, out, split_paragraphs=True, valid_every=4,
            samples_per_shard=samples_per_shard, workers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    return {"a": _corpus(root / "a"), "b": _corpus(root / "b", copies=3)}


def test_a_blend_takes_each_corpus_in_its_proportion_and_each_sample_once_per_epoch(corpora):
    from setdiff_dist.data.blend import Blend
    from setdiff_dist.data.loader import _StreamSamples

    blend = Blend.open(f"0.3 {corpora['a']} 0.7 {corpora['b']}", "train", seq_len=32)
    stream = _StreamSamples(blend, seed=5, shuffle=True)
    picks = [stream.sample_index(p) for p in range(10_000)]
    share = sum(1 for c, _ in picks if c == 0) / len(picks)
    assert abs(share - 0.3) < 0.01
    for window in range(0, 10_000, 1000):  # evenly spread, not in runs
        part = picks[window:window + 1000]
        assert abs(sum(1 for c, _ in part if c == 0) / 1000 - 0.3) < 0.01
    # weights that do not sum to 1 (the valid splits of some of the corpora) keep their ratio
    assert Blend(blend.sets, [3.0, 7.0], blend.specs).counts == blend.counts == [3, 7]
    assert blend.period == 10
    for c, s in enumerate(blend.sets):  # every sample of a corpus once before any repeats
        n = len(s)
        mine = [i for cc, i in picks if cc == c][:n]
        assert sorted(mine) == list(range(n)), c


@pytest.mark.parametrize("what", ["tokenizer", "seq_len", "weight", "missing shard"])
def test_a_bad_blend_names_the_corpus_and_the_file(corpora, tmp_path, what):
    from setdiff_dist.config import ConfigError, load_config
    from setdiff_dist.data.blend import Blend
    from setdiff_dist.errors import SetdiffError

    a = corpora["a"]
    if what == "weight":
        with pytest.raises(ConfigError, match=r"data.train_shards: .*the weight of .*b/shards is "
                                              r"-1; weights must be positive"):
            load_config("configs/tiny-cpu.yaml", [f"data.train_shards=0.5 {a} -1 {corpora['b']}"])
        return
    if what == "tokenizer":
        other, words = _corpus(tmp_path / "gpt2", tokenizer="gpt2"), "not with the configured"
    elif what == "seq_len":
        other, words = _corpus(tmp_path / "L64", seq_len=64), "hold sequences of 64 tokens"
    else:
        other = str(tmp_path / "copy")
        shutil.copytree(corpora["b"], other)
        os.remove(os.path.join(other, "train-00001.tar"))
        words = "train-00001.tar is missing"
    with pytest.raises(SetdiffError) as err:
        Blend.open(f"0.5 {a} 0.5 {other}", "train", seq_len=32)
    assert words in str(err.value) and other in str(err.value), str(err.value)


def test_a_blend_resumes_exactly_at_another_data_parallel_size(trained, corpora, tmp_path):
    """A 0.3 / 0.7 blend on two ranks (a session reference run), rewound to its step-3
    checkpoint and resumed on one rank: the same losses (the stream position is global; the
    corpora are recorded); resuming on other weights is refused."""
    from helpers import REFERENCE, REFERENCE_STEPS, resume_check, rewound

    from setdiff_dist.data.shards import ShardError

    blend = f"data.train_shards=0.3 {corpora['a']} 0.7 {corpora['b']}"
    ref = trained(blend, "data.num_workers=1")
    run = rewound(ref, tmp_path)
    res = run_train(run, corpora["a"], *REFERENCE, blend, "data.num_workers=1",
                    steps=REFERENCE_STEPS, nproc=1)
    assert res.returncode == 0, res.stderr[-3000:]
    got, straight = losses(run), losses(ref)
    assert sorted(got) == sorted(straight)
    for step, loss in straight.items():  # (the layouts differ by fp32 rounding only)
        assert got[step] == pytest.approx(loss, abs=1e-5), step
    # the blend is part of the data stream: resuming on other weights is refused
    with pytest.raises(ShardError, match="cannot resume the data stream"):
        resume_check(run, corpora["a"], *REFERENCE,
                     f"data.train_shards=0.5 {corpora['a']} 0.5 {corpora['b']}",
                     steps=REFERENCE_STEPS, dp=1)


# ----------------------------------------------------------------------------- many shards

@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    """About 2,000 shards of one sample each."""
    return _corpus(tmp_path_factory.mktemp("many"), copies=30, samples_per_shard=1)


def _limit_files():
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_two_thousand_shards_train_under_a_limit_of_256_open_files(many_shards, tmp_path,
                                                                   workers):
    with open(os.path.join(many_shards, "manifest.json")) as fh:
        assert len(json.load(fh)["splits"]["train"]["shards"]) >= 2000
    cmd = train_command(tmp_path, many_shards, "train.eval_batches=1",
                        f"data.num_workers={workers}", "checkpoint.save_at_end=false",
                        steps=40)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env(None),
                         preexec_fn=_limit_files)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(losses(tmp_path)) == list(range(1, 41))


def test_more_open_shards_than_the_file_limit_allows_is_a_clear_error(many_shards, tmp_path):
    cmd = train_command(tmp_path, many_shards, "train.eval_batches=1", "data.num_workers=0",
                        "data.max_open_shards=4000", steps=40)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env(None),
                         preexec_fn=_limit_files)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert "open files" in res.stderr and "data.max_open_shards=4000" in res.stderr
    assert "ulimit -n" in res.stderr


# ----------------------------------------------------------------------------- one reader per TP

def _tp_read(rank, shards, run_root, out):
    import torch

    from setdiff_dist.config import load_config
    from setdiff_dist.train.loop import Trainer

    t = Trainer(load_config("configs/tiny-cpu.yaml", [
        f"run_dir={run_root}", "resume=never", f"data.train_shards={shards}", "data.seq_len=32",
        "model.vocab_size=257", "data.global_batch_size=4", "data.micro_batch_size=2",
        "train.tensorboard=false", "data.num_workers=0", "parallel.tensor=2"]))
    steps = t._steps(t.loader(0))
    got = [next(steps) for _ in range(3)]
    torch.save({"open": t.train_set.sets[0].open_shards,
                "tokens": [b.tokens for step in got for b in step],
                "indices": [b.indices for step in got for b in step]}, out / f"rank{rank}.pt")


def test_one_rank_of_a_tensor_parallel_group_reads_and_the_others_receive(corpora, tmp_path):
    import torch
    from mp_harness import spawn

    spawn(_tp_read, 2, corpora["a"], str(tmp_path / "run"), tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["open"] > 0 and r1["open"] == 0  # rank 1 never opened a shard
    assert len(r0["tokens"]) == 6  # 3 steps of 2 micro-batches
    for a, b in zip(r0["tokens"] + r0["indices"], r1["tokens"] + r1["indices"]):
        assert torch.equal(a, b)
