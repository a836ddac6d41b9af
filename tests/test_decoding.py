"""KV-cached set decoding on the inference engine (the lean decode-time model, built from the
weights of a megatron training model): exactness against the training model's forward, the AR
and causal baselines against the training model decoding without a cache, batching, infilling,
stop criteria, bad input, and the lean model's logits against megatron's. One launch of 2 gloo
processes measures at TP=1 and TP=2; assertions run in the parent."""

import math

import pytest
import torch
from mp_harness import results_at_tp1_and_tp2, spawn

V, L = 64, 24


class Chars:
    """A tokenizer of letters (for stop strings): id i <-> chr(97 + i % 26)."""

    vocab_size, eos_id = V, 0

    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def model_for(kind, tp, overrides=()):
    """A seeded megatron training model (the reference) at this TP size."""
    from setdiff_dist.config import load_config
    from setdiff_dist.model.transformer import build_model, transformer_config

    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=32",
                             "model.num_attention_heads=4", "model.num_query_groups=2",
                             "model.ffn_hidden_size=64", f"model.vocab_size={V}",
                             "model.init_std=0.3", f"order.kind={kind}",
                             # a dense mask in position order (training_logits)
                             "model.attention_backend=sdpa", *overrides]).model
    return build_model(cfg, transformer_config(cfg, tensor=tp), seed=3).eval()


def lean_copy(model):
    """The lean decode-time model with the megatron model's weights (full tensors by global
    name, as a checkpoint holds them), this rank's TP slices."""
    from megatron.core import parallel_state as ps

    from setdiff_dist.inference import lean as engine
    from setdiff_dist.model.transformer import global_name, unshard

    rows, state = model.vocab_size + 1, {}
    for name, p in model.named_parameters():
        g = global_name(model, name)
        full = unshard(p.detach(), p)
        state[g] = full[:rows] if g in ("embedding.weight", "output_layer.weight") else full
    # every matmul weight through oneDNN's packed kernel, as large ones are in setdiff-generate
    # (the dense path is what the causal-LM tests of test_hf_import decode on)
    engine._PACK_MIN, small = 0, engine._PACK_MIN
    try:
        model = engine.LeanTransformer.from_state_dict(
            model.model_cfg, state, ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group(),
            pack=True).eval()
    finally:
        engine._PACK_MIN = small
    assert model._packed, "oneDNN packed nothing"
    return model


def training_logits(model, tokens, prompt_len, order):
    """The training forward's logits at the noisy positions, for a fixed reveal order."""
    from setdiff_dist.diffusion import set_causal_mask

    n = len(tokens)
    set_ids = torch.empty(n, dtype=torch.long)
    set_ids[:prompt_len] = torch.arange(prompt_len)
    for rank, pos in enumerate(order):
        set_ids[pos] = prompt_len + rank
    x = torch.tensor(tokens)[None]
    noisy = x.clone()
    noisy[0, prompt_len:] = model.mask_id
    inputs = torch.cat([x, noisy], 1)
    positions = torch.arange(n).repeat(2)[None]
    with torch.no_grad():
        logits = model(inputs, positions, set_causal_mask(set_ids[None])[:, None], n)
    return gather(logits)[:, 0]  # [n, V]


def gather(logits):
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, logits.contiguous(),
                                 group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, -1)[..., :V]


def no_cache_greedy(model, prompt, n, causal):
    """Greedy decoding without a cache: one full forward per token over the clean prefix (plus a
    [MASK] query at the next position, for set-diffusion models)."""
    seq = list(prompt)
    for _ in range(n):
        x = torch.tensor(seq + ([] if causal else [model.mask_id]))[None]
        with torch.no_grad():
            logits = gather(model(x, torch.arange(x.shape[1])[None], None))
        seq.append(int(logits[-1, 0].argmax()))
    return seq[len(prompt):]


def measure(tp, out):
    from setdiff_dist.parallel import initialize_model_parallel

    initialize_model_parallel(tensor=tp, seed=0)
    res = measure_decoding(tp)
    # the lean model computes the training model's function: same logits for a set-causal
    # training forward, with GQA, QK-norm, LayerNorm / GELU and an untied head too
    same = {}
    for name, extra in (("default", ()), ("variant", ("model.qk_norm=true",
                                                      "model.normalization=layernorm",
                                                      "model.activation=gelu",
                                                      "model.tie_embeddings=false"))):
        tokens = [5, 9, 2, 7, 1, 3, 8, 6, 4, 0]
        order = [6, 4, 9, 5, 7, 8]
        model = model_for("staggered", tp, extra)
        same[name] = tuple(training_logits(m, tokens, 4, order)
                           for m in (model, lean_copy(model)))
    res["same_logits"] = same
    if torch.distributed.get_rank() == 0:
        torch.save(res, out / f"tp{tp}.pt")


