"""Hugging Face Llama and Qwen3 checkpoints: import into the set-diffusion transformer, export back.

A *Hugging Face checkpoint* is a local directory with ``config.json`` and ``model.safetensors``
(or ``model-*.safetensors`` with ``model.safetensors.index.json``), as ``save_pretrained``
writes it. Reading it needs only ``safetensors`` and the JSON config, not ``transformers``.

The architectures map onto :class:`setdiff_dist.config.ModelConfig` and megatron-core's layers
(HF name -> our global name):

- ``model.embed_tokens.weight [V, h]`` -> ``embedding.weight``: the ``V`` rows, then ``[MASK]``
  (id ``V``), then zero padding to the layout's table size;
- ``self_attn.{q,k,v}_proj`` -> ``self_attention.linear_qkv.weight``, megatron's grouped rows:
  for each key/value group ``g``, ``[q rows of g's heads ; k rows of g ; v rows of g]``;
- ``self_attn.o_proj`` -> ``self_attention.linear_proj``; Qwen3's ``self_attn.{q,k}_norm`` ->
  ``self_attention.{q,k}_layernorm`` (``model.qk_norm``);
- ``mlp.gate_proj`` + ``mlp.up_proj`` -> ``mlp.linear_fc1 = [gate ; up]``; ``mlp.down_proj`` ->
  ``mlp.linear_fc2``;
- ``input_layernorm``, ``post_attention_layernorm``, ``model.norm`` -> ``input_layernorm``,
  ``pre_mlp_layernorm``, ``decoder.final_layernorm``; ``lm_head`` (untied) -> ``output_layer``.

RoPE: HF's rotate-half layout is megatron's non-interleaved one; ``rope_theta`` is
``model.rotary_base``, and the ``default``, ``linear`` and ``llama3`` rope types are
``model.rope_scaling`` (the others are refused, naming the key).

:func:`load_hf_into` fills a model of *any* tensor / pipeline layout straight from the files:
each rank reads, with ``safe_open(...).get_slice``, only the rows or columns of its own shard and
only the layers of its own pipeline stage. :func:`read_hf_state` builds the full tensors (for
``setdiff-convert --from-hf``), :func:`export_hf` writes full tensors back in HF's names and
layout (bit-identical to the imported files when the weights were not changed).
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import torch

from setdiff_dist.checkpoint.hf_files import (
    DTYPES,
    HFCheckpointError,
    HFFiles,
    read_hf_config,
    write_hf,
)

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}
# per-layer weights that map one to one (our name after "decoder.layers.N." -> HF's after
# "model.layers.N."); Qwen3's per-head QK norms only with model.qk_norm
LAYER_NORMS = {"input_layernorm.weight": "input_layernorm.weight",
               "pre_mlp_layernorm.weight": "post_attention_layernorm.weight"}
QK_NORMS = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}
# tensors some checkpoints carry that hold no weights (recomputed buffers)
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# the ModelConfig keys an HF config determines (everything else is training-time choice)
ARCH_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
             "ffn_hidden_size", "vocab_size", "normalization", "norm_epsilon", "activation",
             "tie_embeddings", "head_dim", "qk_norm", "rotary_base", "rope_scaling",
             "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
             "rope_original_max_positions")


# ----------------------------------------------------------------------------- config


def _rope(hf: dict) -> tuple[dict, str]:
    """The RoPE settings and the key they came from, in either format: ``rope_parameters``
    (transformers 5) or ``rope_theta`` + ``rope_scaling`` (transformers 4, and most published
    checkpoints)."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = dict(hf.get(key) or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope, key


