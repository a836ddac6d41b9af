"""``setdiff-prep``: raw text to tokenized webdataset shards with a manifest, offline.

    setdiff-prep --input PATH [PATH ...] --tokenizer SPEC --seq-len L --out DIR [options]

Inputs: ``.txt`` (one document per file, or per blank-line paragraph with
``--split-paragraphs``), records, one document each: ``.jsonl`` (optionally gzip'd), ``.csv``
(a header row), ``.parquet``, ``.arrow`` and ``datasets.save_to_disk`` folders (the form
Hugging Face datasets come in on disk). A record's text is ``--text-field``: a field, or a
template of fields such as ``"Question: {question}\nAnswer: {answer}"``; ``--prompt-field``
likewise. Directories are read recursively in name order. ``--detokenize lm1b`` first undoes
LM1B's tokenized spacing, as the reference does (:mod:`data_prep.detokenize`).

Modes: ``packed`` (documents joined with end-of-text tokens and cut into sequences of L tokens;
the incomplete tail is dropped and counted) and ``padded`` (one document per sequence, padded, for
task data; with ``--prompt-field`` the prompt tokens come first and are marked as context).

Every ``--valid-every``-th document goes to the validation split (deterministic); ``--split
valid`` puts every document there (a held-out test set, which ``setdiff-eval --task ppl --shards``
and a run's ``data.valid_shards`` read: prepare it with the training shards' tokenizer, given as
their directory). Tokenization runs
in ``--workers`` processes, results in input order, so the same input and options give
byte-identical shards. Everything is written to a temporary directory next to ``--out`` and
renamed only when complete: an error leaves no partial output.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from setdiff_dist.cli import HelpFormatter, command, count
from setdiff_dist.data.shards import FORMAT, MANIFEST, ShardWriter, sha256_file
from setdiff_dist.data.tokenizers import Tokenizer, TokenizerError, load_tokenizer, train_bpe
from setdiff_dist.errors import SetdiffError

from .detokenize import DETOKENIZERS


class PrepError(SetdiffError, ValueError):
    """Bad input; the message names the file (and line)."""


@dataclass
class Document:
    text: str
    prompt: str
    where: str  # "path" or "path line N", for messages


# ----------------------------------------------------------------------------- reading

def input_files(paths: list[str]) -> list[str]:
    files = []
    for p in paths:
        if os.path.isdir(p):
            if os.path.isfile(os.path.join(p, "dataset_dict.json")):
                splits = sorted(d for d in os.listdir(p) if os.path.isdir(os.path.join(p, d)))
                raise PrepError(f"{p}: a datasets DatasetDict (save_to_disk) with splits "
                                f"{', '.join(splits)}: give one split's folder, e.g. "
                                f"{os.path.join(p, splits[0] if splits else 'train')}")
            arrow = _saved_dataset(p)
            if arrow is not None:  # (its JSON files describe it: they are not documents)
                files += arrow
                continue
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs)
            if not found:
                raise PrepError(f"{p}: directory holds no files")
            files += found
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise PrepError(f"{p}: no such file or directory")
    return files


def _saved_dataset(path: str) -> Optional[list[str]]:
    """The Arrow files of a ``datasets`` ``save_to_disk`` folder, in order (None if it is not
    one)."""
    state = os.path.join(path, "state.json")
    if not (os.path.isfile(state) and os.path.isfile(os.path.join(path, "dataset_info.json"))):
        return None
    try:
        names = [f["filename"] for f in json.load(open(state))["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise PrepError(f"{state}: not a datasets state file ({exc})") from None
    return [os.path.join(path, n) for n in names]


TABLES = (".parquet", ".arrow", ".csv", ".csv.gz")


def _table_records(path: str) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` of a Parquet file, an Arrow file (``datasets``' stream format or
    Arrow's file format) or a CSV file (with a header), a batch at a time."""
    if path.endswith((".csv", ".csv.gz")):
        import io

        from .csv_records import CsvRecords

        # (a quote that never closes is an error naming its line, not the rest of the file
        # read as one field; a record's line is where it starts, newlines in fields counted)
        for line, rec in CsvRecords(path, io.StringIO(_read_text(path), newline=""), PrepError):
            yield f"{path} line {line}", rec
        return
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepError(f"{path}: reading Parquet and Arrow needs pyarrow: pip install "
                        "pyarrow") from None
    try:
        if path.endswith(".parquet"):
            batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        else:
            try:
                batches = iter(pa.ipc.open_stream(path))
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(path)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        row = 0
        for batch in batches:
            for rec in batch.to_pylist():
                row += 1
                yield f"{path} row {row}", rec
    except (pa.ArrowInvalid, OSError) as exc:
        raise PrepError(f"{path}: not a readable {os.path.splitext(path)[1][1:]} file "
                        f"({exc})") from None


