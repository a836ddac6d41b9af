"""The mathematics of set diffusion (docs/method.md §§2-4), in pure torch with no distributed code:
order schedules, the set-causal mask, and the NELBO."""

from .masks import (
                    causal_mask,
                    from_reveal_order,
                    permuted_singleton_mask,
                    permuted_singleton_mask_mod,
                    set_causal_mask,
                    set_causal_mask_mod,
                    set_causal_rule,
                    to_reveal_order,
)
from .nelbo import Nelbo, nelbo, noisy_copy, perplexity_bound, token_nll, two_copy_inputs
from .orders import (
                    AutoregressiveSchedule,
                    BlockSchedule,
                    MaskedSchedule,
                    OrderSample,
                    OrderSchedule,
                    StaggeredSchedule,
                    make_schedule,
                    sample_generator,
                    sample_orders,
                    sample_seed,
                    schedule_from_config,
                    staggered_parameters,
)

__all__ = [
    "AutoregressiveSchedule", "BlockSchedule", "MaskedSchedule", "Nelbo", "OrderSample",
    "OrderSchedule", "StaggeredSchedule", "causal_mask", "from_reveal_order", "make_schedule",
    "nelbo", "noisy_copy", "permuted_singleton_mask", "permuted_singleton_mask_mod",
    "perplexity_bound", "sample_generator", "sample_orders", "sample_seed",
    "schedule_from_config", "set_causal_mask", "set_causal_mask_mod", "set_causal_rule",
    "staggered_parameters",
    "to_reveal_order", "token_nll", "two_copy_inputs",
]
