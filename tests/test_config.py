"""Configuration: loading, overrides, and validation that reports every problem at once."""

import math
from pathlib import Path

import pytest
import yaml

from setdiff_dist.cli.config import main as config_cli
from setdiff_dist.config import (
    Config,
    ConfigError,
    all_keys,
    config_from_dict,
    describe,
    load_config,
)

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml"))


def test_there_are_shipped_configs():
    assert any(p.name == "tiny-cpu.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(str(path))
    assert isinstance(cfg, Config)
    # the resolved config survives a round trip through its saved form
    assert config_from_dict(yaml.safe_load(cfg.to_yaml())) == cfg


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def problems(*args, **kw):
    with pytest.raises(ConfigError) as exc:
        load_config(*args, **kw)
    return exc.value.problems, str(exc.value)


def test_unknown_keys_name_the_key_and_suggest_the_nearest(tmp_path):
    path = write(tmp_path, "order:\n  mean_set_sise: 4\nmodle:\n  num_layers: 2\n")
    found, text = problems(path, ["train.stpes=10", "data.seqlen=64"])
    assert len(found) == 4
    assert "order.mean_set_sise: unknown key; did you mean 'order.mean_set_size'?" in text
    assert "modle: unknown key; did you mean 'model'?" in text
    assert "train.stpes: unknown key; did you mean 'train.steps'?" in text
    assert "did you mean 'data.seq_len'?" in text


def test_wrong_types_name_the_key_and_the_expected_type(tmp_path):
    path = write(tmp_path, "train:\n  steps: many\nmodel:\n  tie_embeddings: 3\n"
                           "order: staggered\n")
    found, text = problems(path)
    assert "train.steps: expected an integer, got 'many'" in text
    assert "model.tie_embeddings: expected true or false, got 3" in text
    assert "order: expected a section (mapping), got 'staggered'" in text
    assert len(found) == 3


def test_out_of_range_values_are_all_reported_at_once():
    found, text = problems(None, ["data.seq_len=16", "order.mean_set_size=17", "zero.stage=4",
                                  "decode.top_p=2", "model.init_std=-1"])
    assert "order.mean_set_size=17 is larger than data.seq_len=16" in text
    assert "zero.stage: 4 is above the maximum 3" in text
    assert "decode.top_p: 2.0 is above the maximum 1.0" in text
    assert "model.init_std: -1.0 is below the minimum 0.0" in text
    assert len(found) == 4
    _, text = problems(None, ["order.kind=stagered"])
    assert "order.kind: 'stagered' is not one of" in text and "did you mean 'staggered'?" in text
    # a wrong kind replaced by the default must not hide the set-size conflict of the default
    _, text = problems(None, ["order.kind=block", "order.block_size=5", "data.seq_len=32"])
    assert "order.block_size=5 must divide data.seq_len=32" in text


def test_conflicting_settings_name_both_keys_and_the_reason():
    _, text = problems(None, ["zero.stage=3", "parallel.pipeline=2"])
    assert "zero.stage=3 with parallel.pipeline=2" in text and "pipeline" in text
    _, text = problems(None, ["parallel.tensor=3"])
    assert "parallel.tensor=3 must divide model.num_attention_heads=4" in text
    _, text = problems(None, ["parallel.sequence_parallel=true"])
    assert "parallel.sequence_parallel=true needs parallel.tensor > 1" in text
    _, text = problems(None, ["train.precision=fp8"])
    assert "model.layer_spec=te" in text
    _, text = problems(None, ["model.attention_backend=permuted_causal", "order.kind=block",
                              "data.seq_len=64"])
    assert "singleton sets" in text


def test_overrides_are_parsed_by_the_type_of_their_field():
    cfg = load_config(None, ["optimizer.lr=1e-4", "decode.threshold=inf", "decode.stop=a,b",
                             "order.max_set_size=null", "run_dir=/tmp/x y",
                             "model.ffn_hidden_size=96",
                             "optimizer.betas=[0.9, 0.95]", "train.tensorboard=false",
                             "resume=never"])
    assert cfg.optimizer.lr == 1e-4 and math.isinf(cfg.decode.threshold)
    assert cfg.decode.stop == ["a", "b"] and cfg.order.max_set_size is None
    assert cfg.run_dir == "/tmp/x y" and cfg.model.ffn_hidden_size == 96
    assert cfg.optimizer.betas == [0.9, 0.95] and cfg.train.tensorboard is False
    _, text = problems(None, ["train.steps"])
    assert "is not of the form section.key=value" in text


def test_includes_merge_and_later_values_win(tmp_path):
    write(tmp_path, "model:\n  num_layers: 4\n  hidden_size: 32\n", "base.yaml")
    path = write(tmp_path, "include: base.yaml\nmodel:\n  num_layers: 6\n")
    cfg = load_config(path, ["model.hidden_size=48"])
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (6, 48)
    cyc = write(tmp_path, "include: c2.yaml\n", "c1.yaml")
    write(tmp_path, "include: c1.yaml\n", "c2.yaml")
    _, text = problems(cyc)
    assert "include cycle" in text
    _, text = problems(str(tmp_path / "missing.yaml"))
    assert "config file not found" in text


def test_describe_documents_every_key():
    text = describe()
    for key in all_keys():
        assert key in text, key
    for required in ("run_dir", "resume", "train.steps", "train.seed", "parallel.tensor",
                     "parallel.pipeline", "zero.stage", "order.kind", "order.mean_set_size",
                     "order.block_size"):
        assert required in all_keys()


def test_config_cli_prints_the_resolved_config_or_every_problem(capsys):
    assert config_cli(["order.kind=masked"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["order"]["kind"] == "masked"
    assert config_cli(["order.knd=masked", "zero.stage=9"]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "order.kind" in err


def test_a_checkpoint_config_with_a_retired_key_still_loads():
    """A run saved before data.shuffle_buffer was removed still loads for resume and
    inference; a user's config that sets it is told what replaced it."""
    from setdiff_dist.config import ConfigError, config_from_dict, load_config

    saved = load_config("configs/tiny-cpu.yaml").to_dict()
    saved["data"]["shuffle_buffer"] = 1000
    saved["optimizer"]["torch_adam"] = True
    assert config_from_dict(saved).data.shuffle is True
    with pytest.raises(ConfigError, match="optimizer.torch_adam: no longer a setting"):
        load_config("configs/tiny-cpu.yaml", ["optimizer.torch_adam=true"])
    with pytest.raises(ConfigError, match="did you mean 'data.shuffle'"):
        load_config("configs/tiny-cpu.yaml", ["data.shuffle_buffer=10"])


def test_the_model_widths_are_resolved_once_where_the_config_is_loaded():
    """Null widths become their values at load (saved so, and read by nothing as null); a
    value given stays; a saved section with nulls reads as the same model."""
    from setdiff_dist.config import config_from_dict, load_config, resolved_model

    m = load_config(None, ["model.hidden_size=96", "model.num_attention_heads=6"]).model
    assert (m.num_query_groups, m.ffn_hidden_size, m.head_dim) == (6, 384, 16)
    m = load_config(None, ["model.num_query_groups=2", "model.ffn_hidden_size=100",
                           "model.head_dim=8"]).model
    assert (m.num_query_groups, m.ffn_hidden_size, m.head_dim) == (2, 100, 8)
    cfg = load_config(None)  # (no width given)
    saved = cfg.to_dict()
    saved["model"].update(num_query_groups=None, ffn_hidden_size=None, head_dim=None)
    assert config_from_dict(saved).to_dict()["model"] == cfg.to_dict()["model"]
    assert resolved_model(saved["model"]) == cfg.to_dict()["model"]
    old = {k: v for k, v in saved["model"].items() if k != "qk_norm"}  # (a key added since)
    assert resolved_model(dict(old, gone=1)) == dict(cfg.to_dict()["model"], gone=1)


@pytest.mark.parametrize("command", ["setdiff_dist.cli.generate", "setdiff_dist.cli.eval",
                                     "setdiff_dist.cli.train", "setdiff_dist.cli.convert",
                                     "setdiff_dist.cli.config", "setdiff_dist.cli.demo",
                                     "setdiff_dist.cli.compare",
                                     "data_prep.prep", "data_prep.corpus", "data_prep.tasks"])
def test_help_answers_without_importing_torch(command):
    """``--help`` answers at once: the heavy stack is imported only by the work itself."""
    import subprocess
    import sys

    code = ("import runpy, sys\n"
            f"sys.argv = ['{command}', '--help']\n"
            "try:\n"
            f"    runpy.run_module('{command}', run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert "usage:" in res.stdout and res.stderr.strip().endswith("no torch"), res.stderr


def test_a_warmup_longer_than_the_run_is_the_whole_run_and_said(capsys):
    """`scripts/main.sh train.steps=10` on a config that warms up for 30 steps just runs: the
    LR warms up over the 10 steps, in one line on standard error."""
    cfg = load_config("configs/tiny-cpu.yaml", ["train.steps=10", "optimizer.warmup_steps=30"])
    assert cfg.optimizer.warmup_steps == 10
    assert "optimizer.warmup_steps=30 is longer than train.steps=10" in capsys.readouterr().err
    assert load_config("configs/tiny-cpu.yaml", ["train.steps=40",
                                                 "optimizer.warmup_steps=30"]
                       ).optimizer.warmup_steps == 30


def test_command_line_rough_edges(tmp_path):
    """--config given twice is refused (it kept the last one); every --help shows defaults; a
    reader that goes away (`setdiff-config --keys | head`) ends the command quietly."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "setdiff_dist.cli.train", "--config",
                          "configs/tiny-cpu.yaml", "--config", "configs/tiny-cpu.yaml",
                          f"run_dir={tmp_path}"], capture_output=True, text=True)
    assert res.returncode == 2 and "--config given twice" in res.stderr
    res = subprocess.run([sys.executable, "-m", "setdiff_dist.cli.generate", "--help"],
                         capture_output=True, text=True)
    assert res.returncode == 0 and "(default: 1)" in res.stdout  # --tensor-parallel
    res = subprocess.run(f"{sys.executable} -m setdiff_dist.cli.config --keys | head -1",
                         shell=True, capture_output=True, text=True)
    assert res.returncode == 0 and "Traceback" not in res.stderr and res.stdout.strip()


def test_lr_free_weight_decay_is_composers_decoupled_adamw_through_adamw():
    """optimizer.lr_free_weight_decay (the paper's CNN/DailyMail and GSM8K reference: composer's
    DecoupledAdamW, which multiplies the weights by 1 - (lr / peak lr) x wd each step) gives
    AdamW weight_decay / peak lr, the same decay at every step of the schedule: measured on
    torch's AdamW with a zero gradient (the step is the decay alone); without it, AdamW's
    lr x wd (1e-5 at lr 1e-6: nothing)."""
    import torch

    peak, wd = 1e-6, 1e-5
    cfg = load_config("configs/tiny-cpu.yaml", [f"optimizer.lr={peak}", "optimizer.min_lr=0",
                                                f"optimizer.weight_decay={wd}",
                                                "optimizer.lr_free_weight_decay=true"])
    assert cfg.optimizer.adamw_weight_decay == wd / peak
    for scale in (1.0, 0.5, 0.1):  # (warm-up, a cosine's tail)
        p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
        opt = torch.optim.AdamW([p], lr=peak * scale,
                                weight_decay=cfg.optimizer.adamw_weight_decay)
        p.grad = torch.zeros_like(p)
        opt.step()
        assert torch.allclose(p.detach(), torch.full((3,), 1 - scale * wd, dtype=torch.float64),
                              rtol=0, atol=1e-15)
    plain = load_config("configs/tiny-cpu.yaml", [f"optimizer.weight_decay={wd}"])
    assert plain.optimizer.adamw_weight_decay == wd
    for path in ("configs/paper/cnndm-qwen3s-setdlm-s32.yaml",
                 "configs/finetune/qwen3-1.7b-gsm.yaml"):
        o = load_config(path).optimizer
        assert o.lr_free_weight_decay and o.betas == [0.9, 0.98] and o.weight_decay == 1e-5, path


def test_get_prints_a_section_as_yaml_and_values_as_the_file_spells_them(capsys):
    """setdiff-config --get order printed a dataclass repr; a section is now its keys as YAML
    (what the config file holds), a value as YAML spells it (null, true, [0.9, 0.999])."""
    import yaml

    from setdiff_dist.cli.config import main

    cfg = load_config("configs/tiny-cpu.yaml")
    assert main(["--config", "configs/tiny-cpu.yaml", "--get", "order"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == cfg.to_dict()["order"]
    for key, shown in (("order.kind", "staggered"), ("order.max_set_size", "null"),
                       ("optimizer.betas", "[0.9, 0.999]"), ("train.tensorboard", "true"),
                       ("run_dir", "runs/tiny-cpu"), ("train.steps", "300")):
        assert main(["--config", "configs/tiny-cpu.yaml", "--get", key]) == 0
        assert capsys.readouterr().out == shown + "\n", key


@pytest.mark.parametrize("module", ["setdiff_dist.cli.generate", "setdiff_dist.cli.eval",
                                    "setdiff_dist.cli.serve", "setdiff_dist.cli.train",
                                    "setdiff_dist.cli.convert", "setdiff_dist.cli.compare",
                                    "setdiff_dist.cli.config", "setdiff_dist.cli.demo",
                                    "data_prep.prep", "data_prep.tasks", "data_prep.corpus"])
def test_every_flag_of_every_command_says_what_it_does(module, monkeypatch):
    """--help shows a line for every flag (several generate / eval / prep flags had none): the
    command's parser, caught as it parses, has help text on each argument."""
    import argparse
    import importlib

    seen = []

    class Parsed(Exception):
        pass

    def catch(self, *args, **kwargs):
        seen.append(self)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    main = importlib.import_module(module).main
    with pytest.raises(Parsed):
        getattr(main, "__wrapped__", main)([])
    bare = [a.option_strings or [a.dest] for a in seen[0]._actions
            if not a.help and a.dest != "help"]
    assert not bare, f"{seen[0].prog}: no help text for {bare}"


def test_every_row_of_the_recipe_table_names_a_config_of_its_order():
    """docs/recipes.md's row table (the runner's rows): each row's config exists, validates and
    trains the row's order (AR causal, MDLM masked, BD3LM N blocks of N, SetDLM S <= N a mean
    set size of N / 2), and a row read at its best checkpoint keeps one."""
    import re

    from setdiff_dist.config import load_config

    text = open("docs/recipes.md").read()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if re.match(r"\| (OWT|LM1B|GSM8K|CNN/DM|ROCStories) \|", line)]
    assert len(rows) >= 36
    seen = set()
    for table, row, config, weights, _, _ in rows:
        if config == "any LM1B row":
            continue
        cfg = load_config("configs/" + config.strip("`"))
        order = cfg.order
        if row == "AR":
            assert order.kind == "causal", (table, row)
        elif row.startswith("MDLM"):
            assert order.kind == "masked", (table, row)
        elif row.startswith("BD3LM"):
            assert order.kind == "block" and order.block_size == int(row.split()[1]), row
        else:
            smax = int(re.match(r"SetDLM S <= (\d+)", row).group(1))
            assert order.kind == "staggered" and 2 * order.mean_set_size == smax, (table, row)
        assert not weights.startswith("best") or cfg.checkpoint.keep_best, (table, row)
        # the reference's antithetic times: its LM1B BD3LM runs only
        assert cfg.order.stratified_times == (table == "LM1B" and row.startswith("BD3LM")) \
            or order.kind not in ("block", "masked"), (table, row)
        seen.add((table, row))
    assert len(seen) == len(rows) - 1  # (one line a row)


def test_a_key_given_twice_in_a_config_file_is_refused_naming_both_lines(tmp_path):
    """YAML keeps the last of two equal keys silently (a second ``order:`` section would drop
    the first one's block_size); a config file with one is refused, both lines named."""
    from setdiff_dist.config import ConfigError, load_config

    bad = tmp_path / "twice.yaml"
    bad.write_text("order:\n  kind: block\n  block_size: 8\ntrain:\n  steps: 2\n"
                   "order:\n  stratified_times: true\n")
    with pytest.raises(ConfigError, match=r"'order' is given twice \(lines 1 and 6\)"):
        load_config(str(bad))