def _json_records(path: str, text: str) -> Iterator[tuple[str, dict]]:
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {i}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as exc:
            raise PrepError(f"{where}: not valid JSON ({exc.msg})") from None


def field(rec, spec: str, where: str, flag: str) -> str:
    """A record's text: the field ``spec``, or ``spec`` as a template of fields (``"{question}
    {answer}"``: Python's format over the record)."""
    if not isinstance(rec, dict):
        raise PrepError(f"{where}: not a record of fields")
    if "{" in spec:
        try:
            return spec.format_map(rec)
        except KeyError as exc:
            raise PrepError(f"{where}: no field {exc.args[0]!r} for the template {flag} "
                            f"{spec!r} (fields: {', '.join(map(str, rec))})") from None
        except (ValueError, IndexError) as exc:
            raise PrepError(f"{flag} {spec!r}: not a valid template ({exc})") from None
    if not isinstance(rec.get(spec), str):
        raise PrepError(f"{where}: no string field {spec!r} (choose it with {flag}, or give a "
                        f"template such as '{{question}} {{answer}}'; fields: "
                        f"{', '.join(map(str, rec))})")
    return rec[spec]


def _read_text(path: str) -> str:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as fh:
                raw = fh.read()
        else:
            with open(path, "rb") as fh:
                raw = fh.read()
    except (OSError, EOFError) as exc:
        raise PrepError(f"{path}: cannot read ({exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise PrepError(f"{path}: not valid UTF-8 (byte {exc.start}, line {line}); convert it to "
                        "UTF-8 first (e.g. iconv -f latin1 -t utf-8)") from None
    if not text.strip():
        raise PrepError(f"{path}: empty file (no text)")
    return text


def read_documents(path: str, text_field: str, prompt_field: Optional[str],
                   split_paragraphs: bool) -> Iterator[Document]:
    base = path[:-3] if path.endswith(".gz") else path
    if base.endswith((".jsonl", ".json")) or path.endswith(TABLES):
        records = _table_records(path) if path.endswith(TABLES) else \
            _json_records(path, _read_text(path))
        n = 0
        for where, rec in records:
            text = field(rec, text_field, where, "--text-field")
            prompt = field(rec, prompt_field, where, "--prompt-field") if prompt_field else ""
            n += 1
            yield Document(text, prompt, where)
        if n == 0:
            raise PrepError(f"{path}: no documents")
        return
    text = _read_text(path)
    if prompt_field:
        raise PrepError(f"{path}: --prompt-field needs records (.jsonl, .parquet, .arrow, "
                        ".csv)")
    if split_paragraphs:
        for k, para in enumerate(p.strip() for p in text.split("\n\n")):
            if para:
                yield Document(para, "", f"{path} paragraph {k + 1}")
    else:
        yield Document(text, "", path)


# ----------------------------------------------------------------------------- tokenizing

_TOKENIZER: Optional[Tokenizer] = None
_INIT_ERROR: Optional[str] = None


def _init_worker(spec: str, eos_token: Optional[str] = None) -> None:
    # a failure is kept and raised by the first chunk: raised here, multiprocessing's pool would
    # start the worker again, and again, forever (the command would hang, saying nothing)
    global _TOKENIZER, _INIT_ERROR
    try:
        _TOKENIZER = load_tokenizer(spec, eos_token=eos_token)
    except Exception as exc:  # noqa: BLE001  (re-raised in the parent by the first chunk)
        _INIT_ERROR = f"{type(exc).__name__}: {exc}"


