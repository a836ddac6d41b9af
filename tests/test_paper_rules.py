"""Decoding and evaluation as the paper and its reference code define them (docs/method.md §§4-6):
the GSM stop, the positional candidate window, the decode defaults, the diffusion-time floor,
and the decoding trace."""

import math
from types import SimpleNamespace

import pytest
import torch


class Digits:
    """A tokenizer of one character per token, digits included (as GPT-2 splits numbers)."""

    chars = "#0123456789 \nabc.,\\oxed{}"
    vocab_size, eos_id = len(chars), None

    def encode(self, text):
        return [self.chars.index(c) for c in text]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


def test_the_gsm_stop_waits_for_the_whole_number():
    """Committed one digit at a time, ``#### 42`` stops only once a terminator follows, and
    the answer extracted is the whole number (the old rule stopped at ``#### 4``)."""
    from setdiff_dist.eval.tasks import GSM_STOP, _answer
    from setdiff_dist.inference.decoder import Sample, SetDecoder, StopCriteria

    tok = Digits()
    model = SimpleNamespace(mask_id=tok.vocab_size, vocab_size=tok.vocab_size,
                            device=torch.device("cpu"))
    dec = SetDecoder(model, tok, context=64)
    stop = StopCriteria(stop=["re:" + GSM_STOP])
    for text, answer in (("ab #### 42\nabc", "42"), ("#### 1,234 a", "1234"),
                         ("#### 3.5.\n", "3.5"), ("#### 7", None),
                         # the distilled solutions' closed marker: done at the brace
                         ("ab \\boxed{42}.", "42"), ("\\boxed{1,234", None)):
        ids = tok.encode(text)
        s = Sample(tokens=[None] * len(ids), region=list(range(len(ids))), prompt_len=0)
        for j, t in enumerate(ids):  # commit left to right, one token per step
            s.commit([(j, t)])
            dec._check_stop(s, stop)
            if s.done:
                break
        if answer is None:
            assert not s.done
            continue
        assert s.done, text
        kept = tok.decode([s.tokens[p] for p in range(s.end)])
        assert _answer(kept) == answer
        assert kept.rstrip("}").endswith(answer.replace("1234", "1,234"))
    # the reference's stop on a degenerate solution: a run of 8 equal tokens ends it there
    from setdiff_dist.eval.tasks import gsm_stop

    stop = gsm_stop(tok)
    assert stop.max_repeat_run == 8 and stop.eos_id == tok.eos_id
    ids = tok.encode("ab 1111111" + "1" * 5)
    s = Sample(tokens=[None] * len(ids), region=list(range(len(ids))), prompt_len=0)
    for j, t in enumerate(ids):
        s.commit([(j, t)])
        dec._check_stop(s, stop)
        if s.done:
            break
    assert s.done and s.end == len("ab ") + 8


def test_in_set_diffusion_times_have_a_floor_and_the_bound_is_unclipped():
    from setdiff_dist.config import load_config
    from setdiff_dist.diffusion.orders import T_EPS, BlockSchedule, schedule_from_config

    g = torch.Generator().manual_seed(0)
    t = torch.cat([BlockSchedule(4).draw(4096, g)[3] for _ in range(4)])
    assert t.min() >= T_EPS and t.max() <= 1.0 and t.min() < 2 * T_EPS + 0.01
    cfg = load_config(None, ["order.kind=block", "order.t_min=0.3", "order.t_max=0.8",
                             "data.seq_len=64"])
    train = schedule_from_config(cfg.order, 64)
    bound = schedule_from_config(cfg.order, 64, evaluation=True)
    tt = torch.cat([train.draw(64, g)[3] for _ in range(200)])
    tb = torch.cat([bound.draw(64, g)[3] for _ in range(200)])
    assert 0.3 <= tt.min() and tt.max() <= 0.8  # training clips
    assert tb.min() < 0.1 and tb.max() > 0.9  # the bound does not
    assert math.isclose(max(bound.t_min, T_EPS), T_EPS)


