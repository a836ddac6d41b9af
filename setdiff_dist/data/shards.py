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
length, tokenizer) and every file's size, keeps a bounded number of shards open, and names the
file in every error (full re-hashing on request: ``data.verify=full``).
:mod:`setdiff_dist.data.loader` turns it into per-rank micro-batches. This module needs numpy
only, so that setdiff-prep's tokenizer workers start without torch.
"""

from __future__ import annotations

import bisect
import errno
import io
import json
import os
import tarfile
from collections import OrderedDict
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


VERIFY = ("size", "full", "eager")
MAX_OPEN = 32  # shards a reader keeps open (two file handles each)


class ShardSet:
    """Random access to the samples of one split, checked against the manifest.

    ``seq_len`` and ``tokenizer_sha256``, when given, must match the manifest (the training
    config and its tokenizer). Every file's size is checked now (a stat per file), and each
    shard's index against its tar when the shard is opened; the bytes were hashed when
    setdiff-prep wrote them. ``verify="full"`` also hashes each shard in full on its first use
    in each process (once: the verdict is kept), ``"eager"`` hashes them all now (what
    ``setdiff-prep --verify DIR`` does). At most ``max_open`` shards are open at a time (the
    least recently used is closed first), whatever the number of shards: a random global order
    over 10^5 shards needs no more file handles than over 6."""

    def __init__(self, directory: str, split: str = "train", *, seq_len: Optional[int] = None,
                 tokenizer_sha256: Optional[str] = None, verify: str = "size",
                 max_open: int = MAX_OPEN):
        if verify not in VERIFY:
            raise ShardError(f"verify={verify!r}: expected one of {', '.join(VERIFY)}")
        if max_open < 1:
            raise ShardError(f"max_open={max_open}: a reader needs at least one open shard")
        self.directory, self.split, self.verify = directory, split, verify
        self.max_open = max_open
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
        self._open: OrderedDict = OrderedDict()
        self._verified: set = set()
        self._pid = os.getpid()
        if verify == "eager":
            for i in range(len(self.shards)):
                self._hash(i)

    def __len__(self) -> int:
        return int(self._ends[-1])

    @property
    def tokens(self) -> int:
        return int(self.manifest["splits"][self.split]["tokens"])

    @property
    def open_shards(self) -> int:
        """Shards this process holds open now (at most ``max_open``)."""
        return len(self._open)

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

    def _hash(self, i: int) -> None:
        """Check shard ``i`` and its index against the manifest's sha256 (once per process)."""
        if i in self._verified:
            return
        s = self.shards[i]
        for p, want in ((self._path(s["file"]), s["sha256"]),
                        (self._path(s["index"]), s["index_sha256"])):
            if sha256_file(p) != want:
                raise ShardError(f"shard {p} is corrupt: its sha256 differs from the "
                                 "manifest's; re-run setdiff-prep")
        self._verified.add(i)

    def _shard(self, i: int):
        if os.getpid() != self._pid:  # a forked loader worker: its own file handles
            self._open, self._pid = OrderedDict(), os.getpid()
        entry = self._open.get(i)
        if entry is not None:
            self._open.move_to_end(i)
            return entry
        s = self.shards[i]
        path, idx_path = self._path(s["file"]), self._path(s["index"])
        if self.verify != "size":
            self._hash(i)
        while len(self._open) >= self.max_open:
            _, (old, _) = self._open.popitem(last=False)
            old.close()
        try:
            index = np.load(idx_path, mmap_mode="r")  # (read as samples need it)
            fh = open(path, "rb")
        except OSError as exc:
            if exc.errno == errno.EMFILE:
                import resource

                raise ShardError(
                    f"too many open files opening {path}: this process holds {len(self._open)} "
                    f"shards open (data.max_open_shards={self.max_open}, two files each) and "
                    f"may open {resource.getrlimit(resource.RLIMIT_NOFILE)[0]} files (ulimit -n); "
                    "lower data.max_open_shards or raise ulimit -n", every_rank=False) from None
            raise ShardError(f"cannot read shard {path} ({exc.strerror})",
                             every_rank=False) from None
        except ValueError as exc:
            raise ShardError(f"{idx_path} is not a shard index ({exc}); re-run "
                             "setdiff-prep") from None
        if index.shape != (s["samples"], 4):
            raise ShardError(f"{idx_path}: index of shape {index.shape}, expected "
                             f"({s['samples']}, 4)")
        if s["samples"] and int(index[-1, 0]) + int(index[-1, 1]) > s["bytes"]:
            raise ShardError(f"{idx_path} points past the end of {path}: the index and the "
                             "shard are not from one write; re-run setdiff-prep")
        self._open[i] = entry = (fh, index)
        return entry

    def __getitem__(self, i: int):
        """``(tokens int32 [L], length, context)`` of sample ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = bisect.bisect_right(self._ends, i)
        fh, index = self._shard(k)
        offset, size, length, context = (int(v) for v in
                                         index[i - (self._ends[k - 1] if k else 0)])
        raw = os.pread(fh.fileno(), size, offset)
        try:
            tokens = np.load(io.BytesIO(raw))
        except Exception as exc:
            raise ShardError(f"shard {self._path(self.shards[k]['file'])}: sample {i} is "
                             f"unreadable ({exc}); re-run setdiff-prep") from None
        if tokens.shape != (self.seq_len,):
            raise ShardError(f"shard {self._path(self.shards[k]['file'])}: sample {i} has shape "
                             f"{tokens.shape}, expected ({self.seq_len},)")
        return tokens, length, context

    def close(self) -> None:
        while self._open:
            _, (fh, _) = self._open.popitem()
            fh.close()

    def __getstate__(self):  # file handles stay behind when a loader worker is started
        state = dict(self.__dict__)
        state["_open"] = OrderedDict()
        return state
