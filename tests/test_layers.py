"""The package's layers import in one direction only (read from the source, statically):

- ``checkpoint/`` (on-disk formats) imports nothing of the model, inference, training,
  evaluation or the commands: both training and inference stand on it;
- ``model/`` imports nothing of inference, training, evaluation or the commands;
- ``inference/`` imports nothing of training;
- ``objective.py`` (the loss and the evaluation loop of every command) imports nothing of
  inference, training, evaluation, checkpoints or the commands;
- only ``train/`` imports DeepSpeed (the commands reach it through ``train/``)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "setdiff_dist"
FORBIDDEN = {
    "checkpoint": {"model", "inference", "train", "eval", "cli"},
    "model": {"inference", "train", "eval", "cli"},
    "inference": {"train", "eval", "cli"},
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
    assert not problems, "\n".join(problems)


def test_the_check_sees_relative_and_lazy_imports(tmp_path):
    """The reader resolves ``from ..x import y`` and imports inside functions."""
    found = imports(PACKAGE / "train" / "loop.py")
    assert "setdiff_dist.train.checkpoint" in found  # `from . import checkpoint`
    assert "setdiff_dist.model.hf" in found          # imported inside a method


def test_a_rank_imports_no_compiler_until_a_fused_function_runs():
    """megatron-core's jit_fuser (torch.compile) is lazy (setdiff_dist._lazy_jit): a training
    rank's imports leave torch._dynamo and torch._inductor out (about a third of them), the
    launcher imports no torch at all, and a fused function compiles at its first call."""
    import subprocess
    import sys

    code = ("import sys, time\n"
            "import setdiff_dist.cli.train\n"
            "launcher = sorted(m for m in ('torch', 'megatron', 'deepspeed') if m in sys.modules)\n"
            "import setdiff_dist.train.loop, deepspeed, megatron.core.jit as jit\n"
            "print(launcher, 'torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules,\n"
            "      jit.jit_fuser.__module__)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[] False False setdiff_dist._lazy_jit", \
        res.stdout


def test_a_lazily_fused_function_compiles_once_at_its_first_call(monkeypatch):
    import torch

    from setdiff_dist._lazy_jit import lazy_compile

    compiled = []

    def fake_compile(fn):
        compiled.append(fn)
        return lambda *a: fn(*a) * 10

    monkeypatch.setattr(torch, "compile", fake_compile)

    @lazy_compile
    def add(a, b):
        return a + b

    assert compiled == [] and add.__name__ == "add"
    assert add(1, 2) == 30 and add(2, 2) == 40 and len(compiled) == 1
