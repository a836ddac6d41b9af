"""Weights on disk, readable without a model, a process group or unpickling: the per-rank
``weights/tpTT_ppPP[_partRR].safetensors`` of a checkpoint (any training layout) and the
one-file export of ``setdiff-convert``. :func:`open_weights` reads full tensors by global name
one at a time; :meth:`TensorSource.shard` reads one rank's slice."""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Optional

import torch

from setdiff_dist.config import config_from_dict
from setdiff_dist.data.tokenizers import Tokenizer, load_shipped_tokenizer
from setdiff_dist.errors import SetdiffError

from .files import damaged, describe_files, pointer_target, shared_problems, step_directory
from .format import CONFIG, EMA_WEIGHTS, MANIFEST, WEIGHTS, weights_name, weights_part
from .manifest import read_manifest
from .sharding import merge_shards, split_shard

EXPORT_FORMAT = "setdiff-export/1"
VOCAB_ROWS = ("embedding.weight", "output_layer.weight")


class LoadError(SetdiffError, ValueError):
    """A checkpoint or export that cannot be loaded; the message names what is wrong."""


def locate(path: str, what: str = "--checkpoint") -> tuple[str, str]:
    """``("export" | "checkpoint", directory)`` for a run dir, a checkpoints dir, a step dir or an
    export; errors name the path as ``what`` gave it (a flag, a config key)."""
    sep = "=" if what.endswith(("init_from", "init_from_hf")) else " "
    path = pointer_target(path)
    if not os.path.isdir(path):
        raise LoadError(f"{what}{sep}{path}: no such directory")
    if os.path.isfile(os.path.join(path, "export.json")):
        return "export", path
    if _is_shard_directory(path):
        raise LoadError(f"{what}{sep}{path} is a shard directory (setdiff-prep's output), "
                        "not a checkpoint: give a training run directory, a checkpoints/step_* "
                        "directory or a setdiff-convert export")
    path = step_directory(path)
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        raise LoadError(f"{path} is neither a setdiff-convert export nor a complete checkpoint "
                        "(no export.json, manifest.json or checkpoints/latest)")
    if not glob.glob(os.path.join(path, WEIGHTS, "*.safetensors")):
        raise LoadError(f"{path} has no weights/ directory (a checkpoint from an older version?)")
    return "checkpoint", path


def _is_shard_directory(path: str) -> bool:
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as fh:
            return "splits" in json.load(fh)
    except (OSError, ValueError):
        return False


def _config_of(directory: str):
    import yaml

    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise LoadError(f"{directory}: {CONFIG} is missing")
    with open(path) as fh:
        return config_from_dict(yaml.safe_load(fh), check=False)


def _tokenizer_of(directory: str, identity: dict) -> Tokenizer:
    if identity.get("file"):
        from setdiff_dist.paths import inside

        inside(directory, identity["file"], "the manifest's tokenizer file", LoadError)
    if identity.get("file") and not os.path.isfile(os.path.join(directory, identity["file"])):
        raise LoadError(f"{directory} has no tokenizer: {identity['file']} (tokenizer "
                        f"{identity['spec']!r}) is missing; copy it from the shard directory the "
                        "model was trained on")
    try:
        return load_shipped_tokenizer(directory, identity)
    except Exception as exc:
        raise LoadError(f"{directory}: cannot load its tokenizer ({exc})") from None


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16",
                       "float64": "F64", "int64": "I64", "int32": "I32", "bool": "BOOL"}


