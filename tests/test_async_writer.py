"""The writer process of background saves and the host buffers they are staged in
(setdiff_dist.train.writer), in this process: what it writes is what torch writes, its errors
come back as the same errors, and its death is named."""

import errno
import os
import shutil
import signal
from collections import namedtuple

import pytest
import torch

from setdiff_dist.train.writer import Staging, WriterProcess


def _state():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(33, 17, generator=g)
    return {"module": {"w": w, "w_t": w.t(), "bf16": torch.randn(301, generator=g).bfloat16(),
                       "step": torch.tensor(7), "mask": torch.rand(9, generator=g) > 0.5,
                       "empty": torch.zeros(0, 4)},
            "client_state": {"step": 7, "note": "x", "shape": torch.Size([3, 4])}}


@pytest.fixture
def writer():
    staging = Staging()
    w = WriterProcess(staging)
    w.start()
    yield w
    w.close()
    staging.close()


def _staged(staging, obj):
    from setdiff_dist.train.async_save import host_copy

    staging.begin()
    return host_copy(obj, staging.copy)


def test_the_writer_writes_what_torch_writes_from_the_staged_copy(writer, tmp_path):
    state = _state()
    staged = _staged(writer.staging, state)
    assert writer.staging.place(staged["module"]["w"]) is not None and not writer.staging.unstaged
    done = []
    writer.run([(torch.save, (staged, str(tmp_path / "a.pt")), {}),
                (torch.save, (staged["module"], str(tmp_path / "b.pt")), {})],
               lambda: done.append(1))
    assert done == [1, 1]
    torch.save(state, tmp_path / "ref.pt")
    got, want = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "ref.pt")
    for k, v in want["module"].items():
        assert torch.equal(got["module"][k], v) and got["module"][k].dtype == v.dtype, k
    assert got["client_state"] == want["client_state"]
    # a staged tensor is written as its own bytes, not its buffer's
    assert os.path.getsize(tmp_path / "b.pt") < os.path.getsize(tmp_path / "ref.pt") + 4096
    # the next save of the same state fits in the same buffers
    segments = list(writer.staging.segments)
    _staged(writer.staging, state)
    assert writer.staging.segments == segments


def test_an_error_in_the_writer_is_raised_as_the_same_error_and_it_writes_on(writer, tmp_path):
    with pytest.raises(OSError) as info:
        writer.run([(shutil.copyfile, (__file__, "/dev/full"), {}),  # (a full disk)
                    (torch.save, (1, str(tmp_path / "never.pt")), {})], lambda: None)
    assert info.value.errno == errno.ENOSPC and not (tmp_path / "never.pt").exists()
    with pytest.raises(RuntimeError, match="Parent directory"):  # (torch's writer's error)
        writer.run([(torch.save, (1, str(tmp_path / "no" / "x.pt")), {})], lambda: None)
    writer.run([(torch.save, ({"x": 1}, str(tmp_path / "next.pt")), {})], lambda: None)
    assert torch.load(tmp_path / "next.pt") == {"x": 1}


def test_a_writer_that_dies_is_named_and_starts_again(writer, tmp_path):
    os.kill(writer.proc.pid, signal.SIGKILL)
    writer.proc.wait()
    with pytest.raises(RuntimeError, match=r"writer process \(pid \d+\) ended during the save"):
        writer.run([(torch.save, (1, str(tmp_path / "x.pt")), {})], lambda: None)
    writer.start()
    writer.run([(torch.save, (2, str(tmp_path / "x.pt")), {})], lambda: None)
    assert torch.load(tmp_path / "x.pt") == 2


def test_too_little_shared_memory_is_said_once_and_the_save_goes_through_the_pipe(
        writer, tmp_path, monkeypatch, capsys):
    vfs = namedtuple("vfs", "f_bavail f_frsize")
    monkeypatch.setattr(os, "statvfs", lambda _: vfs(16, 4096))  # (64 KiB free)
    state = _state()
    staged = _staged(writer.staging, state)
    _staged(writer.staging, state)
    assert writer.staging.segments == [] and writer.staging.unstaged > 0
    assert capsys.readouterr().err.count("/dev/shm has 0 MiB free") == 1
    writer.run([(torch.save, (staged, str(tmp_path / "a.pt")), {})], lambda: None)
    assert torch.equal(torch.load(tmp_path / "a.pt")["module"]["w"], state["module"]["w"])


def test_a_segment_cuda_cannot_page_lock_stays_pageable_with_one_note(monkeypatch, capsys):
    """(CUDA's runtime stood in for: this machine has none; the GPU tests pin for real.) A
    refused registration (a locked-memory limit) leaves that segment pageable, says so once,
    and is never unregistered; a registered one is unregistered at close."""
    from setdiff_dist.train import writer as writer_module

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr))
            return 2 if len(calls) == 1 else 0  # (cudaErrorMemoryAllocation, then success)

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

        def cudaGetErrorString(self, res):
            return "out of memory"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    monkeypatch.setattr(writer_module, "_MIN_SEGMENT", 1 << 20)
    staging = Staging()
    try:
        staging.begin()
        staging.copy(torch.zeros(1 << 20, dtype=torch.uint8))
        staging.copy(torch.zeros(3 << 20, dtype=torch.uint8))  # (more than the first holds)
        staging.begin()
        staging.copy(torch.zeros(16, dtype=torch.uint8))
        first, second = (ptr for kind, ptr in calls if kind == "register")
    finally:
        staging.close()
    assert calls[2:] == [("unregister", second)], calls
    err = capsys.readouterr().err
    assert err.count("could not be page-locked (out of memory)") == 1, err
