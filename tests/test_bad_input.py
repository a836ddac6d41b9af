"""Bad input gets a clear error (exit code 2, no traceback) and loses nothing: manifests cannot
point a reader or a writer outside their directory, non-finite numbers and out-of-range flags
are refused before any work, and results are valid JSON written only where they can be."""

import contextlib
import json
import os

import pytest
from helpers import cli, sonnet_shards, tree_hash


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return sonnet_shards(tmp_path_factory.mktemp("bad"), "bpe:300")


def _with_manifest(src, dst, edit):
    import shutil

    shutil.copytree(src, dst)
    path = dst / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    return str(dst)


@pytest.mark.parametrize("name", ["../outside.tar", "/etc/passwd"])
def test_a_shard_path_escaping_the_manifest_directory_is_refused(shards, tmp_path, name):
    from setdiff_dist.data.shards import ShardError, ShardSet

    def edit(m):
        m["splits"]["train"]["shards"][0]["file"] = name

    directory = _with_manifest(shards, tmp_path / "escape", edit)
    with pytest.raises(ShardError, match="refused"):
        ShardSet(directory, "train", seq_len=32)


def test_a_tokenizer_file_escaping_the_manifest_directory_is_refused(shards, tmp_path):
    from setdiff_dist.data.tokenizers import TokenizerError, load_shipped_tokenizer

    with open(f"{shards}/manifest.json") as fh:
        manifest = json.load(fh)
    identity = dict(manifest["tokenizer"], file="../../../etc/passwd")
    with pytest.raises(TokenizerError, match="points outside"):
        load_shipped_tokenizer(shards, identity)


def test_an_hf_index_naming_a_file_outside_is_refused(tmp_path):
    from setdiff_dist.checkpoint.hf_files import HFCheckpointError, HFFiles

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "../../secret.safetensors"}}))
    with pytest.raises(HFCheckpointError, match="points outside"):
        HFFiles(str(tmp_path))


@pytest.mark.parametrize("override", ["optimizer.lr=nan", "model.init_std=inf",
                                      "order.t_max=-inf"])
def test_non_finite_numbers_are_refused_by_the_config(override):
    from setdiff_dist.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="expected a finite number|not a number"):
        load_config("configs/tiny-cpu.yaml", [override])


@pytest.mark.parametrize("flags,words", [
    (["--temperature", "nan"], "temperature=nan: it must be a finite number 0 (greedy)"),
    # (inside the range a float can hold, outside what the float32 sampler can divide by)
    (["--temperature", "1e-38"], "temperature=1e-38: it must be 0 (greedy) or from 1.18e-38"),
    (["--repetition-penalty", "1e-300"], "repetition_penalty=1e-300: it must be in"),
    (["--threshold", "-0.5"], "threshold=-0.5: a confidence in [0, 1]"),
    (["--repetition-penalty", "0"], "repetition_penalty=0.0"),
])
def test_bad_generation_flags_are_refused_before_any_model_is_loaded(tmp_path, flags, words):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "setdiff_dist.cli.generate", "--checkpoint",
                          str(tmp_path / "no-such-run"), "--prompt", "x", *flags],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and words in res.stderr and "Traceback" not in res.stderr
    assert "no such directory" not in res.stderr  # (the flags are checked first)


