"""The loggers beside metrics.jsonl: tensorboard and, with ``logging.wandb``, Weights & Biases
(offline here: nothing leaves the machine), fed the same records in this process."""

import json
import os
import struct
import time

import pytest


def wandb_history(run_dir) -> dict:
    """``{name: [(step, value)]}`` from the offline W&B run under ``run_dir/wandb``: its
    ``.wandb`` file is a log of protobuf records in 32 KiB blocks (LevelDB's log format), read
    here without the network or W&B's own (online) API."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(run_dir, "wandb"))
              for f in fs if f.endswith(".wandb")]
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, parts, out = 32768, 7, [], {}
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # (a block's tail too short for a header is padding)
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            if record.HasField("history"):
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                for k, v in items.items():
                    if k not in ("step", "_step", "_runtime", "_timestamp"):
                        out.setdefault(k, []).append((items["step"], v))
    return out


def test_wandb_gets_the_scalars_tensorboard_gets(tmp_path):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from setdiff_dist.config import load_config
    from setdiff_dist.train.metrics import MetricsLogger

    cfg = load_config("configs/tiny-cpu.yaml", [f"run_dir={tmp_path}", "logging.wandb=true",
                                                "logging.wandb_mode=offline"])
    logger = MetricsLogger(str(tmp_path), True, 3, 1e6, 2, tensorboard=True, cfg=cfg)
    for step in (1, 2, 3):
        logger.log({"step": step, "loss": 5.0 - step, "lr": 1e-3 * step, "grad_norm": 0.5,
                    "samples_seen": 8 * step}, 1000, 0.5)
    logger.log_eval(3, {"valid_loss": 2.5, "valid_ppl_bound": 12.2})
    logger.close()
    tb = EventAccumulator(str(tmp_path / "tensorboard"))
    tb.Reload()
    board = {tag: [(e.step, e.value) for e in tb.Scalars(tag)] for tag in tb.Tags()["scalars"]}
    # on disk once the logger has closed (it tears W&B's service down); in one CI run the file
    # held no history right after close (before the teardown), so allow its writer a moment
    deadline = time.monotonic() + 30
    while not (ours := wandb_history(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "train/loss" in board and "valid/valid_loss" in board
    assert sorted(ours) == sorted(board)
    for tag, points in board.items():
        assert [s for s, _ in ours[tag]] == [s for s, _ in points], tag
        assert [v for _, v in ours[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag
    # a resumed run goes on in the same W&B run
    assert (tmp_path / "wandb_id").read_text().strip()


def test_wandb_asked_for_without_wandb_is_refused_at_start(monkeypatch):
    import sys

    from setdiff_dist.config import load_config
    from setdiff_dist.errors import TrainingError
    from setdiff_dist.train.metrics import check_loggers

    monkeypatch.setitem(sys.modules, "wandb", None)  # (as if it were not installed)
    cfg = load_config("configs/tiny-cpu.yaml", ["logging.wandb=true"])
    with pytest.raises(TrainingError, match=r"pip install 'setdiff-dist\[wandb\]'"):
        check_loggers(cfg)
    check_loggers(load_config("configs/tiny-cpu.yaml", []))
