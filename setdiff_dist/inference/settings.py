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
DECODE_KEYS = ("window", "threshold", "greedy", "temperature", "top_p", "top_k",
               "repetition_penalty", "max_new_tokens", "max_repeat_run")
# the settings that say how a token is chosen (:class:`~.decoding.Sampling`'s, less the seed)
SAMPLING_KEYS = ("greedy", "temperature", "top_p", "top_k", "repetition_penalty")


def sampling_of(settings, seed: int = 0):
    """The :class:`~setdiff_dist.inference.decoding.Sampling` of resolved decoding settings
    (a dict with :data:`SAMPLING_KEYS`, or an object with them as attributes): the one
    conversion every caller makes (the API, setdiff-eval, the harness, the server)."""
    from setdiff_dist.inference.decoding import Sampling

    get = settings.get if isinstance(settings, dict) else \
        (lambda k, default=None: getattr(settings, k, default))
    return Sampling(greedy=bool(get("greedy")), temperature=get("temperature"),
                    top_p=get("top_p"), top_k=get("top_k", 0) or 0,
                    repetition_penalty=get("repetition_penalty"), seed=seed)


def inference_dtype(name: str):
    """The torch dtype of ``--dtype``: ``auto`` is bf16 on a GPU and fp32 on CPUs."""
    import torch

    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def default_window(order_cfg) -> Optional[int]:
    """W when neither the config nor a flag sets it, as the order says: the mean set size D for
    staggered orders (the paper's GSM point), the block size for block, 1 for AR and causal,
    and None for masked (MDLM's sampler has no window: every masked position is a
    candidate)."""
    from setdiff_dist.diffusion.kinds import order_of

    return order_of(order_cfg).default_window(order_cfg)


def decode_settings(cfg, preset: Optional[str] = None, **flags) -> dict:
    """The decoding settings of a run: the checkpoint's ``decode`` section, then ``preset``
    (:data:`PRESETS`), then every flag that is not None; an unset window follows the order
    (:func:`default_window`). A window past the order's S_max is allowed, with a note. A block
    checkpoint's window is its block and an MDLM's is None, whatever the config or a preset
    says (a ``--window`` flag that asks for another is an error)."""
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
    from setdiff_dist.diffusion.kinds import order_of
    from setdiff_dist.errors import rank_and_world
    from setdiff_dist.inference.decoder import DecodeError, check_threshold

    # block and masked checkpoints decode as they trained (inference.decoder.decoder_for):
    # a block model's window is its block, MDLM has none; only a flag can ask otherwise
    order, asked = order_of(cfg.order), flags.get("window")
    problem = order.window_problem(cfg.order, asked) if asked is not None else None
    if problem:
        raise DecodeError(problem)
    if out["window"] is None or order.fixed_window:
        out["window"] = order.default_window(cfg.order)
    if order.causal_lm and asked is None:  # (one token a step: a config's window is not its)
        out["window"] = 1

    check_threshold(out["threshold"])
    s_max = order.largest_set(cfg.order)
    if s_max is not None and out["window"] > s_max and rank_and_world()[0] == 0:
        import sys

        print(f"note: window {out['window']} is wider than the largest set this model was "
              f"trained on (S_max = {s_max:g}): candidates past it are outside the training "
              f"distribution; the paper decodes with W <= S_max (W = D = "
              f"{default_window(cfg.order)} for GSM)", file=sys.stderr)
    return out
