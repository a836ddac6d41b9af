"""The mathematics of set diffusion (docs/method.md §§2-4), in pure torch with no distributed code:
order kinds (:mod:`.kinds`), order schedules, the set-causal mask, and the NELBO.

Names are imported on first use (PEP 562), so that :mod:`.kinds`, which the config reads,
loads without torch."""

import importlib

_WHERE = {
    "AutoregressiveSchedule": "orders",
    "BlockSchedule": "orders",
    "MaskedSchedule": "orders",
    "Nelbo": "nelbo",
    "OrderSample": "orders",
    "OrderSchedule": "orders",
    "StaggeredSchedule": "orders",
    "causal_mask": "masks",
    "from_reveal_order": "masks",
    "make_schedule": "orders",
    "nelbo": "nelbo",
    "noisy_copy": "nelbo",
    "permuted_singleton_mask": "masks",
    "permuted_singleton_mask_mod": "masks",
    "perplexity_bound": "nelbo",
    "sample_generator": "orders",
    "sample_orders": "orders",
    "sample_seed": "orders",
    "schedule_from_config": "orders",
    "set_causal_mask": "masks",
    "set_causal_mask_mod": "masks",
    "set_causal_rule": "masks",
    "step_mask": "masks",
    "staggered_parameters": "orders",
    "to_reveal_order": "masks",
    "token_nll": "nelbo",
    "two_copy_inputs": "nelbo",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _WHERE[name]
    module = importlib.import_module(f"{__name__}.{where}")
    # every name of that module at once: the import just bound the submodule ``nelbo`` here,
    # and the function of that name is what this package exports
    globals().update({n: getattr(module, n) for n, m in _WHERE.items() if m == where})
    return globals()[name]


__all__ = sorted(_WHERE)
