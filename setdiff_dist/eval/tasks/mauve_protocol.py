"""MAUVE as the paper measures it (``mauve-text``): seeded subsets of the human texts, each
against the generations, the mean and the spread over the subsets."""

from __future__ import annotations

from setdiff_dist.eval.tasks import EvalError

# the paper's MAUVE protocol (the reference's scripts/eval/robust_mauve_bootstrap.py): 5 subsets
# of 1,000 human texts, drawn without replacement by numpy's default_rng(20260701), each
# against the first min(1000, samples) generations, subset k's MAUVE seeded 1234 + k; the mean
# and the standard deviation (ddof 0) over the subsets
MAUVE_SUBSETS, MAUVE_SUBSET_SIZE, MAUVE_REFERENCE_SEED, MAUVE_SEED = 5, 1000, 20260701, 1234


def mauve_subsets(p_features, q_features, subsets: int = MAUVE_SUBSETS,
                  size: int = MAUVE_SUBSET_SIZE, reference_seed: int = MAUVE_REFERENCE_SEED,
                  seed: int = MAUVE_SEED) -> dict:
    """MAUVE of generations (``q_features``) against ``subsets`` subsets of ``size`` human
    texts drawn from ``p_features`` (the pool), as the reference measures it: ``{"mauve": mean,
    "mauve_std", "mauve_per_subset", ...}``."""
    import numpy as np

    try:
        import mauve
    except ImportError:
        raise EvalError("MAUVE needs mauve-text: pip install 'setdiff-dist[eval]'") from None
    pool = len(p_features)
    if size > pool:
        raise EvalError(f"MAUVE draws {subsets} subsets of {size} reference texts, but "
                        f"--references has {pool}: give more texts or a smaller "
                        "--mauve-subset-size (the paper: 1000)")
    rng = np.random.default_rng(reference_seed)
    scores = []
    for k in range(subsets):
        pick = rng.choice(pool, size=size, replace=False)
        n = min(size, len(q_features))
        m = mauve.compute_mauve(p_features=p_features[pick][:n], q_features=q_features[:n],
                                seed=seed + k, verbose=False)
        scores.append(float(m.mauve))
    values = np.asarray(scores, dtype=np.float64)
    return {"mauve": float(values.mean()), "mauve_std": float(values.std(ddof=0)),
            "mauve_per_subset": scores, "mauve_subsets": subsets, "mauve_subset_size": size,
            "mauve_compared": min(size, len(q_features))}
