"""Sampling and acceptance, as free functions of a step's logits: every decoder (set decoding,
the BD3LM and MDLM baselines) chooses its tokens with :func:`pick` and keeps them with
:func:`accept`. The settings are :class:`~setdiff_dist.inference.decoding.Sampling`."""

from __future__ import annotations

import secrets

import torch


def fresh_seed() -> int:
    """A sampling seed for a call that gave none: new each time (an unseeded request must not
    repeat the last one's text), returned to the caller so that it can repeat it."""
    return secrets.randbits(63)


def pick(logits, sampling, gen, seen=None, counts=None, failed=None, lengths=None,
         eos_id=None):
    """Every sample's choices for its candidate rows of ``logits [B, M, V]`` in a few
    batched ops where the logits are (a repetition penalty over ``seen[b]``, the token ids
    sample ``b`` holds; temperature, top-k, top-p, then greedy or a draw); only ``[B, M]`` token ids
    and confidences go to the host. A length penalty (``sampling.length_penalty``) raises
    ``eos_id``'s logit at each candidate by its row of ``lengths[b]`` (the generated tokens
    before each candidate), after the repetition penalty (:func:`length_boost`).

    A draw inverts each row's cumulative distribution at a uniform number (the token whose
    interval holds it), for every row in the same few ops. ``gen`` is one random stream for
    the whole ``[B, M]`` (``generate``'s batch), or one per sample, of which sample ``b`` draws
    ``counts[b]`` numbers (its real candidates, default ``M``): then a sample draws the same
    tokens alone or beside any others (a server's rows), and a batch of them costs one pass
    over the vocabulary, not one ``multinomial`` per row.

    Every accepted setting (:class:`~.decoding.Sampling`) gives finite probabilities: the
    logits are kept finite after the penalty and the largest is subtracted before the
    temperature divides them, so the largest is 0 and its probability is never lost. Logits
    that are NaN or +inf to begin with, or -inf for every token (a broken model; -inf alone
    rules a token out) are a sample's failure: with a list
    ``failed`` the samples that have them are appended to it and the others are chosen as
    usual (theirs are placeholders); without one they raise."""
    logits = logits.float()
    B, _, V = logits.shape
    # (-inf is a token ruled out; NaN, +inf or nothing left to draw is a broken row)
    broken = (torch.isnan(logits) | torch.isposinf(logits)).flatten(1).any(-1) \
        | torch.isneginf(logits).all(-1).any(-1)
    if bool(broken.any()):
        rows = broken.nonzero()[:, 0].tolist()
        if failed is None:
            raise FloatingPointError(f"the model's logits are not finite (NaN, +inf, or -inf "
                                     f"for every token) for sample(s) {rows}")
        failed += rows
        logits = torch.where(broken[:, None, None], torch.zeros_like(logits), logits)
    if sampling.repetition_penalty != 1.0:
        rows, cols = [], []
        for b, ids in enumerate(seen or [()] * B):
            rows += [b] * len(ids)
            cols += sorted(ids)
        seen = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
        index = torch.tensor([rows, cols], dtype=torch.long, device=logits.device)
        seen[index[0], index[1]] = True
        p = sampling.repetition_penalty
        big = torch.finfo(torch.float32).max
        logits = torch.where(seen[:, None], torch.where(logits > 0, logits / p, logits * p),
                             logits).clamp(-big, big)
    if sampling.length_penalty != 1.0 and eos_id is not None and lengths is not None:
        boost = length_boost(sampling, lengths, logits.shape[1]).to(logits.device)
        eos = logits[..., eos_id]
        logits = logits.clone()
        logits[..., eos_id] = eos + eos.abs() * boost
    if sampling.greedy or sampling.temperature == 0:
        conf, toks = torch.softmax(logits, -1).max(-1)
        return toks.tolist(), conf.tolist()
    scaled = logits / sampling.temperature
    if sampling.temperature < 1 and not bool(torch.isfinite(scaled).all()):
        # a small temperature overflowed: the largest logit made 0 and the others at most 0
        # first, the division cannot reach inf - inf (softmax's own shift)
        scaled = (logits - logits.max(-1, keepdim=True).values) / sampling.temperature
    probs = torch.softmax(scaled, -1)
    if 0 < sampling.top_k < V:  # (ties with the k-th stay in, as transformers' top-k)
        kth = probs.topk(sampling.top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    if sampling.top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > sampling.top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    u = uniforms(B, probs.shape[1], gen, counts).to(probs.device)
    cdf = probs.cumsum(-1)  # (in float32, as torch.multinomial sums on the CPU)
    # the first token whose cumulative mass exceeds u * total (kept below the total, which a
    # rounding could reach): a token of zero mass never is
    total = cdf[..., -1]
    at = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    toks = torch.searchsorted(cdf, at[..., None], right=True)[..., 0].clamp_(max=V - 1)
    conf = probs.gather(-1, toks[..., None])[..., 0]
    return toks.tolist(), conf.tolist()


def length_boost(sampling, lengths, M: int) -> torch.Tensor:
    """``[B, M]``: ``length_penalty^(n - start) - 1`` for a candidate with ``n > start``
    generated tokens before it (``lengths[b][j]``; padding and ``n <= start``: 0), the factor
    of ``|e|`` that transformers' ``ExponentialDecayLengthPenalty`` adds to end-of-text's logit
    ``e``; kept finite (a long generation at a large factor would overflow)."""
    start, factor = sampling.length_penalty_start, sampling.length_penalty
    big = torch.finfo(torch.float32).max
    rows = [[min(factor ** (n - start) - 1.0, big) if n > start else 0.0 for n in row]
            + [0.0] * (M - len(row)) for row in lengths]
    return torch.tensor(rows, dtype=torch.float32)


def uniforms(B: int, M: int, gen, counts=None) -> torch.Tensor:
    """``[B, M]`` uniform numbers in [0, 1): from one stream ``gen`` for all, or from
    ``gen[b]`` for row ``b`` (its first ``counts[b]``; the rest are padding, never used)."""
    if not isinstance(gen, (list, tuple)):
        device = gen.device if gen is not None else "cpu"
        return torch.rand(B, M, generator=gen, device=device, dtype=torch.float32)
    rows = []
    for b, g in enumerate(gen):
        n = M if counts is None else max(min(counts[b], M), 1)
        r = torch.rand(n, generator=g, device=g.device, dtype=torch.float32)
        rows.append(torch.nn.functional.pad(r, (0, M - n)))
    return torch.stack(rows)


def accept(toks, conf, cands, threshold):
    """The most confident candidate, and every one at or above the threshold, as
    ``(position, token, confidence)``."""
    conf = conf[:len(cands)]
    best = max(range(len(cands)), key=lambda j: (conf[j], -j))
    return [(pos, int(toks[j]), float(conf[j])) for j, pos in enumerate(cands)
            if j == best or conf[j] >= threshold]
