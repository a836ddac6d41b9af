"""Bad input gets a clear error (exit code 2, no traceback) and loses nothing: manifests cannot
point a reader or a writer outside their directory, non-finite numbers and out-of-range flags
are refused before any work, and results are valid JSON written only where they can be."""

import json

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
