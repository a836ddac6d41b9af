"""Hugging Face checkpoint directories as files: ``config.json``, ``model.safetensors`` or
``model-*.safetensors`` with ``model.safetensors.index.json``, read lazily (one tensor or one
slice at a time) and written through a temporary directory. What the tensors *mean* (names,
layouts, the config's architecture) is :mod:`setdiff_dist.model.hf`'s business."""

from __future__ import annotations

import json
import os

import torch

from .weights import LoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class HFCheckpointError(LoadError):
    """A Hugging Face checkpoint that cannot be imported; the message names the key or tensor."""


def read_hf_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise HFCheckpointError(f"{directory}: no such directory")
    if not os.path.isfile(path):
        raise HFCheckpointError(f"{directory} is not a Hugging Face checkpoint: config.json is "
                                "missing")
    with open(path, encoding="utf-8") as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as exc:
            raise HFCheckpointError(f"{path}: not valid JSON ({exc})") from None


class HFFiles:
    """The safetensors files of an HF checkpoint directory: which file holds each tensor (from
    the index, whose every shard must exist, or the single file's header), opened lazily."""

    def __init__(self, directory: str):
        self.directory = directory
        self.file_of = self._index()
        self._open: dict = {}

    def _index(self) -> dict[str, str]:
        from safetensors import safe_open

        index = os.path.join(self.directory, "model.safetensors.index.json")
        single = os.path.join(self.directory, "model.safetensors")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFCheckpointError(f"{index} has no weight_map")
            from setdiff_dist.paths import inside

            for name, file in sorted(weight_map.items()):
                inside(self.directory, file, f"the index's shard for {name}", HFCheckpointError)
                if not os.path.isfile(os.path.join(self.directory, file)):
                    raise HFCheckpointError(
                        f"shard {file} is missing from {self.directory}: "
                        f"model.safetensors.index.json maps {name} (and maybe more) to it")
            return dict(weight_map)
        if os.path.isfile(single):
            with safe_open(single, "pt") as fh:
                return {name: "model.safetensors" for name in fh.keys()}
        raise HFCheckpointError(f"{self.directory} has no weights: neither model.safetensors nor "
                                "model.safetensors.index.json (only safetensors checkpoints are "
                                "read; convert .bin files with transformers first)")

    def _file(self, name: str):
        from safetensors import safe_open

        file = self.file_of[name]
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.directory, file), "pt")
        return self._open[file]

    def slice(self, name: str):
        if name not in self.file_of:
            raise HFCheckpointError(f"tensor {name} is missing from {self.directory}")
        try:
            return self._file(name).get_slice(name)
        except Exception as exc:  # the index names a tensor its shard does not hold
            raise HFCheckpointError(f"tensor {name}: cannot be read from "
                                    f"{self.file_of[name]} ({exc})") from None

    def dtype(self, name: str) -> torch.dtype:
        code = self.slice(name).get_dtype()
        if code not in SAFETENSORS_DTYPES:
            raise HFCheckpointError(f"tensor {name} has dtype {code}; float32, bfloat16 or "
                                    "float16 is needed")
        return SAFETENSORS_DTYPES[code]


def write_hf(tensors: dict, config: dict, out: str, dtype: str,
             max_shard_bytes: int = 5 * 2**30, tokenizer=None) -> list[str]:
    """Write an HF checkpoint directory (new or empty): ``config.json`` and safetensors shards
    of at most ``max_shard_bytes`` (one ``model.safetensors`` when everything fits), with
    ``model.safetensors.index.json`` when there are several, and ``tokenizer`` (ours: its file,
    and for a ``tokenizer.json`` the ``tokenizer_config.json`` that transformers' auto classes
    look for), all through a temporary directory: a failure leaves nothing at ``out``. Returns
    the weight files."""
    from setdiff_dist.checkpoint.files import save_tensors

    if os.path.exists(out) and os.listdir(out):
        raise HFCheckpointError(f"{out} exists and is not empty")
    if dtype not in DTYPES:
        raise HFCheckpointError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    tensors = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in tensors.items()}
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    tmp = f"{out.rstrip('/')}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(names, shards):
        save_tensors(shard, os.path.join(tmp, file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in tensors.values())},
                 "weight_map": {n: f for f, s in zip(names, shards) for n in s}}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
            json.dump(index, fh, indent=2, sort_keys=True)
    with open(os.path.join(tmp, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
    shipped = tokenizer.save(tmp) if tokenizer is not None else None
    if shipped is None and hasattr(tokenizer, "tok"):
        # a built-in Hugging Face tokenizer (GPT-2's BPE) ships no file with shards, but
        # transformers needs its tokenizer.json next to the weights
        tokenizer.tok.save(os.path.join(tmp, "tokenizer.json"))
        shipped = "tokenizer.json"
    if shipped == "tokenizer.json" and \
            not os.path.isfile(os.path.join(tmp, "tokenizer_config.json")):
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as fh:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
                       "eos_token": getattr(tokenizer, "eos_token", None)}, fh, indent=2)
    if os.path.exists(out):
        os.rmdir(out)
    os.replace(tmp, out)
    return names
