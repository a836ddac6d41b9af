"""Bad input gets a clear error (exit code 2, no traceback) and loses nothing: manifests cannot
point a reader or a writer outside their directory, non-finite numbers and out-of-range flags
are refused before any work, and results are valid JSON written only where they can be."""

import json

import pytest

from helpers import sonnet_shards


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
    (["--temperature", "nan"], "temperature=nan: it must be a finite number 0 or more"),
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
    from setdiff_dist.cli.eval import _finite

    text = json.dumps(_finite({"a": [1.0, float("inf")], "b": {"c": float("nan")}}),
                      allow_nan=False)
    assert json.loads(text) == {"a": [1.0, "inf"], "b": {"c": "nan"}}