def measure_decoding(tp):
    """Decoding on the lean engine; the references (training forward, decoding without a
    cache) on the megatron model it was built from."""
    from setdiff_dist.inference.decoder import (
        CausalDecoder,
        DecodeError,
        Sampling,
        SetDecoder,
        StopCriteria,
    )

    tok, greedy, res = Chars(), Sampling(greedy=True), {}
    reference = model_for("staggered", tp)
    model = lean_copy(reference)
    dec = SetDecoder(model, tok, context=L, keep_logits=True)
    prompt = [5, 9, 2, 7]
    order = [6, 4, 9, 5, 7, 8]  # a fixed reveal order of the 6 new positions 4..9
    r = dec.generate([prompt], 6, window=1, threshold=math.inf, sampling=greedy,
                     order=[order])[0]
    full = prompt + r.tokens
    ref = training_logits(reference, full, len(prompt), order)
    got = torch.stack([logits for _, logits in sorted(dec._last_logits.items())])
    res["exact"] = (got, ref[len(prompt):])
    # AR: W = 1, tau = inf, greedy == no-cache greedy with [MASK] queries; batched == single
    ar = SetDecoder(model, tok, context=L)
    batch = ar.generate([prompt, [3, 1]], 10, window=1, sampling=greedy)
    res["ar"] = ([b.tokens for b in batch],
                 [no_cache_greedy(reference, p, 10, False) for p in (prompt, [3, 1])])
    res["ar_steps"] = [b.steps for b in batch]
    # parallel decoding: a low threshold commits several tokens per step
    fast = ar.generate([prompt], 12, window=6, threshold=0.0, sampling=greedy)[0]
    res["fast"] = (len(fast.tokens), fast.steps)
    sampled = ar.generate([prompt] * 2, 8, window=4, threshold=0.5,
                          sampling=Sampling(temperature=1.0, top_p=0.9, seed=1,
                                            repetition_penalty=1.3))
    res["sampled"] = [s.tokens for s in sampled]
    # the causal-LM baseline: KV-cached == no-cache greedy
    causal = model_for("causal", tp)
    cdec = CausalDecoder(lean_copy(causal), tok, context=L)
    res["causal"] = (cdec.generate([prompt], 10, window=1, sampling=greedy)[0].tokens,
                     no_cache_greedy(causal, prompt, 10, True))
    # infilling: the right context matters, given tokens stay
    left, right = [1, 2, 3, 4], [9, 9, 8]
    a = ar.infill([left], [right], [5], window=2, sampling=greedy)[0].tokens
    b = ar.infill([left], [[30, 31, 32]], [5], window=2, sampling=greedy)[0].tokens
    res["infill"] = (a, b)
    # stops: end-of-text, a stop string, a repeated run; all shorten the output
    stops = {}
    long = ar.generate([prompt], 16, window=1, sampling=greedy)[0].tokens
    stops["long"] = long
    eos = long[5]
    stops["eos"] = ar.generate([prompt], 16, window=1, sampling=greedy,
                               stop=StopCriteria(eos_id=eos))[0].tokens
    text = tok.decode(long)
    stops["string"] = ar.generate([prompt], 16, window=1, sampling=greedy,
                                  stop=StopCriteria(stop=[text[7:9]]))[0].text
    stops["regex"] = ar.generate([prompt], 16, window=1, sampling=greedy,
                                 stop=StopCriteria(stop=["re:" + text[3] + "."]))[0].text
    stops["text"] = text
    stops["repeat"] = ar.generate([prompt], 16, window=1, sampling=greedy,
                                  stop=StopCriteria(max_repeat_run=1))[0].tokens
    # longer than the model's context (24): the cache is cropped from the left, and it goes on
    res["past_context"] = len(ar.generate([prompt], 30, window=1, sampling=greedy)[0].tokens)
    errors = []
    # with several stop strings, the earliest match in the text wins
    stops["two"] = ar.generate([prompt], 16, window=1, sampling=greedy,
                               stop=StopCriteria(stop=[text[9:11], text[2:4]]))[0].text
    res["stops"] = stops
    for call in (lambda: ar.generate([[]], 4),
                 lambda: ar.generate([list(range(1, 22))], 4, window=4),
                 lambda: ar.infill([left], [right], [3], window=4),
                 lambda: ar.generate([prompt], 0),
                 lambda: cdec.infill([left], [right], [3], window=1)):
        try:
            call()
        except DecodeError as exc:
            errors.append(str(exc))
    res["errors"] = errors
    # a cache that starts tiny grows (and squeezes out cropped slots) without changing a token
    from setdiff_dist.inference import kv_cache

    kv_cache.INITIAL_CAPACITY = 2
    try:
        res["tiny_cache"] = (
            [b.tokens for b in ar.generate([prompt, [3, 1]], 10, window=1, sampling=greedy)],
            ar.generate([prompt], 30, window=1, sampling=greedy)[0].tokens,
            ar.infill([left], [right], [5], window=2, sampling=greedy)[0].tokens,
            ar.generate([prompt], 12, window=6, threshold=0.0, sampling=greedy)[0].tokens)
    finally:
        kv_cache.INITIAL_CAPACITY = 64
    res["default_cache"] = (
        res["ar"][0], ar.generate([prompt], 30, window=1, sampling=greedy)[0].tokens, a,
        ar.generate([prompt], 12, window=6, threshold=0.0, sampling=greedy)[0].tokens)
    return res


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return results_at_tp1_and_tp2(measure, tmp_path_factory.mktemp("decode"))