class StreamingSafetensors:
    """A safetensors file written one tensor at a time: the header (names, dtypes, shapes and
    offsets, all known in advance) first, then each tensor's bytes as it comes, so that a
    writer never holds more than one tensor. Written to ``path.tmp`` and renamed on
    :meth:`close`, so a crash leaves no file that looks complete."""

    def __init__(self, path: str, specs: list):
        """``specs``: ``[(name, torch dtype, shape), ...]`` in the order :meth:`write` gets them."""
        header, offset = {}, 0
        self._expected = []
        for name, dtype, shape in specs:
            nbytes = torch.empty(0, dtype=dtype).element_size()
            for d in shape:
                nbytes *= int(d)
            header[name] = {"dtype": _SAFETENSORS_DTYPES[str(dtype).replace("torch.", "")],
                            "shape": [int(d) for d in shape],
                            "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, dtype, tuple(int(d) for d in shape)))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # (the format aligns the data to 8 bytes)
        self.path, self._tmp = path, path + ".tmp"
        self._fh = open(self._tmp, "wb")
        self._fh.write(len(raw).to_bytes(8, "little") + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = self._expected[self._next]
        got = (name, tensor.dtype, tuple(tensor.shape))
        if got != want:
            raise ValueError(f"streaming safetensors {self.path}: expected {want}, got {got}")
        data = tensor.detach().to("cpu").contiguous()
        self._fh.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expected):
            raise ValueError(f"streaming safetensors {self.path}: {self._next} of "
                             f"{len(self._expected)} tensors written")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self._tmp, self.path)


def tensor_names(file: str) -> list[str]:
    """The tensors of a safetensors ``file``, from its header, after checking that the file
    holds every byte the header describes (a truncated copy or an interrupted transfer is
    caught here, before any weights are read)."""
    size = os.path.getsize(file)
    with open(file, "rb") as fh:
        raw = fh.read(8)
        length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if length < 0 or length > size - 8:
            raise LoadError(f"{file} is truncated or not a safetensors file ({size} bytes)")
        try:
            header = json.loads(fh.read(length))
        except ValueError:
            raise LoadError(f"{file}: its header is not valid JSON (a damaged file)") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = 8 + length + max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if size < end:
        raise LoadError(f"{file} is truncated: {size} bytes, its header describes {end} "
                        f"(copy the checkpoint again, or resume from an earlier one)")
    return list(tensors)


def _stored(name: str, meta: Optional[dict]) -> str:
    """The name a tensor has in its file (``name``, unless the source maps it to another's:
    :func:`_untie_drifted`)."""
    return meta.get("stored", name) if meta else name


class TensorSource(Mapping):
    """The full tensors of a checkpoint or export by global name, read *one at a time* (each
    from the per-rank files that hold its slices, merged), so that loading never holds the
    whole model twice. Vocabulary-shaped tensors keep their ``vocab_size + 1`` real rows."""

    def __init__(self, files: dict, rows: int):
        # name -> [(safetensors file, sharding) per TP rank]
        self._files, self._rows = files, rows

    def __iter__(self):
        return iter(self._files)

    def __len__(self):
        return len(self._files)

    def __contains__(self, name):
        return name in self._files

    def shape(self, name: str) -> list[int]:
        """The full tensor's shape (vocabulary tensors: their real rows), from the headers."""
        from safetensors import safe_open

        parts = self._files[name]
        file, meta = parts[0]
        with safe_open(file, framework="pt") as fh:
            shape = list(fh.get_slice(_stored(name, meta)).get_shape())
        if meta and meta["tensor_parallel"] and len(parts) > 1:
            shape[meta["dim"]] *= len(parts)
        if name in VOCAB_ROWS:
            shape[0] = min(shape[0], self._rows)
        return shape

    def shard(self, name: str, rank: int, size: int, dim: int, stride: int = 1) -> torch.Tensor:
        """Rank ``rank`` of ``size``'s slice of the full tensor along ``dim``, as megatron splits
        it (:func:`~setdiff_dist.checkpoint.sharding.split_shard`), read from only the rows or
        columns of the files that hold it, whatever TP size they were saved at. Vocabulary
        tensors: slices of the real rows (the caller pads)."""
        from safetensors import safe_open

        full = self.shape(name)
        chunk = full[dim] // (size * stride)
        want = [((j * size + rank) * chunk, (j * size + rank + 1) * chunk) for j in range(stride)]
        parts = self._files[name]
        saved_tp = parts[0][1] is not None and parts[0][1]["tensor_parallel"] and len(parts) > 1
        # where each global index along dim lives: (file, local offset) per saved range
        held = []  # (global lo, global hi, file, local lo)
        if saved_tp:
            n = len(parts)
            with safe_open(parts[0][0], framework="pt") as fh:
                local = fh.get_slice(_stored(name, parts[0][1])).get_shape()[dim]
            c = local // stride
            for r, (file, _) in enumerate(parts):
                for j in range(stride):
                    lo = (j * n + r) * c
                    held.append((lo, lo + c, file, j * c))
        else:
            held.append((0, full[dim], parts[0][0], 0))
        pieces = []
        for a, b in want:
            b = min(b, full[dim])  # (vocabulary rows past the real ones: padding)
            for lo, hi, file, at in held:
                x, y = max(a, lo), min(b, hi)
                if x >= y:
                    continue
                with safe_open(file, framework="pt") as fh:
                    sl = fh.get_slice(_stored(name, parts[0][1]))
                    index = (slice(None),) * dim + (slice(at + x - lo, at + y - lo),)
                    pieces.append(sl[index])
        if not pieces:
            shape = list(full)
            shape[dim] = 0
            return torch.empty(shape)
        return torch.cat(pieces, dim=dim)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        parts, meta = [], None
        for file, meta in self._files[name]:  # noqa: B007 (every part has the same meta)
            with safe_open(file, framework="pt") as fh:  # closed at once: no mapped pages kept
                parts.append(fh.get_tensor(_stored(name, meta)))
        if meta and meta["tensor_parallel"] and len(parts) > 1:
            full = merge_shards(parts, meta["dim"], meta["stride"])
        else:
            full = parts[0]
        return full[:self._rows] if name in VOCAB_ROWS else full


