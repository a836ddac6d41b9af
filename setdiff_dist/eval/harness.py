"""lm-evaluation-harness on setdiff-dist checkpoints: an ``lm_eval`` model class, and the run
behind ``setdiff-eval --task harness``.

:class:`SetdiffLM` (registered with lm-eval as ``setdiff``) answers the harness's three
request types on the inference engine, at any tensor-parallel size:

- ``loglikelihood`` and ``loglikelihood_rolling``: :class:`setdiff_dist.eval.likelihood.Scorer`
  (exact for causal LMs; for set-diffusion models the autoregressive-order likelihood, exact for
  ``W = 1`` decoding and a bound otherwise: the results say which);
- ``generate_until``: the checkpoint's own decoder (``inference.decoder.decoder_for``: set
  decoding, cached AR, BD3LM blocks or MDLM's sampler) with the run's decode settings (window,
  threshold, ...: model arguments, or setdiff-eval's decode flags), stopping at each
  request's ``until`` strings (cut from the text, as the harness expects) or at
  ``max_gen_toks``.

Under tensor parallelism every rank runs the same harness over the same requests (the harness
sees one process: ranks split the model, not the data), and rank 0 reports. Offline use: a task
YAML whose ``dataset_path: json`` reads local JSONL files (``--include-path DIR``; see
``tests/harness/`` for a multiple-choice and a generation task).
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from setdiff_dist.eval.likelihood import ScoreError, Scorer


@register_model("setdiff")
class SetdiffLM(TemplateLM):
    backend = "causal"  # the harness's pair encoding: the whole text, then the context's prefix

    def __init__(self, checkpoint: Optional[str] = None, *, loaded=None, tensor_parallel: int = 1,
                 dtype: str = "auto", batch_size=8, raw_weights: bool = False,
                 preset: Optional[str] = None, device: Optional[str] = None,
                 max_batch_size=None, **decode):
        """``checkpoint``: a checkpoint or export directory (or ``loaded``: ``(model, config,
        tokenizer)`` already built). ``decode``: decoding settings over the checkpoint's
        ``decode`` section and ``preset`` (window, threshold, greedy, temperature, top_p,
        repetition_penalty, max_new_tokens, max_repeat_run). ``device``, ``batch_size`` and
        ``max_batch_size`` are what lm-eval's command line passes every model (``batch_size``
        "auto": 8; ``max_batch_size``: its cap)."""
        super().__init__()
        from setdiff_dist.inference.decoder import decoder_for
        from setdiff_dist.inference.settings import DECODE_KEYS, decode_settings

        unknown = sorted(set(decode) - set(DECODE_KEYS))
        if unknown:
            raise ScoreError(f"unknown model argument(s) {', '.join(unknown)}; the decoding "
                             f"settings are {', '.join(DECODE_KEYS)}")
        if loaded is None:
            if not checkpoint:
                raise ScoreError("give the model argument checkpoint=DIR (a checkpoint or "
                                 "export)")
            import torch

            from setdiff_dist.inference.settings import inference_dtype
            from setdiff_dist.inference.weights import build_inference_model

            if device and device.startswith("cuda") and not torch.cuda.is_available():
                raise ScoreError(f"device {device} was asked for (lm-eval's default is cuda:0) "
                                 "but this machine has no CUDA GPU: pass --device cpu")
            loaded = build_inference_model(checkpoint, tensor=int(tensor_parallel),
                                           device=device, dtype=inference_dtype(dtype),
                                           raw=bool(raw_weights))
        model, cfg, tok = loaded
        batch = 8 if str(batch_size).startswith("auto") else int(batch_size)
        if max_batch_size is not None:
            batch = min(batch, int(max_batch_size))
        self.scorer = Scorer(model, cfg, tok, batch)
        self.tok = tok
        self.decode = decode_settings(cfg, preset, **decode)
        self.decoder = decoder_for(model, tok, cfg)
        # the settings generation requests decoded with -> how many (a task's own
        # max_gen_toks and until override the defaults): what results report
        self.generated: dict[str, int] = {}

    # -- what the harness asks of a token-level model ------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs):
        return self.tok.encode(string)  # (our tokenizers add no special tokens)

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tok.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        out = self.scorer.loglikelihood_tokens(pairs)
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [req.args[0] for req in requests]
        out = self.scorer.rolling(texts)
        for text, answer in zip(texts, out):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), answer)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, per the settings or the request) set decoding of each context,
        cut at the first of its ``until`` strings; requests with the same arguments decode as
        one batch of ragged prompts."""
        groups: dict = {}
        for i, req in enumerate(requests):
            context, kwargs = req.args
            groups.setdefault(json.dumps(kwargs, sort_keys=True, default=str), []).append(
                (i, context))
        out: list = [None] * len(requests)
        for key, items in groups.items():
            kwargs = json.loads(key)
            for lo in range(0, len(items), self.scorer.batch_size):
                chunk = items[lo:lo + self.scorer.batch_size]
                for (i, _), text in zip(chunk, self._generate([c for _, c in chunk],
                                                                      kwargs)):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _generate(self, contexts: list[str], kwargs: dict) -> list[str]:
        from setdiff_dist.inference.decoder import Sampling, StopCriteria

        kwargs = dict(kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        d = self.decode
        max_new = int(kwargs.pop("max_gen_toks", d["max_new_tokens"]))
        greedy = d["greedy"]
        if "do_sample" in kwargs:
            greedy = not kwargs.pop("do_sample")
        temperature = float(kwargs.pop("temperature", d["temperature"]))
        if temperature == 0:
            greedy = True
        top_p = float(kwargs.pop("top_p", d["top_p"]))
        if kwargs:
            raise ScoreError(f"generation arguments {', '.join(sorted(kwargs))} are not "
                             "supported (until, max_gen_toks, do_sample, temperature, top_p "
                             "are); remove them from the task's generation_kwargs")
        window = d["window"]
        # a prompt and the first window fit the context (set decoding crops its cache past
        # it); block and MDLM decoding need the whole continuation to fit as well
        keep = self.max_length - (max_new if self.decoder.decoding in ("block", "mdlm")
                                  else window)
        if keep < 1:
            raise ScoreError(f"max_gen_toks={max_new} leaves no room for a prompt in this "
                             f"{self.decoder.decoding} model's context of {self.max_length}")
        prompts = [(self.tok.encode(c) or [self.tok.eos_id])[-keep:] for c in contexts]
        sampling = Sampling(greedy=greedy, temperature=temperature if not greedy else 1.0,
                            top_p=top_p, repetition_penalty=d["repetition_penalty"])
        stop = StopCriteria(eos_id=self.tok.eos_id, stop=tuple(u for u in until if u),
                            max_repeat_run=d["max_repeat_run"])
        used = json.dumps({"max_new_tokens": max_new, "until": until, "greedy": greedy,
                           "temperature": sampling.temperature, "top_p": top_p,
                           "window": window, "threshold": d["threshold"],
                           "repetition_penalty": d["repetition_penalty"]}, default=str)
        self.generated[used] = self.generated.get(used, 0) + len(contexts)
        results = self.decoder.generate(prompts, max_new, window=window,
                                        threshold=d["threshold"], sampling=sampling, stop=stop)
        texts = []
        for r in results:
            text = self.tok.decode([t for t in r.tokens if t is not None])
            for u in until:
                if u:
                    text = text.split(u)[0]
            texts.append(text)
        return texts


def task_manager(tasks: list[str], include_path: Optional[str]):
    """The harness's task index with ``include_path``'s tasks; refuses unknown task names
    (before any model is loaded)."""
    from lm_eval.tasks import TaskManager

    from setdiff_dist.errors import rank_and_world

    if rank_and_world()[0] != 0:  # (every rank runs the harness; rank 0 speaks)
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    manager = TaskManager(include_path=include_path)
    known = set(manager.all_tasks)
    missing = [t for t in tasks if t not in known]
    if missing:
        where = f" or in {include_path}" if include_path else \
            " (a task of your own: --include-path DIR with its YAML)"
        raise ScoreError(f"unknown harness task(s) {', '.join(missing)}: not among the "
                         f"harness's{where}")
    return manager


def load_tasks(tasks: list[str], manager) -> list:
    """The harness's task (and group) objects of ``tasks``, their datasets loaded: done before
    any model is loaded, so that a dataset that cannot be had (offline, no such dataset) is
    said at once, in a line, rather than as a traceback after the load."""
    try:
        loaded = manager.load(list(tasks))
    except Exception as exc:  # (the datasets library and the hub raise many kinds)
        text = str(exc).strip().splitlines()
        raise ScoreError(
            f"harness task(s) {', '.join(tasks)}: the dataset could not be loaded "
            f"({type(exc).__name__}: {text[-1][:300] if text else ''}). lm-eval downloads a "
            "task's dataset from the Hugging Face hub on first use, which this machine may not "
            "reach: download it where the hub is reachable into the datasets cache "
            "(HF_DATASETS_CACHE; then HF_DATASETS_OFFLINE=1 here), or run a task of your own on "
            "local files (--include-path DIR; tests/harness/ has examples)") from None
    # the requested objects (a tag, which expands to tasks, is loaded again by name)
    return [loaded["groups"].get(t) or loaded["tasks"].get(t) or t for t in tasks]


def run(lm: SetdiffLM, manager, tasks: list, limit: Optional[int],
        num_fewshot: Optional[int] = None, log_samples: bool = False, seed: int = 0) -> dict:
    """Run the harness's ``tasks`` (names, or :func:`load_tasks`' objects) on ``lm``; the
    harness's results, reduced to JSON, with the generation settings each task's requests
    actually decoded with (``generation``)."""
    import lm_eval

    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                  num_fewshot=num_fewshot, log_samples=log_samples,
                                  random_seed=seed, numpy_random_seed=seed,
                                  torch_random_seed=seed, fewshot_random_seed=seed)
    if out is None:  # (the harness reports on global rank 0 only)
        return {}
    result = {"results": out["results"], "n_samples": out.get("n-samples"),
              "versions": out.get("versions"), "likelihood": lm.scorer.likelihood,
              "exact_likelihood": lm.scorer.exact}
    if lm.generated:
        result["generation"] = [dict(json.loads(k), requests=n) for k, n in lm.generated.items()]
    if log_samples:
        result["samples"] = {task: [{k: s[k] for k in ("doc_id", "doc", "target", "arguments",
                                                       "resps", "filtered_resps") if k in s}
                                    for s in samples]
                             for task, samples in out["samples"].items()}
    return result
