"""Bad input from files: a manifest cannot point a reader or a writer outside its directory."""

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