@pytest.mark.parametrize("kind", ["masked"])
def test_the_trainer_and_the_evaluation_draw_their_own_ranges(kind):
    from setdiff_dist.config import load_config
    from setdiff_dist.objective import Objective

    cfg = load_config(None, [f"order.kind={kind}", "order.t_min=0.5", "data.seq_len=32"])
    assert Objective(cfg, seed=0).schedule.t_min == 0.5
    assert Objective(cfg, seed=0, evaluation=True).schedule.t_min == 0.0
    # training stratifies the times over the global batch (MDLM's antithetic sampling); the
    # bound and the option's off switch do not
    assert Objective(cfg, seed=0).strata == cfg.data.global_batch_size
    assert Objective(cfg, seed=0, evaluation=True).strata is None
    off = load_config(None, [f"order.kind={kind}", "order.stratified_times=false"])
    assert Objective(off, seed=0).strata is None


def test_the_window_is_positional():
    """Candidates are the masked positions in [f, f + W): a hole (5 committed) leaves three
    candidates, not the first four masked positions (which would reach 7)."""
    from setdiff_dist.inference.decoder import Sample

    s = Sample(tokens=[1, 2, 3, None, None, 9, None, None, None], region=list(range(3, 9)),
                prompt_len=3)
    assert s.window(4) == [3, 4, 6] and s.masked(4) == [3, 4, 6, 7]
    s.commit([(3, 1), (4, 1)])
    assert s.window(4) == [6, 7, 8] and s.window(1) == [6]


def test_the_trace_records_each_steps_commits_and_stays_in_the_window():
    from helpers import process_group
    from test_decoding import Chars, lean_copy, model_for

    from setdiff_dist.inference.decoder import Sampling, SetDecoder, StopCriteria

    greedy, P, N = Sampling(greedy=True), 3, 12
    with process_group("gloo"):
        dec = SetDecoder(lean_copy(model_for("staggered", 1)), Chars(), context=24)

        def run(window, threshold):
            return dec.generate([[1, 2, 3]], N, window=window, threshold=threshold,
                                sampling=greedy, stop=StopCriteria())[0]

        # by hand: W = 1 is left to right, one per step; tau = 0 commits each whole window
        assert run(1, math.inf).trace == [[p] for p in range(P, P + N)]
        assert run(4, 0.0).trace == [list(range(b, b + 4)) for b in range(P, P + N, 4)]
        # one token per step, the most confident in the window: holes, never past f + W - 1
        r = run(4, math.inf)
    committed, jumped = set(), False
    assert len(r.trace) == r.steps == N and all(len(step) == 1 for step in r.trace)
    assert all(0 < c <= 1 for step in r.trace_confidence for c in step)
    for step in r.trace:
        f = min(set(range(P, P + N)) - committed)
        assert all(f <= p < f + 4 for p in step), (f, step)
        jumped |= any(p > f for p in step)
        committed |= set(step)
    assert committed == set(range(P, P + N)) and jumped


def test_decode_defaults_come_from_the_checkpoint_config_then_the_preset_then_the_flags(capsys):
    import argparse

    from setdiff_dist.cli import add_decode_arguments, decode_flags
    from setdiff_dist.config import load_config
    from setdiff_dist.inference.settings import decode_settings

    cfg = load_config(None, ["order.kind=staggered", "order.mean_set_size=4",
                             "data.seq_len=64", "decode.stop=[a]"])
    d = decode_settings(cfg)
    assert d.window == 4 and d.greedy is False  # W = D when the config leaves it unset
    assert decode_settings(load_config(None, ["order.kind=block", "order.block_size=8",
                                              "data.seq_len=64"])).window == 8
    assert decode_settings(load_config(None, ["order.kind=autoregressive"])).window == 1
    cfg.decode.window, cfg.decode.threshold = 6, 0.9
    assert decode_settings(cfg).window == 6 and capsys.readouterr().err == ""
    gsm = decode_settings(cfg, "gsm")
    assert gsm.window == 4 and gsm.greedy is True and gsm.threshold == 0.9
    infill = decode_settings(cfg, "infill")
    assert infill.window == 32 and infill.repetition_penalty == 1.2
    assert "wider than the largest set this model was trained on (S_max = 8)" in \
        capsys.readouterr().err  # allowed, with a note
    ap = argparse.ArgumentParser()
    add_decode_arguments(ap)
    ap.add_argument("--stop", action="append", default=[])
    args = ap.parse_args(["--preset", "gsm", "--window", "2", "--no-greedy", "--stop", "b"])
    d = decode_settings(cfg, args.preset, stop=args.stop, **decode_flags(args))
    assert d.window == 2 and d.greedy is False and d.stop == ("a", "b")
    # a block checkpoint decodes its own blocks (a preset's W is set decoding's); MDLM has no
    # window; a flag that asks for another is refused
    from setdiff_dist.inference.decoder import DecodeError

    block = load_config(None, ["order.kind=block", "order.block_size=8", "data.seq_len=64"])
    assert decode_settings(block, "infill").window == 8
    assert decode_settings(block, window=8).window == 8
    with pytest.raises(DecodeError, match="its own blocks of order.block_size = 8"):
        decode_settings(block, window=4)
    masked = load_config(None, ["order.kind=masked"])
    assert decode_settings(masked).window is None
    with pytest.raises(DecodeError, match="has no window"):
        decode_settings(masked, "gsm", window=4)
    assert decode_flags(ap.parse_args([]))["greedy"] is None  # not given: the config decides