def model_config_from_hf(hf: dict, where: str = "config.json"):
    """The :class:`ModelConfig` of an HF Llama / Qwen3 ``config.json`` (as a dict); raises
    :class:`HFCheckpointError` listing every unsupported setting, each by its key."""
    from setdiff_dist.config import ModelConfig

    arch = hf.get("architectures") or []
    arch = arch[0] if arch else MODEL_TYPES.get(hf.get("model_type", ""), "")
    if arch not in ARCHITECTURES:
        raise HFCheckpointError(
            f"{where}: architectures={hf.get('architectures')!r} (model_type="
            f"{hf.get('model_type')!r}) is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}")
    problems = []
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if not isinstance(hf.get(key), int):
            problems.append(f"{key} is missing or not an integer ({hf.get(key)!r})")
    if problems:
        raise HFCheckpointError(f"{where}: " + "; ".join(problems))
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key}=true: biases are not supported")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true: sliding-window attention is not supported")
    rope, rope_key = _rope(hf)
    kind = rope["rope_type"]
    if kind not in ROPE_TYPES:
        problems.append(f"{rope_key}.rope_type={kind!r} is not supported (supported: "
                        f"{', '.join(ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("partial_rotary_factor != 1: only full rotary embeddings are supported")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if problems:
        raise HFCheckpointError(f"{where}: " + "; ".join(problems))
    m = ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        normalization="rmsnorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        activation="swiglu", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_dim=head_dim, qk_norm=ARCHITECTURES[arch] == "qwen3",
        rotary_base=float(rope["rope_theta"]), rope_scaling=ROPE_TYPES.get(kind, "none"),
        attention_backend="sdpa")  # (a causal LM: see config.resolve_attention_backend)
    if kind in ("linear", "llama3"):
        m.rope_scaling_factor = float(rope.get("factor", 1.0))
    if kind == "llama3":
        m.rope_low_freq_factor = float(rope.get("low_freq_factor", 1.0))
        m.rope_high_freq_factor = float(rope.get("high_freq_factor", 4.0))
        m.rope_original_max_positions = int(rope.get("original_max_position_embeddings")
                                            or hf.get("max_position_embeddings", 8192))
    return m


def check_tensor_parallel(hf: dict, tensor: int, where: str = "config.json") -> None:
    """Every TP-split dimension of the checkpoint must divide by the tensor-parallel size."""
    problems = [f"{key}={hf.get(key)} is not divisible by the tensor-parallel size {tensor}"
                for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
                if isinstance(hf.get(key), int) and hf[key] % tensor]
    if problems:
        raise HFCheckpointError(f"{where}: " + "; ".join(problems))


def architecture_differences(model_cfg, hf_model_cfg) -> list[str]:
    """``model.KEY: config A, checkpoint B`` for every architecture key that differs."""
    out = []
    for key in ARCH_KEYS:
        mine, theirs = getattr(model_cfg, key), getattr(hf_model_cfg, key)
        used = {"rope_scaling_factor": ("linear", "llama3"), "rope_low_freq_factor": ("llama3",),
                "rope_high_freq_factor": ("llama3",), "rope_original_max_positions": ("llama3",)}
        if key in used and hf_model_cfg.rope_scaling == model_cfg.rope_scaling and \
                model_cfg.rope_scaling not in used[key]:
            continue  # a parameter of another RoPE scaling does not matter
        if mine != theirs:
            out.append(f"model.{key}={mine!r}, but the checkpoint has {theirs!r}")
    return out


def model_yaml(model_cfg) -> str:
    """The ``model:`` section for a config file (``setdiff-convert --from-hf --print-config``)."""
    import yaml

    return yaml.safe_dump({"model": {k: getattr(model_cfg, k) for k in ARCH_KEYS}},
                          sort_keys=False)


# ----------------------------------------------------------------------------- reading

