"""The package's layers import in one direction only (read from the source, statically):

- ``checkpoint/`` (on-disk formats) imports nothing of the model, inference, training,
  evaluation or the commands: both training and inference stand on it;
- ``model/`` imports nothing of inference, training, evaluation or the commands;
- ``inference/`` imports nothing of training;
- ``eval/`` (tasks, the likelihood scorer, the harness adapter) imports nothing of training or
  the commands;
- ``serve/`` (the HTTP server) imports nothing of training, evaluation or the commands;
- ``objective.py`` (the loss and the evaluation loop of every command) imports nothing of
  inference, training, evaluation, checkpoints or the commands;
- only ``train/`` imports DeepSpeed (the commands reach it through ``train/``);
- no two modules import each other, directly or round a longer circle, even inside a function."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "setdiff_dist"
FORBIDDEN = {
    "checkpoint": {"model", "inference", "train", "eval", "cli"},
    "model": {"inference", "train", "eval", "cli"},
    "inference": {"train", "eval", "cli"},
    "eval": {"train", "cli"},
    "serve": {"train", "eval", "cli"},
    "diffusion": {"model", "inference", "train", "eval", "cli", "checkpoint"},
    "parallel": {"model", "inference", "train", "eval", "cli", "checkpoint"},
    # the objective (training, evaluation, the demo): the model's inputs and losses only
    "objective.py": {"inference", "train", "eval", "cli", "checkpoint"},
}


def imports(path: pathlib.Path) -> set:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_layers_import_in_one_direction():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = path.relative_to(PACKAGE).parts[0]
        for name in sorted(imports(path)):
            parts = name.split(".")
            if parts[0] == "setdiff_dist" and len(parts) > 1 and \
                    parts[1] in FORBIDDEN.get(layer, ()):
                problems.append(f"{path.relative_to(PACKAGE)} imports {name}")
            if parts[0] == "deepspeed" and layer not in ("train",):
                problems.append(f"{path.relative_to(PACKAGE)} imports DeepSpeed ({name})")
            if parts[0] == "megatron" and layer == "checkpoint":  # (its readers run without it)
                problems.append(f"{path.relative_to(PACKAGE)} imports megatron ({name})")
    assert not problems, "\n".join(problems)


def _literals(path: pathlib.Path) -> list:
    """``(line, text)`` of every string literal of ``path`` in code (docstrings left out; an
    f-string gives its constant pieces)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)
            and isinstance(n.value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs]


def test_step_directory_names_are_spelled_once():
    """Every writer and reader of a step directory takes its file names from
    ``checkpoint/format.py``: no other code spells them."""
    import re

    spelled = re.compile(r"rng_rank|^_pp$|^_part|^weights_ema$|^step_$|^universal$|^tp$")
    found = [f"{path.relative_to(PACKAGE)}:{line}: {text!r}"
             for path in sorted(PACKAGE.rglob("*.py")) if path.name != "format.py"
             for line, text in _literals(path) if spelled.search(text)]
    assert not found, "\n".join(found)
    assert len([t for _, t in _literals(PACKAGE / "checkpoint" / "format.py")
                if spelled.search(t)]) >= 5


# the run directory's own names (and DeepSpeed's junk in a step directory), each exactly
RUN_NAMES = ("config.yaml", "exit_status.json", "metrics.jsonl", "tensorboard", "wandb_id",
             "profile", ".pt.trace.json", "faults.jsonl", ".setdiff.lock", "checkpoints",
             "watchdog", ".previous", "hang.json", "hang.claim", "stacks-rank",
             "latest_universal", "nccl_trace")
# (the names of a rank's files: a piece of an f-string)
RUN_NAME_PIECES = ("stacks-rank", ".pt.trace.json")
# a name owned outside checkpoint/format.py: by a layer that may not import checkpoint/
# (parallel/ turns NCCL's flight recorder on, and names its directory)
RUN_NAME_OWNERS = {"nccl_trace": "parallel/state.py"}