@pytest.mark.parametrize("tp", [1, 2])
def test_the_lean_model_computes_the_training_models_logits(measured, tp):
    assert measured[tp]["same_logits"]  # (nothing measured would pass vacuously)
    for name, (megatron, lean) in measured[tp]["same_logits"].items():
        assert torch.allclose(lean, megatron, atol=2e-5), (name, (lean - megatron).abs().max())


@pytest.mark.parametrize("tp", [1, 2])
def test_cached_decoding_logits_equal_the_training_forward(measured, tp):
    got, ref = measured[tp]["exact"]
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


@pytest.mark.parametrize("tp", [1, 2])
def test_ar_mode_equals_decoding_without_a_cache_and_batching_changes_nothing(measured, tp):
    cached, reference = measured[tp]["ar"]
    assert cached == reference
    assert measured[tp]["ar_steps"] == [10, 10]
    assert measured[1]["ar"] == measured[2]["ar"]


@pytest.mark.parametrize("tp", [1, 2])
def test_causal_lm_cached_decoding_equals_decoding_without_a_cache(measured, tp):
    cached, reference = measured[tp]["causal"]
    assert cached == reference and len(cached) == 10


def test_a_low_threshold_decodes_several_tokens_per_step(measured):
    n, steps = measured[1]["fast"]
    assert n == 12 and steps < 12
    # two samples of the same prompt draw different continuations (seeded: reproducible)
    first, second = measured[1]["sampled"]
    assert len(first) == len(second) == 8 and first != second


def test_infilling_uses_the_right_context(measured):
    a, b = measured[1]["infill"]
    assert len(a) == len(b) == 5 and a != b


def test_stop_criteria_shorten_the_output(measured):
    s = measured[1]["stops"]
    assert s["repeat"] == s["long"][:1]
    assert s["two"] == s["text"][:4]  # a run of one token is already "repeated" at k = 1
    assert s["eos"] == s["long"][:5]
    assert s["string"] == s["text"][:9]
    assert len(s["regex"]) < len(s["text"]) and s["text"].startswith(s["regex"])


def test_a_cache_that_grows_and_squeezes_decodes_the_same_tokens(measured):
    assert measured[1]["tiny_cache"] == measured[1]["default_cache"]
    assert measured[2]["tiny_cache"] == measured[2]["default_cache"]


def test_generation_past_the_context_crops_the_cache(measured):
    assert measured[1]["past_context"] == measured[2]["past_context"] == 30


def test_bad_decoding_input_is_a_clear_error(measured):
    empty, too_long, window, zero, causal_infill = measured[1]["errors"]
    assert "max_new_tokens must be at least 1" in zero
    assert "a causal LM cannot condition on the right context" in causal_infill
    assert "prompt 0 is empty" in empty
    assert "does not fit the model's context of 24 tokens" in too_long
    assert "window 4 is larger than the masked span of 3 tokens" in window


def test_block_and_mdlm_baselines_decode_through_the_same_model(tmp_path):
    spawn(_baselines, 1, tmp_path)
    r = torch.load(tmp_path / "baselines.pt")
    assert len(r["block"]) == 8 and len(r["mdlm"]) == 8
    # one token per step; steps count forward passes: block decoding caches the prompt and each
    # finished block inside the next block's first pass (as the reference code does): one
    # forward per denoising step, nothing more; MDLM one per token
    assert r["block_steps"] == 8
    assert r["mdlm_empty"] == r["mdlm"] and r["mdlm_infill"] == 3 == r["mdlm_infill_steps"]
    assert r["mdlm_steps"] == 8
    assert r["mdlm_fast_steps"] < 8  # a low threshold unmasks several tokens per step
    # with block size 1 the block decoder is AR decoding (each pass caches the previous token
    # and queries the next): equal to the cached set decoder
    assert r["block1"] == r["ar"]
    # blocks lie on the training grid: after 5 prompt tokens the blocks are [5, 8), [8, 12),
    # [12, 13), each one step at tau = 0 (a grid from the prompt's end would take 2)
    assert r["grid_steps"] == 3 and len(r["grid"]) == 8
    # stop criteria end block decoding on the committed prefix (a run of 1 stops at once)
    assert r["stopped"] == r["block"][:1] and r["stopped_steps"] == 1
    # a batch of prompts of different lengths (each on its own grid, padded into one forward
    # per step) decodes what each prompt decodes alone
    assert r["batched"] == r["alone"] and r["batched_steps"] == r["alone_steps"]
    # a checkpoint decodes as its order trained (decoder_for: what setdiff-generate, -eval and
    # the harness use): a block model's generate() is blocks(), its window must be the block,
    # and it cannot infill; an MDLM's generate() and infill() are the MDLM sampler, its stop
    # criteria applied to the decoded span
    assert r["kinds"] == {"causal": "causal", "staggered": "set", "autoregressive": "set",
                          "block": "block", "masked": "mdlm"}
    assert r["block_generate"] == r["batched"] and r["block_generate_steps"] == r["batched_steps"]
    assert "order.block_size = 4" in r["block_window_error"]
    assert "cannot condition on the right context" in r["block_infill_error"]
    assert r["mdlm_generate"] == [r["mdlm"], r["mdlm2"]] and r["mdlm_infill_generic"] == \
        r["mdlm_infill_tokens"]
    assert r["mdlm_stopped"] == r["mdlm"][:1]
    # the baselines record which positions each step committed, as set decoding does
    assert all(sorted(p for step in t for p in step) == list(range(4, 12)) and len(t) == 8
               for t in r["traces"])


