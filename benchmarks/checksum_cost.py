"""What checking every weights file's SHA-256 on read costs, beside the read itself, on the
110m shape (the paper's DiT-sized model: ~108M parameters, ~0.43 GB in fp32).

    python benchmarks/checksum_cost.py [--config configs/models/110m.yaml] [--rounds 5]

It writes an export of that shape (random weights under the trained model's global names, from
a meta-device build of the megatron-core model), then, interleaved over ``--rounds`` rounds (the
page cache warm, as on a second read), times:

- ``hash``: :func:`check_weight_files` (sizes and SHA-256 of every file read);
- ``read``: ``open_weights(checksums=False)`` and every tensor read in full;
- ``load``: ``build_inference_model`` (which checks), the whole load a command does.

and prints the medians and the ratios hash / read and hash / load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shapes(cfg) -> dict:
    """Global parameter name -> shape of the model of ``cfg`` at TP = PP = 1 (meta device)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from setdiff_dist.model.transformer import (
        SetDiffusionTransformer,
        global_name,
        transformer_config,
    )
    from setdiff_dist.parallel import cpu_compat

    cpu_compat.apply()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(create_gloo_process_groups=False)
        with torch.device("meta"):
            model = SetDiffusionTransformer(cfg.model, transformer_config(cfg.model))
        return {global_name(model, n): tuple(p.shape) for n, p in model.named_parameters()
                if not (n.startswith("output_layer") and model.tie)}
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _export(cfg, out: str) -> int:
    import torch

    from setdiff_dist.checkpoint.weights import VOCAB_ROWS, write_export
    from setdiff_dist.data.tokenizers import load_tokenizer

    g = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in _shapes(cfg).items():
        if name in VOCAB_ROWS:  # (an export keeps the real rows: vocabulary + [MASK])
            shape = (cfg.model.vocab_size + 1, *shape[1:])
        state[name] = torch.randn(shape, generator=g) * 0.02
    write_export(out, state, cfg, load_tokenizer("bytes"), source=out)
    return sum(v.numel() for v in state.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "models", "110m.yaml"))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from setdiff_dist.checkpoint.weights import check_weight_files, open_weights
    from setdiff_dist.config import load_config
    from setdiff_dist.inference.weights import build_inference_model
    from setdiff_dist.parallel import destroy_model_parallel

    cfg = load_config(args.config, [])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "export")
        n = _export(cfg, out)
        size = os.path.getsize(os.path.join(out, "model.safetensors"))
        print(f"{args.config}: {n:,} parameters, model.safetensors {size / 2**30:.2f} GiB")

        def hash_():
            check_weight_files(out)

        def read():
            source = open_weights(out, checksums=False)[0]
            for name in source:
                source[name]

        def load():
            build_inference_model(out, pack=False)
            destroy_model_parallel()

        times = {"hash": [], "read": [], "load": []}
        load()  # (warm: the page cache, the imports, the process group)
        for _ in range(args.rounds):
            for name, fn in (("hash", hash_), ("read", read), ("load", load)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"{k:5s} {v:7.3f} s (median of {args.rounds}; "
                  f"{size / v / 2**30:5.2f} GiB/s)")
        print(f"hash / read = {med['hash'] / med['read']:.2f}x, "
              f"hash / load = {med['hash'] / med['load']:.2f} "
              f"(the share of a load that checking takes)")


if __name__ == "__main__":
    sys.exit(main())
