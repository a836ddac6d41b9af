"""Sampling and acceptance, as free functions of a step's logits: every decoder (set decoding,
the BD3LM and MDLM baselines) chooses its tokens with :func:`pick` and keeps them with
:func:`accept`. The settings are :class:`~setdiff_dist.inference.decoding.Sampling`."""

from __future__ import annotations

import torch


def pick(logits, sampling, gen, seen=None):
    """Every sample's choices for its candidate rows of ``logits [B, M, V]`` in a few
    batched ops where the logits are (a repetition penalty over ``seen[b]``, the token ids
    sample ``b`` holds; temperature, top-p, greedy or one multinomial draw for all rows, from
    ``gen``); only ``[B, M]`` token ids and confidences go to the host."""
    logits = logits.float()
    B, _, V = logits.shape
    if sampling.repetition_penalty != 1.0:
        rows, cols = [], []
        for b, ids in enumerate(seen or [()] * B):
            rows += [b] * len(ids)
            cols += sorted(ids)
        seen = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
        index = torch.tensor([rows, cols], dtype=torch.long, device=logits.device)
        seen[index[0], index[1]] = True
        p = sampling.repetition_penalty
        logits = torch.where(seen[:, None], torch.where(logits > 0, logits / p, logits * p),
                             logits)
    if sampling.greedy or sampling.temperature == 0:
        conf, toks = torch.softmax(logits, -1).max(-1)
        return toks.tolist(), conf.tolist()
    probs = torch.softmax(logits / sampling.temperature, -1)
    if sampling.top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > sampling.top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    toks = torch.multinomial(probs.view(-1, V), 1, generator=gen).view(B, -1)
    conf = probs.gather(-1, toks[..., None])[..., 0]
    return toks.tolist(), conf.tolist()


def accept(toks, conf, cands, threshold):
    """The most confident candidate, and every one at or above the threshold, as
    ``(position, token, confidence)``."""
    conf = conf[:len(cands)]
    best = max(range(len(cands)), key=lambda j: (conf[j], -j))
    return [(pos, int(toks[j]), float(conf[j])) for j, pos in enumerate(cands)
            if j == best or conf[j] >= threshold]
