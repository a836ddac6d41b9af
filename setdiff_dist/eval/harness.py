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

log = logging.getLogger("setdiff_dist.eval.harness")


@register_model("setdiff")
class SetdiffLM(TemplateLM):
    backend = "causal"  # the harness's pair encoding: the whole text, then the context's prefix

    def __init__(self, checkpoint: Optional[str] = None, *, loaded=None, tensor_parallel: int = 1,
                 dtype: str = "auto", batch_size=8, raw_weights: bool = False,
                 preset: Optional[str] = None, device: Optional[str] = None,
                 max_batch_size=None, pretrained: Optional[str] = None, **decode):
        """``checkpoint``: a checkpoint or export directory (or ``loaded``: ``(model, config,
        tokenizer)`` already built); ``pretrained``, the name lm-eval's own models take (and
        names its output directories by), says the same. ``decode``: decoding settings over
        the checkpoint's ``decode`` section and ``preset`` (window, threshold, greedy,
        temperature, top_p, top_k, repetition_penalty, max_new_tokens, max_repeat_run).
        ``device``, ``batch_size`` and ``max_batch_size`` are what lm-eval's command line
        passes every model (``batch_size`` "auto": 8; ``max_batch_size``: its cap)."""
        super().__init__()
        from setdiff_dist.inference.decoder import decoder_for
        from setdiff_dist.inference.settings import decode_settings

        if pretrained is not None:
            if checkpoint is not None and checkpoint != pretrained:
                raise ScoreError(f"--model_args: checkpoint={checkpoint} and pretrained="
                                 f"{pretrained} name two models; give one")
            checkpoint = pretrained
        given = dict(decode, tensor_parallel=tensor_parallel, dtype=dtype,
                     raw_weights=raw_weights, preset=preset)
        if loaded is None:
            given["checkpoint"] = checkpoint
        check_model_args(given, need_checkpoint=loaded is None)
        batch = batch_rows(batch_size, max_batch_size)
        if loaded is None:
            import torch

            from setdiff_dist.inference.weights import build_inference_model, model_dtype

            if device and device.startswith("cuda") and not torch.cuda.is_available():
                raise ScoreError(f"device {device} was asked for (lm-eval's default is cuda:0) "
                                 "but this machine has no CUDA GPU: pass --device cpu")
            loaded = build_inference_model(checkpoint, tensor=int(tensor_parallel),
                                           device=device, dtype=model_dtype(dtype, "dtype"),
                                           raw=bool(raw_weights), what="checkpoint")
        model, cfg, tok = loaded
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
        out, step = [], 8 * self.scorer.batch_size
        with _progress(len(pairs), "loglikelihood", disable_tqdm) as bar:
            for lo in range(0, len(pairs), step):
                out += self.scorer.loglikelihood_tokens(pairs[lo:lo + step])
                bar.update(len(pairs[lo:lo + step]))
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
        with _progress(len(requests), "generate_until", disable_tqdm) as bar:
            for key, items in groups.items():
                kwargs = json.loads(key)
                for lo in range(0, len(items), self.scorer.batch_size):
                    chunk = items[lo:lo + self.scorer.batch_size]
                    for (i, _), text in zip(chunk, self._generate([c for _, c in chunk],
                                                                          kwargs)):
                        out[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(chunk))
        return out

    #: what lm-eval's ``hf`` model generates when a task does not say (``max_gen_toks``)
    max_gen_toks = 256

    def _generate(self, contexts: list[str], kwargs: dict) -> list[str]:
        """As lm-eval's ``hf`` model: the request's settings normalized by lm-eval itself
        (``max_gen_toks`` 256 unless the task says), each context cut from the left to leave
        room for the generation (with a line saying so), the text cut at the first ``until``
        string."""
        from setdiff_dist.errors import rank_and_world
        g = generation_settings(kwargs, self.max_gen_toks)
        until, max_new, greedy = g["until"], g["max_gen_toks"], g["greedy"]
        d = self.decode
        temperature = g.get("temperature", d.temperature) if not greedy else 1.0
        top_p = g.get("top_p", d.top_p)
        top_k = g.get("top_k", d.top_k)
        window = d.window
        # what hf keeps of a context: the model's length minus the generation's (set decoding
        # also needs its first window in the cache)
        room = self.decoder.room(max_new, window)
        keep = self.max_length - room
        if keep < 1:
            raise ScoreError(f"max_gen_toks={max_new} leaves no room for a prompt in this "
                             f"{self.decoder.decoding} model's context of {self.max_length} "
                             "tokens (lm-eval's hf model refuses it too): set a smaller "
                             "max_gen_toks in the task's generation_kwargs or --gen-kwargs")
        encoded = [self.tok.encode(c) or [self.tok.eos_id] for c in contexts]
        cut = [len(e) - keep for e in encoded if len(e) > keep]
        if cut and rank_and_world()[0] == 0:
            import sys

            print(f"setdiff harness: {len(cut)} of {len(encoded)} prompts are longer than the "
                  f"{keep} tokens left of the context ({self.max_length}) for {room} "
                  f"generated; their left ends are cut (up to {max(cut)} tokens), as lm-eval's "
                  "hf model cuts them", file=sys.stderr, flush=True)
        prompts = [e[-keep:] for e in encoded]
        sampling = d.replace(greedy=greedy, temperature=temperature, top_p=top_p,
                             top_k=top_k).sampling()
        # (the task's stop strings, not the checkpoint's: lm-eval's until rules)
        stop = d.stopping(self.tok.eos_id, extra=[u for u in until if u], strings=False)
        used = json.dumps({"max_new_tokens": max_new, "until": until, "greedy": greedy,
                           "temperature": sampling.temperature, "top_p": top_p,
                           "top_k": top_k,
                           "window": window, "threshold": d.threshold,
                           "repetition_penalty": d.repetition_penalty}, default=str)
        self.generated[used] = self.generated.get(used, 0) + len(contexts)
        results = self.decoder.generate(prompts, max_new, window=window,
                                        threshold=d.threshold, sampling=sampling, stop=stop)
        texts = []
        for r in results:
            text = self.tok.decode([t for t in r.tokens if t is not None])
            for u in until:
                if u:
                    text = text.split(u)[0]
            texts.append(text)
        return texts


