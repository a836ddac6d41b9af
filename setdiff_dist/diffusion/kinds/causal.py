"""``causal``: the plain causal-LM baseline (a GPT): L tokens, the next-token loss, no order
schedule and no sets; its loss is the exact log-likelihood and it decodes with a KV cache, one
token at a time."""

from . import Order, register


@register
class Causal(Order):
    name = "causal"
    help = "the plain causal LM (GPT baseline)"
    causal_lm = True
    singleton = False  # (no sets at all)
    exact_likelihood = True
    decoder = "causal"

    def schedule(self, order_cfg, seq_len, evaluation=False):
        raise ValueError("'causal' is the plain causal-LM baseline (L tokens, next-token loss), "
                         "not a set-diffusion order: it has no schedule")
