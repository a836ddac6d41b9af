"""Parameter counts and the 2L-token FLOP formula."""

import pytest

from setdiff_dist.config import load_config
from setdiff_dist.model.flops import param_count, training_flops_per_token
from setdiff_dist.model.reference import ReferenceTransformer


def test_param_count_matches_the_reference_transformer():
    m = load_config(None, ["model.num_layers=3", "model.hidden_size=48",
                           "model.ffn_hidden_size=80", "model.vocab_size=97"]).model
    ref = ReferenceTransformer(m.vocab_size, m.hidden_size, m.num_layers, m.num_attention_heads,
                               m.ffn_hidden_size)
    assert param_count(m).total == sum(p.numel() for p in ref.parameters())


@pytest.mark.parametrize("name, billions", [("110m", 0.108), ("1.3b", 1.34), ("8b", 8.03)])
def test_shipped_model_sizes(name, billions):
    m = load_config(f"configs/models/{name}.yaml").model
    assert param_count(m).total / 1e9 == pytest.approx(billions, rel=0.02)


def test_set_diffusion_costs_about_twice_a_causal_lm_step():
    m = load_config("configs/models/1.3b.yaml").model
    for L in (256, 1024, 4096):
        ratio = training_flops_per_token(m, L) / training_flops_per_token(m, L, causal_lm=True)
        assert 1.8 < ratio < 2.0  # below 2 only because logits are needed on one half