def test_every_order_scores_the_same_positions_and_the_ar_identity_still_holds():
    """The first token is clean context for every order (as a BOS is in the reference code):
    causal and set-diffusion objectives score positions 1..L-1 (less padding and prompt), and
    the autoregressive order's NELBO over them is still the model's exact NLL."""
    from setdiff_dist.config import load_config
    from setdiff_dist.data.loader import Batch
    from setdiff_dist.diffusion import (
        make_schedule,
        nelbo,
        sample_orders,
        set_causal_mask,
        token_nll,
        two_copy_inputs,
    )
    from setdiff_dist.model.reference import ReferenceTransformer, sequential_ar_nll
    from setdiff_dist.objective import Objective, first_clean

    B, L, V = 3, 16, 40
    g = torch.Generator().manual_seed(0)
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[1, 12:] = True
    context = torch.zeros(B, L, dtype=torch.bool)
    context[2, :4] = True
    batch = Batch(tokens=torch.randint(0, V, (B, L), generator=g), padding=padding,
                  context=context, indices=torch.arange(B))
    scored = {}
    for kind in ("causal", "autoregressive", "staggered", "block", "masked"):
        cfg = load_config(None, [f"order.kind={kind}", f"data.seq_len={L}"])
        mask = Objective(cfg, seed=0).target_mask(batch)
        if kind != "causal":
            assert not mask[:, 0].any()
            mask = mask[:, 1:]
        scored[kind] = mask  # over positions 1..L-1
    assert all(torch.equal(m, scored["causal"]) for m in scored.values())
    assert int(scored["causal"].sum()) == B * (L - 1) - 4 - 3

    torch.manual_seed(0)
    model = ReferenceTransformer(V, 32, 2, 4, 64, 10000.0, 1e-5, 0.3).double().eval()
    x = batch.tokens
    o = sample_orders(make_schedule("autoregressive", L), L, range(B), 0,
                      context=first_clean(torch.zeros(B, L, dtype=torch.bool)))
    with torch.no_grad():
        tok, pos = two_copy_inputs(x, o, model.mask_id)
        vec = token_nll(model(tok, pos, set_causal_mask(o.set_ids))[:, L:], x).double()
        seq = sequential_ar_nll(model, x)
    assert torch.allclose(vec[:, 1:], seq[:, 1:], rtol=0, atol=1e-6)
    bound = nelbo(vec, o)
    assert math.isclose(float(bound.total), float(seq[:, 1:].sum()), rel_tol=1e-7)


def test_summarize_frames_the_source_as_the_reference_and_cuts_only_the_article(tmp_path):
    """--task summarize --bos-eos --max-prompt-tokens: the reference's CNN/DailyMail source,
    [BOS] article [EOS] (the end-of-text where the tokenizer has no BOS) of at most N tokens,
    then the cue; the article's text is what is cut, never the frame or the cue; the summary is
    scored stripped, with rouge-score unstemmed."""
    import json

    from setdiff_dist.eval import tasks

    class Chars:
        eos_id, bos_id = 0, None

        def encode(self, text):
            return [ord(c) for c in text]

    seen = []

    class Decoder:
        context = 64

        def generate(self, prompts, max_new_tokens, **kw):
            seen.append(prompts[0])
            return [SimpleNamespace(tokens=[1, 2], seconds=0.5, tokens_per_step=1.0,
                                    text=" the cat sat ")]

    data = tmp_path / "cnn.jsonl"
    data.write_text(json.dumps({"article": "x" * 40, "highlights": "the cat sat"}) + "\n"
                    + json.dumps({"article": "short", "highlights": "a dog"}) + "\n")
    out = tasks.summarize(Decoder(), Chars(), str(data), None, 8, None, math.inf, None,
                          template="{article}Summary:", bos_eos=True, max_prompt_tokens=12)
    cue = [ord(c) for c in "Summary:"]
    assert seen[0] == [0] + [ord("x")] * 10 + [0] + cue
    assert seen[1] == [0] + [ord(c) for c in "short"] + [0] + cue
    assert out["articles_cut"] == 1 and out["bos_eos"] is True and out["count"] == 2
    assert out["rouge1"] == pytest.approx((1.0 + 0.0) / 2)