class HFCheckpoint(HFFiles):
    """A local HF checkpoint: its config and lazily opened safetensors files (the files
    themselves are :class:`setdiff_dist.checkpoint.hf_files.HFFiles`).

    Opening checks everything that can be checked from the headers alone, before any weight is
    read: a supported architecture, every shard the index names, every tensor the config implies
    with the shape it implies, and no unknown tensors."""

    def __init__(self, directory: str, tensor_parallel: int = 1):
        self.hf = read_hf_config(directory)
        cfg_path = os.path.join(directory, "config.json")
        self.model_cfg = model_config_from_hf(self.hf, cfg_path)
        check_tensor_parallel(self.hf, tensor_parallel, cfg_path)
        super().__init__(directory)
        self._check()


    # -- what the config implies ---------------------------------------------------------------
    def expected_shapes(self) -> dict[str, list[int]]:
        m = self.model_cfg
        h, d, f, V = m.hidden_size, m.head_dim, m.ffn_hidden_size, m.vocab_size
        H, G = m.num_attention_heads, m.num_query_groups
        shapes = {"model.embed_tokens.weight": [V, h], "model.norm.weight": [h]}
        if not m.tie_embeddings:
            shapes["lm_head.weight"] = [V, h]
        for i in range(m.num_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_proj.weight": [H * d, h],
                p + "self_attn.k_proj.weight": [G * d, h],
                p + "self_attn.v_proj.weight": [G * d, h],
                p + "self_attn.o_proj.weight": [h, H * d],
                p + "mlp.gate_proj.weight": [f, h], p + "mlp.up_proj.weight": [f, h],
                p + "mlp.down_proj.weight": [h, f]})
            if m.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = [d]
                shapes[p + "self_attn.k_norm.weight"] = [d]
        return shapes

    def _check(self) -> None:
        m = self.model_cfg
        expected = self.expected_shapes()
        for name, want in expected.items():
            if name not in self.file_of:
                raise HFCheckpointError(f"tensor {name} is missing from {self.directory} "
                                        f"(config.json implies it, with shape {want})")
            got = list(self.slice(name).get_shape())
            if got != want:
                raise HFCheckpointError(
                    f"tensor {name} in {self.file_of[name]} has shape {got}, but config.json "
                    f"implies {want} (hidden_size={m.hidden_size}, num_attention_heads="
                    f"{m.num_attention_heads}, num_key_value_heads={m.num_query_groups}, "
                    f"head_dim={m.head_dim}, intermediate_size={m.ffn_hidden_size}, "
                    f"vocab_size={m.vocab_size})")
            self.dtype(name)
        # a tied checkpoint may still carry lm_head.weight (a copy); it is not used
        allowed = set(expected) | ({"lm_head.weight"} if m.tie_embeddings else set())
        unknown = sorted(n for n in self.file_of if n not in allowed and not IGNORED.fullmatch(n))
        if unknown:
            raise HFCheckpointError(f"{self.directory} has tensors a {self.architecture} of this "
                                    f"config.json does not: {', '.join(unknown[:5])}"
                                    + (" ..." if len(unknown) > 5 else ""))

    @property
    def architecture(self) -> str:
        return "Qwen3ForCausalLM" if self.model_cfg.qk_norm else "LlamaForCausalLM"

    # -- building our tensors ------------------------------------------------------------------
    def mask_embedding(self) -> torch.Tensor:
        """The ``[MASK]`` input embedding: the mean of the pretrained embedding rows.

        The mean is the least-informative point of the embedding distribution, so a [MASK]
        token starts as "some token" of typical scale and direction: the pretrained layers see
        in-distribution activations at masked positions from the first fine-tuning step, and
        the row is deterministic and the same for every layout. It is summed in float64 over
        chunks of rows, so the rank that holds it never holds the whole table."""
        sl = self.slice("model.embed_tokens.weight")
        V = self.model_cfg.vocab_size
        total = torch.zeros(self.model_cfg.hidden_size, dtype=torch.float64)
        for start in range(0, V, 8192):
            total += sl[start:min(start + 8192, V)].to(torch.float64).sum(0)
        return (total / V).to(self.dtype("model.embed_tokens.weight"))

    def vocab_rows(self, gname: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of our vocabulary table ``gname`` (embedding or untied
        output layer): the pretrained rows, then ``[MASK]`` (row ``V``: the mean embedding in the
        embedding; zero in an untied output layer, whose [MASK] logit is never used), then
        zero padding."""
        V, h = self.model_cfg.vocab_size, self.model_cfg.hidden_size
        source = "model.embed_tokens.weight" if gname == "embedding.weight" else "lm_head.weight"
        dtype = self.dtype(source)
        out = torch.zeros(stop - start, h, dtype=dtype)
        if start < V:
            out[:min(stop, V) - start] = self.slice(source)[start:min(stop, V)]
        if start <= V < stop and gname == "embedding.weight":
            out[V - start] = self.mask_embedding()
        return out

    def tensor(self, gname: str, rank: int = 0, size: int = 1, rows: Optional[int] = None):
        """Tensor-parallel rank ``rank`` of ``size``'s part of our global tensor ``gname``,
        read from the files without reading the other ranks' parts. ``rows`` is the local row
        count of a vocabulary table (its padding depends on the layout)."""
        m = self.model_cfg
        if gname in ("embedding.weight", "output_layer.weight"):
            n = rows if rows is not None else m.vocab_size + 1
            return self.vocab_rows(gname, rank * n, (rank + 1) * n)
        if gname == "decoder.final_layernorm.weight":
            return self.slice("model.norm.weight")[:]
        match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", gname)
        if not match:
            raise HFCheckpointError(f"no Hugging Face tensor corresponds to {gname}")
        p, rest = f"model.layers.{match.group(1)}.", match.group(2)
        norms = {**LAYER_NORMS, **QK_NORMS}
        if rest in norms:
            return self.slice(p + norms[rest])[:]
        d, H, G, f = m.head_dim, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size
        if rest == "self_attention.linear_qkv.weight":
            # megatron's rows: per key/value group g, [q of g's heads ; k_g ; v_g]; TP ranks
            # hold whole groups
            per, groups = H // G, G // size
            q, k, v = (self.slice(p + f"self_attn.{x}_proj.weight") for x in "qkv")
            parts = []
            for g in range(rank * groups, (rank + 1) * groups):
                parts += [q[g * per * d:(g + 1) * per * d], k[g * d:(g + 1) * d],
                          v[g * d:(g + 1) * d]]
            return torch.cat(parts)
        if rest == "self_attention.linear_proj.weight":
            n = H * d // size
            return self.slice(p + "self_attn.o_proj.weight")[:, rank * n:(rank + 1) * n]
        if rest == "mlp.linear_fc1.weight":  # [gate ; up], each split over the ranks
            n = f // size
            return torch.cat([self.slice(p + f"mlp.{x}_proj.weight")[rank * n:(rank + 1) * n]
                              for x in ("gate", "up")])
        if rest == "mlp.linear_fc2.weight":
            n = f // size
            return self.slice(p + "mlp.down_proj.weight")[:, rank * n:(rank + 1) * n]
        raise HFCheckpointError(f"no Hugging Face tensor corresponds to {gname}")


def global_names(model_cfg) -> list[str]:
    """Every global parameter name of a whole model of ``model_cfg`` (no tied copy)."""
    names = ["embedding.weight"]
    for i in range(model_cfg.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight",
                  p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight",
                  p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
        if model_cfg.qk_norm:
            names += [p + "self_attention.q_layernorm.weight",
                      p + "self_attention.k_layernorm.weight"]
    names.append("decoder.final_layernorm.weight")
    if not model_cfg.tie_embeddings:
        names.append("output_layer.weight")
    return names


def read_hf_state(directory: str):
    """``(full tensors by global name, ModelConfig, HFCheckpoint)`` of a whole HF checkpoint, in
    its dtype, vocabulary tables with their ``V + 1`` real rows (as an export holds them). Holds
    the whole model: for conversion; training and inference load per rank (:func:`load_hf_into`)."""
    ckpt = HFCheckpoint(directory)
    return {n: ckpt.tensor(n) for n in global_names(ckpt.model_cfg)}, ckpt.model_cfg, ckpt


def load_hf_into(model, directory: str) -> HFCheckpoint:
    """Fill ``model`` (one pipeline stage, one TP rank's shards) from an HF checkpoint, reading
    only this rank's slices of this stage's tensors. The model's architecture must be the
    checkpoint's; the differences are listed otherwise."""
    from megatron.core import parallel_state as ps

    from setdiff_dist.model.transformer import global_name

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ckpt = HFCheckpoint(directory, tensor_parallel=tp)
    diffs = architecture_differences(model.model_cfg, ckpt.model_cfg)
    if diffs:
        raise HFCheckpointError(f"the model config does not describe {directory}:\n  - "
                                + "\n  - ".join(diffs) + "\n(setdiff-convert --from-hf "
                                f"{directory} --print-config prints the model section)")
    with torch.no_grad():
        for name, p in model.named_parameters():
            gname = global_name(model, name)
            sharded = getattr(p, "tensor_model_parallel", False)
            local = ckpt.tensor(gname, rank if sharded else 0, tp if sharded else 1,
                                rows=p.shape[0] if p.dim() == 2 else None)
            if local.shape != p.shape:
                raise HFCheckpointError(f"{gname}: built {tuple(local.shape)} from {directory}, "
                                        f"the model's shard is {tuple(p.shape)}")
            p.copy_(local.to(p.dtype))
    return ckpt


def build_model_from_hf(model_cfg, config, directory: str):
    """This rank's pipeline stage of ``model_cfg``, with the weights of an HF checkpoint."""
    from megatron.core import parallel_state as ps

    from setdiff_dist.model.transformer import SetDiffusionTransformer

    model = SetDiffusionTransformer(model_cfg, config, pre_process=ps.is_pipeline_first_stage(),
                                    post_process=ps.is_pipeline_last_stage())
    load_hf_into(model, directory)
    return model


# ----------------------------------------------------------------------------- export

def hf_tensors(state: dict, model_cfg) -> dict[str, torch.Tensor]:
    """Full tensors by our global names -> HF names and layout ([MASK] and padding dropped)."""
    m = model_cfg
    V, d, H, G, f = m.vocab_size, m.head_dim, m.num_attention_heads, m.num_query_groups, \
        m.ffn_hidden_size
    out = {"model.embed_tokens.weight": state["embedding.weight"][:V],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    if not m.tie_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"][:V]
    for i in range(m.num_layers):
        s, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = state[s + "self_attention.linear_qkv.weight"].view(G, H // G + 2, d, -1)
        fc1 = state[s + "mlp.linear_fc1.weight"]
        norms = {**LAYER_NORMS, **(QK_NORMS if m.qk_norm else {})}
        out.update({p + hf: state[s + ours] for ours, hf in norms.items()})
        out.update({
            p + "self_attn.q_proj.weight": qkv[:, :H // G].reshape(H * d, -1),
            p + "self_attn.k_proj.weight": qkv[:, H // G].reshape(G * d, -1),
            p + "self_attn.v_proj.weight": qkv[:, H // G + 1].reshape(G * d, -1),
            p + "self_attn.o_proj.weight": state[s + "self_attention.linear_proj.weight"],
            p + "mlp.gate_proj.weight": fc1[:f], p + "mlp.up_proj.weight": fc1[f:],
            p + "mlp.down_proj.weight": state[s + "mlp.linear_fc2.weight"]})
    return out


def hf_config(model_cfg, template: Optional[dict] = None, dtype: str = "float32",
              max_positions: int = 4096, eos_id: Optional[int] = None) -> dict:
    """The ``config.json`` of ``model_cfg``: the template (the imported checkpoint's config) with
    the architecture fields set from ``model_cfg``, or a fresh one in transformers 4's keys
    (``rope_theta`` / ``rope_scaling``, which transformers 5 reads too)."""
    m = model_cfg
    if m.normalization != "rmsnorm" or m.activation != "swiglu":
        raise HFCheckpointError(f"model.normalization={m.normalization}, model.activation="
                                f"{m.activation}: only rmsnorm + swiglu models have a Llama / "
                                "Qwen3 equivalent")
    arch = "Qwen3ForCausalLM" if m.qk_norm else "LlamaForCausalLM"
    out = dict(template or {})
    if (out.get("architectures") or [arch])[0] != arch:
        out = {}  # the template is of another architecture: start afresh
    out.update({"architectures": [arch], "model_type": ARCHITECTURES[arch],
                "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
                "intermediate_size": m.ffn_hidden_size,
                "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
                "num_key_value_heads": m.num_query_groups,
                "head_dim": m.head_dim,
                "hidden_act": "silu", "rms_norm_eps": m.norm_epsilon,
                "tie_word_embeddings": m.tie_embeddings, "attention_bias": False})
    out.setdefault("max_position_embeddings", max_positions)
    if eos_id is not None and template is None:
        out["eos_token_id"] = eos_id
    rope: dict = {"rope_type": {"none": "default"}.get(m.rope_scaling, m.rope_scaling)}
    if m.rope_scaling in ("linear", "llama3"):
        rope["factor"] = m.rope_scaling_factor
    if m.rope_scaling == "llama3":
        rope.update(low_freq_factor=m.rope_low_freq_factor,
                    high_freq_factor=m.rope_high_freq_factor,
                    original_max_position_embeddings=m.rope_original_max_positions)
    if "rope_parameters" in out:
        out["rope_parameters"] = dict(rope, rope_theta=m.rotary_base)
        out.pop("rope_scaling", None)
    else:
        out["rope_theta"] = m.rotary_base
        out["rope_scaling"] = None if m.rope_scaling == "none" else rope
    if "torch_dtype" in out:
        out["torch_dtype"] = dtype
    else:
        out["dtype"] = dtype
    return out


def template_dtype(template: Optional[dict]) -> str:
    dtype = (template or {}).get("dtype") or (template or {}).get("torch_dtype") or "float32"
    return dtype if dtype in DTYPES else "float32"


def export_hf(path: str, out: str, dtype: Optional[str] = None,
              template_dir: Optional[str] = None, max_shard_bytes: int = 5 * 2**30,
              raw: bool = False, as_causal_lm: bool = False) -> dict:
    """``setdiff-convert --to-hf``: a setdiff checkpoint or export (any layout) as an HF
    Llama / Qwen3 checkpoint directory, with the tokenizer. The config starts from the source
    checkpoint's ``config.json`` when one is known (``template_dir``, the ``hf_config.json`` of
    an imported export, or ``checkpoint.init_from_hf`` of the run), so fields we do not model
    (token ids, ``max_position_embeddings``, ...) survive the round trip; ``dtype`` defaults to
    the template's (else float32).

    An HF causal LM runs the weights left to right under a causal mask: what a model trained
    as a causal LM (``order.kind=causal``) is, and a set-diffusion model is not (its scores
    and generations there are another model's). Such a checkpoint is refused unless
    ``as_causal_lm``, and its ``config.json`` then says what the weights were trained as."""
    from setdiff_dist.checkpoint.weights import read_full_state_dict
    from setdiff_dist.diffusion.kinds import order_of

    state, cfg, tok, src = read_full_state_dict(path, raw=raw)  # (the EMA, if kept)
    trained_as = None
    if not order_of(cfg.order).causal_lm:
        trained_as = (f"set diffusion, order.kind={cfg.order.kind}: exported as a causal LM on "
                      "request (setdiff-convert --as-causal-lm); a causal LM's scores and "
                      "generations are not this model's")
        if not as_causal_lm:
            raise HFCheckpointError(
                f"{path} is a set-diffusion model (order.kind={cfg.order.kind}), not a causal "
                "LM: a Hugging Face causal LM would run its weights left to right under a "
                "causal mask, and score and generate as another model (lm-eval's hf on such "
                "an export disagrees with the model itself). Evaluate it as it is with "
                "setdiff-eval or setdiff-lm-eval; to export the weights as a causal LM anyway, "
                "add --as-causal-lm")
    template = None
    candidates = [os.path.join(template_dir, "config.json")] if template_dir else [
        os.path.join(src, "hf_config.json"),
        os.path.join(cfg.checkpoint.init_from_hf, "config.json")
        if cfg.checkpoint.init_from_hf else ""]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate):
            with open(candidate, encoding="utf-8") as fh:
                template = json.load(fh)
            break
    if template_dir and template is None:
        raise HFCheckpointError(f"--hf-config {template_dir}: config.json is missing")
    dtype = dtype or template_dtype(template)
    config = hf_config(cfg.model, template, dtype, max_positions=cfg.data.seq_len,
                       eos_id=tok.eos_id)
    if trained_as:
        config["setdiff_trained_as"] = trained_as
    files = write_hf(hf_tensors(state, cfg.model), config, out, dtype, max_shard_bytes,
                     tokenizer=tok)
    return {"source": os.path.abspath(src), "architecture": config["architectures"][0],
            "dtype": dtype, "files": files, "trained_as": trained_as,
            "parameters": int(sum(v.numel() for v in state.values()))}


def import_hf(directory: str, out: str, tokenizer: Optional[str] = None) -> dict:
    """``setdiff-convert --from-hf``: an HF checkpoint as a setdiff export (``model.safetensors``
    of full tensors with the [MASK] row, ``config.yaml`` in causal mode, the tokenizer, and the
    original ``config.json`` as ``hf_config.json`` for the way back). ``setdiff-generate`` and
    ``setdiff-eval`` read it directly; training starts from the HF directory itself
    (``checkpoint.init_from_hf``), sharded per rank."""
    from setdiff_dist.checkpoint.weights import check_new_directory, write_export
    from setdiff_dist.config import Config
    from setdiff_dist.data.tokenizers import TokenizerError, load_tokenizer

    state, model_cfg, ckpt = read_hf_state(directory)
    spec = tokenizer or f"hf:{directory}"
    try:
        tok = load_tokenizer(spec)
    except TokenizerError as exc:
        raise HFCheckpointError(f"{exc}; name another tokenizer with --tokenizer") from None
    if tok.vocab_size > model_cfg.vocab_size:
        raise HFCheckpointError(f"the tokenizer has {tok.vocab_size} tokens, more than "
                                f"vocab_size={model_cfg.vocab_size} of {directory}/config.json")
    check_new_directory(out)
    cfg = Config(model=model_cfg)
    cfg.order.kind = "causal"  # what the weights are until fine-tuned: decode them as an LM
    cfg.data.seq_len = min(int(ckpt.hf.get("max_position_embeddings") or 4096), 4096)
    return write_export(out, state, cfg, tok, directory,
                        extra_meta={"imported_from": ckpt.architecture},
                        extra_files={"hf_config.json": ckpt.hf})