def _baselines(rank, out):
    from setdiff_dist.inference.decoder import (
        BlockDecoder,
        MDLMDecoder,
        Sampling,
        SetDecoder,
        StopCriteria,
    )
    from setdiff_dist.parallel import initialize_model_parallel

    initialize_model_parallel(seed=0)

    greedy = Sampling(greedy=True)
    block_model = lean_copy(model_for("block", 1))
    blocks = BlockDecoder(block_model, Chars(), context=L)
    mdlms = MDLMDecoder(block_model, Chars(), context=L)
    dec = SetDecoder(block_model, Chars(), context=L)
    prompt = [5, 9, 2, 7]
    b = blocks.block(prompt, 8, block_size=4, sampling=greedy)
    m = mdlms.mdlm(prompt, 8, sampling=greedy)
    fast = mdlms.mdlm(prompt, 8, threshold=0.0, sampling=greedy)
    b1 = blocks.block(prompt, 8, block_size=1, sampling=greedy)
    # MDLM infilling: the right context is given; an empty one is plain continuation
    m_empty = mdlms.mdlm(prompt, 8, sampling=greedy, right=[])
    m_infill = mdlms.mdlm(prompt, 3, sampling=greedy, right=[4, 4, 6])
    ar = dec.generate([prompt], 8, window=1, sampling=greedy)[0]
    grid = blocks.block(prompt + [3], 8, block_size=4, threshold=0.0, sampling=greedy)
    stopped = blocks.block(prompt, 8, block_size=4, sampling=greedy,
                        stop=StopCriteria(max_repeat_run=1))
    many = [prompt, prompt + [3, 1], prompt[:1], prompt + [3]]
    alone = [blocks.block(p, 7, block_size=4, threshold=0.5, sampling=greedy) for p in many]
    batched = blocks.blocks(many, 7, block_size=4, threshold=0.5, sampling=greedy)
    from setdiff_dist.config import load_config
    from setdiff_dist.inference.decoder import DecodeError, decoder_for

    kinds = {k: decoder_for(block_model, Chars(), load_config(None, [
        f"order.kind={k}", f"data.seq_len={L}"])).decoding
        for k in ("causal", "staggered", "autoregressive", "block", "masked")}
    blk = decoder_for(block_model, Chars(), load_config(None, [
        "order.kind=block", "order.block_size=4", f"data.seq_len={L}"]))
    block_generate = blk.generate(many, 7, window=4, threshold=0.5, sampling=greedy)
    errors = {}
    for name, call in (("window", lambda: blk.generate([prompt], 8, window=2)),
                       ("infill", lambda: blk.infill([prompt], [[4]], [2], window=2))):
        try:
            call()
        except DecodeError as exc:
            errors[name] = str(exc)
    mdl = decoder_for(block_model, Chars(), load_config(None, ["order.kind=masked",
                                                               f"data.seq_len={L}"]))
    mdlm_generate = mdl.generate([prompt, prompt + [3]], 8, window=None, sampling=greedy)
    mdlm_stopped = mdl.generate([prompt], 8, window=None, sampling=greedy,
                                stop=StopCriteria(max_repeat_run=1))[0]
    mdlm_infill = mdl.infill([prompt], [[4, 4, 6]], [3], window=None, sampling=greedy)[0]
    torch.save({"kinds": kinds, "block_generate": [r.tokens for r in block_generate],
                "block_generate_steps": [r.steps for r in block_generate],
                "block_window_error": errors.get("window", ""),
                "block_infill_error": errors.get("infill", ""),
                "mdlm_generate": [r.tokens for r in mdlm_generate],
                "mdlm2": mdlms.mdlm(prompt + [3], 8, sampling=greedy).tokens,
                "mdlm_stopped": mdlm_stopped.tokens, "mdlm_infill_generic": mdlm_infill.tokens,
                "mdlm_infill_tokens": m_infill.tokens, "traces": [b.trace, m.trace],
                "alone": [a.tokens for a in alone], "batched": [b.tokens for b in batched],
                "alone_steps": [a.steps for a in alone],
                "batched_steps": [b.steps for b in batched], "grid": grid.tokens,
                "grid_steps": grid.steps, "stopped": stopped.tokens,
                "stopped_steps": stopped.steps, "block": b.tokens, "block_steps": b.steps,
                "mdlm": m.tokens,
                "mdlm_steps": m.steps, "mdlm_fast_steps": fast.steps, "block1": b1.tokens,
                "ar": ar.tokens, "mdlm_empty": m_empty.tokens, "mdlm_infill": len(m_infill.tokens),
                "mdlm_infill_steps": m_infill.steps}, out / "baselines.pt")


