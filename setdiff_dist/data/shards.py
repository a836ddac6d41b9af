"""Tokenized webdataset shards: the manifest, the writer, and the training reader.

A shard directory holds, per split (``train``, ``valid``):
- ``{split}-NNNNN.tar``: a webdataset shard; sample ``KEY`` has ``KEY.tokens.npy`` (int32 ``[L]``)
  and ``KEY.meta.json`` (``length``: real tokens, the rest is padding; ``context``: leading
  prompt tokens, revealed first and never predicted);
- ``{split}-NNNNN.idx.npy``: per sample ``(byte offset, size, length, context)`` of its tokens,
  so that the reader reaches any sample without scanning the tar;
- ``manifest.json``: format, tokenizer identity and hash, sequence length, counts, and the
  sha256 of every file. Files are written to a temporary directory and renamed at the end.

The reader (:class:`ShardSet`) checks the manifest against what training expects (sequence
length, tokenizer), each shard's size on open and its sha256 on first use, and names the file in
every error. :mod:`setdiff_dist.data.loader` turns it into per-rank micro-batches. This module
needs numpy only, so that setdiff-prep's tokenizer workers start without torch.
"""

from __future__ import annotations

import bisect
import io
import json
import os
import tarfile
from typing import Optional

import numpy as np

from setdiff_dist.errors import SetdiffError
from setdiff_dist.paths import sha256_file

MANIFEST = "manifest.json"
FORMAT = "setdiff-shards/1"


class ShardError(SetdiffError, ValueError):
    """A problem with shard files or their manifest; the message names the file."""


# ----------------------------------------------------------------------------- writing

class ShardWriter:
    """Writes one split's fixed-length samples into numbered shards with their indexes."""

    def __init__(self, directory: str, split: str, seq_len: int, samples_per_shard: int = 4096):
        self.directory, self.split, self.seq_len = directory, split, seq_len
        self.samples_per_shard = samples_per_shard
        self.shards: list[dict] = []
        self._writer = None
        self._meta: list[tuple[int, int]] = []

    def add(self, tokens: np.ndarray, length: int, context: int = 0) -> None:
        import webdataset as wds

        if tokens.shape != (self.seq_len,):
            raise ValueError(f"sample has shape {tokens.shape}, expected ({self.seq_len},)")
        if self._writer is None:
            name = f"{self.split}-{len(self.shards):05d}"
            self._tar = os.path.join(self.directory, name + ".tar")
            self._writer = wds.TarWriter(self._tar, mtime=0.0)  # fixed mtime: reproducible bytes
        key = f"{self.split}-{len(self.shards):05d}-{len(self._meta):07d}"
        self._writer.write({"__key__": key, "tokens.npy": tokens.astype(np.int32, copy=False),
                            "meta.json": {"length": int(length), "context": int(context)}})
        self._meta.append((int(length), int(context)))
        if len(self._meta) == self.samples_per_shard:
            self._finish_shard()

    def _finish_shard(self) -> None:
        self._writer.close()
        self._writer = None
        with tarfile.open(self._tar) as tf:
            members = [(m.offset_data, m.size) for m in tf if m.name.endswith(".tokens.npy")]
        if len(members) != len(self._meta):
            raise RuntimeError(f"{self._tar}: wrote {len(self._meta)} samples, found "
                               f"{len(members)}")
        index = np.array([(offset, size, length, context) for (offset, size), (length, context)
                          in zip(members, self._meta)], dtype=np.int64)
        idx_path = self._tar[:-len(".tar")] + ".idx.npy"
        np.save(idx_path, index)
        self.shards.append({
            "file": os.path.basename(self._tar), "index": os.path.basename(idx_path),
            "samples": len(self._meta), "tokens": int(sum(m[0] for m in self._meta)),
            "bytes": os.path.getsize(self._tar), "sha256": sha256_file(self._tar),
            "index_sha256": sha256_file(idx_path)})
        self._meta = []

    def close(self) -> dict:
        if self._writer is not None:
            self._finish_shard()
        return {"shards": self.shards, "samples": sum(s["samples"] for s in self.shards),
                "tokens": sum(s["tokens"] for s in self.shards)}


# ----------------------------------------------------------------------------- reading

