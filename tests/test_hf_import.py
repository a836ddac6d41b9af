"""Hugging Face Llama / Qwen3 checkpoints: import, export, and a set-diffusion fine-tune.

Tiny random models are made with ``transformers`` (config, random init, ``save_pretrained``): a
Llama with untied embeddings, llama3 RoPE scaling and a sharded checkpoint, and a Qwen3 with tied
embeddings, per-head QK norm and ``head_dim`` != hidden / heads. transformers is the reference
implementation: in causal mode our model must give its logits, at TP=1 and TP=2.
"""

import json
import os
import shutil
import subprocess

import pytest
import torch
from helpers import run_cli, train_command
from mp_harness import spawn

V, L = 300, 24
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def gsm_records(n=24):
    """Short GSM-style problems (the prompt is the context of the fine-tune)."""
    out = []
    for i in range(n):
        a, b = 2 + i % 7, 3 + (i * 5) % 11
        out.append({"prompt": f"Question: Tom has {a} apples and buys {b} more. How many?\n"
                              "Answer: ", "completion": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return out


def _randomize(model):
    """Weights far from the init (norm weights too), so that a swapped tensor shows."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if p.dim() == 1 else
                    0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Two tiny HF checkpoints with a tokenizer each, and transformers' logits on ``x``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from setdiff_dist.data import sample_text
    from setdiff_dist.data.tokenizers import train_bpe

    tmp = tmp_path_factory.mktemp("hf")
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
    models = {
        "llama": _randomize(LlamaForCausalLM(LlamaConfig(
            **common, head_dim=16, rope_parameters=dict(LLAMA3_ROPE), max_position_embeddings=256,
            tie_word_embeddings=False, eos_token_id=V - 1))),
        "qwen3": _randomize(Qwen3ForCausalLM(Qwen3Config(
            **common, head_dim=32, rope_theta=1e6, tie_word_embeddings=True,
            max_position_embeddings=256))),
    }
    texts = [r["prompt"] + r["completion"] for r in gsm_records()] + [sample_text()]
    dirs = {}
    for name, model in models.items():
        d = tmp / name
        # the llama one is sharded (an index and several files), the qwen3 one is not
        model.save_pretrained(d, max_shard_size="40KB" if name == "llama" else "1GB")
        tok = train_bpe(texts, V - 1 if name == "llama" else V).tok
        if name == "llama":  # Llama 3's end-of-text token is not <|endoftext|>
            tok.add_special_tokens(["<|end_of_text|>"])
            (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
        assert tok.get_vocab_size() == V
        tok.save(str(d / "tokenizer.json"))
        dirs[name] = d
    assert len(list(dirs["llama"].glob("model-*.safetensors"))) > 2
    x = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = {name: m(x).logits for name, m in models.items()}
    return {"dirs": dirs, "x": x, "logits": logits, "tmp": tmp}


@pytest.fixture(scope="module")
def finetuned(hf):
    """A short set-diffusion fine-tune of the imported Qwen3 at TP=2 through setdiff-train, on
    GSM-style data tokenized with the model's own tokenizer (prompt as context)."""
    from data_prep.prep import prepare
    from setdiff_dist.model.hf import ARCH_KEYS, HFCheckpoint

    tmp, qwen = hf["tmp"], hf["dirs"]["qwen3"]
    src = tmp / "gsm.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in gsm_records()))
    shards = tmp / "gsm-shards"
    prepare([str(src)], f"hf:{qwen}", 64, str(shards), mode="padded", prompt_field="prompt",
            text_field="completion", valid_every=4, workers=1, progress=False)
    imported = HFCheckpoint(str(qwen)).model_cfg
    model_keys = [f"model.{k}={getattr(imported, k)}" for k in ARCH_KEYS]
    cmd = train_command(tmp / "run", shards, *model_keys, f"checkpoint.init_from_hf={qwen}",
                        "parallel.tensor=2", "zero.stage=1", nproc=2, steps=3, seq_len=64,
                        vocab=V, global_batch=4, micro_batch=2)
    cmd[cmd.index("configs/tiny-cpu.yaml")] = "configs/finetune/tiny-hf-gsm.yaml"
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return {"run": tmp / "run", "stdout": res.stdout, "cmd": cmd}


@pytest.fixture(scope="module")
def measured(hf, finetuned, tmp_path_factory):
    out = tmp_path_factory.mktemp("measured")
    spawn(_measure, 2, {k: str(v) for k, v in hf["dirs"].items()}, hf["x"],
          str(finetuned["run"]), out)
    return {"tp": {tp: torch.load(out / f"tp{tp}.pt") for tp in (1, 2)},
            "pp": [torch.load(out / f"pp{r}.pt") for r in (0, 1)]}


def _full_logits(logits):
    """Vocab-parallel [s, b, V_pad / TP] -> [b, s, V]."""
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, logits.contiguous(),
                                 group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :V].transpose(0, 1)


def _measure(rank, dirs, x, run, out):
    """At TP=1 and TP=2: causal logits of each import and of the fine-tuned checkpoint; at PP=2:
    each stage's imported weights against the full tensors."""
    from setdiff_dist.checkpoint.weights import VOCAB_ROWS
    from setdiff_dist.inference.weights import build_inference_model
    from setdiff_dist.model.hf import HFCheckpoint, build_model_from_hf, read_hf_state
    from setdiff_dist.model.transformer import global_name, transformer_config
    from setdiff_dist.parallel import initialize_model_parallel

    positions = torch.arange(L).expand(x.shape[0], L)
    for tp in (1, 2):
        initialize_model_parallel(tensor=tp, seed=0)
        res = {}
        with torch.no_grad():
            for name, d in dirs.items():
                mc = HFCheckpoint(d).model_cfg
                model = build_model_from_hf(mc, transformer_config(mc, tensor=tp), d).eval()
                res[name] = _full_logits(model(x, positions, None))
            model, cfg, _ = build_inference_model(run, tensor=tp)
            res["finetuned"] = _full_logits(model(x, positions, None))
        if rank == 0:
            torch.save(res, out / f"tp{tp}.pt")
    initialize_model_parallel(tensor=1, pipeline=2, seed=0)
    res = {}
    for name, d in dirs.items():
        state, mc, _ = read_hf_state(d)
        model = build_model_from_hf(mc, transformer_config(mc, pipeline=2), d)
        for n, p in model.named_parameters():
            g = global_name(model, n)
            local = p.detach()
            if g in VOCAB_ROWS:  # the padding rows are zero
                res[f"{name}:{g}:padding"] = float(local[V + 1:].abs().max())
                local = local[:V + 1]
            res[f"{name}:{g}"] = float((local - state[g].float()).abs().max())
    torch.save(res, out / f"pp{rank}.pt")


# ----------------------------------------------------------------------------- tests

@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_causal_logits_equal_transformers_at_tp1_and_tp2(hf, measured, arch):
    ref = hf["logits"][arch]
    for tp in (1, 2):
        ours = measured["tp"][tp][arch]
        diff = float((ours - ref).abs().max())
        print(f"{arch} TP={tp}: max |logit diff| vs transformers = {diff:.2e}")
        assert ours.shape == ref.shape and diff < 1e-4, (arch, tp, diff)
    assert float(ref.abs().max()) > 1.0  # logits far from uniform: a swapped tensor would show


def test_rope_scaling_and_head_dim_are_imported(hf):
    from setdiff_dist.model.dims import rotary_inv_freq
    from setdiff_dist.model.hf import HFCheckpoint

    llama = HFCheckpoint(str(hf["dirs"]["llama"])).model_cfg
    assert (llama.rope_scaling, llama.rope_scaling_factor, llama.rope_original_max_positions,
            llama.rotary_base, llama.tie_embeddings) == ("llama3", 8.0, 16, 50000.0, False)
    qwen = HFCheckpoint(str(hf["dirs"]["qwen3"])).model_cfg
    assert (qwen.head_dim, qwen.qk_norm, qwen.tie_embeddings, qwen.num_query_groups) == \
        (32, True, True, 2)
    # the scaling changes the frequencies the imported model sees (inside the tested context)
    plain = rotary_inv_freq(type(llama)(**dict(vars(llama), rope_scaling="none")), 16)
    assert not torch.allclose(rotary_inv_freq(llama, 16), plain)


@pytest.mark.multiprocess
def test_pipeline_stages_load_their_own_layers(measured):
    first, last = measured["pp"]
    assert all(v == 0.0 for v in {**first, **last}.values()), {**first, **last}
    assert "llama:decoder.layers.0.mlp.linear_fc1.weight" in first
    assert "llama:decoder.layers.1.mlp.linear_fc1.weight" in last
    assert "llama:decoder.layers.1.mlp.linear_fc1.weight" not in first
    # a tied embedding is loaded on both ends of the pipeline; an untied head only on the last
    assert "qwen3:embedding.weight" in first and "qwen3:embedding.weight" in last
    assert "llama:output_layer.weight" in last and "llama:output_layer.weight" not in first


def _tensors(directory):
    from safetensors import safe_open

    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(directory, f), "pt") as fh:
                out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def test_import_then_export_is_bit_identical_and_loads_in_transformers(hf, tmp_path):
    from transformers import AutoModelForCausalLM

    from setdiff_dist.model.hf import export_hf, import_hf

    for name, d in hf["dirs"].items():
        imported, back = tmp_path / f"{name}-setdiff", tmp_path / f"{name}-hf"
        meta = import_hf(str(d), str(imported))
        assert meta["tokenizer"]["vocab_size"] == V
        export_hf(str(imported), str(back))
        original, exported = _tensors(d), _tensors(back)
        assert sorted(original) == sorted(exported)
        for k, t in original.items():
            assert exported[k].dtype == t.dtype and torch.equal(exported[k], t), k
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(back).eval()(hf["x"]).logits
        assert torch.equal(logits, hf["logits"][name])
    # without the source config.json (a fresh config, transformers 4 RoPE keys) it loads too
    os.remove(tmp_path / "llama-setdiff" / "hf_config.json")
    export_hf(str(tmp_path / "llama-setdiff"), str(tmp_path / "fresh"))
    config = json.loads((tmp_path / "fresh" / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and "rope_parameters" not in config
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tmp_path / "fresh").eval()(hf["x"]).logits
    assert float((logits - hf["logits"]["llama"]).abs().max()) < 1e-5


def test_mask_row_is_the_mean_embedding_and_the_tokenizer_is_the_models(hf):
    from setdiff_dist.data.tokenizers import load_shipped_tokenizer, load_tokenizer
    from setdiff_dist.model.hf import read_hf_state

    state, mc, _ = read_hf_state(str(hf["dirs"]["llama"]))
    emb = state["embedding.weight"]
    assert emb.shape == (V + 1, 64) and mc.vocab_size == V
    assert torch.allclose(emb[V], emb[:V].double().mean(0).float(), atol=1e-7)
    assert not state["output_layer.weight"][V].any()  # never predicted
    # hf:DIR takes the end-of-text token from tokenizer_config.json, and keeps it when shipped
    tok = load_tokenizer(f"hf:{hf['dirs']['llama']}")
    ident = dict(tok.identity(), file="tokenizer.json")
    assert ident["eos_token"] == "<|end_of_text|>" and tok.eos_id == V - 1
    assert load_shipped_tokenizer(str(hf["dirs"]["llama"]), ident).eos_id == V - 1
    assert "eos_token" not in load_tokenizer(f"hf:{hf['dirs']['qwen3']}").identity()


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_bad_checkpoints_are_clear_errors(hf, tmp_path):
    from setdiff_dist.model.hf import HFCheckpoint, HFCheckpointError

    def copy(name, dest):
        shutil.copytree(hf["dirs"][name], tmp_path / dest)
        return tmp_path / dest

    def error(directory, **kw):
        with pytest.raises(HFCheckpointError) as exc:
            HFCheckpoint(str(directory), **kw)
        return str(exc.value)

    arch = copy("qwen3", "mistral")
    _edit_config(arch, architectures=["MistralForCausalLM"], model_type="mistral")
    assert "architectures=['MistralForCausalLM']" in error(arch) and "not supported" in error(arch)
    yarn = copy("llama", "yarn")
    _edit_config(yarn, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    assert "rope_parameters.rope_type='yarn' is not supported" in error(yarn)
    shard = copy("llama", "missing-shard")
    os.remove(next(shard.glob("model-00002-of-*.safetensors")))
    msg = error(shard)
    assert "shard model-00002-of-" in msg and "is missing" in msg and "model.layers." in msg
    shape = copy("qwen3", "shape")
    _edit_config(shape, intermediate_size=128)
    msg = error(shape)
    assert "tensor model.layers.0.mlp.gate_proj.weight in model.safetensors has shape [96, 64], " \
        "but config.json implies [128, 64]" in msg
    msg = error(hf["dirs"]["llama"], tensor_parallel=4)
    assert "num_key_value_heads=2 is not divisible by the tensor-parallel size 4" in msg
    # the command line names the problem and exits 2
    res = run_cli("setdiff_dist.cli.convert", "--from-hf", shape, "--out", tmp_path / "x")
    assert res.returncode == 2 and "mlp.gate_proj.weight" in res.stderr
    assert not (tmp_path / "x").exists()


def test_a_model_config_that_is_not_the_checkpoints_is_refused(hf):
    from setdiff_dist.config import load_config
    from setdiff_dist.model.hf import HFCheckpoint, architecture_differences

    imported = HFCheckpoint(str(hf["dirs"]["qwen3"])).model_cfg
    tiny = load_config("configs/tiny-cpu.yaml", [f"model.vocab_size={V}"]).model
    diffs = architecture_differences(tiny, imported)
    assert "model.head_dim=16, but the checkpoint has 32" in diffs
    assert "model.qk_norm=False, but the checkpoint has True" in diffs
    assert architecture_differences(imported, imported) == []


@pytest.mark.multiprocess
def test_set_diffusion_finetune_from_an_import_checkpoints_and_decodes(hf, finetuned, measured,
                                                                       tmp_path):
    from transformers import AutoModelForCausalLM

    from setdiff_dist.model.hf import HFCheckpointError, export_hf

    run = finetuned["run"]
    assert "initialized from the Hugging Face checkpoint" in finetuned["stdout"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 3 and all(0 < v < 20 for v in losses)
    assert (run / "checkpoints" / "step_0000003" / "manifest.json").is_file()
    # the set decoder (KV cache, window, threshold) decodes the fine-tuned checkpoint
    res = run_cli("setdiff_dist.cli.generate", "--checkpoint", run, "--prompt",
                  "Question: Tom has 3 apples", "--max-new-tokens", "8", "--window", "4",
                  "--threshold", "0.5", "--greedy", "--json", "--no-eos-stop")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["mode"] == "set" and len(out["tokens"][0]) == 8
    # the fine-tuned weights exported to HF give our causal logits in transformers
    # (a set-diffusion fine-tune: exported as a causal LM on request, and said so)
    with pytest.raises(HFCheckpointError, match="is a set-diffusion model"):
        export_hf(str(run), str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()
    meta = export_hf(str(run), str(tmp_path / "hf"), as_causal_lm=True)
    assert "set diffusion" in json.loads((tmp_path / "hf" / "config.json").read_text())[
        "setdiff_trained_as"] and meta["trained_as"]
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(hf["x"]).logits
    assert not torch.equal(theirs, hf["logits"]["qwen3"])  # the fine-tune changed the weights
    for tp in (1, 2):
        diff = float((measured["tp"][tp]["finetuned"] - theirs).abs().max())
        assert diff < 1e-4, (tp, diff)
    # a second run in the same run_dir resumes its checkpoint: the import is not even read
    cmd = finetuned["cmd"] + [f"checkpoint.init_from_hf={tmp_path / 'nowhere'}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "initialized from" not in res.stdout


def _greedy(rank, exports, prompt, n, out):
    """Greedy causal decoding of each imported model on the lean engine at TP=1 and TP=2."""
    from setdiff_dist.inference.decoder import CausalDecoder, Sampling
    from setdiff_dist.inference.weights import build_inference_model

    for tp in (1, 2):
        res = {}
        for name, d in exports.items():
            model, cfg, tok = build_inference_model(d, tensor=tp)
            dec = CausalDecoder(model, tok, context=cfg.data.seq_len)
            res[name] = dec.generate([prompt], n, window=1, sampling=Sampling(greedy=True))[0] \
                .tokens
        if rank == 0:
            torch.save(res, out / f"greedy-tp{tp}.pt")


@pytest.mark.multiprocess
def test_greedy_decoding_of_an_import_equals_transformers_generate(hf, tmp_path):
    """An HF causal model, imported (setdiff-convert --from-hf) and decoded by our KV-cached
    causal decoder on the lean engine, gives exactly transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    from setdiff_dist.model.hf import import_hf

    exports = {}
    for name, d in hf["dirs"].items():
        exports[name] = str(tmp_path / name)
        import_hf(str(d), exports[name])
    prompt, n = hf["x"][0, :6].tolist(), 24
    spawn(_greedy, 2, exports, prompt, n, tmp_path)
    for name, d in hf["dirs"].items():
        model = AutoModelForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        for tp in (1, 2):
            assert torch.load(tmp_path / f"greedy-tp{tp}.pt")[name] == ref, (name, tp)
