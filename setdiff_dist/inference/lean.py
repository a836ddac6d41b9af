"""The decode-time transformer: the trained architecture in plain torch, for KV-cached decoding.

The training model is megatron-core's: every layer goes through megatron's autograd wrappers,
autocast decorators and module plumbing, which costs more than the matmuls of a small model's
batch-1 decoding step. :class:`LeanTransformer` computes the same function with a handful of
fused tensor operations per layer and no autograd:

- a full embedding table (replicated over tensor-parallel ranks), RMSNorm or LayerNorm;
- attention with one fused ``qkv`` matmul in megatron's grouped layout (per query group: its
  query heads, then its key, then its value), optional QK-norm, rotary embeddings at each
  token's own position, grouped-query attention, ``sdpa`` under a dense mask or the KV cache of
  :mod:`setdiff_dist.inference.kv_cache`;
- a SwiGLU or GELU MLP;
- tensor parallelism as megatron splits the weights: ``qkv`` and ``fc1`` column-parallel (whole
  query groups, ``[gate ; up]`` halves), the attention output and ``fc2`` row-parallel with one
  all-reduce each, and a vocab-parallel output head over the TP-padded vocabulary, so that the
  logits have the training model's layout ``[s, b, V_pad / TP]`` (``[MASK]`` and padding never
  predicted); at TP=1 the head holds the real vocabulary only, ``[s, b, V]``.

Weights are the layout-free full tensors of a checkpoint or export
(:func:`setdiff_dist.inference.weights.read_full_state_dict`); each rank keeps only its slices.
It is called like the training model: ``model(tokens [b, s], positions [b, s], mask, logits_from)``
with ``mask`` a boolean ``[b, 1, s, s]`` (True = may attend) or None (causal), so the set decoder
runs on it unchanged.
"""

from __future__ import annotations

import statistics
import time
import types
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from setdiff_dist.checkpoint.sharding import split_shard
from setdiff_dist.errors import SetdiffError
from setdiff_dist.model.dims import padded_vocab_size, rotary_inv_freq

# Weights stored transposed, ``[in, out]``, and applied as ``x @ w``: the ones wider than they
# are deep (the fused qkv, fc1 and the output head). For the few rows of a decoding step MKL's
# GEMM reads a wide ``[out, in]`` weight several times over (measured on 2 Xeon cores: the
# 50k x 256 head takes 1.8 ms for 4-5 rows, 2.8 ms for 8, against 0.9 ms for one row), the
# transposed one about once (1.0 ms, 1.1 ms); narrow weights (proj, fc2) are faster as they are.
_WIDE = ("qkv", "fc1", "head")
# With ``pack`` (on the CPU, in fp32), matmul weights of at least this many elements may go to
# oneDNN's blocked layout, straight from the checkpoint's tensors (no second copy). Whether that
# pays depends on the CPU and its MKL: oneDNN's packed kernel stays near its one-row cost for the
# 4-8 rows of a set-decoding step (W queries and a commit) or of a batch, where MKL's GEMM on the
# dense layout may cost twice its one-row time, but it adds a fixed cost per call. Measured on
# one 2-core Xeon (us per call, 5 rows, MKL against oneDNN): the 110m shape's 768 x 2304 qkv
# 253 / 163 and 768 x 2048 fc1 214 / 141, a 50k x 256 head 1,196 / 1,067 (oneDNN ahead); the
# 4 x 256 shape's 256 x 768 qkv 12 / 27, 1024 x 256 fc2 16 / 28, a 2,048-row head 24 / 40 (MKL
# ahead: packing them made a W=4 set step 1.5x a causal step). An earlier machine had MKL 2-4x
# slower on the small ones, and oneDNN ahead there. So ``pack="auto"`` measures both kernels on
# each weight shape at the step's row count when the model loads (:func:`packing_pays`, once
# per shape per process) and packs where oneDNN is clearly faster; ``pack=True`` packs every
# weight from this size on (tests, to cover the packed kernel).
_PACK_MIN = 1 << 17
_MATMULS = ("qkv", "proj", "fc1", "fc2", "head")
_PACK_CHOICES: dict = {}  # (shape, rows, wide, threads) -> oneDNN measured faster