def test_variable_length_samples_stop_and_are_drawn_again_as_the_reference_does():
    """genppl --variable-length: the reference's EntropyEosStoppingCriteria (the first
    end-of-text after 32 generated tokens ends a sample, kept; before 32 it does not; the last
    128 tokens' unigram entropy below 4 nats stops it, those 128 dropped) and its filter (a
    sample of low entropy, or of 50 tokens or fewer, is drawn again)."""
    from setdiff_dist.eval import tasks

    eos, varied = 0, list(range(1, 200))  # (199 distinct tokens: entropy ~5.3 nats)
    ids, why = tasks.variable_length(varied[:10] + [eos] + varied[10:40] + [eos] + varied, eos)
    assert why == "eos" and ids == varied[:10] + [eos] + varied[10:40] + [eos]
    flat = varied[:60] + [7] * 300  # (entropy of the last 128 falls under 4 at 60 + 69 + ...)
    ids, why = tasks.variable_length(flat, eos)
    n = next(n for n in range(1, len(flat) + 1) if n + 1 >= 128 and tasks.unigram_entropy(
        ([None] + flat)[n + 1 - 128:n + 1]) < 4.0)
    assert why == "low_entropy" and ids == flat[:max(n + 1 - 128, 33) - 1]
    assert tasks.variable_length(varied, eos) == (varied, "length")
    assert tasks.degenerate([7] * 100 + [eos] * 5, eos) and not tasks.degenerate(varied, eos)

    class Tok:
        eos_id = eos

        def decode(self, ids):
            return " ".join(map(str, ids))

    draws = iter([[7] * 150,              # degenerate: drawn again
                  varied[:40] + [eos],    # 41 tokens: too short, drawn again
                  varied[:80] + [eos] + varied[:10],
                  varied[:150]])

    class Decoder:
        def generate(self, prompts, n, **kw):
            return [SimpleNamespace(tokens=next(draws), seconds=1.0, tokens_per_step=1.0,
                                    text="") for _ in prompts]

    class Scorer:
        dtype = "torch.float32"

        def score(self, texts, features=False, nll=True):
            return 1.0, len(texts), None

    from setdiff_dist.inference.decoding import Sampling

    out = tasks.generative_perplexity(Decoder(), Tok(), Scorer(), 2, 150, 4, math.inf,
                                      Sampling(), batch_size=1, variable=True)
    assert out["draws"] == 4 and out["stops"] == {"drawn_again": 2, "eos": 1, "length": 1}
    assert out["mean_length"] == (81 + 150) / 2 and out["examples"][0] == Tok().decode(
        varied[:80])


def test_top_k_samples_among_the_k_most_likely_tokens_only():
    """Sampling(top_k=k): every draw is one of the k largest logits (before top_p, as
    transformers' warpers); k = 1 is the argmax; 0 is every token; a negative k is refused."""
    from setdiff_dist.inference.decoding import DecodeError, Sampling
    from setdiff_dist.inference.sampling import pick

    logits = torch.randn(4, 6, 50, generator=torch.Generator().manual_seed(0))
    top3 = logits.topk(3, dim=-1).indices
    seen = set()
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        toks, conf = pick(logits, Sampling(temperature=1.5, top_k=3), gen)
        t = torch.tensor(toks)
        assert (top3 == t[..., None]).any(-1).all()
        seen |= set(t.flatten().tolist())
        one, _ = pick(logits, Sampling(temperature=1.5, top_k=1), gen)
        assert one == logits.argmax(-1).tolist()
    assert len(seen) > 12  # (it does sample: not always the argmax)
    every = {t for seed in range(40) for row in pick(
        logits, Sampling(temperature=3.0), torch.Generator().manual_seed(seed))[0] for t in row}
    assert len(every) > len(seen)
    with pytest.raises(DecodeError, match="top_k=-1"):
        Sampling(top_k=-1)
