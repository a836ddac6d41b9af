"""The exponential moving average of the weights (train.ema_decay): what it holds after each
step, its survival through a resume in another layout, and which weights inference reads."""

import torch
from helpers import EMA_RUN, REFERENCE, REFERENCE_STEPS, rewound, run_train


def _weights(run, step, raw):
    from setdiff_dist.checkpoint.weights import read_full_state_dict

    return read_full_state_dict(str(run / "checkpoints" / f"step_{step:07d}"), raw=raw)[0]


def test_the_ema_is_the_hand_computed_average_and_survives_a_resume_in_another_layout(
        trained, sonnets, tmp_path):
    """ZeRO-3 on two ranks (each rank averages its partition; a save gathers them): after step
    k the saved average is 0.5 * (the one after step k-1) + 0.5 * (the weights after step k).
    Rewound to step 3 and resumed on one rank (another data-parallel size), the last step's
    average is the uninterrupted run's."""
    straight = trained(*EMA_RUN)
    last = REFERENCE_STEPS
    ema = {k: _weights(straight, k, raw=False) for k in range(1, last + 1)}
    raw = {k: _weights(straight, k, raw=True) for k in range(1, last + 1)}
    assert sorted(ema[last]) == sorted(raw[last])
    for k in range(2, last + 1):
        for name, value in ema[k].items():
            want = 0.5 * ema[k - 1][name].float() + 0.5 * raw[k][name].float()
            assert torch.allclose(value.float(), want, atol=1e-6), (k, name)
    assert any(not torch.equal(ema[last][n].float(), raw[last][n].float()) for n in raw[last])
    split = rewound(straight, tmp_path)
    res = run_train(split, sonnets, *REFERENCE, *EMA_RUN, steps=last, nproc=1)
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = _weights(split, last, raw=False)
    for name, value in ema[last].items():
        assert torch.allclose(resumed[name].float(), value.float(), atol=1e-5), name

    # inference reads the average by default and says so; --raw-weights reads the weights
    from setdiff_dist.checkpoint.weights import provenance

    step = str(straight / "checkpoints" / f"step_{last:07d}")
    assert provenance(step)["weights"] == "ema"
    assert provenance(step, raw=True)["weights"] == "raw"