def write_weights(directory: str, tp: int, pp: int, tp_size: int, parts: int, part: int,
                  entries: list, values: Iterable[torch.Tensor]) -> None:
    """Write data-parallel share ``part`` (of ``parts``) of the weights of tensor-parallel rank
    ``tp`` of stage ``pp``: ``entries`` lists every tensor in order as ``(global name, dtype,
    shape, sharding)`` (sharding: ``{"tensor_parallel", "dim", "stride"}``); ``values`` yields
    each tensor in that order, on every share's writer (a ZeRO-3 gather inside it is a
    collective); tensor ``i`` is written by share ``i % parts`` alone, one at a time. Share 0
    also writes the tensor list (``NAME.json``), which readers take the layout from."""
    meta = {g: dict(sharding, part=i % parts) for i, (g, _, _, sharding) in enumerate(entries)}
    os.makedirs(directory, exist_ok=True)
    writer = StreamingSafetensors(os.path.join(directory, weights_part(tp, pp, part)),
                                  [(g, dtype, tuple(shape)) for i, (g, dtype, shape, _)
                                   in enumerate(entries) if i % parts == part])
    for i, value in enumerate(values):
        if i % parts == part:
            writer.write(entries[i][0], value)
    writer.close()
    if part == 0:
        with open(os.path.join(directory, weights_name(tp, pp) + ".json"), "w") as fh:
            json.dump({"tensor_parallel_size": tp_size, "parts": parts, "tensors": meta}, fh,
                      indent=1, sort_keys=True)


def local_shard(state, name: str, p, shape: list, tp: int, rank: int,
                what: str) -> torch.Tensor:
    """Tensor-parallel rank ``rank``'s (of ``tp``) shard of tensor ``name`` of a weights
    source (any saved layout) for parameter ``p`` (its megatron sharding attributes), whose
    local shape is ``shape``: only its rows or columns are read; vocabulary tables keep their
    real rows, padded to this layout's table. Errors name the source as ``what``."""
    if name not in state:
        raise LoadError(f"{what}: tensor {name} is missing")
    split = getattr(p, "tensor_model_parallel", False) and tp > 1
    dim, stride = getattr(p, "partition_dim", 0), getattr(p, "partition_stride", 1)
    want = list(shape)
    if getattr(p, "tensor_model_parallel", False):
        want[dim] *= tp
    if name in VOCAB_ROWS:  # the real rows, padded to this layout's table
        full = state[name]
        if list(full.shape[1:]) != want[1:] or full.shape[0] > want[0]:
            raise LoadError(f"{what}: tensor {name} has shape {tuple(full.shape)}, this model "
                            f"{tuple(want)}")
        full = torch.cat([full, full.new_zeros(want[0] - full.shape[0], *full.shape[1:])])
        return split_shard(full, rank, tp, dim, stride) if split else full
    if state.shape(name) != want:
        raise LoadError(f"{what}: tensor {name} has shape {tuple(state.shape(name))}, this model "
                        f"{tuple(want)}")
    return state.shard(name, rank, tp, dim, stride) if split else state[name]


