"""The exponential moving average of the weights (train.ema_decay): what it holds after each
step, its survival through a resume in another layout, and which weights inference reads."""

import pytest
import torch
from helpers import run_train, sonnet_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return sonnet_shards(tmp_path_factory.mktemp("ema"))


COMMON = ("zero.stage=3", "train.ema_decay=0.5", "checkpoint.interval=1", "train.eval_batches=1",
          "optimizer.warmup_steps=0")


def _weights(run, step, raw):
    from setdiff_dist.checkpoint.weights import read_full_state_dict

    return read_full_state_dict(str(run / "checkpoints" / f"step_{step:07d}"), raw=raw)[0]


def test_the_ema_is_the_hand_computed_average_and_survives_a_resume_in_another_layout(
        shards, tmp_path):
    """ZeRO-3 on two ranks (each rank averages its partition; a save gathers them): after step
    k the saved average is 0.5 * (the one after step k-1) + 0.5 * (the weights after step k).
    Stopped at step 2 and resumed on one rank (another data-parallel size), step 3's average is
    the uninterrupted run's."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    res = run_train(straight, shards, *COMMON, steps=3)
    assert res.returncode == 0, res.stderr[-3000:]
    ema = {k: _weights(straight, k, raw=False) for k in (1, 2, 3)}
    raw = {k: _weights(straight, k, raw=True) for k in (1, 2, 3)}
    assert sorted(ema[3]) == sorted(raw[3])
    for k in (2, 3):
        for name, value in ema[k].items():
            want = 0.5 * ema[k - 1][name].float() + 0.5 * raw[k][name].float()
            assert torch.allclose(value.float(), want, atol=1e-6), (k, name)
    assert any(not torch.equal(ema[3][n].float(), raw[3][n].float()) for n in raw[3])
    res = run_train(split, shards, *COMMON, "train.exit_at_step=2", steps=3)
    assert res.returncode == 0, res.stderr[-3000:]
    res = run_train(split, shards, *COMMON, steps=3, nproc=1)
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = _weights(split, 3, raw=False)
    for name, value in ema[3].items():
        assert torch.allclose(resumed[name].float(), value.float(), atol=1e-5), name

    # inference reads the average by default and says so; --raw-weights reads the weights
    from setdiff_dist.checkpoint.weights import provenance

    step3 = str(straight / "checkpoints" / "step_0000003")
    assert provenance(step3)["weights"] == "ema"
    assert provenance(step3, raw=True)["weights"] == "raw"