#: the model arguments of ``--model setdiff`` (``--model_args K=V,...``) besides the decoding
#: settings (:data:`setdiff_dist.inference.settings.DECODE_KEYS`); lm-eval passes ``device``,
#: ``batch_size`` and ``max_batch_size`` from its own flags (:data:`LM_EVAL_FLAGS`)
MODEL_ARGS = ("checkpoint", "tensor_parallel", "dtype", "raw_weights", "preset")
LM_EVAL_FLAGS = {"device": "--device", "batch_size": "--batch_size",
                 "max_batch_size": "--max_batch_size"}


def check_model_args(args: dict, need_checkpoint: bool = True) -> None:
    """lm-eval's ``--model_args`` for ``--model setdiff`` (a dict, as lm-eval parses them),
    checked before anything is loaded: every key known (a near miss is suggested; lm-eval's
    own flags are not model arguments), a ``checkpoint`` directory (with ``need_checkpoint``),
    and ``dtype``, ``tensor_parallel``, ``raw_weights`` and ``preset`` of the kinds they take.
    A :class:`ScoreError` (exit code 2) says which and what to give instead; the decoding
    settings' values are checked against the checkpoint when it is loaded (``--batch_size``:
    :func:`batch_rows`)."""
    import difflib

    from setdiff_dist.inference.settings import DECODE_KEYS, PRESETS
    from setdiff_dist.inference.weights import (
        LoadError,
        check_model_path,
        model_dtype,
        tensor_parallel_size,
    )

    args, name = dict(args), "pretrained" if "pretrained" in args else "checkpoint"
    if "pretrained" in args:  # (lm-eval's name for it, which names its output directories)
        if args.get("checkpoint") not in (None, args["pretrained"]):
            raise ScoreError(f"--model_args: checkpoint={args['checkpoint']} and pretrained="
                             f"{args['pretrained']} name two models; give one")
        args["checkpoint"] = args.pop("pretrained")
    flags = [k for k in args if k in LM_EVAL_FLAGS]
    if flags:
        raise ScoreError(f"--model_args {', '.join(flags)}: lm-eval sets "
                         f"{'these' if len(flags) > 1 else 'this'} with its own flag: give "
                         f"{', '.join(LM_EVAL_FLAGS[k] + ' ...' for k in flags)} instead")
    known = MODEL_ARGS + DECODE_KEYS
    unknown = sorted(set(args) - set(known))
    if unknown:
        hints = []
        for key in unknown:
            near = ["checkpoint"] if key in ("path", "model") else \
                difflib.get_close_matches(key, known, n=1)
            if near:
                hints.append(f"{key} (did you mean {near[0]}?)")
        raise ScoreError(f"--model_args: unknown model argument(s) {', '.join(unknown)} of "
                         f"--model setdiff{': ' + '; '.join(hints) if hints else ''}. Its model "
                         f"arguments are {', '.join(MODEL_ARGS)} and the decoding settings "
                         f"{', '.join(DECODE_KEYS)}")
    if need_checkpoint and not args.get("checkpoint"):
        raise ScoreError("--model_args: give checkpoint=DIR or pretrained=DIR (a training run, a "
                         "checkpoint or a setdiff-convert export directory): --model_args "
                         "pretrained=runs/NAME")
    try:
        if args.get("dtype") is not None:
            model_dtype(args["dtype"], "dtype")
        if args.get("tensor_parallel") is not None:
            tensor_parallel_size(args["tensor_parallel"], "tensor_parallel")
        if need_checkpoint:
            check_model_path(args["checkpoint"], name)
    except LoadError as exc:
        raise ScoreError(f"--model_args {exc}") from None
    raw = args.get("raw_weights")
    if raw is not None and not isinstance(raw, bool):
        raise ScoreError(f"--model_args raw_weights={raw}: give true or false")
    preset = args.get("preset")
    if preset is not None and preset not in PRESETS:
        raise ScoreError(f"--model_args preset={preset}: unknown preset; give one of "
                         f"{', '.join(PRESETS)}")