def _in_block_order(trace, blocks):
    """Whether every step of ``trace`` commits inside one block and no step reaches a block
    before all earlier blocks are full (each position committed once)."""
    which = {p: k for k, block in enumerate(blocks) for p in block}
    done = set()
    for step in trace:
        ks = {which[p] for p in step}
        if len(ks) != 1 or done & set(step):
            return False
        k = ks.pop()
        if any(not set(blocks[j]) <= done for j in range(k)):
            return False
        done |= set(step)
    return True


def test_mdlm_decodes_semi_autoregressively_in_blocks(tmp_path):
    """MDLM with a block size (issue 53: the paper's MDLM rows on CNN/DailyMail and GSM8K decode
    in blocks of 32, as the reference sampler does): blocks on the grid, finished left to right,
    stop criteria checked after each finished block; a block holding the whole span is the
    whole-span decode."""
    spawn(_mdlm_blocks, 1, tmp_path)
    r = torch.load(tmp_path / "mdlm_blocks.pt")
    # block = max_new_tokens after a prompt on the grid (8 tokens, blocks of 8), and a block
    # the span does not cross: the whole-span decode, token for token, step for step
    for name in ("aligned", "aligned_tau", "wide"):
        whole, block = r[name]
        assert whole == block, name
    # blocks of 4 after a 5-token prompt: [5, 8), [8, 12), [12, 15); one token per step at
    # tau = inf, each block finished before the next one starts
    blocks = [[5, 6, 7], [8, 9, 10, 11], [12, 13, 14]]
    small = r["small"]
    assert len(small["tokens"]) == 10 and small["steps"] == 10
    assert _in_block_order(small["trace"], blocks)
    assert sorted(p for step in small["trace"] for p in step) == list(range(5, 15))
    # at tau = 0 a block is one step (all its candidates accepted), sampled or greedy
    assert r["fast_steps"] == 3 and _in_block_order(r["fast_trace"], blocks)
    assert _in_block_order(r["sampled_trace"], blocks) and len(r["sampled"]) == 10
    # the whole-span decode of the same span is another decode: its candidates are every
    # masked position (the blocks' rule changes what is committed when)
    assert r["whole_small_steps"] == 10
    # a stop inside a block ends generation once that block is finished: end-of-text at
    # output index j of block 0 (3 steps) or of block 1 (3 + 4 steps)
    for key, steps in (("eos0", 3), ("eos1", 7)):
        j, tokens, got_steps, trace = r[key]
        assert tokens == small["tokens"][:j] and got_steps == steps, key
        assert trace == small["trace"][:steps]
    # a run of one token stops at the first token: after block 0 (whole-span: all 10 steps)
    assert r["repeat"] == (small["tokens"][:1], 3)
    # decoder_for's MDLM decoder: whole span by default; its block_size makes generate()
    # decode in blocks; infilling stays whole-span
    assert r["generic_default"] == r["whole_small"]
    assert r["generic_blocks"] == small["tokens"]
    assert r["generic_infill"] == r["infill_whole"]
    bad_size, bad_infill = r["errors"]
    assert "block_size=0" in bad_size and "right context" in bad_infill


