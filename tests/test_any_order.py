"""Any-order autoregression (``order.kind=any_order``), the order kind added as one file,
``setdiff_dist/diffusion/kinds/any_order.py``: nothing else in the package names it, and it
trains, evaluates its bound and decodes through the same commands as every other kind."""

import itertools
import json
import math
import pathlib

import pytest
import torch
from helpers import losses, run_cli

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "setdiff_dist"


def test_the_kind_is_one_file_and_the_config_finds_it():
    from setdiff_dist.config import ConfigError, load_config
    from setdiff_dist.diffusion.kinds import order_kinds, order_of

    mentions = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                      if "any_order" in p.read_text())
    assert mentions == ["diffusion/kinds/any_order.py"]
    assert "any_order" in order_kinds()
    order = order_of("any_order")
    assert order.singleton and not order.causal_lm and not order.exact_likelihood
    assert order.decoder == "set" and order.default_window(None) == 1
    cfg = load_config("configs/tiny-cpu.yaml", ["order.kind=any_order"])
    assert cfg.model.attention_backend == "permuted_causal"  # (singleton sets: no mask)
    with pytest.raises(ConfigError, match="'any_ordr' is not one of .*did you mean 'any_order'"):
        load_config("configs/tiny-cpu.yaml", ["order.kind=any_ordr"])


def test_it_reveals_one_token_at_a_time_in_a_uniformly_random_order():
    from setdiff_dist.diffusion import make_schedule, sample_orders

    L, n = 4, 4800
    o = sample_orders(make_schedule("any_order", L), L, range(n), seed=0)
    assert torch.equal(o.set_ids.sort(dim=1).values, torch.arange(L).expand(n, L))  # singletons
    assert o.noisy.all() and torch.equal(o.loss_weight, torch.ones(n, L))
    counts = {p: 0 for p in itertools.permutations(range(L))}
    for row in o.order.tolist():
        counts[tuple(row)] += 1
    expected = n / len(counts)  # 200 each
    assert all(abs(c - expected) < 5 * math.sqrt(expected) for c in counts.values()), counts


def test_its_nelbo_in_the_identity_order_equals_the_autoregressive_orders():
    """Through the objective training uses: a sample whose random order is left to right has
    the autoregressive order's NELBO, to the last bit; one in another order does not."""
    from setdiff_dist.config import load_config
    from setdiff_dist.data.loader import Batch
    from setdiff_dist.diffusion import sample_orders
    from setdiff_dist.model.reference import AsTrainingModel, ReferenceTransformer
    from setdiff_dist.objective import Objective, first_clean

    B, L, V = 1, 5, 40
    objectives = {kind: Objective(load_config(None, [
        f"order.kind={kind}", f"data.seq_len={L}", f"model.vocab_size={V}",
        "model.attention_backend=sdpa"]), seed=7) for kind in ("any_order", "autoregressive")}
    clean = first_clean(torch.zeros(1, L, dtype=torch.bool))

    def order_of_sample(i):
        return sample_orders(objectives["any_order"].schedule, L, [i], 7,
                             context=clean).order[0].tolist()

    identity = next(i for i in range(2000) if order_of_sample(i) == list(range(L)))
    shuffled = next(i for i in range(2000) if order_of_sample(i)[1:] == [4, 3, 2, 1])
    torch.manual_seed(0)
    model = AsTrainingModel(ReferenceTransformer(V, 32, 2, 4, 64, init_std=0.3).eval())
    tokens = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))

    def bound(kind, index):
        batch = Batch(tokens=tokens, padding=torch.zeros(B, L, dtype=torch.bool),
                      context=torch.zeros(B, L, dtype=torch.bool), indices=torch.tensor([index]))
        return objectives[kind].evaluate(model, [batch], torch.device("cpu"))

    ar = bound("autoregressive", 0)
    assert ar[1] == L - 1
    assert bound("any_order", identity) == ar
    assert bound("any_order", shuffled)[0] != ar[0]


def test_it_trains_evaluates_its_bound_and_decodes_through_the_commands(trained, tmp_path):
    run = trained("order.kind=any_order")
    path = tmp_path / "ppl.json"
    res = run_cli("setdiff_dist.cli.eval", "--checkpoint", run, "--task", "ppl", "--out", path)
    assert res.returncode == 0, res.stderr[-3000:]
    ppl = json.loads(path.read_text())
    # a bound (over random orders), below the loss of the weights as drawn
    assert ppl["order"] == "any_order" and ppl["exact"] is False
    assert 1 < ppl["ppl_bound"] < math.exp(losses(run)[1])
    res = run_cli("setdiff_dist.cli.generate", "--checkpoint", run, "--prompt",
                  "Shall I compare thee", "--max-new-tokens", "8", "--greedy", "--json",
                  "--no-eos-stop")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # the set decoder at its default window for this order (W = 1): one token per step
    assert len(out["tokens"][0]) == 8 and out["steps"][0] == 8