def batch_rows(batch_size, max_batch_size=None) -> int:
    """The rows a batch of requests takes: lm-eval's ``--batch_size`` (an integer of 1 or more,
    or "auto" / "auto:N", which is 8 here: our batches do not grow) capped by
    ``--max_batch_size``; anything else is a :class:`ScoreError` saying what to give."""
    text = "8" if batch_size is None else str(batch_size).strip()
    if text == "auto" or (text.startswith("auto:") and text[5:].isdigit()):
        batch = 8
    elif text.isdigit() and not isinstance(batch_size, (bool, float)):
        batch = int(text)
    else:
        batch = 0
    if batch < 1:
        raise ScoreError(f"--batch_size {batch_size}: give how many requests are scored at "
                         "once, an integer of 1 or more (or auto)")
    if max_batch_size is not None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or \
                max_batch_size < 1:
            raise ScoreError(f"--max_batch_size {max_batch_size}: give an integer of 1 or more")
        batch = min(batch, max_batch_size)
    return batch


def _progress(total: int, what: str, disable: bool):
    """A progress bar of ``total`` requests on standard error (rank 0; none when lm-eval
    says so)."""
    from setdiff_dist.errors import rank_and_world
    from setdiff_dist.progress import bar

    return bar(total=total, desc=f"setdiff {what}", unit="req", leave=False,
               disable=disable or rank_and_world()[0] != 0)


SUPPORTED = ("until", "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens",
             "do_sample", "temperature", "top_p", "top_k", "num_beams")


