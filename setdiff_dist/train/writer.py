"""The writer process of background saves (``checkpoint.async_save``), and the host buffers a
save is staged in.

A background save copies the state to host memory at the step boundary and writes it while
training goes on. Written by a thread of the training process, the write (torch's pickler and
zip writer, which hold the GIL) competes with the training thread for the interpreter: on this
machine's CPUs a training loop ran 9% slower while a thread wrote and hashed a 400 MB state, 3%
slower while a process did (``benchmarks/background_writer.py``). So the files are written
by one :class:`WriterProcess` per rank, at the lowest CPU priority, and the training process's
background thread only waits for it.

The copy goes to :class:`Staging`: POSIX shared-memory segments that the writer maps too, so
that nothing is copied again on the way, kept from save to save (a save of the same layout
needs the same room), pinned on a GPU (``cudaHostRegister``) so that the device-to-host copy
runs at full speed, as torchtitan's and DCP's staging buffers are. When shared memory is too
small for a save (a container's default 64 MB ``/dev/shm``), the save says so once and its
tensors travel to the writer through its pipe instead.

The writer runs calls, ``(function, args, kwargs)``, pickled with each staged tensor replaced
by its place in a segment; it answers after each call and names any error, which the parent
raises as the same ``OSError`` (a full disk keeps its errno) or as a ``RuntimeError``. It ends
when its pipe closes, and with its parent (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
from typing import Callable, Optional

import torch

_ALIGN = 64
_MIN_SEGMENT = 64 << 20


class Staging:
    """Host buffers for the state one save copies, reused from save to save: shared-memory
    segments taken in order; :meth:`begin` at the start of each save, :meth:`copy` for each
    tensor."""

    def __init__(self):
        self.segments: list = []  # multiprocessing.shared_memory.SharedMemory
        self._bases: list[torch.Tensor] = []
        self._at = (0, 0)  # (segment, offset) of the next copy
        self.unstaged = 0  # bytes of this save that did not fit (sent through the pipe)
        self._said = False
        self._pinned: set = set()  # data pointers of the segments registered with CUDA
        self._said_pin = False

    def begin(self) -> None:
        self._at, self.unstaged = (0, 0), 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` in a segment (a new one when those there are full and shared
        memory has room), else in private memory."""
        t = t.detach()
        n = t.numel() * t.element_size()
        if n == 0:  # (its own empty storage: a view of a segment would pickle the segment)
            return torch.empty(t.shape, dtype=t.dtype)
        seg, at = self._at
        while seg < len(self.segments):
            at = -(-at // _ALIGN) * _ALIGN
            if at + n <= self.segments[seg].size:
                break
            seg, at = seg + 1, 0
        else:
            if not self._grow(max(n, _MIN_SEGMENT, sum(s.size for s in self.segments))):
                self.unstaged += n
                return t.to("cpu", copy=True)
            seg, at = len(self.segments) - 1, 0
        out = self._bases[seg][at:at + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        self._at = (seg, at + n)
        return out

    def _grow(self, size: int) -> bool:
        from multiprocessing import shared_memory

        try:
            free = os.statvfs("/dev/shm")
            room = free.f_bavail * free.f_frsize
        except OSError:
            room = 0
        if size > room * 0.9:  # (a mapping past the room would fault: SIGBUS, not ENOSPC)
            if not self._said:
                self._said = True
                print(f"note: checkpoint.async_save: /dev/shm has {room / 2**20:.0f} MiB free, "
                      f"a host copy needs {size / 2**20:.0f} MiB more: tensors that do not fit "
                      "go to the writer process through its pipe (slower); give the container "
                      "more shared memory (docker run --shm-size)", file=sys.stderr, flush=True)
            return False
        shm = shared_memory.SharedMemory(create=True, size=size)
        base = torch.frombuffer(shm.buf, dtype=torch.uint8)
        if torch.cuda.is_available():  # pinned: the device-to-host copy at full speed
            self._pin(base, size)
        self.segments.append(shm)
        self._bases.append(base)
        return True

    def _pin(self, base: torch.Tensor, size: int) -> None:
        """Register ``base`` with CUDA (page-locked). Where that fails (a container's locked-
        memory limit), the segment stays pageable, with a note once: slower copies, the same
        bytes. The failure is also the thread's last CUDA error, which the next kernel launch's
        check would raise as its own: it is cleared here."""
        cudart = torch.cuda.cudart()
        res = cudart.cudaHostRegister(base.data_ptr(), size, 0)
        if int(res) == 0:
            self._pinned.add(base.data_ptr())
            return
        try:
            import ctypes

            ctypes.CDLL(None).cudaGetLastError()  # (torch loads libcudart globally)
        except (OSError, AttributeError):
            pass
        if not self._said_pin:
            self._said_pin = True
            try:
                why = cudart.cudaGetErrorString(res)
            except (TypeError, RuntimeError):
                why = f"cudaError {int(res)}"
            print(f"note: checkpoint.async_save: the host copy could not be page-locked ({why}):"
                  " it stays pageable, and the device-to-host copies are slower; raise the "
                  "locked-memory limit (ulimit -l, docker run --ulimit memlock=-1)",
                  file=sys.stderr, flush=True)

    def place(self, t: torch.Tensor) -> Optional[tuple]:
        """``(segment name, offset)`` of a tensor :meth:`copy` staged, else None."""
        ptr = t.data_ptr()
        for shm, base in zip(self.segments, self._bases):
            if base.data_ptr() <= ptr < base.data_ptr() + shm.size:
                return shm.name, ptr - base.data_ptr()
        return None

    def close(self) -> None:
        """Unmap and remove the segments (a staged tensor still held keeps its mapping until
        it is freed; the name goes now)."""
        segments, bases = self.segments, self._bases
        self.segments, self._bases = [], []
        for base in bases:
            if base.data_ptr() in self._pinned:
                self._pinned.discard(base.data_ptr())
                torch.cuda.cudart().cudaHostUnregister(base.data_ptr())
        del bases
        for shm in segments:
            try:
                shm.close()
            except BufferError:
                pass
            shm.unlink()


def _send(pipe, message) -> None:
    pipe.write(struct.pack("<Q", len(message)) + message)
    pipe.flush()


def _receive(pipe) -> Optional[bytes]:
    head = pipe.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    body = pipe.read(n)
    return body if len(body) == n else None


class WriterProcess:
    """One rank's writer: :meth:`run` sends it calls and waits for them (from the background
    save's thread). Started at the first save, ended by :meth:`close`."""

    def __init__(self, staging: Staging):
        self.staging = staging
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        """Start the writer if it is not running. From the training thread: the writer ends
        with the thread that started it (``PR_SET_PDEATHSIG`` follows the thread)."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "setdiff_dist.train.writer"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def run(self, calls: list, done: Callable[[], None]) -> None:
        """Each ``(function, args, kwargs)`` of ``calls`` in the writer (:meth:`start`), in
        order, ``done()`` after each; its error raised here."""
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)

        def persistent_id(obj):
            if isinstance(obj, torch.Tensor) and obj.is_contiguous():
                where = self.staging.place(obj)
                if where is not None:
                    return ("staged", *where, str(obj.dtype).split(".")[1], tuple(obj.shape))
            return None

        pickler.persistent_id = persistent_id
        pickler.dump(calls)
        try:
            _send(self.proc.stdin, buf.getvalue())
        except (BrokenPipeError, OSError):
            pass  # (the answer below says what became of it)
        del buf
        for _ in calls:
            answer = _receive(self.proc.stdout)
            if answer is None:
                code = self.proc.wait()
                raise RuntimeError(f"the checkpoint writer process (pid {self.proc.pid}) ended "
                                   f"during the save (exit code {code}; killed for memory?)")
            kind, *rest = pickle.loads(answer)
            if kind == "error":
                raise _error(*rest)
            done()

    def close(self, wait: bool = True) -> None:
        """End the writer: once it has written what it was sent (``wait``), else now."""
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                if not wait:
                    self.proc.kill()
                self.proc.wait(timeout=600)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
            self.proc = None


def _error(name: str, message: str, os_error) -> BaseException:
    """The writer's error, as the training process would have raised it writing the file
    itself: an ``OSError`` with its errno and file, a ``RuntimeError`` (torch's writer) with its
    message; another named."""
    if os_error is not None:
        return OSError(*os_error)
    if name == "RuntimeError":
        return RuntimeError(message)
    return RuntimeError(f"the checkpoint writer failed: {name}: {message}")


# --------------------------------------------------------------------------- the writer side

def main() -> None:
    """The writer's loop (``python -m setdiff_dist.train.writer``)."""
    from multiprocessing import resource_tracker, shared_memory

    from setdiff_dist.processes import die_with_parent

    die_with_parent()
    try:
        os.nice(19)
    except OSError:
        pass
    segments: dict = {}

    def segment(name):
        if name not in segments:
            shm = shared_memory.SharedMemory(name=name)
            # (the parent owns it: the tracker of this process must not remove it at exit)
            resource_tracker.unregister(shm._name, "shared_memory")
            segments[name] = shm
        return segments[name]

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            _, name, offset, dtype, shape = pid
            dtype = getattr(torch, dtype)
            numel = 1
            for d in shape:
                numel *= d
            if numel == 0:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(segment(name).buf, dtype=dtype, count=numel,
                                    offset=offset).view(shape)

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # (what a call prints must not reach the pipe)
    while True:
        message = _receive(stdin)
        if message is None:
            return
        try:
            calls = Unpickler(io.BytesIO(message)).load()
            for fn, args, kwargs in calls:
                fn(*args, **kwargs)
                _send(stdout, pickle.dumps(("done",)))
        except Exception as exc:  # noqa: BLE001 (told to the parent, which raises it)
            os_error = (exc.errno, exc.strerror) + ((exc.filename,) if exc.filename else ()) \
                if isinstance(exc, OSError) and exc.errno is not None else None
            _send(stdout, pickle.dumps(("error", type(exc).__name__, str(exc), os_error)))
        calls = None


if __name__ == "__main__":
    main()