def _encode(chunk: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    if _INIT_ERROR is not None:
        raise PrepError(f"a tokenizer process could not load the tokenizer: {_INIT_ERROR}")
    texts = _TOKENIZER.encode_batch([t for t, _ in chunk])
    prompts = _TOKENIZER.encode_batch([p for _, p in chunk]) if any(p for _, p in chunk) else \
        [[] for _ in chunk]
    return list(zip(prompts, texts))


def _chunks(docs: Iterator[Document], size: int):
    batch: list[Document] = []
    for d in docs:
        batch.append(d)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# ----------------------------------------------------------------------------- writing

class _Split:
    """Packs or pads one split's token stream into a shard writer."""

    def __init__(self, directory, name, seq_len, mode, eos, samples_per_shard, truncate,
                 bos=None, max_prompt=None, frame=None, max_text=None):
        self.writer = ShardWriter(directory, name, seq_len, samples_per_shard)
        self.L, self.mode, self.eos, self.truncate = seq_len, mode, eos, truncate
        self.bos = bos  # packed with a BOS per chunk (the reference's LM1B): see add
        self.max_prompt = max_prompt  # padded: a prompt keeps its first max_prompt tokens
        # padded, --bos-eos: each prompt is [frame] prompt [EOS] (frame: the BOS, or the EOS of
        # a tokenizer without one), and a cut one keeps its closing EOS, as the reference's
        self.frame = frame
        self.max_text = max_text  # padded: the text and its EOS keep their first max_text
        self.texts_cut = 0
        self.buffer: list[int] = []
        self.documents = 0
        self.truncated = 0
        self.prompts_cut = 0

    def add(self, prompt: list[int], text: list[int], where: str) -> None:
        self.documents += 1
        if self.mode == "packed":
            # documents joined by [EOS]; with a BOS per chunk (MDLM's and BD3LM's wrapped LM1B)
            # each document is [BOS] text [EOS] in the stream and each sequence [BOS], the next
            # L - 2 tokens of the stream, [EOS]
            head, tail = ([self.bos], [self.eos]) if self.bos is not None else ([], [])
            self.buffer += head + prompt + text + [self.eos]
            step = self.L - len(head) - len(tail)
            while len(self.buffer) >= step:
                self.writer.add(np.asarray(head + self.buffer[:step] + tail, dtype=np.int32),
                                self.L)
                del self.buffer[:step]
            return
        if self.frame is not None:
            prompt = [self.frame] + prompt + [self.eos]
        if self.max_prompt is not None and len(prompt) > self.max_prompt:
            prompt, self.prompts_cut = prompt[:self.max_prompt], self.prompts_cut + 1
            if self.frame is not None:
                prompt[-1] = self.eos
        if self.max_text is not None and len(text) + 1 > self.max_text:
            text, self.texts_cut = text[:self.max_text - 1], self.texts_cut + 1
        ids = prompt + text + [self.eos]
        if len(ids) > self.L:
            if not self.truncate:
                raise PrepError(f"{where}: {len(ids)} tokens do not fit --seq-len {self.L} in "
                                "padded mode; raise --seq-len or pass --truncate")
            ids, self.truncated = ids[: self.L], self.truncated + 1
        if len(prompt) >= len(ids):
            raise PrepError(f"{where}: the prompt leaves no room for the text at --seq-len "
                            f"{self.L}")
        row = np.full(self.L, self.eos, dtype=np.int32)
        row[: len(ids)] = ids
        self.writer.add(row, len(ids), len(prompt))

    def close(self) -> dict:
        info = self.writer.close()
        info.update(documents=self.documents, dropped_tail_tokens=len(self.buffer),
                    truncated_documents=self.truncated, prompts_cut=self.prompts_cut,
                    texts_cut=self.texts_cut)
        return info


def prepare(inputs: list[str], tokenizer: str, seq_len: int, out: str, *, mode: str = "packed",
            text_field: str = "text", prompt_field: Optional[str] = None,
            split_paragraphs: bool = False, valid_every: int = 100, samples_per_shard: int = 4096,
            workers: int = 0, truncate: bool = False, overwrite: bool = False,
            progress: bool = True, chunk_bos: bool = False,
            detokenize: Optional[str] = None, max_prompt_tokens: Optional[int] = None,
            split: Optional[str] = None, bos_eos: bool = False,
            max_text_tokens: Optional[int] = None) -> dict:
    """Run setdiff-prep; returns the manifest. See the module docstring. ``split``: every
    document goes to this split ("train" or "valid"; a held-out test set is prepared with
    "valid", which ``setdiff-eval --task ppl`` and ``data.valid_shards`` read), and
    ``valid_every`` is not used."""
    if detokenize is not None and detokenize not in DETOKENIZERS:
        raise PrepError(f"--detokenize {detokenize}: expected one of {', '.join(DETOKENIZERS)}")
    if seq_len < 2:
        raise PrepError(f"--seq-len must be at least 2, got {seq_len}")
    if chunk_bos and (mode != "packed" or seq_len < 3):
        raise PrepError("--chunk-bos packs sequences of [BOS], L - 2 tokens and [EOS]: it needs "
                        "--mode packed and --seq-len 3 or more")
    if max_prompt_tokens is not None and (mode != "padded" or not prompt_field
                                          or not 1 <= max_prompt_tokens < seq_len):
        raise PrepError("--max-prompt-tokens cuts a record's --prompt-field to its first N "
                        "tokens in --mode padded, N at least 1 and below --seq-len")
    if bos_eos and (mode != "padded" or not prompt_field):
        raise PrepError("--bos-eos frames each record's --prompt-field as [BOS] prompt [EOS]: it "
                        "needs --mode padded and a --prompt-field")
    if max_text_tokens is not None and (mode != "padded" or not 2 <= max_text_tokens < seq_len):
        raise PrepError("--max-text-tokens cuts a record's text (and its end-of-text) to its "
                        "first N tokens in --mode padded, N at least 2 and below --seq-len")
    if valid_every < 0 or valid_every == 1:
        raise PrepError("--valid-every must be 0 (no validation split) or at least 2")
    if split not in (None, "train", "valid"):
        raise PrepError(f"--split {split}: train or valid")
    out = os.path.abspath(out)
    if os.path.exists(out) and not overwrite and (not os.path.isdir(out) or os.listdir(out)):
        raise PrepError(f"{out} already exists; pass --overwrite to replace it")
    files = input_files(inputs)
    workers = workers or min(os.cpu_count() or 1, 8)
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        manifest = _prepare_into(tmp, files, tokenizer, seq_len, mode, text_field, prompt_field,
                                 split_paragraphs, valid_every, samples_per_shard, workers,
                                 truncate, progress, chunk_bos, detokenize,
                                 max_prompt_tokens, split, bos_eos, max_text_tokens)
        if os.path.exists(out):
            old = out + f".old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _prepare_into(tmp, files, spec, seq_len, mode, text_field, prompt_field, split_paragraphs,
                  valid_every, samples_per_shard, workers, truncate, progress,
                  chunk_bos=False, detokenize=None, max_prompt=None, only=None,
                  bos_eos=False, max_text=None) -> dict:
    undo = DETOKENIZERS[detokenize] if detokenize else None

    def documents():
        for f in files:
            for d in read_documents(f, text_field, prompt_field, split_paragraphs):
                yield Document(undo(d.text), undo(d.prompt), d.where) if undo else d

    # validate every input (and read it once) before any work is done
    n_docs = sum(1 for _ in documents())
    if spec.startswith("bpe:"):
        try:
            size = int(spec.split(":", 1)[1])
        except ValueError:
            raise PrepError(f"--tokenizer {spec}: expected bpe:N with an integer N") from None
        tok = train_bpe((d.prompt + d.text for d in documents()), size)
    else:
        try:
            tok = load_tokenizer(spec)
        except TokenizerError as exc:
            raise PrepError(f"--tokenizer {spec}: {exc}") from None
    shipped = tok.save(tmp)
    # what the tokenizer processes load: the file just shipped, or the built-in tokenizer's own
    # spec (a shard directory given as --tokenizer names one: gpt2, bytes)
    worker_spec = os.path.join(tmp, shipped) if shipped == "tokenizer.json" else (
        f"sentencepiece:{os.path.join(tmp, shipped)}" if shipped else tok.spec)

    bos = None
    if chunk_bos:
        bos = getattr(tok, "bos_id", None)
        if bos is None:
            raise PrepError(f"--chunk-bos: the tokenizer {spec} has no beginning-of-sequence "
                            "token (wordpiece:VOCAB has [CLS])")
    # --bos-eos: the reference's [BOS] prompt [EOS], its end-of-text for a tokenizer without a
    # BOS (GPT-2's, Qwen3's)
    frame = None
    if bos_eos:
        frame = tok.eos_id if getattr(tok, "bos_id", None) is None else tok.bos_id
    if only:
        valid_every = 0
    splits = {name: _Split(tmp, name, seq_len, mode, tok.eos_id, samples_per_shard, truncate,
                           bos, max_prompt, frame, max_text)
              for name in ([only] if only else ["train"] + (["valid"] if valid_every else []))}
    bar = None
    if progress:
        from setdiff_dist.progress import bar as progress_bar

        bar = progress_bar(total=n_docs, unit="doc", desc="setdiff-prep", file=sys.stderr)
    start, n_tokens, ordinal = time.perf_counter(), 0, 0
    eos_token = getattr(tok, "eos_token", None)  # a Hugging Face model's own end-of-text
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker,
                                      initargs=(worker_spec, eos_token)) as pool:
        sent: deque = deque()  # chunks handed to the pool, in order (imap keeps that order)

        def payloads():
            for chunk in _chunks(documents(), 64):
                sent.append(chunk)
                yield [(d.text, d.prompt) for d in chunk]

        for encoded in pool.imap(_encode, payloads()):
            chunk = sent.popleft()
            for doc, (prompt_ids, text_ids) in zip(chunk, encoded):
                name = only or ("valid" if valid_every and
                                ordinal % valid_every == valid_every - 1 else "train")
                splits[name].add(prompt_ids, text_ids, doc.where)
                n_tokens += len(prompt_ids) + len(text_ids) + 1
                ordinal += 1
            if bar:
                bar.update(len(chunk))
                bar.set_postfix(tokens_per_s=f"{n_tokens / (time.perf_counter() - start):.3g}",
                                refresh=False)  # (drawn with the next update)
    if bar:
        bar.close()
    elapsed = time.perf_counter() - start
    info = {name: s.close() for name, s in splits.items()}
    for name, s in info.items():
        if s["samples"] == 0:
            raise PrepError(f"the {name} split is empty: {ordinal} documents of "
                            f"{n_tokens} tokens are too few for --seq-len {seq_len}"
                            + (f" and --valid-every {valid_every}"
                               if name == "valid" and valid_every else "")
                            + "; use more text, a shorter --seq-len, or --valid-every 0")
    identity = tok.identity()
    identity["file"] = shipped
    manifest = {
        "format": FORMAT, "seq_len": seq_len, "mode": mode + ("+chunk-bos" if chunk_bos else ""),
        "tokenizer": identity,
        "splits": info, "documents": ordinal, "input_tokens": n_tokens,
        "inputs": [{"path": os.path.abspath(f), "sha256": sha256_file(f)} for f in files],
        "options": {"text_field": text_field, "prompt_field": prompt_field,
                    "detokenize": detokenize, "max_prompt_tokens": max_prompt,
                    "bos_eos": bos_eos, "max_text_tokens": max_text,
                    "split_paragraphs": split_paragraphs, "valid_every": valid_every,
                    "split": only,
                    "samples_per_shard": samples_per_shard, "truncate": truncate},
    }
    with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
    manifest["throughput_tokens_per_s"] = n_tokens / max(elapsed, 1e-9)
    return manifest