def weights_dir(directory: str, raw: bool) -> str:
    """Which weights of a checkpoint to read: the EMA (``weights_ema/``, when the run kept one)
    unless ``raw``, else the raw weights (``weights/``)."""
    ema = os.path.join(directory, EMA_WEIGHTS)
    return WEIGHTS if raw or not os.path.isdir(ema) else EMA_WEIGHTS


def _export_meta(directory: str) -> dict:
    try:
        with open(os.path.join(directory, "export.json")) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as exc:
        raise LoadError(f"{directory}/export.json is damaged ({exc}): export it again with "
                        "setdiff-convert") from None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        raise LoadError(f"{directory}/export.json: format "
                        f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected "
                        f"{EXPORT_FORMAT!r}")
    return meta


def weight_files(path: str, raw: bool = False, which: Optional[str] = None,
                 what: str = "--checkpoint"):
    """``(kind, directory, table, names)``: the weight files :func:`open_weights` reads from
    the checkpoint or export at ``path`` (the weights directory read, with its tensor lists; an
    export's ``model.safetensors``) and the table of their sizes and SHA-256 checksums (a
    checkpoint's manifest, an export's ``export.json``; an export written before exports
    listed their files has an empty table). The config and the tokenizer are text a user may
    edit (an export relabelled, decoding defaults): their readers check them."""
    kind, directory = locate(path, what)
    if kind == "export":
        table = _export_meta(directory).get("files", {})
        return kind, directory, table, sorted(n for n in table if n == "model.safetensors")
    manifest = read_manifest(directory)
    sub = which or weights_dir(directory, raw)
    table = manifest.get("files", {})
    return kind, directory, table, sorted(n for n in table if n.startswith(sub + "/"))


def check_weight_files(path: str, raw: bool = False, which: Optional[str] = None,
                       checksums: bool = True, group=None, what: str = "--checkpoint") -> None:
    """Check what :func:`open_weights` reads against its table: present, of its size and,
    with ``checksums``, of its SHA-256 (about 1 GB/s on one core); a :class:`LoadError`
    naming every damaged file. With ``group`` (a torch.distributed process group whose ranks
    all call this together) the ranks share the hashing and raise alike."""
    kind, directory, table, names = weight_files(path, raw, which, what)
    from setdiff_dist.paths import inside

    for name in names:  # (a manifest names files inside its own directory)
        inside(directory, name, "the manifest's file", LoadError)
    problems = shared_problems(directory, table, list(names), checksums, group)
    if not problems:
        return
    if kind == "export":
        raise LoadError(f"export {directory} is damaged:\n  - " + "\n  - ".join(problems)
                        + "\nexport it again with setdiff-convert")
    raise LoadError(str(damaged(directory, problems, reading=True)))


