"""What a resume reads of a checkpoint: the files every data-parallel replica loads are read in
shares and exchanged (``checkpoint.parallel_load``), so each byte is read about once in all,
and the load equals ``torch.load``'s (setdiff_dist.checkpoint.reading)."""

import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from helpers import curve, train_config  # noqa: E402
from mp_harness import spawn  # noqa: E402

from setdiff_dist.checkpoint.reading import balance, shared_by_replicas  # noqa: E402


def test_shares_are_balanced_by_bytes_and_the_same_on_every_rank():
    sizes = [100, 1, 60, 50, 2, 40]
    owners = balance(sizes, 3)
    assert owners == balance(list(sizes), 3)
    load = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(3)]
    assert sorted(load) == [63, 90, 100]
    assert balance([5], 4) == [0] and balance([], 2) == []


def test_which_files_every_replica_loads():
    shared = ["mp_rank_00_model_states.pt", "layer_03-model_01-model_states.pt",
              "layer_03-model_states.pt", "megatron_dp_model_tp01_pp00.pt"]
    own = ["zero_pp_rank_1_mp_rank_00_model_states.pt",
           "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
           "zero_pp_rank_0_mp_rank_01_optim_states.pt", "megatron_dp_rank00003.pt",
           "rng_rank2.pt"]
    assert all(shared_by_replicas(f"/x/step_0000002/{n}") for n in shared)
    assert not any(shared_by_replicas(f"/x/step_0000002/{n}") for n in own)


def _state():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 33, generator=g)
    return {"module": {"w": base, "w_t": base.t(), "tail": base[5:9],  # (one storage, views)
                       "bf16": torch.randn(300, generator=g).to(torch.bfloat16),
                       "steps": torch.arange(7), "empty": torch.zeros(0)},
            "param": torch.nn.Parameter(torch.ones(3, 4), requires_grad=False),
            "shapes": [{"w": torch.Size([64, 33])}],
            "nested": (1, "two", [torch.full((17,), 3.0)]),
            "client_state": {"step": 4, "note": "x"}}