def _mdlm_blocks(rank, out):
    from setdiff_dist.config import load_config
    from setdiff_dist.inference.decoder import (
        DecodeError,
        MDLMDecoder,
        Sampling,
        StopCriteria,
        decoder_for,
    )
    from setdiff_dist.parallel import initialize_model_parallel

    initialize_model_parallel(seed=0)
    greedy = Sampling(greedy=True)
    model = lean_copy(model_for("masked", 1))
    dec = MDLMDecoder(model, Chars(), context=L)

    def run(prompt, n, block_size=None, **kw):
        return dec.mdlm(prompt, n, block_size=block_size, **kw)

    def key(r):
        return (r.tokens, r.steps, r.trace, r.trace_confidence)

    res = {}
    aligned, prompt = [5, 9, 2, 7, 1, 3, 8, 6], [5, 9, 2, 7, 1]
    for name, p, n, bs, tau in (("aligned", aligned, 8, 8, math.inf),
                                ("aligned_tau", aligned, 8, 8, 0.3),
                                ("wide", prompt, 10, 16, math.inf)):
        res[name] = tuple(key(run(p, n, b, threshold=tau, sampling=greedy))
                          for b in (None, bs))
    small = run(prompt, 10, 4, sampling=greedy)
    res["small"] = {"tokens": small.tokens, "steps": small.steps, "trace": small.trace}
    fast = run(prompt, 10, 4, threshold=0.0, sampling=greedy)
    res["fast_steps"], res["fast_trace"] = fast.steps, fast.trace
    sampled = run(prompt, 10, 4, threshold=0.5, sampling=Sampling(temperature=1.0, seed=3))
    res["sampled"], res["sampled_trace"] = sampled.tokens, sampled.trace
    whole = run(prompt, 10, sampling=greedy)
    res["whole_small"], res["whole_small_steps"] = whole.tokens, whole.steps
    # end-of-text: the last output index of block 0 (output 0..2) and of block 1 (3..6) whose
    # token is not earlier in the output
    full = small.tokens
    for name, lo, hi in (("eos0", 0, 3), ("eos1", 3, 7)):
        j = max(i for i in range(lo, hi) if full[i] not in full[:i])
        r = run(prompt, 10, 4, sampling=greedy, stop=StopCriteria(eos_id=full[j]))
        res[name] = (j, r.tokens, r.steps, r.trace)
    r = run(prompt, 10, 4, sampling=greedy, stop=StopCriteria(max_repeat_run=1))
    res["repeat"] = (r.tokens, r.steps)
    generic = decoder_for(model, Chars(), load_config(None, ["order.kind=masked",
                                                             f"data.seq_len={L}"]))
    res["generic_default"] = generic.generate([prompt], 10, sampling=greedy)[0].tokens
    generic.block_size = 4
    res["generic_blocks"] = generic.generate([prompt], 10, sampling=greedy)[0].tokens
    res["generic_infill"] = generic.infill([prompt], [[4, 4, 6]], [3], sampling=greedy)[0].tokens
    res["infill_whole"] = run(prompt, 3, right=[4, 4, 6], sampling=greedy).tokens
    errors = []
    for call in (lambda: run(prompt, 4, 0), lambda: run(prompt, 3, 2, right=[4])):
        try:
            call()
        except DecodeError as exc:
            errors.append(str(exc))
    res["errors"] = errors
    torch.save(res, out / "mdlm_blocks.pt")


