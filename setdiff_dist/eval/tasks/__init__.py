"""The evaluation tasks of ``setdiff-eval``: each value of ``--task`` is a :class:`Task`,
described once in a module of this package and found by its name.

A task says what ``setdiff-eval`` needs to know of it: the flags it takes (``--help`` and the
refusal of a flag given to a task that does not take it come from them), its up-front checks
(run before the model loads, so that bad input costs no model load), whether it generates
(decode settings in its results, ``--mdlm-block``), the decode preset it measures at, and its
:meth:`Task.run`, which returns the JSON-able dict of results. The command never compares a
task's name.

A new task is one module here defining a subclass of :class:`Task` decorated with
:func:`register`, and its test: :func:`task_of` and :func:`task_names` import every module of
the package on first use, and nothing else needs an edit. Nothing here imports torch at import
time (``setdiff-eval --help`` reads the flags without it): a module imports the heavy stack
inside the functions that evaluate.

The helpers several tasks share have modules of their own: :mod:`.records` (the task files),
:mod:`.rouge_metric`, :mod:`.hf_scorer` (a Hugging Face causal LM as a judge),
:mod:`.mauve_protocol` and :mod:`.flags` (the flags several tasks take). Every name code
imported from the one module this package replaces is still found here (:data:`_MOVED`).
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional

from setdiff_dist.errors import SetdiffError
from setdiff_dist.registry import Registry

_TASKS = Registry(__name__, "task", first=("ppl", "infill", "gsm", "summarize", "genppl",
                                          "throughput", "choice", "harness"))


class EvalError(SetdiffError, ValueError):
    """A task file that cannot be evaluated, or an evaluation that evaluated nothing."""


class Flag:
    """A flag of ``setdiff-eval`` that one or more tasks take, declared once (a spec: the
    command turns it into an argparse argument). ``count``: a whole number of at least this
    much (the command's own ``count`` type); ``options``: the rest of ``add_argument``'s
    keywords. ``exclusive``: giving it to a task that does not take it is refused (a flag
    that changes nothing there would read as if it had); ``refusal``: that refusal's own words
    for a flag several tasks share, ``{flag}``, ``{tasks}`` and ``{task}`` filled in."""

    def __init__(self, name: str, help: str, *, count: Optional[int] = None,
                 exclusive: bool = True, refusal: Optional[str] = None, **options):
        self.name, self.help, self.count, self.options = name, help, count, options
        self.exclusive, self.refusal = exclusive, refusal
        self.dest = name.lstrip("-").replace("-", "_")
        self.default = options.get("default", False if options.get("action") == "store_true"
                                   else None)

    def given(self, args) -> bool:
        """Whether the command line set it (a value other than its default)."""
        return getattr(args, self.dest) != self.default

    def __repr__(self) -> str:
        return f"<flag {self.name}>"


class Task:
    """What an evaluation task is, for ``setdiff-eval``. Subclasses set the class attributes
    and override the methods that differ; the command makes one per run, from its parsed
    arguments, and calls :meth:`check` before the model loads and :meth:`run` after."""

    name: str = ""
    flags: tuple[Flag, ...] = ()  # the flags it takes beside the command's own
    # it generates with the decode settings, and its results say which (harness: each request
    # carries its own, said in its results)
    generates: bool = True
    preset: Optional[str] = None  # the paper's operating point for it, unless --preset
    greedy: bool = True  # decodes greedily unless --no-greedy (reproducible numbers)

    def __init__(self, args):
        self.args = args

    @classmethod
    def refuse(cls, flags: list[str], task: str) -> str:
        """The refusal of its own ``flags`` given to ``--task task``."""
        return f"{', '.join(flags)} {'goes' if len(flags) == 1 else 'go'} with --task {cls.name}"

    def check(self) -> None:
        """Refuse what can be refused before the model loads (raise :class:`EvalError`)."""

    def run(self, loaded, decode, flags: dict, publish: Callable[[dict], None]) -> dict:
        """The results. ``loaded``: :func:`setdiff_dist.api.load`'s model; ``decode``: the
        :class:`~setdiff_dist.inference.settings.DecodeSettings` it decodes with; ``flags``: the
        decode flags given (greedy resolved), for a task that builds its own decoding;
        ``publish``: writes a partial result (what a long task finished) where the final one
        goes."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<task {self.name}>"


#: class decorator: make ``cls`` (a subclass of :class:`Task`) the task named ``cls.name``
register = _TASKS.register


def task_names() -> tuple[str, ...]:
    """Every registered task's name (the choices of ``--task``), the built-in ones first in the
    order the command's help lists them."""
    return _TASKS.names()


def task_of(name: str) -> type[Task]:
    """The :class:`Task` named ``name``."""
    return _TASKS.get(name, EvalError)


def task_flags() -> dict[Flag, tuple[str, ...]]:
    """Every task's flags, once each, in the order of :func:`task_names`, with the names of the
    tasks that take each."""
    out: dict[Flag, tuple[str, ...]] = {}
    for name in task_names():
        for flag in _TASKS.members[name].flags:
            out[flag] = out.get(flag, ()) + (name,)
    return out


def check_flags(args) -> None:
    """Refuse a flag given to a task that does not take it (an exclusive :class:`Flag`), before
    anything is read: the flags of one other task in one line, in that task's words; a flag
    several tasks share in its own."""
    task, foreign = args.task, {}
    for flag, takers in task_flags().items():
        if flag.exclusive and flag.given(args) and task not in takers:
            foreign.setdefault(takers, []).append(flag)
    for takers, flags in foreign.items():
        if len(takers) == 1:
            raise EvalError(_TASKS.members[takers[0]].refuse([f.name for f in flags], task))
        flag = flags[0]
        listed = ", ".join(takers[:-1]) + " or " + takers[-1]
        raise EvalError((flag.refusal or "{flag} goes with --task {tasks}, not --task {task}")
                        .format(flag=flag.name, tasks=listed, task=task))


# where each name of the module this package replaces lives now (found on first use, so that
# importing the package imports no task's dependencies); no module here is named as a name it
# exports (importing the module would bind its name here, over the function's)
_MOVED = {
    **dict.fromkeys(("_records", "check_task_file"), "records"),
    **dict.fromkeys(("rouge", "rouge_f1", "rouge_scorer", "ROUGE_KEYS"), "rouge_metric"),
    "HFScorer": "hf_scorer",
    **dict.fromkeys(("mauve_subsets", "MAUVE_SUBSETS", "MAUVE_SUBSET_SIZE",
                     "MAUVE_REFERENCE_SEED", "MAUVE_SEED"), "mauve_protocol"),
    **dict.fromkeys(("PAPER_TAUS", "parse_thresholds"), "flags"),
    "perplexity": "ppl",
    "multiple_choice": "choice",
    **dict.fromkeys(("infilling", "infill_window", "fit_context"), "infill"),
    **dict.fromkeys(("gsm", "gsm_sweep", "gsm_stop", "GSM_STOP", "GSM_REPEAT_RUN", "_answer"),
                    "gsm8k"),
    **dict.fromkeys(("summarize", "SUMMARY_TEMPLATE"), "summaries"),
    **dict.fromkeys(("generative_perplexity", "read_texts", "variable_length", "degenerate",
                     "unigram_entropy", "VARIABLE_LENGTH"), "genppl"),
    **dict.fromkeys(("throughput", "THROUGHPUT_METHOD"), "speed"),
}


def __getattr__(name: str):
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