def open_weights(path: str, raw: bool = False, which: Optional[str] = None,
                 checksums: bool = True, group=None, what: str = "--checkpoint",
                 untie_drifted: bool = True, stage: str = "last"):
    """``(TensorSource, config, tokenizer, source directory)`` of a checkpoint (any training
    layout) or an export; tensors are read when asked for. A checkpoint's EMA of the weights
    is read when it has one, unless ``raw`` (``which`` names the directory outright). Every
    file read is checked first against the manifest (:func:`check_weight_files`: its size and,
    unless ``checksums`` is False, its SHA-256; ``group``: the ranks that share the hashing),
    then complete and holding the tensors its list names. Errors name ``path`` as ``what``
    gave it. ``untie_drifted``: a checkpoint whose pipeline stages' copies of the tied embedding
    differ (:func:`_untie_drifted`) is read as the untied model it trained as; otherwise its
    last stage's copy is read, with a note. ``stage``: which pipeline stage's copy of a tied
    embedding the name ``embedding.weight`` reads where the stages saved one each, ``"first"``
    or ``"last"`` (equal since the fix; a run that resumes its EMA reads its own stage's)."""
    check_weight_files(path, raw, which, checksums, group, what)
    kind, directory = locate(path, what)
    cfg = _config_of(directory)
    rows = cfg.model.vocab_size + 1
    if kind == "export":
        meta = _export_meta(directory)
        file = os.path.join(directory, "model.safetensors")
        if not os.path.isfile(file):
            raise LoadError(f"{file} is missing: the export is incomplete")
        names = tensor_names(file)
        source = TensorSource({n: [(file, None)] for n in names}, rows)
        return source, cfg, _tokenizer_of(directory, meta["tokenizer"]), directory
    manifest = read_manifest(directory)
    sub = which or weights_dir(directory, raw)
    layout = manifest["layout"]
    files: dict[str, list] = {}
    stages: dict = {}  # the tied embedding's copy of each pipeline stage, by TP rank
    for pp in range(layout["pipeline"]):
        for tp in range(layout["tensor"]):
            base = os.path.join(directory, sub, weights_name(tp, pp))
            if not os.path.isfile(base + ".json"):
                raise LoadError(f"{base}.json is missing: the checkpoint is incomplete")
            try:
                with open(base + ".json") as fh:
                    top = json.load(fh)
                meta, parts = top["tensors"], int(top.get("parts", 1))
            except (ValueError, KeyError, TypeError):
                raise LoadError(f"{base}.json is damaged (not the tensor list of a weights "
                                "file)") from None
            for part in range(parts):  # one file per data-parallel rank that wrote a part
                file = os.path.join(directory, sub, weights_part(tp, pp, part))
                if not os.path.isfile(file):
                    raise LoadError(f"{file} is missing: the checkpoint is incomplete")
                names = tensor_names(file)
                listed = {n for n, m in meta.items() if m.get("part", 0) == part}
                missing = sorted(listed - set(names))
                if missing:
                    raise LoadError(f"{file} lacks tensor {missing[0]}"
                                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                                       else "")
                                    + f" that {os.path.basename(base)}.json lists: the file "
                                    "is damaged or from another save")
                for name in names:  # (a tied embedding is in the first and the last stage)
                    if name not in listed:
                        raise LoadError(f"{file} holds tensor {name} that "
                                        f"{os.path.basename(base)}.json does not list")
                    files.setdefault(name, {})[tp] = (file, meta[name])
                    if name == TIED:
                        stages.setdefault(pp, {})[tp] = (file, meta[name])
    for name, by_tp in files.items():  # a tensor-parallel tensor needs every TP rank's slice
        if any(m["tensor_parallel"] for _, m in by_tp.values()) and \
                len(by_tp) != layout["tensor"]:
            absent = sorted(set(range(layout["tensor"])) - set(by_tp))
            raise LoadError(f"tensor {name}: the slice of TP rank {absent[0]} is missing "
                            f"({sub}/{weights_name(absent[0], 0).split('_')[0]}_pp*.safetensors)")
    files = {name: [by_tp[tp] for tp in sorted(by_tp)] for name, by_tp in files.items()}
    stages = {pp: [by_tp[tp] for tp in sorted(by_tp)] for pp, by_tp in stages.items()}
    if stage == "first" and len(stages) > 1:
        files[TIED] = stages[min(stages)]
    elif which is None and len(stages) > 1 and manifest.get("decay_rule") != "global":
        _untie_drifted(files, stages[min(stages)], stages[max(stages)], rows, cfg, path,
                       untie_drifted)
    return TensorSource(files, rows), cfg, _tokenizer_of(directory, manifest["tokenizer"]), \
        directory


TIED = "embedding.weight"  # (a tied model's output layer: saved by the first and last stage)


