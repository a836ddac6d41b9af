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
