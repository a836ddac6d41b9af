"""``--task ppl``: the NELBO bound on validation shards over fixed seeded orders of the
model's own schedule (the exact perplexity for ``causal`` and ``autoregressive``)."""

from __future__ import annotations

from setdiff_dist.eval.tasks import EvalError, Flag, Task, register
from setdiff_dist.eval.tasks.flags import BATCH_SIZE

SHARDS = Flag("--shards", "ppl: a shard directory with a valid split", exclusive=False)
BATCHES = Flag("--batches", "ppl: validation batches", count=1, default=16, exclusive=False)


@register
class Perplexity(Task):
    name = "ppl"
    flags = (SHARDS, BATCHES, BATCH_SIZE)
    generates = False

    def run(self, loaded, decode, flags, publish) -> dict:
        cfg, args = loaded.config, self.args
        shards = args.shards or cfg.data.valid_shards or cfg.data.train_shards
        return perplexity(loaded.module, cfg, shards, args.batches, args.batch_size)


def perplexity(model, cfg, shards_dir: str, batches: int = 16, batch_size: int = 8) -> dict:
    """NELBO per token and the PPL bound (``PPL <=``) on the validation split of ``shards_dir``,
    over fixed orders seeded by ``order.eval_seed`` and the sample index (reproducible numbers),
    for the model's own order schedule (the causal LM's exact perplexity)."""
    from setdiff_dist.data.blend import Blend
    from setdiff_dist.data.loader import TokenLoader
    from setdiff_dist.diffusion import perplexity_bound
    from setdiff_dist.inference.decoder import model_device
    from setdiff_dist.objective import Objective

    shards = Blend.open(shards_dir, "valid", seq_len=cfg.data.seq_len)
    objective = Objective(cfg, seed=cfg.order.eval_seed, stream=1, evaluation=True)
    n = min(batches, max(1, len(shards) // batch_size))
    loader = TokenLoader(shards, global_batch=batch_size, micro_batch=batch_size, shuffle=False,
                         num_workers=0)
    total, tokens = objective.evaluate(model, (b for _, (b,) in zip(range(n), loader)),
                                       model_device(model))
    if not tokens:
        raise EvalError(f"{shards_dir}: the validation split gave no batch of {batch_size} "
                        "sequences; lower --batch-size or prepare more validation data")
    per_token = total / tokens
    return {"nelbo_per_token": per_token, "ppl_bound": perplexity_bound(per_token),
            "tokens": tokens, "sequences": n * batch_size, "order": cfg.order.kind,
            "exact": objective.order.exact_likelihood}