def verify(directory: str) -> int:
    """``setdiff-prep --verify DIR``: hash every shard and index of every split."""
    from setdiff_dist.data.shards import ShardSet, read_manifest

    start, files, size = time.perf_counter(), 0, 0
    for split, info in sorted(read_manifest(directory)["splits"].items()):
        if info["shards"]:
            ShardSet(directory, split, verify="eager")  # (a ShardError names a bad file)
            files += 2 * len(info["shards"])
            size += sum(s["bytes"] for s in info["shards"])
    print(f"setdiff-prep: {directory}: {files} files, {size / 2**20:.1f} MiB, every size and "
          f"sha256 as the manifest says ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return 0


@command("setdiff-prep")
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-prep", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--verify", metavar="DIR",
                    help="check every file of an existing shard directory against its manifest "
                         "(sizes and sha256, every split) and exit: nothing else is needed")
    ap.add_argument("--input", nargs="+", help="files or directories")
    ap.add_argument("--tokenizer",
                    help="gpt2, bytes, sentencepiece:PATH, bpe:N, hf:DIR (a Hugging Face model's "
                         "tokenizer.json), or a tokenizer.json directory")
    ap.add_argument("--seq-len", type=count(2), help="tokens per sequence (L)")
    ap.add_argument("--out", help="output directory")
    ap.add_argument("--mode", choices=("packed", "padded"), default="packed",
                    help="packed: documents back to back in sequences of --seq-len (pretraining); "
                         "padded: one document per sequence (task data)")
    ap.add_argument("--text-field", default="text",
                    help="records: the field with the text, or a template of fields "
                         "('{question} {answer}')")
    ap.add_argument("--prompt-field", default=None,
                    help="records: the field (or template) of a prompt (padded mode: marked "
                         "as context)")
    ap.add_argument("--split-paragraphs", action="store_true",
                    help=".txt: one document per blank-line paragraph")
    ap.add_argument("--valid-every", type=count(0), default=None,
                    help="every N-th document goes to the validation split (0 = none; "
                         "default 100)")
    ap.add_argument("--split", choices=("train", "valid"), default=None,
                    help="every document goes to this split: a held-out test file is prepared "
                         "as --split valid (what setdiff-eval --task ppl --shards and "
                         "data.valid_shards read), with the training shards' tokenizer")
    ap.add_argument("--samples-per-shard", type=count(), default=4096,
                    help="sequences per webdataset shard")
    ap.add_argument("--workers", type=count(0), default=0, help="tokenizer processes (0 = cores)")
    ap.add_argument("--chunk-bos", action="store_true",
                    help="packed: every sequence is [BOS], the next L - 2 tokens, [EOS], each "
                         "document [BOS] text [EOS] (the reference's LM1B; wordpiece:VOCAB)")
    ap.add_argument("--detokenize", choices=sorted(DETOKENIZERS), default=None,
                    help="undo a corpus's tokenized spacing first (lm1b: the reference's "
                         "LM1B detokenizer, \"it 's\" -> \"it's\")")
    ap.add_argument("--max-prompt-tokens", type=count(), default=None,
                    help="padded: a prompt keeps its first N tokens (the reference cuts a "
                         "CNN/DailyMail article to 512), leaving room for the text")
    ap.add_argument("--bos-eos", action="store_true",
                    help="padded: each prompt is [BOS] prompt [EOS] (the end-of-text where the "
                         "tokenizer has no BOS), a prompt cut by --max-prompt-tokens keeping its "
                         "closing [EOS]: the reference's CNN/DailyMail source framing")
    ap.add_argument("--max-text-tokens", type=count(), default=None,
                    help="padded: the text and its end-of-text keep their first N tokens, the "
                         "last the end-of-text (the reference cuts a CNN/DailyMail summary to "
                         "180)")
    ap.add_argument("--truncate", action="store_true",
                    help="padded mode: cut documents longer than --seq-len instead of failing")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.verify:
        return verify(args.verify)
    missing = [f"--{k.replace('_', '-')}" for k in ("input", "tokenizer", "seq_len", "out")
               if getattr(args, k) is None]
    if missing:
        ap.error(f"the following arguments are required: {', '.join(missing)}")
    if args.split and args.valid_every is not None:
        ap.error(f"--split {args.split} puts every document in one split: --valid-every "
                 "does not apply")
    m = prepare(args.input, args.tokenizer, args.seq_len, args.out, mode=args.mode,
                text_field=args.text_field, prompt_field=args.prompt_field,
                split_paragraphs=args.split_paragraphs,
                valid_every=100 if args.valid_every is None else args.valid_every,
                split=args.split,
                samples_per_shard=args.samples_per_shard, workers=args.workers,
                truncate=args.truncate, overwrite=args.overwrite, progress=not args.quiet,
                chunk_bos=args.chunk_bos, detokenize=args.detokenize,
                max_prompt_tokens=args.max_prompt_tokens, bos_eos=args.bos_eos,
                max_text_tokens=args.max_text_tokens)
    counts = ", ".join(f"{k}: {v['samples']} sequences / {v['tokens']} tokens / "
                       f"{len(v['shards'])} shards" for k, v in m["splits"].items())
    print(f"setdiff-prep: {m['documents']} documents -> {args.out} ({counts}); tokenizer "
          f"{m['tokenizer']['spec']} (vocab {m['tokenizer']['vocab_size']}); "
          f"{m['throughput_tokens_per_s']:.3g} tokens/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
