"""``--task throughput``: batch-1 tokens/s and tokens/step at several (W, tau), as the paper
measures them: warm-up generations of each setting, not counted, then the measured ones."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from setdiff_dist.eval.tasks import EvalError, Flag, Task, register
from setdiff_dist.eval.tasks.flags import MDLM_BLOCK, SAMPLES, THRESHOLDS, thresholds

if TYPE_CHECKING:
    from setdiff_dist.inference.decoder import Sampling, SetDecoder

PROMPT = Flag("--prompt", "throughput prompts", action="append", default=None, exclusive=False)
UNCONDITIONAL = Flag("--unconditional", "throughput: generate from the end-of-text token, no "
                                        "prompt (the paper's OWT and LM1B throughput)",
                     action="store_true")
WARMUP = Flag("--warmup", "throughput: generations per setting before the measured ones (the "
                          "paper: 50)", count=0, default=1)
DEFAULT_PROMPTS = ["Shall I compare thee", "In the beginning", "O Romeo"]


@register
class Throughput(Task):
    name = "throughput"
    flags = (PROMPT, UNCONDITIONAL, WARMUP, SAMPLES, THRESHOLDS, MDLM_BLOCK)

    def check(self) -> None:
        from setdiff_dist.inference.decoder import check_text

        args = self.args
        self.thresholds = thresholds(args)
        for text in args.prompt or []:
            check_text("--prompt", text)
        if args.unconditional and args.prompt:
            raise EvalError("give --prompt or --unconditional, not both")

    def run(self, loaded, decode, flags, publish) -> dict:
        args, d, decoder = self.args, decode, loaded.decoder
        prompts = [None] if args.unconditional else args.prompt or DEFAULT_PROMPTS
        if self.thresholds or args.threshold is not None:  # the thresholds asked for, at W
            settings = [(d.window, tau) for tau in self.thresholds or [d.threshold]]
        else:
            settings = decoder.speed_points(d.window)
        return throughput(decoder, loaded.tokenizer, prompts, d.max_new_tokens, settings,
                          d.sampling(), args.warmup, args.samples)


THROUGHPUT_METHOD = ("batch 1; per setting, the mean over the prompts of each sample's "
                     "generated tokens / wall seconds, after warm-up samples of every setting "
                     "(the paper's measure); median_tokens_per_s beside it")


def throughput(decoder: SetDecoder, tok, prompts: list, max_new_tokens: int,
               settings: list[tuple[int, float]], sampling: Sampling, warmup: int = 1,
               samples: Optional[int] = None) -> dict:
    """Batch-1 tokens/s as the paper measures it (the mean of per-sample tokens/s over
    ``samples`` generations, the prompts taken in turn; default one per prompt), after
    ``warmup`` generations of each setting, which are not counted, and tokens/step, per
    (W, tau). A prompt of None is unconditional (from the end-of-text token), as the paper's
    OWT and LM1B throughput (its protocol: 50 warm-ups, 200 samples)."""
    ids = [[tok.eos_id] if p is None else tok.encode(p) for p in prompts]
    measured = [ids[i % len(ids)] for i in range(len(ids) if samples is None else samples)]
    rows = []
    for window, tau in settings:
        for i in range(warmup):  # (allocations, kernels, caches of this shape)
            decoder.generate([ids[i % len(ids)]], max_new_tokens, window=window,
                             threshold=tau, sampling=sampling)
        rates, per_step = [], []
        for p in measured:
            t = time.perf_counter()
            r = decoder.generate([p], max_new_tokens, window=window, threshold=tau,
                                 sampling=sampling)[0]
            rates.append(len(r.tokens) / (time.perf_counter() - t))
            per_step.append(r.tokens_per_step)
        rows.append({"window": window, "threshold": tau,
                     "tokens_per_s": sum(rates) / len(rates),
                     "median_tokens_per_s": sorted(rates)[len(rates) // 2],
                     "tokens_per_step": sum(per_step) / len(per_step)})
    return {"batch_size": 1, "max_new_tokens": max_new_tokens, "warmup_samples": warmup,
            "samples": len(measured), "method": THROUGHPUT_METHOD, "settings": rows}
