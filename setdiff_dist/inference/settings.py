"""Decoding settings: the paper's operating points and how a run's settings are resolved from
the checkpoint's ``decode`` section, a preset and the flags. Imports nothing heavy: the command
lines read it for ``--help``."""

from __future__ import annotations

from typing import Optional

# The paper's operating points (on top of the checkpoint's decode section; flags override).
PRESETS = {
    "gsm": {"window": None, "greedy": True},  # W = D, greedy
    "infill": {"window": 32, "greedy": True, "repetition_penalty": 1.2},  # an S <= 32 model
}
DECODE_KEYS = ("window", "threshold", "greedy", "temperature", "top_p", "repetition_penalty",
               "max_new_tokens", "max_repeat_run")


def default_window(order_cfg) -> int:
    """W when neither the config nor a flag sets it: the mean set size D for staggered orders
    (the paper's GSM point), the block size for block, 1 for AR and causal, 16 for masked."""
    kind = order_cfg.kind
    if kind == "staggered":
        return max(1, round(order_cfg.mean_set_size))
    if kind == "block":
        return order_cfg.block_size
    return 16 if kind == "masked" else 1


def largest_set(order_cfg) -> Optional[float]:
    """S_max of a staggered order (2D unless set); None for the others."""
    if order_cfg.kind != "staggered":
        return None
    return order_cfg.max_set_size or 2 * order_cfg.mean_set_size


def decode_settings(cfg, preset: Optional[str] = None, **flags) -> dict:
    """The decoding settings of a run: the checkpoint's ``decode`` section, then ``preset``
    (:data:`PRESETS`), then every flag that is not None; an unset window follows the order
    (:func:`default_window`). A window past the order's S_max is allowed, with a note."""
    out = {k: getattr(cfg.decode, k) for k in DECODE_KEYS}
    out["stop"] = list(cfg.decode.stop)
    if preset is not None:
        if preset not in PRESETS:
            from setdiff_dist.inference.decoder import DecodeError

            raise DecodeError(f"unknown preset {preset!r}; expected {', '.join(PRESETS)}")
        out.update(PRESETS[preset])
    for k, v in flags.items():
        if v is not None:
            out[k] = out["stop"] + list(v) if k == "stop" else v
    if out["window"] is None:
        out["window"] = default_window(cfg.order)
    from setdiff_dist.errors import rank_and_world
    from setdiff_dist.inference.decoder import check_threshold

    check_threshold(out["threshold"])
    s_max = largest_set(cfg.order)
    if s_max is not None and out["window"] > s_max and rank_and_world()[0] == 0:
        import sys

        print(f"note: window {out['window']} is wider than the largest set this model was "
              f"trained on (S_max = {s_max:g}): candidates past it are outside the training "
              f"distribution; the paper decodes with W <= S_max (W = D = "
              f"{default_window(cfg.order)} for GSM)", file=sys.stderr)
    return out