def _parallel_loads(rank, root, out):
    import torch.distributed as dist

    from setdiff_dist.checkpoint.files import CheckpointError
    from setdiff_dist.checkpoint.reading import TALLY, parallel_load

    dist.init_process_group("gloo")
    zipped, legacy = f"{root}/mp_rank_00_model_states.pt", f"{root}/legacy.pt"
    TALLY.reset()
    got = parallel_load(zipped)
    want = torch.load(zipped)
    share = TALLY.total
    report = {"share": share}
    flat_got, flat_want = [], []

    def leaves(obj, into):
        if isinstance(obj, torch.Tensor):
            into.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                leaves(v, into)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                leaves(v, into)
    leaves(got, flat_got)
    leaves(want, flat_want)
    report["same"] = len(flat_got) == len(flat_want) and all(
        a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        and type(a) is type(b) and torch.equal(a, b) for a, b in zip(flat_got, flat_want))
    m = got["module"]
    report["views_share_a_storage"] = (
        m["w"].untyped_storage().data_ptr() == m["w_t"].untyped_storage().data_ptr()
        == m["tail"].untyped_storage().data_ptr())
    report["size_kept"] = type(got["shapes"][0]["w"]) is torch.Size
    report["rest"] = (got["client_state"], got["nested"][:2])
    m["w"].add_(1)  # (writable, and not the file's pages)
    report["file_unchanged"] = torch.equal(torch.load(zipped)["module"]["w"], want["module"]["w"])
    TALLY.reset()
    report["legacy_same"] = torch.equal(parallel_load(legacy)["module"]["w"], want["module"]["w"])
    report["legacy_read"] = TALLY.total
    try:  # (a rank that loads another file than its group's: every rank says so)
        parallel_load(zipped if rank else f"{root}/other.pt")
        report["mismatch"] = None
    except CheckpointError as exc:
        report["mismatch"] = str(exc)
    torch.save(report, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_a_parallel_load_equals_torch_load_and_each_rank_reads_a_share(tmp_path):
    state = _state()
    torch.save(state, tmp_path / "mp_rank_00_model_states.pt")
    torch.save(state, tmp_path / "other.pt")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    world = 3
    spawn(_parallel_loads, world, str(tmp_path), str(tmp_path))
    reports = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    size = os.path.getsize(tmp_path / "mp_rank_00_model_states.pt")
    storage = 64 * 33 * 4 + 300 * 2 + 7 * 8 + 12 * 4 + 17 * 4
    for r in reports:
        assert r["same"] and r["views_share_a_storage"] and r["size_kept"], r
        assert r["rest"] == ({"step": 4, "note": "x"}, (1, "two")) and r["file_unchanged"]
        # a third of the storages' bytes, and the rest of the file
        assert r["share"] <= size - storage + -(-storage // world), r["share"]
        assert r["legacy_same"] and r["legacy_read"] == os.path.getsize(tmp_path / "legacy.pt")
        assert r["mismatch"] and "loading different files" in r["mismatch"]
    # in all, the storages once and the rest (the pickle, the archive's headers) by every rank
    assert sum(r["share"] for r in reports) == storage + world * (size - storage)
    assert max(r["share"] for r in reports) - min(r["share"] for r in reports) <= world


def _resume_dp4(rank, shards, root, out):
    import torch.distributed as dist

    from setdiff_dist.quiet import quiet

    quiet()
    from setdiff_dist.train.loop import Trainer

    common = ("checkpoint.interval=2", "checkpoint.save_at_end=false", "checkpoint.keep_last=0")
    ref = f"{root}/ref"
    Trainer(train_config(ref, shards, *common, steps=4)).fit()
    found = {"ref": curve(ref)[0]}
    for parallel in (False, True):
        run = f"{root}/parallel-{parallel}"
        dist.barrier()
        if rank == 0:  # (the reference as it was after step 2)
            shutil.copytree(ref, run,
                            ignore=shutil.ignore_patterns(".setdiff.lock", "watchdog"))
            shutil.rmtree(f"{run}/checkpoints/step_0000004")
            with open(f"{run}/checkpoints/latest", "w") as fh:
                fh.write("step_0000002\n")
            os.remove(f"{run}/metrics.jsonl")
        dist.barrier()
        t = Trainer(train_config(run, shards, *common, f"checkpoint.parallel_load={parallel}",
                                 steps=4))
        reads = t.resume_reads
        t.fit()
        found[parallel] = (curve(run)[0], reads)
    files = f"{ref}/checkpoints/step_0000002"
    found["sizes"] = {os.path.relpath(os.path.join(d, n), files): os.path.getsize(
        os.path.join(d, n)) for d, _, names in os.walk(files) for n in names}
    if rank == 0:
        torch.save(found, out)


@pytest.mark.slow
def test_a_resume_at_dp4_reads_each_byte_about_once_and_continues_exactly(sonnets, tmp_path):
    """Four ranks of one model-parallel rank (megatron's distributed optimizer, the default):
    with checkpoint.parallel_load each reads a quarter of the module's file in place of all of
    it, the ranks read about the checkpoint's bytes twice in all (once to check the checksums,
    once to load), and both loads continue the uninterrupted run's losses exactly."""
    out = tmp_path / "found.pt"
    spawn(_resume_dp4, 4, str(sonnets), str(tmp_path), str(out))
    found = torch.load(out)
    ref = found["ref"]
    (whole_curve, whole), (shared_curve, shared) = found[False], found[True]
    assert whole_curve == ref[2:] and shared_curve == ref[2:], (ref, whole_curve, shared_curve)
    sizes = found["sizes"]
    model = sizes["megatron_dp_model_tp00_pp00.pt"]
    checkpoint = sum(sizes.values())
    print(f"bytes read per rank at resume, DP 4: whole files {whole}, shared {shared}; "
          f"model file {model}, checkpoint {checkpoint}")
    # every rank read the model file whole before; a quarter of it (and its pickle) now
    assert all(w - s > model / 2 for w, s in zip(whole, shared)), (whole, shared, model)
    # in all: the checksums read the checkpoint once, the loads about once more (DP times the
    # model file before)
    assert sum(shared) < 2.1 * checkpoint < sum(whole), (shared, whole, checkpoint)
