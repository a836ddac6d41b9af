"""``python -m setdiff_dist.train.universal --input_folder STEP --output_folder OUT``: DeepSpeed's
``ds_to_universal`` converter, run on our checkpoints.

Megatron's linear layers save an ``_extra_state`` entry in the module state (Transformer
Engine's FP8 metadata; ``None`` for the local layers), which the converter would take for a
tensor and fail on; the weights themselves come from the ZeRO optimizer's fp32 partitions, so
those entries are left out of what it reads. Everything else is DeepSpeed's converter as is.
"""

from __future__ import annotations

import os
import sys

import torch


def _without_extra_state(load):
    def wrapped(*args, **kwargs):
        state = load(*args, **kwargs)
        if isinstance(state, dict) and isinstance(state.get("module"), dict):
            state["module"] = {k: v for k, v in state["module"].items()
                               if torch.is_tensor(v)}
        return state
    return wrapped


def main(argv=None) -> int:
    from deepspeed.checkpoint import ds_to_universal

    from .checkpoint import CheckpointError, no_unpickling

    sys.argv = ["ds_to_universal"] + list(sys.argv[1:] if argv is None else argv)
    args = ds_to_universal.parse_arguments()
    with no_unpickling():  # nothing in the checkpoint runs code here either
        torch.load = _without_extra_state(torch.load)  # (this process only converts)
        try:
            ds_to_universal.main(args)
        except CheckpointError as exc:
            print(exc, file=sys.stderr)
            return 2
    # the converter points a `latest_universal` file at its output, inside the checkpoint: we
    # never read it (the trainer knows where the universal form is), so it is not left there
    stray = os.path.join(os.path.dirname(os.path.normpath(args.output_folder)), "latest_universal")
    if os.path.isfile(stray):
        os.remove(stray)
    return 0


if __name__ == "__main__":
    sys.exit(main())