def _median_us(fn, rounds: int = 7) -> float:
    fn()
    start = time.perf_counter()
    fn()
    calls = max(2, int(1e-3 / max(time.perf_counter() - start, 1e-7)))  # ~1 ms a round
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times) * 1e6


def packing_pays(w: torch.Tensor, rows: int, wide: bool) -> bool:
    """Whether oneDNN's packed kernel runs ``rows`` rows through the fp32 weight ``w``
    (``[out, in]``) at least 10% faster than MKL's GEMM on the layout :class:`LeanTransformer`
    stores otherwise (transposed when ``wide``), measured on this CPU, in this process's
    threads; decided once per shape (a tie keeps MKL: no second layout, no per-call cost)."""
    key = (tuple(w.shape), rows, wide, torch.get_num_threads())
    if key not in _PACK_CHOICES:
        with torch.inference_mode():
            x = torch.randn(1, rows, w.shape[1])
            dense = w.t().contiguous() if wide else w
            packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 8)
            mkl = _median_us((lambda: x @ dense) if wide else (lambda: F.linear(x, dense)))
            dnn = _median_us(lambda: torch.ops.mkldnn._linear_pointwise(
                x, packed, None, "none", [], ""))
        _PACK_CHOICES[key] = dnn < 0.9 * mkl
    return _PACK_CHOICES[key]