def test_run_directory_names_are_spelled_once():
    """Every writer and reader of a run directory (the trainer, its metrics, its hang watch, the
    launcher's housekeeping of leftovers, the commands that find a run's checkpoints) takes its
    names from ``checkpoint/format.py``, as the step directory's: no other code spells them."""
    found, owned = [], {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        for line, text in _literals(path):
            name = next((n for n in RUN_NAMES if text == n or n in RUN_NAME_PIECES
                         and n in text), None)
            if name is None:
                continue
            owner = RUN_NAME_OWNERS.get(name, "checkpoint/format.py")
            if where == owner:
                owned[name] = owned.get(name, 0) + 1
            else:
                found.append(f"{where}:{line}: {text!r} (owned by {owner})")
    assert not found, "\n".join(found)
    assert owned == dict.fromkeys(RUN_NAMES, 1), owned  # each spelled there, once


def _module_graph() -> dict:
    """Module name -> the package's modules it imports (``from pkg import submodule`` counts
    as the submodule, not the package's ``__init__``)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        found = imports(path)
        deps = set()
        for imported in found:
            while imported and imported not in modules:  # a name inside a module
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                deps.add(imported)
        # a package counts only where something of its own __init__ is used
        deps -= {d for d in deps if modules[d].name == "__init__.py"
                 and all(n == d or n.startswith(d + ".") and n in modules
                         for n in found if n == d or n.startswith(d + "."))}
        graph[name] = deps
    return graph


def circles(graph: dict) -> list:
    """The groups of modules that reach each other through imports (a circle each)."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    groups = {tuple(sorted({m} | {o for o in reach[m] if m in reach[o]})) for m in graph
              if m in reach[m]}
    return sorted(groups)


def test_no_import_circle():
    assert circles(_module_graph()) == []


def test_the_circle_check_sees_a_circle():
    graph = _module_graph()
    assert "setdiff_dist.errors" in graph["setdiff_dist.train.engine"]
    assert "setdiff_dist.parallel.cpu_compat" in graph["setdiff_dist.parallel.state"]
    graph["setdiff_dist.errors"] = graph["setdiff_dist.errors"] | {"setdiff_dist.train.engine"}
    found = circles(graph)  # one circle, through whatever else the engine imports
    assert len(found) == 1
    assert {"setdiff_dist.errors", "setdiff_dist.train.engine"} <= set(found[0])


def test_the_check_sees_relative_and_lazy_imports(tmp_path):
    """The reader resolves ``from ..x import y`` and imports inside functions."""
    found = imports(PACKAGE / "train" / "loop.py")
    assert "setdiff_dist.train.checkpoint" in found  # `from . import checkpoint`
    assert "setdiff_dist.model.hf" in found          # imported inside a method