def test_eval_checks_its_output_directory_before_evaluating(tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "setdiff_dist.cli.eval", "--checkpoint",
                          str(tmp_path / "no-such-run"), "--task", "ppl", "--out",
                          str(tmp_path / "missing" / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "is not a writable directory; create it first" in res.stderr


def test_non_finite_results_are_written_as_valid_json():
    from setdiff_dist.cli import json_text

    text = json_text({"a": [1.0, float("inf")], "b": {"c": float("nan")}})
    assert json.loads(text) == {"a": [1.0, "inf"], "b": {"c": "nan"}}


# ----------------------------------------------------------------------------- one line, exit 2
# Each case: a command as a user would type it, the words its one-line error must hold (what
# is wrong, where, and the fix), run in this process (the errors come before any process group)
# with the workspace hashed before and after: a refusal writes nothing and loses nothing.

@pytest.fixture(scope="module")
def workspace(shards, tmp_path_factory):
    """A shard directory, task files and a config, as a user's working directory holds them."""
    import shutil

    ws = tmp_path_factory.mktemp("ws")
    shutil.copytree(shards, ws / "shards")
    (ws / "binary.yaml").write_bytes(b"\x00\x01\xff\xfe")
    (ws / "notjson.jsonl").write_text('{"left": "a", "middle": "b", "right": "c"}\nnot json\n')
    (ws / "gsm.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    (ws / "corpus.txt").write_text("Shall I compare thee to a summer's day?\n")
    return ws


TRAIN = ["--config", "configs/tiny-cpu.yaml", "data.train_shards={ws}/shards", "data.seq_len=32",
         "model.vocab_size=300", "run_dir={ws}/run", "data.global_batch_size=8",
         "data.micro_batch_size=2"]
GENERATE = ["--checkpoint", "{ws}/shards", "--prompt", "x"]

BAD_INPUT = [
    ("binary config", "setdiff_dist.cli.train", ["--config", "{ws}/binary.yaml"],
     ["binary.yaml", "not a text file", "give a YAML config"]),
    ("TP=4 on 2 ranks", "setdiff_dist.cli.train",
     TRAIN + ["--nproc-per-node", "2", "parallel.tensor=4"],
     ["world size 2 is not divisible by parallel.tensor=4", "launch a multiple of 4 ranks"]),
    ("TP=3", "setdiff_dist.cli.train", TRAIN + ["--nproc-per-node", "3", "parallel.tensor=3"],
     ["parallel.tensor=3 must divide model.num_query_groups=4"]),
    ("micro x DP > global batch", "setdiff_dist.cli.train",
     TRAIN + ["--nproc-per-node", "2", "data.micro_batch_size=8"],
     ["data.global_batch_size=8 must be a multiple of data.micro_batch_size=8 x data-parallel "
      "size 2", "set data.global_batch_size=16"]),
    ("--nproc-per-node -1", "setdiff_dist.cli.train", TRAIN + ["--nproc-per-node", "-1"],
     ["--nproc-per-node: must be 1 or more, got -1"]),
    ("--device-memory nan", "setdiff_dist.cli.train",
     TRAIN + ["--dry-run", "--device-memory", "nan"],
     ["--device-memory nan: a positive number of GiB"]),
    ("an unknown key", "setdiff_dist.cli.train", TRAIN + ["optimizer.lrr=1"],
     ["optimizer.lrr", "did you mean 'optimizer.lr'"]),
    ("--tokenizer bpe:100", "data_prep.prep",
     ["--input", "{ws}/corpus.txt", "--tokenizer", "bpe:100", "--seq-len", "32", "--out",
      "{ws}/prep-out"], ["bpe:100", "needs at least 257 tokens"]),
    ("--workers -1", "data_prep.prep",
     ["--input", "{ws}/corpus.txt", "--tokenizer", "bytes", "--seq-len", "32", "--out",
      "{ws}/prep-out", "--workers", "-1"], ["--workers: must be 0 or more, got -1"]),
    ("non-UTF-8 prompt bytes", "setdiff_dist.cli.generate",
     ["--checkpoint", "{ws}/run", "--prompt", "x\udcff"],
     ["--prompt is not valid UTF-8 text", "re-encode it as UTF-8"]),
    ("--stop 're:('", "setdiff_dist.cli.generate", GENERATE + ["--stop", "re:("],
     ["stop pattern 're:(' is not a valid regular expression", "drop the 're:' prefix"]),
    ("a shard directory as --checkpoint", "setdiff_dist.cli.generate", GENERATE,
     ["shards is a shard directory (setdiff-prep's output), not a checkpoint",
      "give a training run directory"]),
    ("a JSONL line that is not JSON", "setdiff_dist.cli.eval",
     ["--checkpoint", "{ws}/run", "--task", "infill", "--data", "{ws}/notjson.jsonl"],
     ["notjson.jsonl, line 2: not JSON", "setdiff-tasks infill --out"]),
    ("the wrong task file", "setdiff_dist.cli.eval",
     ["--checkpoint", "{ws}/run", "--task", "infill", "--data", "{ws}/gsm.jsonl"],
     ["gsm.jsonl, line 1: no 'left', 'middle', 'right' field: not an infill task file"]),
    ("a missing task file", "setdiff_dist.cli.eval",
     ["--checkpoint", "{ws}/run", "--task", "gsm", "--data", "{ws}/none.jsonl"],
     ["--data", "none.jsonl: no such file", "setdiff-tasks gsm --out"]),
    ("--limit 0", "setdiff_dist.cli.eval",
     ["--checkpoint", "{ws}/run", "--task", "gsm", "--data", "{ws}/gsm.jsonl", "--limit", "0"],
     ["--limit: must be 1 or more, got 0"]),
]


@pytest.mark.parametrize("module,argv,words", [c[1:] for c in BAD_INPUT],
                         ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_message_and_exit_code_2_and_writes_nothing(workspace, capsys, module,
                                                                     argv, words):
    before = tree_hash(workspace)
    code, err = cli(module, [a.format(ws=workspace) for a in argv], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err
    assert tree_hash(workspace) == before


def test_a_bad_warm_start_setting_is_one_message_and_exit_code_2(workspace, capsys,
                                                                 monkeypatch):
    """SETDIFF_WARM_START (how the launcher starts its ranks) takes 0 or 1: anything else is
    refused before a rank starts, never read as one of them."""
    monkeypatch.setenv("SETDIFF_WARM_START", "yes")
    before = tree_hash(workspace)
    code, err = cli("setdiff_dist.cli.train",
                    [a.format(ws=workspace) for a in TRAIN + ["--nproc-per-node", "2"]], capsys)
    assert code == 2, err
    assert "SETDIFF_WARM_START='yes': set 0" in err and "Traceback" not in err
    assert tree_hash(workspace) == before


def test_a_corrupt_shard_met_in_training_is_one_message_from_the_rank_that_read_it(tmp_path):
    """With data.verify=full a shard is hashed when a loader worker first opens it: the error
    comes from inside a DataLoader worker of one rank, and is printed as the reader raised it,
    not as the worker's traceback; the job ends with exit code 2."""
    from helpers import run_train

    from data_prep.prep import prepare
    from setdiff_dist.data import sample_text

    src = tmp_path / "sonnets.txt"
    src.write_text(sample_text())
    shards = tmp_path / "shards"
    prepare([str(src)], "bytes", 32, str(shards), split_paragraphs=True, valid_every=0,
            samples_per_shard=8, workers=1, progress=False)
    for tar in sorted(shards.glob("train-*.tar")):  # every shard: whichever a rank reads first
        data = bytearray(tar.read_bytes())
        data[len(data) // 2] ^= 0xFF
        tar.write_bytes(bytes(data))
    res = run_train(tmp_path / "run", str(shards), "data.num_workers=1", "train.eval_batches=1",
                    "data.verify=full", steps=2)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "is corrupt: its sha256 differs from the manifest's; re-run setdiff-prep" in res.stderr
    assert "Traceback" not in res.stderr and "DataLoader worker" not in res.stderr


def _damage_missing_index(d):
    next(d.glob("train-*.idx.npy")).unlink()


def _damage_truncated_manifest(d):
    text = (d / "manifest.json").read_text()
    (d / "manifest.json").write_text(text[:len(text) // 2])


def _damage_seq_len(d):  # a manifest that disagrees with its samples
    m = json.loads((d / "manifest.json").read_text())
    m["seq_len"] = 16
    (d / "manifest.json").write_text(json.dumps(m))


def _damage_tokenizer(d):
    m = json.loads((d / "manifest.json").read_text())
    (d / m["tokenizer"]["file"]).unlink()


@pytest.mark.parametrize("damage,seq_len,words", [
    (_damage_missing_index, 32, ["shard file", ".idx.npy is missing (listed in",
                                 "re-run setdiff-prep"]),
    (_damage_truncated_manifest, 32, ["manifest.json: not valid JSON"]),
    (_damage_seq_len, 16, ["has shape (32,), expected (16,)"]),
    (_damage_tokenizer, 32, ["the tokenizer file", "is missing", "manifest names it: 'bpe:300'"]),
], ids=["missing index", "truncated manifest", "seq_len disagrees with the samples",
        "deleted tokenizer"])
def test_a_damaged_shard_directory_is_one_clear_error(shards, tmp_path, damage, seq_len, words):
    """What the trainer meets, in the order it meets it: the manifest, the shard files, the
    tokenizer, then each sample as a loader reads it."""
    import shutil

    from setdiff_dist.data.loader import TokenLoader
    from setdiff_dist.data.shards import ShardSet
    from setdiff_dist.data.tokenizers import load_shipped_tokenizer
    from setdiff_dist.errors import SetdiffError

    d = tmp_path / "shards"
    shutil.copytree(shards, d)
    damage(d)
    with pytest.raises(SetdiffError) as err:
        s = ShardSet(str(d), "train", seq_len=seq_len)
        load_shipped_tokenizer(str(d), s.manifest["tokenizer"])
        next(iter(TokenLoader(s, global_batch=2, micro_batch=2, num_workers=0)))
    for w in words:
        assert w in str(err.value), str(err.value)


# ----------------------------------------------------------------------- setdiff_dist.load(...)
# The Python API checks its arguments before it reads anything, and its errors name them as a
# Python caller gave them (load(path=...)), where a command's name its flags (--checkpoint).

@pytest.mark.parametrize("kwargs,words", [
    ({"dtype": "fp16"}, ["load(dtype='fp16'): float16 is not supported",
                         "float32 (fp32) or bfloat16 (bf16)"]),
    ({"dtype": "float16"}, ["load(dtype='float16'): float16 is not supported"]),
    ({"dtype": "fp8"}, ["load(dtype='fp8'): unknown dtype; give auto", "bfloat16 (bf16)"]),
    ({"tensor_parallel": 0}, ["load(tensor_parallel=0): the tensor-parallel size must be an "
                              "integer of 1 or more", "torchrun --nproc-per-node N"]),
    ({"tensor_parallel": -2}, ["load(tensor_parallel=-2): the tensor-parallel size"]),
    ({"tensor_parallel": 1.5}, ["load(tensor_parallel=1.5): the tensor-parallel size"]),
], ids=["fp16", "float16", "fp8", "tp 0", "tp -2", "tp 1.5"])
def test_load_refuses_a_bad_dtype_or_tensor_parallel_size_first(tmp_path, kwargs, words):
    import setdiff_dist
    from setdiff_dist.errors import SetdiffError

    with pytest.raises(SetdiffError) as err:  # (before the path, which does not exist)
        setdiff_dist.load(str(tmp_path / "no-such-run"), **kwargs)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_load_names_its_path_argument_and_a_command_its_flag(tmp_path, capsys):
    import setdiff_dist
    from setdiff_dist.checkpoint.weights import LoadError

    missing = tmp_path / "no-such-run"
    with pytest.raises(LoadError) as err:
        setdiff_dist.load(missing)  # (a pathlib.Path is a path too)
    assert str(err.value).startswith(f"load(path={str(missing)!r}): no such directory; give a "
                                     "training run directory"), str(err.value)
    assert "--checkpoint" not in str(err.value)
    shards = tmp_path / "shards"  # setdiff-prep's output, given for a checkpoint
    shards.mkdir()
    (shards / "manifest.json").write_text(json.dumps({"splits": {}}))
    with pytest.raises(LoadError, match=r"^load\(path='.*shards'\) is a shard directory"):
        setdiff_dist.load(str(shards))
    with pytest.raises(LoadError, match=r"^load\(path=None\): expected a directory"):
        setdiff_dist.load(None)
    # the commands (which load through the same function) name their flag
    code, err = cli("setdiff_dist.cli.generate", ["--checkpoint", str(missing), "--prompt",
                                                  "x"], capsys)
    assert code == 2 and f"--checkpoint {missing}: no such directory" in err, err
    assert "load(path" not in err


def test_load_has_an_explicit_documented_signature():
    """``setdiff_dist.load`` (the lazy entry) takes the same arguments as
    ``setdiff_dist.api.load``, each named in its docstring."""
    import inspect

    import setdiff_dist
    import setdiff_dist.api

    ours, api = inspect.signature(setdiff_dist.load), inspect.signature(setdiff_dist.api.load)
    assert list(ours.parameters) == list(api.parameters) == [
        "path", "tensor_parallel", "dtype", "device", "raw_weights"]
    assert [p.default for p in ours.parameters.values()] == \
        [p.default for p in api.parameters.values()]
    for name in api.parameters:
        assert f"{name}:" in setdiff_dist.api.load.__doc__, name
        assert f"``{name}``" in setdiff_dist.load.__doc__, name


def test_load_accepts_the_dtype_aliases(trained):
    """"fp32" and "bf16" (and torch's dtypes, any case) are the dtypes they name, in this
    process (its process group taken down after)."""
    import os

    import torch

    import setdiff_dist
    from setdiff_dist.parallel import destroy_model_parallel

    run, saved = trained(), dict(os.environ)
    try:
        for dtype, want in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                            (torch.bfloat16, torch.bfloat16), ("BFloat16", torch.bfloat16)):
            model = setdiff_dist.load(run, dtype=dtype, device="cpu")
            # (the decode-time model keeps its weights as buffers)
            assert {b.dtype for b in model.module.buffers() if b.is_floating_point()} == \
                {want}, dtype
    finally:
        destroy_model_parallel()
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _read_only(directory):
    """``directory`` read-only: its mode, and for root (whom the mode does not stop) the
    immutable attribute; skips where neither can be had."""
    import subprocess

    directory.chmod(0o555)
    immutable = False
    try:
        try:
            (directory / "probe").write_text("root writes anyway")
            (directory / "probe").unlink()
            res = subprocess.run(["chattr", "+i", str(directory)], capture_output=True)
            if res.returncode != 0:
                pytest.skip("cannot make a directory read-only for this user here")
            immutable = True
        except PermissionError:
            pass
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(directory)], capture_output=True)
        directory.chmod(0o755)


def test_a_read_only_checkpoints_directory_is_refused_before_training(tmp_path, capsys):
    """A run directory that can be written holding a checkpoints/ that cannot: refused at the
    start, in one line saying what to do, exit code 2, instead of a traceback at the first
    save (and a restart)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with _read_only(run / "checkpoints"):
        code, err = cli("setdiff_dist.cli.train", [
            "--config", "configs/tiny-cpu.yaml", f"run_dir={run}",
            f"data.train_shards={tmp_path / 'no-shards'}"], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert f"setdiff-train: error: cannot write to {run / 'checkpoints'} (" in err, err
    assert "make it writable" in err and "give another run_dir" in err, err
    assert os.listdir(run / "checkpoints") == []