class LeanError(SetdiffError, ValueError):
    """Weights that do not fit the architecture; the message names the tensor."""


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``t [b, s, n, d]`` (megatron's non-interleaved form)."""
    x1, x2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat([-x2, x1], dim=-1) * sin


class LeanTransformer(nn.Module):
    def __init__(self, model_cfg, tp_rank: int = 0, tp_size: int = 1, tp_group=None):
        super().__init__()
        m = model_cfg
        if m.num_attention_heads % tp_size or m.num_query_groups % tp_size:
            raise LeanError(f"tensor-parallel size {tp_size} must divide the attention heads "
                            f"({m.num_attention_heads}) and key/value groups")
        self.model_cfg = m
        self.vocab_size = m.vocab_size
        self.mask_id = m.vocab_size
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.heads = m.num_attention_heads // tp_size
        self.groups = m.num_query_groups // tp_size
        self.head_dim = m.head_dim
        self.gated = m.activation == "swiglu"
        self.rms = m.normalization == "rmsnorm"
        self.eps = m.norm_epsilon
        self.padded_vocab = padded_vocab_size(m.vocab_size, tp_size)
        self.config = types.SimpleNamespace(num_layers=m.num_layers)  # what the decoders read
        # kept in fp32 whatever the weights' dtype (not a buffer, so .to(dtype) leaves it)
        self._inv_freq = rotary_inv_freq(m, self.head_dim)
        self._first_unreal = m.vocab_size  # local logit columns past the real vocabulary
        self._packed: dict = {}  # weight key -> oneDNN-packed weight (pack)
        self._pack_rows = 5  # the rows of a step that pack="auto" measures (from_state_dict)

    # -- weights ---------------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, model_cfg, state: dict, tp_rank: int = 0, tp_size: int = 1,
                        tp_group=None, pack: Union[bool, str] = False, device=None,
                        dtype: Optional[torch.dtype] = None,
                        pack_rows: int = 5) -> "LeanTransformer":
        """This rank's slices of the full tensors ``state`` (global names, vocabulary tensors with
        their ``vocab_size + 1`` real rows). ``pack``: on the CPU, hand the large fp32 matmul
        weights to oneDNN (see :data:`_PACK_MIN`): True every one, "auto" those whose shape
        runs a step of ``pack_rows`` rows faster packed (:func:`packing_pays`); the model must
        then stay on the CPU in fp32 (a tied head keeps a dense copy of the table for the
        embedding lookups). With
        ``device`` / ``dtype`` each tensor is moved and cast as it is read, so the host never
        holds more than one full tensor in the checkpoint's dtype."""
        if pack not in (True, False, "auto"):
            raise ValueError(f"pack={pack!r}: True, False or 'auto'")
        model = cls(model_cfg, tp_rank, tp_size, tp_group)
        model._pack_rows = pack_rows
        model._load(state, pack if torch.backends.mkldnn.is_available() else False, device,
                    dtype)
        return model

    @staticmethod
    def _require(state, name: str) -> None:
        if name not in state:
            raise LeanError(f"tensor {name} is missing from the checkpoint")

    @staticmethod
    def _require_shape(name: str, have, shape) -> None:
        if list(have) != list(shape):
            raise LeanError(f"tensor {name}: shape {tuple(have)}, the architecture needs "
                            f"{tuple(shape)}")

    def _get(self, state, name, shape):
        self._require(state, name)
        t = state[name]
        self._require_shape(name, t.shape, shape)
        return t

    def _shard(self, t, dim: int, stride: int = 1):
        """This rank's slice of ``t`` as megatron splits it (a new tensor, so the full one can
        go); the tensor itself at TP=1."""
        if self.tp_size == 1:
            return t
        return split_shard(t, self.tp_rank, self.tp_size, dim, stride)

    def _read_shard(self, state, name, shape, dim: int, stride: int = 1):
        """This rank's slice of tensor ``name`` (full shape ``shape``): read as a slice from
        the files when ``state`` can (a checkpoint reader), else cut from the full tensor."""
        if self.tp_size == 1 or not hasattr(state, "shard"):
            return self._shard(self._get(state, name, shape), dim, stride)
        self._require(state, name)
        self._require_shape(name, state.shape(name), shape)
        return state.shard(name, self.tp_rank, self.tp_size, dim, stride)

    def _load(self, state, pack: bool = False, device=None, dtype=None):
        m, h, d = self.model_cfg, self.model_cfg.hidden_size, self.head_dim
        heads, groups, ffn = m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size
        rows = m.vocab_size + 1
        used = set()

        def finite(name, t):
            # (a sum is non-finite iff an element is: no tensor-sized mask while loading)
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t.sum())):
                bad = int((~torch.isfinite(t)).sum())
                raise LeanError(f"tensor {name} has {bad} non-finite values (NaN or inf) of "
                                f"{t.numel()}: the training diverged before this checkpoint; "
                                "use an earlier one")
            return t

        def get(name, shape):
            used.add(name)
            return finite(name, self._get(state, name, shape)).to(device=device, dtype=dtype)

        def get_shard(name, shape, dim, stride=1):  # only this rank's rows or columns are read
            used.add(name)
            return finite(name, self._read_shard(state, name, shape, dim, stride)).to(
                device=device, dtype=dtype)

        w = {"embedding": get("embedding.weight", [rows, h])}
        head = w["embedding"] if m.tie_embeddings else get("output_layer.weight", [rows, h])
        if self.tp_size == 1:
            w["head"] = head
            if m.tie_embeddings and not self._packs(pack, head[:m.vocab_size], True):
                # one table, stored once
                del w["embedding"]  # ([h, rows], see _WIDE; the lookups read its columns)
        else:  # this rank's rows of the TP-padded table (padding rows are zero)
            per = self.padded_vocab // self.tp_size
            lo = self.tp_rank * per
            part = head[lo:lo + per]
            w["head"] = torch.cat([part, part.new_zeros(per - part.shape[0], h)])
            # columns from here on are [MASK] or padding, never predicted
            self._first_unreal = min(per, max(0, m.vocab_size - lo))
        norms = ("weight",) if self.rms else ("weight", "bias")
        for i in range(m.num_layers):
            p = f"decoder.layers.{i}."
            for norm, key in (("input_layernorm", "norm1"), ("pre_mlp_layernorm", "norm2")):
                for part in norms:
                    w[f"{i}.{key}.{part}"] = get(f"{p}{norm}.{part}", [h])
            w[f"{i}.qkv"] = get_shard(f"{p}self_attention.linear_qkv.weight",
                                      [(heads + 2 * groups) * d, h], 0)  # whole query groups
            if m.qk_norm:
                for which in ("q", "k"):
                    for part in norms:
                        w[f"{i}.{which}norm.{part}"] = get(
                            f"{p}self_attention.{which}_layernorm.{part}", [d])
            w[f"{i}.proj"] = get_shard(f"{p}self_attention.linear_proj.weight",
                                       [h, heads * d], 1)
            w[f"{i}.fc1"] = get_shard(f"{p}mlp.linear_fc1.weight",
                                      [(2 if self.gated else 1) * ffn, h], 0,
                                      2 if self.gated else 1)  # [gate ; up] halves
            w[f"{i}.fc2"] = get_shard(f"{p}mlp.linear_fc2.weight", [h, ffn], 1)
        for part in norms:
            w[f"final.{part}"] = get(f"decoder.final_layernorm.{part}", [h])
        extra = sorted(set(state.keys()) - used)
        if extra:
            raise LeanError(f"the checkpoint has tensors the architecture does not: "
                            f"{', '.join(extra[:5])}")
        # buffers: .to() moves and casts them; nothing needs a gradient. The tensors read from
        # the checkpoint are kept as they are (TP slices are new tensors), or transposed in
        # place of them: no second copy
        for k, v in w.items():
            v = v.detach()
            kind = k.rsplit(".", 1)[-1]
            # the real vocabulary only (a view: no copy)
            real = v[:m.vocab_size] if k == "head" and self.tp_size == 1 else v
            if kind in _MATMULS and self._packs(pack, real, kind in _WIDE):
                self._packed[k] = torch.ops.mkldnn._reorder_linear_weight(real.contiguous(), 8)
                v = v.new_empty(0)
            elif kind in _WIDE:
                v = v.t().contiguous()
            self.register_buffer("w_" + k.replace(".", "_"), v.contiguous(), persistent=False)
            w[k] = None  # (the full tensor can go as soon as the caller drops it)

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.half()``...: refused where the model holds oneDNN-packed
        weights and the move leaves the CPU or fp32. Those weights are not buffers, so they
        would stay behind, packed for the CPU, and the first forward would fail far from here
        (a CUDA input to a oneDNN matmul)."""
        if self._packed:
            probe = fn(torch.zeros(1))
            if probe.device.type != "cpu" or probe.dtype != torch.float32:
                raise LeanError(
                    f"this model's matmul weights are packed for oneDNN (pack=True or 'auto'), "
                    f"which runs on the CPU in fp32: it cannot move to {probe.device} "
                    f"{probe.dtype}. Build it there instead (from_state_dict(..., device=, "
                    "dtype=): off the CPU or fp32 nothing is packed)")
        return super()._apply(fn, recurse)

    def _packs(self, pack, t: torch.Tensor, wide: bool) -> bool:
        if not (pack and t.device.type == "cpu" and t.dtype == torch.float32
                and t.numel() >= _PACK_MIN):
            return False
        return pack is True or packing_pays(t, self._pack_rows, wide)

    def _w(self, key: str) -> torch.Tensor:
        return getattr(self, "w_" + key.replace(".", "_"))

    @property
    def device(self) -> torch.device:
        return self.w_head.device

    # -- forward ---------------------------------------------------------------------------------
    def _norm(self, x, key):
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), self._w(key + ".weight"), self.eps)
        return F.layer_norm(x, (x.shape[-1],), self._w(key + ".weight"), self._w(key + ".bias"),
                            self.eps)

    def _linear(self, x, key):
        packed = self._packed.get(key)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        w = self._w(key)
        return x @ w if key.rsplit(".", 1)[-1] in _WIDE else F.linear(x, w)

    def _embed(self, tokens):
        if not hasattr(self, "w_embedding"):  # tied at TP=1: columns of the [h, rows] table
            b, s = tokens.shape
            return self.w_head.index_select(1, tokens.reshape(-1)).t().reshape(b, s, -1)
        return F.embedding(tokens, self.w_embedding)

    def _all_reduce(self, x):
        if self.tp_size > 1:
            torch.distributed.all_reduce(x, group=self.tp_group)
        return x

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, logits_from: int = 0,
                step=None):
        """Logits ``[s - logits_from, b, V]`` of ``tokens`` at ``positions`` (``[b, s]``) (or
        ``[1, b, V]`` when ``logits_from`` is a tensor ``[b]``: one position per row), under
        ``attention_mask`` (``[b, 1, s, s]``, True = may attend; None = causal), or, with
        ``step`` (a :class:`~setdiff_dist.inference.kv_cache.DecodeStep`), over its KV cache
        under its own mask."""
        b, s = tokens.shape
        x = self._embed(tokens)
        if self._inv_freq.device != tokens.device:
            self._inv_freq = self._inv_freq.to(tokens.device)
        freqs = positions.to(torch.float32)[..., None] * self._inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [b, s, 1, d]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        rep, d = self.heads // self.groups, self.head_dim
        for i in range(self.model_cfg.num_layers):
            h = self._norm(x, f"{i}.norm1")
            qkv = self._linear(h, f"{i}.qkv").view(b, s, self.groups, rep + 2, d)
            v = qkv[:, :, :, rep + 1]
            if self.model_cfg.qk_norm:
                q = self._norm(qkv[:, :, :, :rep], f"{i}.qnorm").reshape(b, s, self.heads, d)
                k = self._norm(qkv[:, :, :, rep], f"{i}.knorm")
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            else:  # queries and keys rotated in one go: [b, s, g, rep + 1, d]
                qk = _rotate(qkv[:, :, :, :rep + 1], cos[:, :, :, None], sin[:, :, :, None])
                q, k = qk[:, :, :, :rep].reshape(b, s, self.heads, d), qk[:, :, :, rep]
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, n, s, d]
            if step is not None:
                o = step.attend(i, q, k, v)
            else:
                if rep > 1:
                    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None)
            o = o.transpose(1, 2).reshape(b, s, self.heads * d)
            x = x + self._all_reduce(self._linear(o, f"{i}.proj"))
            h = self._linear(self._norm(x, f"{i}.norm2"), f"{i}.fc1")
            if self.gated:
                gate, up = h.chunk(2, dim=-1)
                h = F.silu(gate) * up
            else:
                h = F.gelu(h)
            x = x + self._all_reduce(self._linear(h, f"{i}.fc2"))
        if isinstance(logits_from, torch.Tensor):  # one position per row: [b] -> [b, 1, h]
            x = x[torch.arange(b, device=x.device), logits_from.to(x.device)][:, None]
        else:
            x = x[:, logits_from:]
        x = self._norm(x, "final").transpose(0, 1)
        # one 2-d GEMM ([s' b, h] rows, contiguous): a strided 3-d input runs as a slow bmm
        rows = x.reshape(-1, x.shape[-1])
        if "head" in self._packed:
            logits = self._linear(rows, "head")
        else:
            head = self.w_head
            if self.tp_size == 1:  # the real vocabulary only: [MASK] is never predicted
                head = head[:, :self.vocab_size]
            logits = rows @ head
        logits = logits.view(x.shape[0], b, -1)  # [s', b, V_pad / TP]
        if self._first_unreal < logits.shape[-1]:  # [MASK] and padding are never predicted
            logits[..., self._first_unreal:] = torch.finfo(logits.dtype).min
        return logits