def test_setdiff_eval_mdlm_block_reaches_an_mdlm_decoder_and_is_refused_elsewhere(
        tmp_path, monkeypatch):
    """``setdiff-eval --mdlm-block B`` sets an MDLM checkpoint's decoder to blocks of B, which
    its generate() decodes with (--task gsm here; no model: the load is a stand-in); with a
    checkpoint of another order, or a task that does not generate, it is a usage error
    (exit code 2)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from helpers import run_cli

    import setdiff_dist.api as api
    from setdiff_dist.config import load_config
    from setdiff_dist.inference.decoder import MDLMDecoder, Result, SetDecoder

    seen = []

    class Recording(MDLMDecoder):  # what generate() asks of the sampler, nothing decoded
        def mdlm(self, prompt, max_new_tokens, *args, block_size=None, **kw):
            seen.append(block_size)
            return Result([], "", 1, 1e-3)

    model = SimpleNamespace(mask_id=V, vocab_size=V, device=torch.device("cpu"))

    def loads(kind, decoder):
        cfg = load_config(None, [f"order.kind={kind}", f"data.seq_len={L}"])
        return lambda *a, **kw: SimpleNamespace(module=None, config=cfg, tokenizer=Chars(),
                                                decoder=decoder(model, Chars(), context=L))

    monkeypatch.setattr(dist, "get_rank", lambda *a, **kw: 1)  # (no result written: rank 1)
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text('{"prompt": "abc", "answer": "4"}\n')
    task = ["--task", "gsm", "--data", gsm, "--max-new-tokens", "8"]
    monkeypatch.setattr(api, "load", loads("masked", Recording))
    for extra, want in (([], None), (["--mdlm-block", "4"], 4)):
        seen.clear()
        res = run_cli("setdiff_dist.cli.eval", "--checkpoint", tmp_path, *task, *extra)
        assert res.returncode == 0, res.stderr
        assert seen == [want]
    res = run_cli("setdiff_dist.cli.eval", "--checkpoint", tmp_path, "--task", "ppl",
                  "--mdlm-block", "4")
    assert res.returncode == 2 and "--mdlm-block goes with --task gsm" in res.stderr
    res = run_cli("setdiff_dist.cli.eval", "--checkpoint", tmp_path, *task, "--mdlm-block", "0")
    assert res.returncode == 2 and "--mdlm-block" in res.stderr
    monkeypatch.setattr(api, "load", loads("staggered", SetDecoder))
    res = run_cli("setdiff_dist.cli.eval", "--checkpoint", tmp_path, *task, "--mdlm-block", "4")
    assert res.returncode == 2, res.stderr
    assert "--mdlm-block 4" in res.stderr and "order.kind=staggered" in res.stderr


def test_choices_on_the_device_equal_the_per_sample_path():
    """The batched chooser (repetition penalty, greedy) picks for each sample what it picks
    for that sample alone, with the same confidences; a top-p draw never leaves the nucleus."""
    from types import SimpleNamespace

    from setdiff_dist.inference.decoder import Sample, Sampling, SetDecoder
    from setdiff_dist.inference.sampling import pick

    model = SimpleNamespace(mask_id=V, vocab_size=V, device=torch.device("cpu"))
    dec = SetDecoder(model, Chars(), context=L)
    logits = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(0)) * 3
    samples = [Sample(tokens=[1, 5, 7, None, None], region=[3, 4], prompt_len=3),
               Sample(tokens=[2, 2, None, None, 9], region=[2, 3], prompt_len=2),
               Sample(tokens=[0, None, None, None, None], region=[1, 2, 3, 4], prompt_len=1)]
    cands = [[3, 4], [2, 3], [1, 2, 3, 4]]
    for penalty in (1.0, 1.7):
        sampling = Sampling(greedy=True, repetition_penalty=penalty)
        toks, conf = pick(logits, sampling, None, [s.seen() for s in samples])
        for b, s in enumerate(samples):
            ref = dec._choose(logits[b, :len(cands[b])], cands[b], s, sampling, None, 0.0)
            assert [(p, t) for p, t, _ in ref] == [(pos, toks[b][j])
                                                   for j, pos in enumerate(cands[b])]
            probs = torch.softmax(logits[b].clone(), -1)
            if penalty == 1.0:
                assert torch.allclose(torch.tensor(conf[b]), probs.max(-1).values)
    gen = torch.Generator().manual_seed(3)
    sampling = Sampling(temperature=1.0, top_p=0.5)
    for _ in range(20):
        toks, _ = pick(logits, sampling, gen, [s.seen() for s in samples])
        for b in range(3):
            for j in range(4):
                p, idx = torch.softmax(logits[b, j], -1).sort(descending=True)
                nucleus = idx[:int((p.cumsum(0) - p <= 0.5).sum())].tolist()
                assert toks[b][j] in nucleus


def test_a_draw_follows_the_distribution_and_a_row_draws_alike_alone_or_in_a_batch():
    """Sampling inverts each row's distribution at a uniform number: the tokens follow the
    softmax (a chi-square test over many draws), a token of zero probability is never drawn,
    and a row with its own random stream draws the same tokens alone as beside other rows
    (a server's requests)."""
    from setdiff_dist.inference.decoder import Sampling
    from setdiff_dist.inference.sampling import pick

    logits = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(1)) * 2
    logits[..., 5] = -torch.inf  # never drawn
    sampling = Sampling(temperature=1.0)
    gens = [torch.Generator().manual_seed(10 + b) for b in range(3)]
    counts = [2, 4, 1]
    together = [pick(logits, sampling, gens, counts=counts)[0] for _ in range(5)]
    alone = []
    gens = [torch.Generator().manual_seed(10 + b) for b in range(3)]
    for _ in range(5):
        alone.append([pick(logits[b:b + 1, :counts[b]], sampling, [gens[b]])[0][0]
                      for b in range(3)])
    for t, a in zip(together, alone):
        for b in range(3):
            assert t[b][:counts[b]] == a[b]
    # 20000 draws from one row's distribution: chi-square over the tokens it expects >= 5 times
    probs = torch.softmax(logits[0, 0].double(), -1)
    n = 20000
    toks, conf = pick(logits[0, 0].expand(n, 1, V).contiguous(), sampling,
                      torch.Generator().manual_seed(0))
    drawn = torch.bincount(torch.tensor(toks).view(-1), minlength=V).double()
    assert drawn[5] == 0
    assert torch.allclose(torch.tensor(conf).view(-1).double(),
                          probs[torch.tensor(toks).view(-1)], atol=1e-6)
    big = probs * n >= 5
    chi2 = (((drawn - probs * n) ** 2) / (probs * n))[big].sum().item()
    dof = int(big.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)  # ~ the 99.9999th percentile


def test_packing_is_decided_by_measuring_both_kernels_once_per_shape(monkeypatch):
    """pack="auto" packs a weight for oneDNN only where that measured faster for a step's rows
    on this CPU (issue 52: on some CPUs the packed kernel made a small model's W=4 set step
    1.5x a causal step); the choice is measured once per shape and kept; a bad pack is refused."""
    from setdiff_dist.inference import lean as engine

    monkeypatch.setattr(engine, "_PACK_CHOICES", {})
    calls = []
    real = engine._median_us
    monkeypatch.setattr(engine, "_median_us", lambda fn, rounds=7: calls.append(1) or real(
        fn, rounds=2))
    w = torch.randn(512, 256)
    first = engine.packing_pays(w, 5, wide=True)
    assert isinstance(first, bool) and len(calls) == 2  # (MKL's GEMM and oneDNN's, once each)
    assert engine.packing_pays(torch.randn(512, 256), 5, wide=True) is first and len(calls) == 2
    engine.packing_pays(w, 9, wide=True)  # another row count is measured on its own
    assert len(calls) == 4 and len(engine._PACK_CHOICES) == 2
    with pytest.raises(ValueError, match="pack='yes'"):
        engine.LeanTransformer.from_state_dict(None, {}, pack="yes")


