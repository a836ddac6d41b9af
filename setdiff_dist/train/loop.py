"""The training loop: data -> objective -> DeepSpeed engine, with metrics and validation.

One optimizer step consumes a global batch of ``data.global_batch_size`` sequences. Its loss is
the exact per-token mean over the *whole* global batch: every rank knows its target-token count
before the forward (from the padding and context masks), the counts are summed over the
data-parallel group, and each micro-batch's loss sum is scaled so that DeepSpeed's gradient
averaging over micro-batches and ranks yields ``sum / global_tokens``. The loss curve therefore
does not depend on the data-parallel size or on how the batch is split into micro-batches.

A step whose loss is not finite on any rank is skipped on all of them (its micro-batches
back-propagate zero, and the optimizer runs at LR 0) and counted; after
``train.max_nonfinite_steps`` in a row the run aborts.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from setdiff_dist.checkpoint.files import resume_path
from setdiff_dist.checkpoint.format import trace_file
from setdiff_dist.checkpoint.manifest import check_resume, saved_config
from setdiff_dist.checkpoint.reading import TALLY, collective_device, gather_into, megabytes
from setdiff_dist.data.blend import Blend
from setdiff_dist.data.loader import Batch, TokenLoader, fixed_batches
from setdiff_dist.data.shards import ShardSet
from setdiff_dist.data.tokenizers import load_shipped_tokenizer, load_tokenizer
from setdiff_dist.diffusion import perplexity_bound
from setdiff_dist.errors import Diverged, TrainingError
from setdiff_dist.model.flops import training_flops_per_token
from setdiff_dist.model.load import init_from_weights
from setdiff_dist.model.pipeline import forward_backward
from setdiff_dist.model.transformer import build_model, transformer_config
from setdiff_dist.objective import Objective
from setdiff_dist.parallel import initialize_model_parallel
from setdiff_dist.progress import progress

from . import checkpoint
from .async_save import AsyncSaver
from .ema import EMA, load_ema
from .engine import (
    GradientSync,
    build_engine,
    check_precision,
    compute_dtype,
    follow_schedule,
    micro_batches_per_step,
    partitioned_construction,
    schedule_changes,
    time_gradient_reduction,
)
from .metrics import MetricsLogger, check_loggers
from .optimizer_state import deepspeed_form_change
from .param_gather import ParamPrefetch
from .timers import PhaseTimers, Profile, Stragglers
from .watchdog import Watchdog, startup_watch

# what a signal asks for, by precedence: a preemption (requeue) outranks a user's pause
STOPS = {signal.SIGINT: "paused", signal.SIGTERM: "preempted", signal.SIGUSR1: "preempted"}
_STOP_CODE = {None: 0, "paused": 1, "preempted": 2}
_STOP_OF = {code: stop for stop, code in _STOP_CODE.items()}


def open_data(cfg):
    """``(train blend, validation blend or None, tokenizer)`` of a run, each checked against
    the config (sequence length, tokenizer, vocabulary): no process group, no model."""
    d = cfg.data
    want_sha = load_tokenizer(d.tokenizer).sha256 if d.tokenizer else None
    opts = {"seq_len": d.seq_len, "verify": d.verify, "max_open": d.max_open_shards}
    train = Blend.open(d.train_shards, "train", tokenizer_sha256=want_sha, **opts)
    tok = load_shipped_tokenizer(train.directory, train.manifest["tokenizer"])
    opts["tokenizer_sha256"] = tok.sha256
    valid = None
    if d.valid_shards:
        valid = Blend.open(d.valid_shards, "valid", **opts)
    else:  # the valid splits of the training corpora that have one, in the same proportions
        have = [(w, s.directory) for w, s in zip(train.shares, train.sets)
                if "valid" in s.manifest["splits"]]
        if have:
            valid = Blend([ShardSet(s, "valid", **opts) for _, s in have],
                          [w for w, _ in have], [s for _, s in have])
    if valid is None and cfg.checkpoint.keep_best:
        from setdiff_dist.config import ConfigError

        raise ConfigError(["checkpoint.keep_best=true keeps the checkpoint of lowest "
                           "validation loss, but the data has no validation split: set "
                           "data.valid_shards, prepare the training shards with one "
                           "(setdiff-prep --valid-every N), or set checkpoint.keep_best=false"])
    if tok.vocab_size > cfg.model.vocab_size:
        raise TrainingError(f"the shards' tokenizer has {tok.vocab_size} tokens but "
                            f"model.vocab_size={cfg.model.vocab_size}; set "
                            f"model.vocab_size={tok.vocab_size}")
    return train, valid, tok


def _fault_at_startup(phase: str) -> None:
    """Fault injection for the start-up watch's tests: ``SETDIFF_FAULT=hang_startup:PHASE:RANK``
    stops rank RANK (the launch's) without progress at the end of its start-up's PHASE (one of
    :data:`~setdiff_dist.train.watchdog.STARTUP_PHASES`), in the job's first start only."""
    from .watchdog import restart_count

    fault = os.environ.get("SETDIFF_FAULT", "")
    if fault == f"hang_startup:{phase}:{os.environ.get('RANK')}" and not restart_count():
        checkpoint.hang_here()


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        check_precision(cfg)
        check_loggers(cfg)
        # the start-up is watched from here (train.startup_timeout_s), by the launch's rank
        # where the process group does not exist yet
        launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        self._startup = startup_watch(cfg, int(os.environ["RANK"]),
                                      int(os.environ["WORLD_SIZE"])) if launched else None
        self._phase = "start-up"
        try:
            self._start(cfg)
            _fault_at_startup(self._phase)
        finally:
            if self._startup is not None:
                self._startup.close()
            self._startup = None

    def _starting(self, phase: str) -> None:
        """The start-up moves on to ``phase`` (the hang watch's report names it)."""
        _fault_at_startup(self._phase)
        self._phase = phase
        if self._startup is not None:
            self._startup.beat(phase)

    def _start(self, cfg) -> None:
        par = cfg.parallel
        initialize_model_parallel(par.tensor, par.pipeline, par.virtual_pipeline,
                                  seed=cfg.train.seed, backend=par.backend, context=par.context)
        if self._startup is None and cfg.train.startup_timeout_s \
                and dist.get_world_size() > 1:
            self._startup = startup_watch(cfg, dist.get_rank(), dist.get_world_size())
        self.rank = dist.get_rank()
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        self.train_set, self.valid_set, self.tokenizer = open_data(cfg)
        self.resume_path = resume_path(cfg)  # None: a fresh run
        TALLY.reset()  # (what the resume reads of the checkpoint: checksums and loads)
        # before any model is built: a refusal costs seconds, not minutes (None: a fresh run)
        self.resume_manifest = self._check_resume()
        config = transformer_config(cfg.model, par.tensor, par.pipeline,
                                    sequence_parallel=par.sequence_parallel,
                                    fp8_recipe=cfg.train.fp8_recipe
                                    if cfg.train.precision == "fp8" else None,
                                    compute_dtype=compute_dtype(cfg.train.precision),
                                    recompute=cfg.train.recompute,
                                    recompute_num_layers=cfg.train.recompute_num_layers)
        self._starting("model build")
        self.model = self._initial_model(config).to(self.device)
        # a checkpoint of another data-parallel size resumes through its universal form
        self.universal = self.resume_path is not None and \
            checkpoint.needs_universal(self.resume_path, cfg)
        decay_rule = checkpoint.decay_rule(self.resume_path, self.resume_manifest, cfg,
                                           self.universal)
        if self.rank == 0 and self.resume_path is not None:
            checkpoint.say_decay_rule(self.resume_path, cfg, decay_rule)
        self._starting("engine build")
        self.engine = build_engine(cfg, self.model, load_universal=self.universal,
                                   decay_rule=decay_rule)
        # the EMA of the weights starts at the initial weights (or the checkpoint's, on resume)
        self.ema = EMA(self.engine.module, cfg.train.ema_decay) if cfg.train.ema_decay else None
        self.sync = GradientSync(self.engine)  # where gradients accumulate, when they reduce
        self.timers = PhaseTimers(Stragglers(cfg.train.straggler_margin,
                                             cfg.train.straggler_intervals))
        # a test's stand-in for a throttled device: this rank's forwards take longer
        slow = os.environ.get("SETDIFF_TEST_SLOW_RANK", "")  # "RANK:SECONDS", tests only
        self._slow_forward = float(slow.split(":")[1]) if slow and \
            int(slow.split(":")[0]) == self.rank else 0.0
        time_gradient_reduction(self.engine, self.timers)
        # ZeRO's gather of the updated parameters, overlapped with the next forward (None: the
        # optimizer gathers them at the end of its step, or does not shard them)
        self.prefetch = ParamPrefetch.maybe(
            self.engine, cfg, timed=lambda fn: self.timers.timed("param_gather", fn))
        self.objective = Objective(cfg, seed=cfg.train.seed)
        self.eval_objective = Objective(cfg, seed=cfg.order.eval_seed, stream=1, evaluation=True)
        self.n_micro = micro_batches_per_step(cfg, self.dp)
        self.step = 0
        self.samples_seen = 0
        self.nonfinite_in_a_row = 0
        self.skipped_steps = 0
        # checkpoint.keep_best: the lowest validation loss so far (its checkpoint is ``best``)
        self.best_loss = math.inf
        self.stop_requested: Optional[str] = None  # "paused" / "preempted", by a signal
        # checkpoint.async_save: the background writer (one save in flight at most)
        self.saver = AsyncSaver() if cfg.checkpoint.async_save else None
        self.save_retries_left = cfg.checkpoint.save_retries
        # run by the hang watch just before this rank exits (setdiff-train records the outcome)
        self.on_hang: Optional[Callable[[dict], None]] = None
        # the wall time of the last completed step (the exit status records it); and, when
        # this start follows another of the job (an in-job restart, a requeue), ("restart N" or
        # "requeue N", the wall time of the previous start's last step, that step), which
        # setdiff-train sets for the first step to report the time lost
        self.last_step_at: Optional[float] = None
        self.restarted_after: Optional[tuple] = None
        self._starting("checkpoint load")
        self.resumed_from = self._resume()

    # -- set-up ------------------------------------------------------------------------------
    def _initial_model(self, config):
        """Weights drawn from the seed, or those of a Hugging Face checkpoint
        (``checkpoint.init_from_hf``, read per rank in this layout) when there is no checkpoint
        to resume: a resumed run continues from its own checkpoint, never from the import."""
        hf = self.cfg.checkpoint.init_from_hf
        if not hf or self.resume_path is not None:
            construct, gathered = partitioned_construction(self.cfg)
            # (weights that init_from or the resume replaces are not drawn first)
            source = self.cfg.checkpoint.init_from if self.resume_path is None else ""
            model = build_model(self.cfg.model, config,
                                seed=None if source else self.cfg.train.seed,
                                construct=construct, gathered=gathered)
            if source:
                from setdiff_dist.checkpoint.weights import LoadError

                try:
                    init_from_weights(model, self.cfg, source, gathered)
                except LoadError as exc:
                    raise TrainingError(str(exc)) from None
                if self.rank == 0:
                    print(f"initialized from the weights of {source}", flush=True)
            return model
        from setdiff_dist.model.hf import HFCheckpointError, build_model_from_hf

        try:
            model = build_model_from_hf(self.cfg.model, config, hf)
        except HFCheckpointError as exc:
            raise TrainingError(f"checkpoint.init_from_hf={hf}: {exc}") from None
        if self.rank == 0:
            print(f"initialized from the Hugging Face checkpoint {hf}", flush=True)
        return model

    def _check_resume(self) -> Optional[dict]:
        """Refuse, before building anything, a checkpoint this run cannot go on from; the
        manifest of the one it can (None: a fresh run)."""
        if self.resume_path is None:
            return None
        return check_resume(self.resume_path, self.cfg, self.tokenizer_identity,
                         checkpoint.layout(), self.loader(0).state_dict(),
                         say=self.rank == 0, group=dist.group.WORLD,
                         form_change=deepspeed_form_change(self.resume_path, self.cfg))

    def _resume(self):
        path = self.resume_path
        if path is None:
            return None
        tag = None
        if self.universal:
            tag = checkpoint.make_universal(
                path, self.model.padded_vocab if self.cfg.zero.stage == 3 else None,
                hashes=self.cfg.checkpoint.checksums)
        state = checkpoint.load(self.engine, path, universal=tag,
                                parallel=self.cfg.checkpoint.parallel_load)["setdiff"]
        # the bytes of checkpoint files each rank read (one small all-gather, once a start)
        device = collective_device()
        every = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
        gather_into(every, torch.tensor([float(TALLY.total)], dtype=torch.float64,
                                        device=device))
        self.resume_reads = [int(b) for b in every.tolist()]
        self.step, self.samples_seen = state["step"], state["samples_seen"]
        self._follow_schedule(path)
        self.skipped_steps = state["nonfinite_skipped_steps"]
        self.nonfinite_in_a_row = state.get("nonfinite_in_a_row", 0)
        self.best_loss = state.get("best_valid_loss", math.inf)
        self.loader(0).load_state_dict(state["loader"])  # same data stream, or a clear error
        if self.ema is not None and not load_ema(self.ema, self.engine.module, path):
            self.ema = EMA(self.engine.module, self.cfg.train.ema_decay)  # from these weights
            if self.rank == 0:
                print(f"note: {path} kept no EMA of the weights; it starts from them now",
                      flush=True)
        return path

    def _follow_schedule(self, path: str) -> None:
        """The LR of every step after a resume is this run's schedule at that step, as in a
        fresh run with this config (the optimizer state and the scheduler's state in the
        checkpoint hold the old one's); a changed schedule is said in one line."""
        old_lr = self.engine.lr_scheduler.get_last_lr()[0]
        new_lr = follow_schedule(self.engine.lr_scheduler, self.cfg, self.step)[0]
        changes = schedule_changes(saved_config(path), self.cfg)
        if changes and self.rank == 0:
            print(f"note: the optimizer settings differ from {path}'s ({'; '.join(changes)}): "
                  f"from step {self.step + 1} on they are this run's, LR {old_lr:.4g} -> "
                  f"{new_lr:.4g} at step {self.step + 1}", flush=True)

    @property
    def tokenizer_identity(self) -> dict:
        return self.train_set.manifest["tokenizer"]

    def whole_weights(self) -> None:
        """Before anything reads the weights outside a forward: the parameter buckets still on
        the wire from the last step arrive (a no-op without ``zero.overlap_param_gather``)."""
        if self.prefetch is not None:
            self.prefetch.finish()
        if hasattr(self.engine, "whole_weights"):  # (megatron's distributed optimizer)
            self.engine.whole_weights()

    def _optimizer_step(self) -> None:
        with self.timers.phase("optimizer"), \
                (self.prefetch.deferring() if self.prefetch else contextlib.nullcontext()):
            self.engine.step()

    def save(self, best: bool = False) -> str:
        """Checkpoint this step (``best``: and point ``best`` at it once it is complete)."""
        progress("checkpoint")  # (the hang watch gives a save train.save_timeout_s)
        if self.saver is not None:
            self._settle_save()  # (the one in flight; a failed one is retried by this save)
        self.whole_weights()
        # one key of our own: DeepSpeed reserves names such as "skipped_steps" in client state
        stream = self.loader(self.step).state_dict()
        state = {"setdiff": {"step": self.step, "samples_seen": self.samples_seen,
                             "nonfinite_skipped_steps": self.skipped_steps,
                             "nonfinite_in_a_row": self.nonfinite_in_a_row,
                             "best_valid_loss": self.best_loss,
                             "loader": stream}}
        return checkpoint.save(self.engine, self.cfg, self.step, state, self.tokenizer_identity,
                               tokenizer_dir=self.train_set.directory, ema=self.ema,
                               data={k: v for k, v in stream.items() if k != "step"},
                               saver=self.saver, best=best)

    def _improves(self, values: dict) -> bool:
        """With ``checkpoint.keep_best``: whether this validation's loss (the same number on
        every rank) is the lowest so far, which its checkpoint then records."""
        loss = values.get("valid_loss", math.inf)
        if not self.cfg.checkpoint.keep_best or not loss < self.best_loss:
            return False
        if self.rank == 0:
            was = f" (was {self.best_loss:.4f})" if math.isfinite(self.best_loss) else ""
            print(f"step {self.step}: validation loss {loss:.4f} is the lowest so far{was}; "
                  "its checkpoint becomes checkpoints/best", flush=True)
        self.best_loss = loss
        return True

    def finish_saving(self) -> None:
        """Wait for the checkpoint still being written in the background (if any): before a
        clean exit, whatever the reason."""
        while self.saver is not None and self._settle_save():
            self.save()  # (a failed save, retried)

    def request_stop(self, signum: int) -> None:
        """Stop at the next step boundary, with a checkpoint: ``"paused"`` on SIGINT,
        ``"preempted"`` on SIGTERM / SIGUSR1 (the stronger request wins)."""
        want = STOPS[signum]
        if _STOP_CODE[want] > _STOP_CODE[self.stop_requested]:
            self.stop_requested = want

    def _agreed_stop(self) -> Optional[str]:
        """The stop any rank was asked for (all ranks stop at the same step boundary), or
        None. The same all-reduce carries whether a rank's background save has failed: then
        every rank raises its save's failure here, at the first step boundary after it (the
        failed rank's write error; the others' save, told of it, fails too), and ``latest``
        stays at the last complete checkpoint."""
        failed = self.saver is not None and self.saver.failed()
        code = torch.tensor([float(_STOP_CODE[self.stop_requested]), float(failed)],
                            device=self.device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        stop, any_failed = code.tolist()
        if any_failed:
            self._failed_save()
        return _STOP_OF[int(stop)]

    def _failed_save(self) -> None:
        """Every rank, at the step boundary after a background save failed on any of them:
        raise the failure, or save again now with a retry left."""
        if self._settle_save():
            with self.timers.phase("checkpoint"):
                self.save()

    def _settle_save(self) -> bool:
        """Wait for the background save in flight (every rank: each one's save ends in the
        failure of any). A failure with ``checkpoint.save_retries`` left: the partial save is
        removed and True returned (the caller saves again, at this step); without: raised."""
        import shutil
        import sys

        from setdiff_dist.checkpoint.format import MANIFEST
        from setdiff_dist.errors import SetdiffError

        try:
            self.saver.wait()
            return False
        except SetdiffError as exc:
            if self.save_retries_left <= 0:
                raise
            self.save_retries_left -= 1
            failed = self.saver.path
            dist.barrier()  # (every rank's writer has stopped)
            if self.rank == 0:
                if failed and not os.path.exists(os.path.join(failed, MANIFEST)):
                    shutil.rmtree(failed, ignore_errors=True)
                print(f"setdiff-train: warning: {exc}. Saving again now, at step {self.step} "
                      f"(checkpoint.save_retries: {self.save_retries_left} left)",
                      file=sys.stderr, flush=True)
            return True

    def loader(self, start_step: int = 0) -> TokenLoader:
        d = self.cfg.data
        return TokenLoader(self.train_set, global_batch=d.global_batch_size,
                           micro_batch=d.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.dp,
                           seed=self.cfg.train.seed, shuffle=d.shuffle,
                           num_workers=d.num_workers, start_step=start_step)

    def _steps(self, loader: TokenLoader):
        """The loader's steps (lists of micro-batches). Only tensor-parallel rank 0
        reads: the step goes to the other ranks of its group in one broadcast (as Megatron
        does), so the data is read once per tensor-parallel group, not once per rank."""
        group = ps.get_tensor_model_parallel_group()
        if ps.get_tensor_model_parallel_world_size() == 1:
            yield from loader
            return
        src = ps.get_tensor_model_parallel_src_rank()
        n_micro, b, L = loader.accumulation, loader.micro_batch, self.cfg.data.seq_len
        steps = iter(loader) if self.rank == src else None
        while True:
            if steps is not None:
                flat = Batch.pack(next(steps)).to(self.device)
            else:
                flat = torch.empty(Batch.packed_size(n_micro, b, L), dtype=torch.long,
                                   device=self.device)
            dist.broadcast(flat, src, group=group)
            yield Batch.unpack(flat, n_micro, b, L)

    # -- one step ------------------------------------------------------------------------------
    # The host waits on the device twice per step, never per micro-batch: once for whether the
    # step's loss is finite (before the optimizer runs) and once for the numbers it reports.
    def _global_tokens(self, micro_batches) -> torch.Tensor:
        """Target tokens of the whole global batch, on the device (no host synchronization)."""
        n = torch.stack([self.objective.target_mask(b).sum() for b in micro_batches]).sum()
        n = n.to(torch.float64).reshape(1)
        dist.all_reduce(n, group=ps.get_data_parallel_group())
        return n

    @staticmethod
    def _sum_from_last_stage(total: torch.Tensor) -> torch.Tensor:
        """``total`` (in place) summed over data-parallel ranks as the last pipeline stage has
        it, on every rank. A NaN or inf on any rank makes it non-finite everywhere."""
        if not ps.is_pipeline_last_stage():
            total.zero_()
        # (context-parallel ranks each hold their tokens' share)
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
        return total

    def _skip_if_nonfinite(self, total: torch.Tensor) -> bool:
        """Whether the step is finite (one host synchronization); if not, its gradients are
        dropped and its LR set to 0, so the optimizer step changes no weight."""
        finite = bool(torch.isfinite(total).all())
        if not finite:
            self.sync.drop()
            self._zero_lr()
        return finite

    def train_step(self, micro_batches) -> dict:
        engine, timers = self.engine, self.timers
        timers.start_step()  # (fit started it before waiting for the batch)
        with timers.phase("data_wait"):
            micro_batches = [b.to(self.device) for b in micro_batches]
            global_tokens = self._global_tokens(micro_batches)
        scale = (self.n_micro * self.dp / global_tokens.clamp_min(1.0)).to(torch.float32)
        # DeepSpeed averages gradients over data x context-parallel ranks, each of which holds
        # its share of the tokens' loss: the context-parallel size makes up for it (megatron's
        # pipeline schedule multiplies its losses by it itself)
        cp = self.cfg.parallel.context
        lr = engine.optimizer.param_groups[0]["lr"]
        local_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        skipped_before = getattr(engine, "skipped_steps", 0)
        if self.cfg.parallel.pipeline == 1:
            # Transformer Engine recasts its FP8 weight copies on a step's first micro-batch
            # only (megatron's schedules set this themselves on the pipeline path)
            engine.module.set_is_first_microbatch()
            for i, b in enumerate(micro_batches):
                with timers.phase("forward"):
                    if self._slow_forward:
                        time.sleep(self._slow_forward)
                    out, terms = self.objective.step(engine, b)
                    total, _ = terms(out)
                    local_sum += total.detach()
                with timers.phase("backward"):  # (the last one reduces: grad_reduce)
                    engine.backward(total * (scale * cp))
                    if i == len(micro_batches) - 1:  # the boundary: DeepSpeed has reduced
                        step_sum = self._sum_from_last_stage(local_sum.reshape(1).clone())
                        finite = self._skip_if_nonfinite(step_sum)
                self._optimizer_step()  # (a micro-batch's: the last one steps)
        else:
            with timers.phase("backward"):  # the schedule, less its forward steps
                stats = forward_backward(engine.module, micro_batches,
                                         self.objective.model_seq_len,
                                         self.cfg.data.micro_batch_size,
                                         timers.timed("forward", self.objective.step),
                                         loss_scale=scale, sync=self.sync)
                for s in stats:
                    local_sum += s["nll_sum"]
                step_sum = self._sum_from_last_stage(local_sum.reshape(1).clone())
                # the schedule has already back-propagated: a non-finite step's gradients are
                # dropped
                finite = self._skip_if_nonfinite(step_sum)
            engine.allreduce_gradients()  # (timed as grad_reduce)
            self._optimizer_step()
        with timers.phase("optimizer"):
            if self.ema is not None:
                self.whole_weights()
                self.ema.update()
            if getattr(engine, "skipped_steps", 0) != skipped_before and engine.lr_scheduler:
                # DeepSpeed skipped the update (a non-finite gradient) and with it the LR
                # schedule: keep the schedule on the trainer's step count, as for a step we
                # skip ourselves
                engine.lr_scheduler.step()
            norm = engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else float("nan")
            loss_sum, tokens = torch.cat([step_sum, global_tokens]).tolist()
        self.step += 1
        self.samples_seen += self.cfg.data.global_batch_size
        timers.end_step()
        # a non-finite gradient norm with a finite loss (an overflow in the backward) is just as
        # fatal if it repeats: count it too (DeepSpeed has skipped the update, except fp32 ZeRO-0)
        if finite and (norm is None or math.isfinite(grad_norm)):
            self.nonfinite_in_a_row = 0
        else:
            self.nonfinite_in_a_row += 1
            self.skipped_steps += 1
            if self.nonfinite_in_a_row >= self.cfg.train.max_nonfinite_steps:
                raise Diverged(
                    f"{self.nonfinite_in_a_row} consecutive steps with a non-finite loss or "
                    f"gradient norm (last at step {self.step}); lower optimizer.lr, check the "
                    "data, or resume from an earlier checkpoint")
        return {"step": self.step, "loss": loss_sum / max(tokens, 1.0) if finite
                else float("nan"), "lr": lr, "grad_norm": grad_norm,
                "samples_seen": self.samples_seen, "target_tokens": tokens,
                "skipped_steps": self.skipped_steps}

    def _zero_lr(self):
        # the scheduler sets every group's LR again at its next step
        for g in self.engine.optimizer.param_groups:
            g["lr"] = 0.0

    # -- validation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """NELBO per token and the PPL bound on the validation set: the first
        ``train.eval_batches x data.global_batch_size`` samples of the validation split (all of
        it when smaller), split over the data-parallel ranks, under fixed orders seeded by each
        sample's index: the same samples, orders and numbers on every layout (summed in
        float64)."""
        if self.valid_set is None:
            return {}
        self.whole_weights()
        d = self.cfg.data
        batches = fixed_batches(self.valid_set, self.cfg.train.eval_batches * d.global_batch_size,
                                d.micro_batch_size, self.dp_rank, self.dp)
        was_training = self.engine.module.training
        self.engine.module.eval()
        self.engine.module.set_is_first_microbatch()  # the weights changed since the last cast
        total = torch.zeros(2, device=self.device, dtype=torch.float64)
        batches = [b.to(self.device) for b in batches]
        if self.cfg.parallel.pipeline == 1:
            for batch in batches:
                progress("eval")
                out, terms = self.eval_objective.step(self.engine.module, batch)
                s, n = terms(out)
                total += torch.stack([s.double(), n.double()])
        else:
            for st in forward_backward(self.engine.module, batches, self.objective.model_seq_len,
                                       d.micro_batch_size, self.eval_objective.step,
                                       forward_only=True):
                total += torch.stack([st["nll_sum"].double(), st["tokens"].double()])
        self.engine.module.train(was_training)
        self._sum_from_last_stage(total)
        per_token = float(total[0] / total[1].clamp_min(1))
        return {"valid_loss": per_token, "valid_ppl_bound": perplexity_bound(per_token),
                "valid_tokens": float(total[1])}

    def _report_restart(self) -> None:
        """Rank 0, after the first step of a start that follows another (an in-job restart,
        a requeue): the time lost, from the previous start's last step to the end of this one,
        and the steps trained again."""
        which, before_at, before_step = self.restarted_after
        self.restarted_after = None
        if self.rank != 0:
            return
        redone = max(int(before_step or 0) - (self.step - 1), 0)
        print(f"{which}: step {self.step} done {self.last_step_at - before_at:.1f} s after the "
              f"previous start's last step (step {before_step}); {redone} step(s) trained "
              f"again from {self.resumed_from or 'the start'}", flush=True)

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> str:
        """Train to ``train.steps``; returns ``"completed"``, ``"paused"`` (``exit_at_step``, or
        SIGINT on any rank) or ``"preempted"`` (SIGTERM / SIGUSR1 on any rank); a stopped run
        saves a checkpoint first. The signal handlers are the caller's (setdiff-train installs
        them from its first line), which hands them on with :meth:`request_stop`."""
        cfg = self.cfg
        L = cfg.data.seq_len
        flops = training_flops_per_token(cfg.model, L, causal_lm=self.objective.order.causal_lm)
        metrics = MetricsLogger(cfg.run_dir, self.rank == 0, cfg.train.steps, flops,
                                dist.get_world_size(), cfg.train.tensorboard, self.step,
                                cfg.train.peak_tflops, cfg=cfg)
        if self.resumed_from and self.rank == 0:
            reads = self.resume_reads
            print(f"resumed from {self.resumed_from} at step {self.step}", flush=True)
            print(f"read at resume: {megabytes(reads[0])} of checkpoint files on rank 0, "
                  f"{megabytes(max(reads))} at most on a rank, {megabytes(sum(reads))} in all",
                  flush=True)
        # a resumed run already has a checkpoint of its first step
        tokens_since, saved_at, outcome = 0, self.step if self.resumed_from else None, "completed"
        timers, profile = self.timers, Profile(cfg.train.profile_steps, cfg.run_dir, self.rank,
                                                  self.whole_weights)
        watchdog = Watchdog(cfg.run_dir, cfg.train.hang_timeout_s, self.rank,
                            dist.get_world_size(), on_hang=self.on_hang,
                            limits={"checkpoint": (cfg.train.save_timeout_s,
                                                   "train.save_timeout_s")}) \
            if cfg.train.hang_timeout_s else None
        try:
            steps = self._steps(self.loader(self.step))
            while self.step < cfg.train.steps:
                if watchdog is not None:
                    watchdog.beat("data_wait", self.step + 1)
                profile.before(self.step + 1)
                timers.start_step()
                with timers.phase("data_wait"):
                    micro_batches = next(steps)
                record = self.train_step(micro_batches)
                self.last_step_at = time.time()
                if self.restarted_after is not None:
                    self._report_restart()
                trace = profile.after(self.step, last=self.step == cfg.train.steps)
                if trace and self.rank == 0:
                    print(f"profiler trace of steps {profile.first}-{self.step}: "
                          f"{os.path.join(os.path.dirname(trace), trace_file('*'))}", flush=True)
                tokens_since += cfg.data.global_batch_size * L
                if self.step % cfg.train.log_interval == 0 or self.step == cfg.train.steps:
                    record.update(timers.report(  # (all ranks)
                        self.device, ps.get_pipeline_model_parallel_rank()))
                    metrics.log(record, tokens_since, record["train_seconds"])
                    tokens_since = 0
                best = False
                if self.step == cfg.train.steps or cfg.train.eval_interval \
                        and self.step % cfg.train.eval_interval == 0:  # (and once at the end)
                    with timers.phase("eval"):
                        values = self.evaluate()
                    if values:
                        metrics.log_eval(self.step, values)
                        best = self._improves(values)
                if best or cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                    with timers.phase("checkpoint"):
                        self.save(best=best)
                    saved_at = self.step
                stop = self._agreed_stop()
                if stop is not None:
                    outcome = stop
                    break
                if cfg.train.exit_at_step and self.step >= cfg.train.exit_at_step:
                    outcome = "paused"
                    break
            # for whoever reads the trained weights next (not after a failure: a dead peer's
            # buckets would never come)
            self.whole_weights()
            if saved_at != self.step and (outcome != "completed" or cfg.checkpoint.save_at_end):
                path = self.save()
                self.finish_saving()
                if self.rank == 0:
                    print(f"checkpoint {path} ({outcome})", flush=True)
            with timers.phase("checkpoint"):
                self.finish_saving()  # (a clean end, a stop on a signal: the save completes)
        finally:
            profile.after(self.step, last=True)  # a stop inside the window keeps its trace
            if self.saver is not None:
                self.saver.close()  # (the writer process and the host buffers)
            metrics.close()
            if watchdog is not None:
                watchdog.close()
        return outcome