def generation_settings(kwargs: dict, default_max_gen_toks: int = SetdiffLM.max_gen_toks) -> dict:
    """A generation request's (or a task's) settings as lm-eval's own ``normalize_gen_kwargs``
    reads them (the aliases of ``max_gen_toks``, ``do_sample`` against ``temperature``), and
    what our decoder makes of them: ``until`` (a list), ``max_gen_toks``, ``greedy`` and the
    sampling ``temperature`` / ``top_p`` / ``top_k`` given. A setting we cannot honour (beam
    search, any other key) is a :class:`ScoreError` naming it."""
    from lm_eval.models.utils import normalize_gen_kwargs

    unknown = sorted(set(kwargs) - set(SUPPORTED))
    beams = kwargs.get("num_beams", 1)
    if unknown or (beams is not None and int(beams) != 1):
        what = ", ".join(unknown + ([f"num_beams={beams}"] if int(beams or 1) != 1 else []))
        raise ScoreError(f"generation setting(s) {what} are not supported by set decoding "
                         f"({', '.join(SUPPORTED)} are; num_beams only 1): remove them from the "
                         "task's generation_kwargs or --gen-kwargs")
    g = normalize_gen_kwargs({k: v for k, v in kwargs.items() if k != "num_beams"},
                             default_max_gen_toks)
    until = g.pop("until", None) or []
    out = {"until": [until] if isinstance(until, str) else list(until),
           "max_gen_toks": int(g["max_gen_toks"]), "greedy": not g.get("do_sample", False)}
    if float(g.get("temperature") or 0.0) > 0:
        out["temperature"] = float(g["temperature"])
    else:
        out["greedy"] = True
    if "top_p" in g and g["top_p"] is not None:
        out["top_p"] = float(g["top_p"])
    if g.get("top_k") is not None:
        out["top_k"] = int(g["top_k"])
    return out


def parse_gen_kwargs(text: Optional[str]) -> dict:
    """``--gen-kwargs K=V,...`` as lm-eval parses its ``--gen_kwargs`` (its own parser)."""
    if not text:
        return {}
    from lm_eval.utils import simple_parse_args_string

    try:
        return simple_parse_args_string(text)
    except Exception as exc:  # noqa: BLE001 (its parser raises several kinds)
        raise ScoreError(f"--gen-kwargs {text!r}: {exc} (expected K=V,K=V)") from None


def check_generation(tasks: list, gen_kwargs: Optional[dict] = None) -> None:
    """Every generation task's settings (its ``generation_kwargs``, with ``gen_kwargs`` over
    them, as lm-eval merges them) checked before the model computes anything: a setting set
    decoding cannot honour is one line and exit 2, not a failure after the first tasks ran."""
    for task in _leaves(tasks):
        config = getattr(task, "config", None)
        if getattr(config, "output_type", None) != "generate_until":
            continue
        kwargs = dict(getattr(config, "generation_kwargs", None) or {})
        kwargs.update(gen_kwargs or {})
        try:
            generation_settings(kwargs)
        except ScoreError as exc:
            raise ScoreError(f"harness task {config.task}: {exc}") from None


def _leaves(tasks) -> list:
    """The task objects of :func:`load_tasks`' list (groups opened, names skipped)."""
    out = []
    for t in tasks:
        if isinstance(t, dict):
            out += _leaves(list(t.values()))
        elif isinstance(t, (list, tuple)):
            out += _leaves(list(t))
        elif hasattr(t, "config"):
            out.append(t)
    return out


# the task indexes built in this process, by what they were built from (_index_key)
_MANAGERS: dict = {}


def _index_key(include_path: Optional[str]) -> tuple:
    """What a task index is built from: lm-eval's own tasks (fixed in a process) and the YAML
    files under ``include_path``, by path, size and modification time, so that an edited task
    is read again."""
    import os

    if not include_path:
        return (None,)
    files = []
    for root, dirs, names in os.walk(os.path.realpath(include_path)):
        dirs.sort()
        for name in sorted(names):
            if name.endswith((".yaml", ".yml", ".py")):
                st = os.stat(os.path.join(root, name))
                files.append((os.path.join(root, name), st.st_size, st.st_mtime_ns))
    return (os.path.realpath(include_path), tuple(files))


def task_manager(tasks: list[str], include_path: Optional[str]):
    """The harness's task index with ``include_path``'s tasks; refuses unknown task names
    (before any model is loaded). lm-eval reads every one of its ~14,000 task files to build
    the index (10-20 s on a CPU core): a process builds it once per set of task files (the
    index holds file paths and configs; the tasks themselves are loaded afresh each run)."""
    from lm_eval.tasks import TaskManager

    from setdiff_dist.errors import rank_and_world

    if rank_and_world()[0] != 0:  # (every rank runs the harness; rank 0 speaks)
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    key = _index_key(include_path)
    manager = _MANAGERS.get(key)
    if manager is None:
        manager = _MANAGERS[key] = TaskManager(include_path=include_path)
    known = set(manager.all_tasks)
    missing = [t for t in tasks if t not in known]
    if missing:
        where = f" or in {include_path}" if include_path else \
            " (a task of your own: --include-path DIR with its YAML)"
        raise ScoreError(f"unknown harness task(s) {', '.join(missing)}: not among the "
                         f"harness's{where}")
    return manager