def test_a_rank_imports_no_compiler_or_wandb_until_they_are_used():
    """megatron-core's jit_fuser (torch.compile) and its ``import wandb`` are lazy
    (setdiff_dist._lazy): a training rank's imports leave torch._dynamo, torch._inductor and
    wandb's own modules out, the launcher imports no torch at all, and a fused function compiles
    at its first call."""
    import subprocess
    import sys

    code = ("import sys, time\n"
            "import setdiff_dist.cli.train\n"
            "launcher = sorted(m for m in ('torch', 'megatron', 'deepspeed') if m in sys.modules)\n"
            "import setdiff_dist.train.loop, deepspeed, megatron.core.jit as jit\n"
            "print(launcher, 'torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules,\n"
            "      jit.jit_fuser.__module__, 'wandb.sdk' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[] False False setdiff_dist._lazy False", \
        res.stdout


def test_a_lazily_fused_function_compiles_once_at_its_first_call(monkeypatch):
    import torch

    from setdiff_dist._lazy import lazy_compile

    compiled = []

    def fake_compile(fn):
        compiled.append(fn)
        return lambda *a: fn(*a) * 10

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    @lazy_compile
    def add(a, b):
        return a + b

    assert compiled == [] and add.__name__ == "add"
    assert add(1, 2) == 30 and add(2, 2) == 40 and len(compiled) == 1
    # without CUDA the function itself: inductor's CPU code generation costs more than these
    # elementwise functions ever run in a CPU job
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    @lazy_compile
    def mul(a, b):
        return a * b

    assert mul(2, 3) == 6 and len(compiled) == 1


def decoder_name_compares(source: str) -> list:
    """Lines of ``source`` that compare a decoder's name (``x.decoding``, or
    ``getattr(x, "decoding")``) with a string: code outside ``inference/`` asks the decoder
    what it can do (``causal_lm``, ``batchable``, ``room()``, ``speed_points()``,
    ``use_blocks()``, ``check_infill()``) instead."""
    def names_decoding(node) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "decoding"
        return isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr" \
            and any(isinstance(a, ast.Constant) and a.value == "decoding" for a in node.args)

    def is_text(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_text(e) for e in node.elts)
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(names_decoding(s) for s in sides) and any(is_text(s) for s in sides):
                found.append(node.lineno)
    return found


def test_no_decoder_name_is_compared_outside_inference():
    found = [f"{path.relative_to(PACKAGE)}:{line}"
             for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE).parts[0] != "inference"
             for line in decoder_name_compares(path.read_text())]
    assert not found, "compare a decoder's name outside inference/:\n" + "\n".join(found)


def test_the_decoder_name_check_sees_a_compare():
    assert decoder_name_compares('if d.decoding == "causal":\n    pass') == [1]
    assert decoder_name_compares('x = m.decoder.decoding in ("block", "mdlm")') == [1]
    assert decoder_name_compares('ok = getattr(d, "decoding", None) not in ("set",)') == [1]
    assert decoder_name_compares('if d.causal_lm:\n    pass\nname = d.decoding') == []


def exit_code_literals(source: str, command: bool = False) -> list:
    """Lines of ``source`` that spell an exit code as a number rather than take it from
    ``errors.py``'s table (``EXIT_*``): a non-zero integer in ``sys.exit(...)`` /
    ``os._exit(...)``, returned by a ``main`` (or by any function of a command module,
    ``command``), or compared with an exit code (``.exitcode``, ``.returncode``,
    ``exit_code``)."""
    def numbers(node) -> list:  # (a literal, or a conditional's literal branches)
        if isinstance(node, ast.IfExp):
            return numbers(node.body) + numbers(node.orelse)
        return [node.lineno] if isinstance(node, ast.Constant) and type(node.value) is int \
            and node.value != 0 else []

    def named_code(node) -> bool:
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        return name in ("exitcode", "returncode", "exit_code", "code")

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) in \
                    ("exit", "_exit"):
                found += numbers(node.args[0])
        elif isinstance(node, ast.FunctionDef) and (command or node.name == "main"):
            for r in ast.walk(node):
                if isinstance(r, ast.Return) and isinstance(r.value, (ast.Constant, ast.IfExp)):
                    found += numbers(r.value)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(named_code(s) for s in sides):
                found += [n for s in sides for n in numbers(s)]
    return sorted(set(found))


def test_exit_codes_come_from_one_table():
    found = [f"{path.relative_to(PACKAGE)}:{line}"
             for path in sorted(PACKAGE.rglob("*.py")) if path.name != "errors.py"
             for line in exit_code_literals(path.read_text(),
                                            command=path.parent.name == "cli")]
    assert not found, "exit codes spelled as numbers (use errors.EXIT_*):\n" + "\n".join(found)


def test_the_exit_code_check_sees_a_number():
    assert exit_code_literals("def main():\n    return 2") == [2]
    assert exit_code_literals("import sys\nsys.exit(2 if bad else 0)") == [2]
    assert exit_code_literals("def serve():\n    return 130", command=True) == [2]
    assert exit_code_literals("if p.exitcode == 76:\n    pass") == [1]
    assert exit_code_literals("def main():\n    return EXIT_USAGE\nx = n == 3") == []