def _untie_drifted(files: dict, first: list, last: list, rows: int, cfg, path: str,
                   untie: bool) -> None:
    """A checkpoint DeepSpeed saved under pipeline parallelism before the weight-decay groups
    went by global name (its manifest has no ``decay_rule``, or ``"local"``) trained with the
    last stage's copy of the tied embedding weight-decayed as a matrix and the first's not:
    the copies drifted apart, and the model that trained is untied (the first stage's copy
    embeds, the last's projects). If they differ, ``files`` is made that model with ``untie``
    (``cfg.model.tie_embeddings`` off, ``output_layer.weight`` read from the last stage's
    copy), else left reading the last stage's copy for both, with a note either way.
    ``first``, ``last``: the two stages' copies, by TP rank."""
    a, b = TensorSource({TIED: first}, rows)[TIED], TensorSource({TIED: last}, rows)[TIED]
    if torch.equal(a, b):
        return
    drift = float((a - b).float().norm() / b.float().norm().clamp_min(1e-30))
    said = (f"note: {path}: its pipeline stages' copies of the tied embedding differ (relative "
            f"difference {drift:.2g}): it was saved when DeepSpeed weight-decayed the last "
            "stage's copy alone, since fixed")
    if not untie:
        print(f"{said}; reading the last stage's copy (the output layer's)", file=sys.stderr,
              flush=True)
        return
    files[TIED] = first
    files["output_layer.weight"] = [(f, dict(m, stored=TIED)) for f, m in last]
    cfg.model.tie_embeddings = False
    print(f"{said}; read as the untied model it trained as (the first stage's copy embeds, the "
          "last stage's projects)", file=sys.stderr, flush=True)


def provenance(path: str, raw: bool = False) -> dict:
    """``{"checkpoint": directory, "step": training step or None, "weights": "ema" | "raw"}``
    of a checkpoint or export, for results to say what they measured."""
    kind, directory = locate(path)
    if kind == "checkpoint":
        which = "ema" if weights_dir(directory, raw) == EMA_WEIGHTS else "raw"
        return {"checkpoint": os.path.abspath(directory),
                "step": read_manifest(directory)["step"], "weights": which}
    with open(os.path.join(directory, "export.json")) as fh:
        meta = json.load(fh)
    return {"checkpoint": os.path.abspath(directory), "step": meta.get("step"),
            "weights": meta.get("weights", "raw")}


def read_full_state_dict(path: str, raw: bool = False):
    """``(full tensors by global name, config, tokenizer, source directory)``; vocabulary-shaped
    tensors keep their ``vocab_size + 1`` real rows (the padding depends on the TP size)."""
    source, cfg, tok, directory = open_weights(path, raw=raw)
    return {name: source[name] for name in source}, cfg, tok, directory


def check_new_directory(out: str, flag: str = "--out") -> None:
    """Refuse an output directory that exists as a file or holds files (a write never mixes
    with what is there)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise LoadError(f"{flag} {out} is a file, not a directory: give a new (or empty) "
                        "directory for the export")
    if os.path.isdir(out) and os.listdir(out):
        raise LoadError(f"{flag} {out} exists and is not empty: give a new (or empty) "
                        "directory")


def write_export(out: str, state: dict, cfg, tok, source: str, extra_meta: Optional[dict] = None,
                 extra_files: Optional[dict] = None) -> dict:
    """Write an export directory (``model.safetensors`` of full tensors, ``config.yaml``, the
    tokenizer, ``export.json`` and any ``extra_files`` {name: JSON-able}) through a temporary
    directory, so that a failure leaves nothing half-written at ``out``."""
    from setdiff_dist.checkpoint.files import save_tensors

    check_new_directory(out)
    tmp = f"{out.rstrip('/')}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    save_tensors({k: v.contiguous() for k, v in state.items()},
                 os.path.join(tmp, "model.safetensors"), metadata={"format": EXPORT_FORMAT})
    with open(os.path.join(tmp, CONFIG), "w") as fh:
        fh.write(cfg.to_yaml())
    for name, obj in (extra_files or {}).items():
        with open(os.path.join(tmp, name), "w") as fh:
            json.dump(obj, fh, indent=2)
    identity = dict(tok.identity(), file=tok.save(tmp))
    try:  # (the step of the training checkpoint exported, when it is one)
        step = provenance(source)["step"]
    except (SetdiffError, OSError, ValueError):
        step = None
    # every file's size and SHA-256, checked by every read (as a checkpoint's manifest)
    files = describe_files(tmp, sorted(os.listdir(tmp)))
    meta = {"format": EXPORT_FORMAT, "source": os.path.abspath(source), "tokenizer": identity,
            "step": step, "weights": "raw",
            "parameters": int(sum(v.numel() for v in state.values())), **(extra_meta or {}),
            "files": files}
    with open(os.path.join(tmp, "export.json"), "w") as fh:
        json.dump(meta, fh, indent=2)
    if os.path.exists(out):
        os.rmdir(out)
    os.replace(tmp, out)
    return meta