def load_tasks(tasks: list[str], manager) -> tuple[list, list]:
    """The harness's task (and group) objects of ``tasks`` and every task among them, their
    datasets loaded: done before
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
    # the requested objects (a tag, which expands to tasks, is loaded again by name), and
    # every task among them (a group's own)
    return ([loaded["groups"].get(t) or loaded["tasks"].get(t) or t for t in tasks],
            list(loaded["tasks"].values()))


# lm-eval's own seeds (simple_evaluate's and its command line's defaults: python's random,
# numpy, torch, the few-shot sampler): the same few-shot examples as lm-eval picks
LM_EVAL_SEEDS = (0, 1234, 1234, 1234)


def run(lm: SetdiffLM, manager, tasks: list, limit: Optional[int],
        num_fewshot: Optional[int] = None, log_samples: bool = False,
        seeds: tuple = LM_EVAL_SEEDS,
        gen_kwargs: Optional[str] = None, output_path: Optional[str] = None,
        names: Optional[list[str]] = None, on_result=None) -> dict:
    """Run the harness's ``tasks`` (names, or :func:`load_tasks`' objects) on ``lm``, one at a
    time: after each, ``on_result(result so far)`` (rank 0), so that a task that fails later
    loses none of the finished ones; with ``output_path``, each task's results and samples in
    lm-eval's own layout there (its ``EvaluationTracker``: what lm-eval's tooling reads). The
    result: the harness's results reduced to JSON, the few-shot count (``n-shot``) and task
    configs, and the generation settings the requests decoded with (``generation``).
    ``seeds``: python's, numpy's, torch's and the few-shot sampler's, by default lm-eval's
    own, so that a task's few-shot examples are the ones lm-eval picks."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    result: dict = {}
    for i, task in enumerate(tasks):
        name = names[i] if names else str(task)
        tracker = EvaluationTracker(output_path=output_path) if output_path else None
        out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit,
                                      num_fewshot=num_fewshot, log_samples=log_samples,
                                      gen_kwargs=gen_kwargs, evaluation_tracker=tracker,
                                      random_seed=seeds[0], numpy_random_seed=seeds[1],
                                      torch_random_seed=seeds[2], fewshot_random_seed=seeds[3])
        if out is None:  # (the harness reports on global rank 0 only)
            continue
        samples = out.pop("samples", None)
        if tracker is not None:
            tracker.general_config_tracker.model_name_sanitized = "setdiff"
            tracker.save_results_aggregated(results=dict(out), samples=samples)
            for task_name in (samples or {}):
                tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
        _merge(result, out, samples if log_samples else None, lm)
        log.info("harness task %s done (%d of %d)", name, i + 1, len(tasks))
        if on_result is not None:
            on_result(result)
    return result


def _merge(result: dict, out: dict, samples: Optional[dict], lm: SetdiffLM) -> None:
    """One task's lm-eval output into the combined result."""
    for key, ours in (("results", "results"), ("n-samples", "n_samples"),
                      ("versions", "versions"), ("n-shot", "n-shot"), ("configs", "configs"),
                      ("higher_is_better", "higher_is_better")):
        if out.get(key):
            result.setdefault(ours, {}).update(json.loads(json.dumps(out[key], default=str)))
    result["likelihood"], result["exact_likelihood"] = lm.scorer.likelihood, lm.scorer.exact
    if lm.generated:
        result["generation"] = [dict(json.loads(k), requests=n) for k, n in lm.generated.items()]
    if samples is not None:
        result.setdefault("samples", {}).update({
            task: [{k: s[k] for k in ("doc_id", "doc", "target", "arguments", "resps",
                                      "filtered_resps") if k in s} for s in task_samples]
            for task, task_samples in samples.items()})