def test_a_model_packed_for_onednn_refuses_to_leave_the_cpu_or_fp32():
    """The packed weights are not buffers: ``.to("cuda")`` or ``.to(torch.bfloat16)`` would
    leave them behind and fail at the first forward, far from the cause (the GPU decode
    benchmark did so); the move is refused naming the fix, and an unpacked model moves."""
    from setdiff_dist.config import load_config
    from setdiff_dist.inference.lean import LeanError, LeanTransformer

    model = LeanTransformer(load_config("configs/tiny-cpu.yaml").model)
    model.register_buffer("w_head", torch.zeros(4, 4), persistent=False)
    model.to("cpu", torch.float32)  # (it stays where oneDNN runs)
    model._packed["head"] = torch.zeros(1)
    for move in (lambda m: m.to(torch.bfloat16), lambda m: m.half(),
                 lambda m: m.to("meta")):
        with pytest.raises(LeanError, match="from_state_dict"):
            move(model)
    assert model.w_head.dtype == torch.float32
    model._packed.clear()
    assert model.to(torch.bfloat16).w_head.dtype == torch.bfloat16


def test_the_length_penalty_is_transformers_exponential_decay_on_the_generated_count():
    """``length_penalty`` raises end-of-text's logit as transformers'
    ``ExponentialDecayLengthPenalty`` does for a sequence of the candidate's count of generated
    tokens before it (the reference's CNN/DM setting: 1.1 from 80), after the repetition
    penalty; the count is of committed tokens left of the candidate, holes not counted; the
    set decoder's batched chooser and the per-sample one (the baselines') apply it alike."""
    from types import SimpleNamespace

    from transformers.generation import ExponentialDecayLengthPenalty

    from setdiff_dist.inference.decoder import Sample, Sampling, SetDecoder
    from setdiff_dist.inference.sampling import length_boost, pick

    logits = torch.randn(1, 3, V, generator=torch.Generator().manual_seed(1)) * 4
    logits[0, 1, Chars.eos_id] = 3.0  # (one positive end-of-text logit, the others random)
    lengths = [[2, 5, 9]]
    sampling = Sampling(greedy=True, length_penalty=1.7, length_penalty_start=4)
    hf = ExponentialDecayLengthPenalty((4, 1.7), Chars.eos_id, 0)
    for j, n in enumerate(lengths[0]):
        want = hf(torch.zeros(1, n, dtype=torch.long), logits[:, j].clone())
        ours = logits[:, j].clone()
        boost = length_boost(sampling, lengths, 3)[0, j]
        ours[:, Chars.eos_id] += ours[:, Chars.eos_id].abs() * boost
        assert torch.allclose(ours, want), (n, ours[0, 0], want[0, 0])
    assert length_boost(sampling, lengths, 3)[0, 0] == 0  # (2 <= start: untouched)
    # a factor so large that end-of-text wins wherever it acts, and nowhere else
    strong = Sampling(greedy=True, length_penalty=1e6, length_penalty_start=4)
    logits[0, :, Chars.eos_id] = -1.0
    toks, _ = pick(logits, strong, None, lengths=lengths, eos_id=Chars.eos_id)
    assert toks[0][0] != Chars.eos_id and toks[0][1:] == [Chars.eos_id] * 2
    toks, _ = pick(logits, strong, None)  # (no counts: no penalty)
    assert Chars.eos_id not in toks[0]
    # the count: committed region tokens left of the position (holes are not generated yet)
    s = Sample(tokens=[7, 1, 2, None, 3, None, None], region=range(1, 7), prompt_len=1)
    assert s.generated_before([3, 5, 6]) == [2, 3, 3] and s.generated_before([6, 3]) == [3, 2]
    # through both choosers: the batched one (set decoding) and the per-sample one (BD3LM,
    # MDLM), with the decoder's end-of-text
    model = SimpleNamespace(mask_id=V, vocab_size=V, device=torch.device("cpu"))
    dec = SetDecoder(model, Chars(), context=L)
    grow = Sampling(greedy=True, length_penalty=1e6, length_penalty_start=2)
    s.rules = SimpleNamespace(sampling=grow, gen=None, pick_key=lambda: 0)
    fast = dec._pick(logits[:, :2].clone(), [s], [[3, 5]])
    assert fast[0][0] == [logits[0, 0].argmax().item(), Chars.eos_id]
    picks = dec._choose(logits[0, :2].clone(), [3, 5], s, grow, None, 0.0)
    assert [t for _, t, _ in picks] == fast[0][0]