def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise ShardError(f"shard directory not found: {directory}")
    if not os.path.isfile(path):
        raise ShardError(f"{path} is missing: {directory} is not a setdiff-prep output "
                         "(run setdiff-prep --out DIR first)")
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ShardError(f"{path}: not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise ShardError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


class ShardSet:
    """Random access to the samples of one split, checked against the manifest.

    ``seq_len`` and ``tokenizer_sha256``, when given, must match the manifest (the training
    config and its tokenizer). ``verify``: ``"lazy"`` hashes each shard on first use in each
    process, ``"eager"`` all of them now, ``"size"`` only checks sizes."""

    def __init__(self, directory: str, split: str = "train", *, seq_len: Optional[int] = None,
                 tokenizer_sha256: Optional[str] = None, verify: str = "lazy"):
        self.directory, self.split, self.verify = directory, split, verify
        self.manifest = m = read_manifest(directory)
        where = os.path.join(directory, MANIFEST)
        if seq_len is not None and m["seq_len"] != seq_len:
            raise ShardError(f"{where}: shards hold sequences of {m['seq_len']} tokens but "
                             f"data.seq_len={seq_len}; re-run setdiff-prep with --seq-len "
                             f"{seq_len} or set data.seq_len={m['seq_len']}")
        if tokenizer_sha256 is not None and m["tokenizer"]["sha256"] != tokenizer_sha256:
            raise ShardError(f"{where}: shards were tokenized with {m['tokenizer']['spec']!r} "
                             f"(sha256 {m['tokenizer']['sha256'][:12]}), not with the configured "
                             f"tokenizer (sha256 {tokenizer_sha256[:12]})")
        if split not in m["splits"] or not m["splits"][split]["shards"]:
            raise ShardError(f"{where}: no {split!r} samples")
        self.seq_len = m["seq_len"]
        self.shards = m["splits"][split]["shards"]
        self._ends = list(np.cumsum([s["samples"] for s in self.shards]))
        for s in self.shards:
            self._check_size(s)
        self._open: dict = {}
        self._pid = os.getpid()
        if verify == "eager":
            for i in range(len(self.shards)):
                self._shard(i)

    def __len__(self) -> int:
        return int(self._ends[-1])

    @property
    def tokens(self) -> int:
        return int(self.manifest["splits"][self.split]["tokens"])

    def _path(self, name: str) -> str:
        from setdiff_dist.paths import inside

        return inside(self.directory, name, "the manifest's shard file", ShardError)

    def _check_size(self, s: dict) -> None:
        path = self._path(s["file"])
        for p in (path, self._path(s["index"])):
            if not os.path.isfile(p):
                raise ShardError(f"shard file {p} is missing (listed in {self.directory}/"
                                 f"{MANIFEST}); restore it or re-run setdiff-prep")
        size = os.path.getsize(path)
        if size != s["bytes"]:
            raise ShardError(f"shard {path} is truncated or changed: {size} bytes, the manifest "
                             f"says {s['bytes']}; re-run setdiff-prep")

    def _shard(self, i: int):
        if os.getpid() != self._pid:  # a forked loader worker: its own file handles
            self._open, self._pid = {}, os.getpid()
        if i not in self._open:
            s = self.shards[i]
            path, idx_path = self._path(s["file"]), self._path(s["index"])
            if self.verify in ("lazy", "eager"):
                for p, want in ((path, s["sha256"]), (idx_path, s["index_sha256"])):
                    if sha256_file(p) != want:
                        raise ShardError(f"shard {p} is corrupt: its sha256 differs from the "
                                         "manifest's; re-run setdiff-prep")
            index = np.load(idx_path)
            if index.shape != (s["samples"], 4):
                raise ShardError(f"{idx_path}: index of shape {index.shape}, expected "
                                 f"({s['samples']}, 4)")
            self._open[i] = (open(path, "rb"), index)
        return self._open[i]

    def __getitem__(self, i: int):
        """``(tokens int32 [L], length, context)`` of sample ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = bisect.bisect_right(self._ends, i)
        fh, index = self._shard(k)
        offset, size, length, context = index[i - (self._ends[k - 1] if k else 0)]
        fh.seek(int(offset))
        raw = fh.read(int(size))
        try:
            tokens = np.load(io.BytesIO(raw))
        except Exception as exc:
            raise ShardError(f"shard {self._path(self.shards[k]['file'])}: sample {i} is "
                             f"unreadable ({exc})") from None
        if tokens.shape != (self.seq_len,):
            raise ShardError(f"shard {self._path(self.shards[k]['file'])}: sample {i} has shape "
                             f"{tokens.shape}, expected ({self.seq_len},)")
        return tokens, int(length), int(context)

    def __getstate__(self):  # file handles stay behind when a loader worker is started
        state = dict(self.__dict__)
        state["_open"] = {}
        return state
