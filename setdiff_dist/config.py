"""Typed configuration: one dataclass per component, YAML files, dotted CLI overrides.

A run is described by a YAML file in ``configs/`` (which may ``include:`` others) plus
``section.key=value`` overrides on the command line. :func:`load_config` parses both, checks
every value against its field's type and bounds, runs the cross-field checks of
:func:`validate`, and raises one :class:`ConfigError` that lists *every* problem at once, each
naming its key (with the nearest valid key for a typo). Field ``help`` texts double as the
documentation printed by ``setdiff-config --keys``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from setdiff_dist.config_checks import validate
from setdiff_dist.diffusion.kinds import order_kinds, order_of
from setdiff_dist.errors import SetdiffError

ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "te", "permuted_causal")


def _f(default: Any = dataclasses.MISSING, help: str = "", *, choices=None, min=None, max=None,
       default_factory: Any = dataclasses.MISSING, infinite: bool = False):
    """A dataclass field with its help text and bounds, checked by :func:`load_config`. Float
    fields are finite unless ``infinite`` (NaN never passes)."""
    md = {"help": help, "choices": choices, "min": min, "max": max, "infinite": infinite}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=md)
    return field(default=default, metadata=md)


@dataclass
class ModelConfig:
    num_layers: int = _f(2, "transformer layers", min=1)
    hidden_size: int = _f(64, "model width", min=1)
    num_attention_heads: int = _f(4, "query heads", min=1)
    num_query_groups: Optional[int] = _f(None, "key/value heads for grouped-query attention; "
                                         "null = one per query head", min=1)
    ffn_hidden_size: Optional[int] = _f(None, "MLP width; null = 4 * hidden_size", min=1)
    vocab_size: int = _f(256, "tokenizer vocabulary (the [MASK] id is vocab_size, outside it)",
                         min=2)
    normalization: str = _f("rmsnorm", "normalization layer", choices=("rmsnorm", "layernorm"))
    norm_epsilon: float = _f(1e-5, "epsilon of the normalization layers", min=0.0)
    activation: str = _f("swiglu", "MLP activation", choices=("swiglu", "gelu"))
    tie_embeddings: bool = _f(True, "share the input embedding and the output projection")
    head_dim: Optional[int] = _f(None, "width of one attention head (megatron kv_channels); "
                                 "null = hidden_size / num_attention_heads", min=1)
    qk_norm: bool = _f(False, "RMSNorm / LayerNorm over each head of the queries and keys before "
                       "the rotary embedding (Qwen3's q_norm and k_norm)")
    rotary_base: float = _f(10000.0, "RoPE base (theta)", min=1.0)
    rope_scaling: str = _f("none", "RoPE frequency scaling of Hugging Face's rope_type: none "
                           "(default), linear (positions / factor) or llama3 (Llama 3.1's "
                           "wavelength-dependent interpolation)",
                           choices=("none", "linear", "llama3"))
    rope_scaling_factor: float = _f(1.0, "RoPE scaling factor (linear, llama3)", min=1.0)
    rope_low_freq_factor: float = _f(1.0, "llama3 RoPE scaling: low_freq_factor", min=0.0)
    rope_high_freq_factor: float = _f(4.0, "llama3 RoPE scaling: high_freq_factor", min=0.0)
    rope_original_max_positions: int = _f(8192, "llama3 RoPE scaling: the pretraining context "
                                          "(original_max_position_embeddings)", min=1)
    init_std: float = _f(0.02, "std of the normal weight initialization", min=0.0)
    attention_dropout: float = _f(0.0, "dropout on attention probabilities", min=0.0, max=1.0)
    hidden_dropout: float = _f(0.0, "dropout on residual branches", min=0.0, max=1.0)
    attention_backend: str = _f("auto", "attention kernel: auto (the cheapest for the order: see "
                                "resolve_attention_backend), sdpa (dense mask, CPU reference), "
                                "flex (FlexAttention, GPU), te (Transformer Engine, GPU), "
                                "permuted_causal (causal kernels on the permuted singleton form)",
                                choices=ATTENTION_BACKENDS)
    layer_spec: str = _f("local", "megatron-core layer spec: local (pure torch) or te "
                         "(Transformer Engine, GPU)", choices=("local", "te"))


@dataclass
class OrderConfig:
    kind: str = _f("staggered", "order schedule, one module each in setdiff_dist/diffusion/kinds/: "
                   "causal (plain GPT baseline), autoregressive, masked (MDLM), block (BD3LM), "
                   "staggered (SetDLM), ...", choices=order_kinds())
    mean_set_size: float = _f(4.0, "staggered: target mean set size D", min=1.0)
    max_set_size: Optional[float] = _f(None, "staggered: maximum set size S_max; null = 2 * D",
                                       min=1.0)
    block_size: int = _f(4, "block: block size B (must divide data.seq_len)", min=1)
    t_min: float = _f(0.0, "block / masked: lower clip beta of the per-set diffusion time, "
                      "for training (times are floored at 1e-3 anyway; the likelihood bound "
                      "always uses the unclipped range)", min=0.0, max=1.0)
    t_max: float = _f(1.0, "block / masked: upper clip omega of the per-set diffusion time, "
                      "for training", min=0.0, max=1.0)
    stratified_times: bool = _f(True, "block / masked: draw the diffusion times stratified "
                                "over the global batch, as MDLM's and BD3LM's antithetic "
                                "sampling (sample j of the G in a step takes block b's time "
                                "from stratum j * blocks + b of [t_min, t_max]): the same "
                                "expected loss with less variance; false = an independent "
                                "time per set. The likelihood bound is never stratified")
    training_loss: str = _f("nelbo", "block / masked: what training minimizes: nelbo (each "
                            "predicted token's -log p weighted by the schedule, per target "
                            "token) or masked_mean (the reference's MDLM / BD3LM training "
                            "loss: each sequence's unweighted mean -log p over its masked "
                            "tokens, averaged over the sequences); validation and "
                            "evaluation always report the NELBO bound",
                            choices=("nelbo", "masked_mean"))
    eval_seed: int = _f(20260707, "seed of the fixed evaluation orders (reproducible PPL bounds)",
                        min=0)


@dataclass
class ParallelConfig:
    tensor: int = _f(1, "tensor-parallel size", min=1)
    pipeline: int = _f(1, "pipeline-parallel size", min=1)
    virtual_pipeline: Optional[int] = _f(None, "interleaved pipeline chunks per rank", min=1)
    sequence_parallel: bool = _f(False, "megatron sequence parallelism (needs tensor > 1)")
    context: int = _f(1, "context-parallel size: each sequence split over this many ranks "
                      "(zigzag; attention gathers keys and values): set-diffusion orders with "
                      "the sdpa or permuted_causal backend", min=1)
    backend: str = _f("auto", "torch.distributed backend: auto = nccl with GPUs, else gloo",
                      choices=("auto", "nccl", "gloo"))


@dataclass
class ZeroConfig:
    stage: int = _f(1, "DeepSpeed ZeRO stage: 0 off, 1 optimizer, 2 +gradients, 3 +parameters",
                    min=0, max=3)
    offload_optimizer: str = _f("none", "optimizer state offload", choices=("none", "cpu"))
    offload_params: str = _f("none", "parameter offload (stage 3 only)", choices=("none", "cpu"))
    overlap_comm: bool = _f(True, "reduce gradients during the backward, bucket by bucket, to "
                            "the rank that owns each partition (ZeRO 1/2; at stage 1 once a "
                            "step, in the last micro-batch's backward, from fp32 accumulators); "
                            "false = one reduction after the backward (bf16 ZeRO-1: "
                            "DeepSpeed's BF16_Optimizer, an all-reduce)")
    overlap_param_gather: bool = _f(True, "ZeRO 1/2: gather the updated parameters during the "
                                    "next forward, bucket by bucket in the forward's order, "
                                    "each from the rank that owns it (false: DeepSpeed's "
                                    "all-gather at the end of the optimizer step)")
    reduce_bucket_size: int = _f(40_000_000, "elements per gradient-reduction and parameter "
                                 "all-gather bucket (megatron's default: smaller buckets start "
                                 "the reduction earlier in the backward)", min=1)
    implementation: str = _f("auto", "who runs data parallelism: megatron (ZeRO-1 on "
                             "megatron-core's distributed optimizer: one reduce-scatter and one "
                             "all-gather per bucket, whatever DP is; fp32 or bf16, no optimizer "
                             "offload), fsdp (ZeRO-2 on torch's FSDP2: one all-gather per layer "
                             "and step and one reduce-scatter per layer and micro-batch, whatever "
                             "DP is; fp32 or bf16, no optimizer offload or pipeline parallelism), "
                             "deepspeed (DeepSpeed's ZeRO optimizer: at ZeRO-1/2 a reduce per "
                             "bucket and owner and a broadcast per owner and bucket, O(DP) "
                             "collectives a step) or auto (megatron at ZeRO-1 and fsdp at ZeRO-2 "
                             "where they run, else deepspeed: ZeRO-3, optimizer offload and fp8 "
                             "are DeepSpeed's)",
                             choices=("auto", "deepspeed", "megatron", "fsdp"))
    min_bucket_per_rank: int = _f(1_000_000, "zero.implementation=megatron: a bucket holds at "
                                  "least this many elements per data-parallel rank (megatron's "
                                  "rule: buckets of max(reduce_bucket_size, this x DP), so each "
                                  "rank's share of a collective stays bandwidth-bound as DP "
                                  "grows); 0: exactly reduce_bucket_size", min=0)


@dataclass
class OptimizerConfig:
    name: str = _f("adamw", "optimizer", choices=("adamw",))
    lr: float = _f(3e-4, "peak learning rate", min=0.0)
    min_lr: float = _f(0.0, "floor of the cosine / linear decay", min=0.0)
    betas: list[float] = _f(default_factory=lambda: [0.9, 0.999], help="Adam betas")
    eps: float = _f(1e-8, "Adam epsilon", min=0.0)
    weight_decay: float = _f(0.0, "decoupled weight decay: AdamW's (each step multiplies the "
                             "matrices by 1 - lr x weight_decay), or with "
                             "optimizer.lr_free_weight_decay the reference's", min=0.0)
    lr_free_weight_decay: bool = _f(False, "weight decay as composer's DecoupledAdamW applies it "
                                    "(the paper's CNN/DailyMail and GSM8K reference): each step "
                                    "multiplies the matrices by 1 - (lr / optimizer.lr) x "
                                    "weight_decay, a decay the peak LR does not scale (run as "
                                    "AdamW with weight_decay / optimizer.lr)")
    schedule: str = _f("constant", "LR schedule after warm-up",
                       choices=("constant", "cosine", "linear"))
    warmup_steps: int = _f(0, "linear warm-up steps", min=0)
    grad_clip: float = _f(1.0, "global gradient-norm clip; 0 = off", min=0.0)

    @property
    def adamw_weight_decay(self) -> float:
        """The weight decay AdamW (torch's, DeepSpeed's, megatron's: decay = lr x wd) is given:
        with ``lr_free_weight_decay`` composer's (lr / peak lr) x wd is the same decay at every
        step of the schedule as AdamW's lr x (wd / peak lr)."""
        if self.lr_free_weight_decay and self.lr > 0:
            return self.weight_decay / self.lr
        return self.weight_decay


@dataclass
class DataConfig:
    train_shards: str = _f("", "training shards: a directory written by setdiff-prep, or a "
                           "blend of several as weight-directory pairs, '0.3 data/web 0.7 "
                           "data/books' (sampled in those proportions; same tokenizer and L)")
    valid_shards: str = _f("", "validation shards (same forms); empty = the 'valid' splits of "
                           "the train_shards directories that have one")
    tokenizer: str = _f("", "tokenizer spec (gpt2, sentencepiece:PATH, bytes, hf:DIR, or a "
                        "directory); empty = the one in the shard manifest")
    seq_len: int = _f(128, "sequence length L (the set-diffusion forward runs on 2L tokens)",
                      min=2)
    micro_batch_size: int = _f(8, "sequences per rank per forward", min=1)
    global_batch_size: int = _f(8, "sequences per optimizer step over all data-parallel ranks",
                                min=1)
    num_workers: int = _f(2, "data-loader worker processes per rank", min=0)
    shuffle: bool = _f(True, "a seeded global shuffle of each epoch (per corpus); false = "
                       "the shards' order")
    verify: str = _f("size", "shard checks when read: size = every file's size and each "
                     "index against its shard (the bytes were hashed by setdiff-prep); full = "
                     "also re-hash each shard on its first use in each process",
                     choices=("size", "full"))
    max_open_shards: int = _f(32, "shards each reader process keeps open (two file handles "
                              "each; least recently used closed first)", min=1)


@dataclass
class TrainConfig:
    steps: int = _f(1000, "optimizer steps", min=1)
    seed: int = _f(1234, "seed of the initialization, the orders and the noise", min=0)
    precision: str = _f("fp32", "fp32, bf16 (bf16 weights and compute, fp32 master weights and "
                        "gradient accumulation in the ZeRO optimizer; needs zero.stage >= 1) or "
                        "fp8 (Transformer Engine layers in FP8 inside bf16 training)",
                        choices=("fp32", "bf16", "fp8"))
    recompute: str = _f("none", "activation recompute (megatron's granularity): none, selective "
                        "(the core attention of every layer: the 2L x 2L scores) or full (whole "
                        "layers, train.recompute_num_layers at a time)",
                        choices=("none", "selective", "full"))
    recompute_num_layers: int = _f(1, "with train.recompute=full: layers per recomputed chunk "
                                   "(megatron's uniform method; more = less memory, same "
                                   "compute)", min=1)
    fp8_recipe: str = _f("delayed", "Transformer Engine FP8 recipe",
                         choices=("delayed", "current"))
    log_interval: int = _f(10, "steps between metric lines", min=1)
    eval_interval: int = _f(0, "steps between validation NELBO runs; 0 = only at the end", min=0)
    eval_batches: int = _f(8, "validation global batches per evaluation: the first "
                           "eval_batches x data.global_batch_size samples of the validation "
                           "split (all of it when smaller), the same on every layout", min=1)
    ema_decay: float = _f(0.0, "keep an exponential moving average of the weights with this "
                          "decay (0.9999 in the paper's recipe; 0 = none): saved with each "
                          "checkpoint (weights_ema/) and what setdiff-generate / -eval / "
                          "-convert read by default (--raw-weights: the raw ones)",
                          min=0.0, max=0.999999999)
    max_nonfinite_steps: int = _f(5, "consecutive non-finite losses tolerated before aborting",
                                  min=1)
    tensorboard: bool = _f(True, "write tensorboard logs into run_dir/tensorboard")
    peak_tflops: Optional[float] = _f(None, "peak dense TFLOP/s of one device, for MFU; null = "
                                      "known GPUs only (H100/H200 bf16: 989)", min=0.0)
    profile_steps: Optional[list[int]] = _f(None, "[a, b]: a torch.profiler trace of steps a "
                                            "to b on every rank, in run_dir/profile/ (open "
                                            "it in Perfetto or tensorboard); null = none",
                                            min=1)
    exit_at_step: Optional[int] = _f(None, "checkpoint and stop after this step (split a run "
                                     "into jobs; resume=auto continues it)", min=1)
    hang_timeout_s: float = _f(600.0, "a rank that makes no progress in the training loop "
                               "for this long (a stuck collective, a stopped process) ends the "
                               "job: its rank and host named, every rank's Python stacks in "
                               "run_dir/watchdog/, exit code 76; 0 = no watch", min=0.0)
    startup_timeout_s: float = _f(900.0, "a rank that makes no progress in the trainer's "
                                  "start-up (process groups, data, model and engine build, a "
                                  "checkpoint's conversion and load) for this long ends the job, "
                                  "named, with every rank's stacks in run_dir/watchdog/, exit "
                                  "code 76; 0 = no watch", min=0.0)
    save_timeout_s: float = _f(900.0, "the same for a checkpoint save (in place of "
                               "train.hang_timeout_s while it writes and hashes its files); 0 = "
                               "no watch of saves", min=0.0)
    straggler_margin: float = _f(0.3, "name a rank whose forward takes more than 1 + this "
                                 "times its pipeline stage's median (a throttled GPU, a noisy "
                                 "neighbour) in the log and metrics.jsonl", min=0.01)
    straggler_intervals: int = _f(3, "log intervals in a row a rank must be over "
                                  "train.straggler_margin to be named a straggler", min=1)
    max_restarts: int = _f(0, "after a rank dies (a crash, a kill, a hang), start every rank "
                           "again from the last checkpoint, at most this many times "
                           "(setdiff-train --nproc-per-node; launchers/slurm/train.sbatch "
                           "passes it to torchrun --max-restarts: restarts inside the job, "
                           "no requeue)", min=0)
    collective_timeout_s: float = _f(1800.0, "the process group's timeout: a collective that "
                                     "waits this long fails (torch.distributed's timeout)",
                                     min=1.0)


@dataclass
class CheckpointConfig:
    interval: int = _f(0, "steps between checkpoints; 0 = only at the end and on signals", min=0)
    keep_last: int = _f(3, "checkpoints to keep; 0 = all", min=0)
    keep_best: bool = _f(False, "keep the checkpoint of lowest validation loss besides the last "
                         "keep_last: a validation (train.eval_interval, and the one at the end) "
                         "that beats every earlier one saves a checkpoint there (unless "
                         "checkpoint.interval saves one anyway) and points checkpoints/best at "
                         "it once it is complete; read it as --checkpoint RUN/checkpoints/best. "
                         "Needs a validation split")
    save_on_signal: bool = _f(True, "checkpoint and exit on SIGTERM / SIGUSR1 (preemption)")
    save_at_end: bool = _f(True, "checkpoint when training ends (false for benchmarks and smoke "
                           "runs, which need no weights; signals and checkpoint.interval still "
                           "save)")
    async_save: bool = _f(False, "copy the state to host memory (shared-memory staging "
                          "buffers, kept from save to save) at the step boundary and write it "
                          "from a writer process per rank while training goes on (a background "
                          "thread hashes it); one save in flight at most, latest moves once it "
                          "is all written; costs the checkpoint's share of each rank in host "
                          "memory, in /dev/shm")
    save_retries: int = _f(0, "a background save (checkpoint.async_save) that fails on any "
                           "rank (a full disk, a lost file system) is known to every rank at "
                           "the next step boundary; with retries left the ranks remove it and "
                           "save again there, at most this many times per start (latest stays "
                           "at the last complete checkpoint meanwhile); 0: the job ends with the "
                           "failure's message and exit code", min=0)
    checksums: bool = _f(True, "write each file's SHA-256 into the checkpoint's manifest and "
                         "check them at resume (the ranks share the hashing, about 1 GB/s "
                         "each); false: sizes only (every other read of a checkpoint, "
                         "init_from and inference, checks the SHA-256 of what it reads)")
    parallel_load: bool = _f(True, "resume: the data-parallel replicas of a model-parallel "
                             "rank each read a share of the files they all load (the module's "
                             "and the client state) and exchange the shares in one all-gather "
                             "per file, so that each byte is read about once in all (megatron's "
                             "fully parallel load); false: every rank reads those files whole "
                             "(DP times the model's bytes from the file system)")
    init_from_hf: str = _f("", "a local Hugging Face Llama / Qwen3 checkpoint directory "
                           "(config.json + safetensors) whose weights start the run when there is "
                           "no checkpoint to resume (resume takes precedence); the model.* keys "
                           "must describe its architecture (setdiff-convert --from-hf DIR "
                           "--print-config prints them)")
    init_from: str = _f("", "a setdiff checkpoint (run, checkpoints or step_* directory) or "
                        "setdiff-convert export whose weights start the run, in any layout, when "
                        "there is no checkpoint to resume (resume takes precedence); the "
                        "optimizer, LR schedule and data position start fresh; the model.* keys "
                        "must match its architecture")


@dataclass
class DecodeConfig:
    """Decoding defaults, saved with every checkpoint: setdiff-generate / setdiff-eval take
    them from the checkpoint's config; a --preset, then each flag, overrides them."""

    window: Optional[int] = _f(None, "candidate window W: the masked positions in [f, f + W), "
                               "f the leftmost masked one; null = the order's mean set size D "
                               "(staggered: the paper's GSM point), the block size (block), 1 "
                               "(autoregressive, causal), 16 (masked)", min=1)
    threshold: float = _f(math.inf, "confidence threshold tau; inf = one token per step",
                          min=0.0, infinite=True)
    greedy: bool = _f(False, "argmax instead of sampling")
    temperature: float = _f(1.0, "sampling temperature", min=0.0)
    top_p: float = _f(1.0, "nucleus sampling mass", min=0.0, max=1.0)
    top_k: int = _f(0, "sample from the k most likely tokens only (before top_p); 0 = all",
                    min=0)
    repetition_penalty: float = _f(1.0, "CTRL-style repetition penalty; 1 = off", min=0.0)
    max_new_tokens: int = _f(128, "length limit of the generated text", min=1)
    stop: list[str] = _f(default_factory=list, help="stop strings (a leading 're:' makes a regex)")
    max_repeat_run: Optional[int] = _f(None, "stop after this many repeats of one token", min=1)
    length_penalty: float = _f(1.0, "raise end-of-text's logit e by |e| (factor^(n - start) - "
                               "1) at a position with n > start generated tokens before it "
                               "(transformers' exponential_decay_length_penalty, as the "
                               "reference's CNN/DM evaluation: 1.1 from 80); 1 = off",
                               min=1.0)
    length_penalty_start: int = _f(0, "the generated tokens after which length_penalty acts",
                                   min=0)


@dataclass
class LoggingConfig:
    """Loggers beside metrics.jsonl and tensorboard (train.tensorboard), on global rank 0."""

    wandb: bool = _f(False, "log the same scalars to Weights & Biases (pip install "
                     "'setdiff-dist[wandb]'); a resumed run continues the same W&B run")
    wandb_project: str = _f("setdiff", "W&B project")
    wandb_run_name: Optional[str] = _f(None, "W&B run name; null = run_dir's name")
    wandb_mode: str = _f("offline", "online (needs WANDB_API_KEY or wandb login) or offline "
                         "(written to run_dir/wandb; upload later with wandb sync)",
                         choices=("online", "offline"))


@dataclass
class Config:
    run_dir: str = _f("runs/default", "directory for logs, metrics and checkpoints")
    resume: str = _f("auto", "auto (latest checkpoint in run_dir, if any), never, or a "
                     "checkpoint path")
    model: ModelConfig = field(default_factory=ModelConfig)
    order: OrderConfig = field(default_factory=OrderConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def zero_implementation(config, saved_before_fsdp: bool = False) -> str:
    """Who runs a config's data parallelism (``zero.implementation`` with ``auto`` resolved):
    ``"megatron"``, ``"fsdp"`` or ``"deepspeed"``. ``config``: a :class:`Config` or a config as
    a dict (a checkpoint's; one from before the key existed ran DeepSpeed's).
    ``saved_before_fsdp``: the config of a checkpoint saved before ``auto`` picked FSDP for
    ZeRO-2 (one whose manifest does not say which ran: DeepSpeed's)."""
    raw = config.to_dict() if isinstance(config, Config) else config
    zero, train = raw.get("zero", {}), raw.get("train", {})
    chosen = zero.get("implementation", "deepspeed")
    if chosen != "auto":
        return chosen
    runs = zero.get("offload_optimizer", "none") == "none" \
        and train.get("precision", "fp32") in ("fp32", "bf16")
    if runs and zero.get("stage", 1) == 1:
        return "megatron"
    if runs and zero.get("stage", 1) == 2 and not saved_before_fsdp \
            and raw.get("parallel", {}).get("pipeline", 1) == 1:
        return "fsdp"
    return "deepspeed"


class ConfigError(SetdiffError, ValueError):
    """Every problem found in a configuration, one per line, each naming its key."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        n = len(self.problems)
        head = f"{n} problem{'s' if n != 1 else ''} in {source}:"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


# ----------------------------------------------------------------------------- schema helpers

def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)  # type: ignore[misc]
            if dataclasses.is_dataclass(f.default_factory)}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys() -> list[str]:
    """Every valid dotted key, e.g. ``order.mean_set_size`` and ``run_dir``."""
    keys = [f.name for f in dataclasses.fields(Config) if f.name not in _sections()]
    for name, cls in _sections().items():
        keys += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def _suggest(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not close:  # a typo in the key part of a dotted key: compare the last part alone
        tail = key.rsplit(".", 1)[-1]
        by_tail = {c.rsplit(".", 1)[-1]: c for c in candidates}
        hit = difflib.get_close_matches(tail, list(by_tail), n=1, cutoff=0.7)
        close = [by_tail[hit[0]]] if hit else []
    return f"; did you mean '{close[0]}'?" if close else ""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} or null"
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, from_cli: bool) -> Any:
    """Convert ``value`` to type ``tp`` or raise TypeError with a short reason."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (from_cli and isinstance(value, str)
                             and value.lower() in ("null", "none")):
            return None
        return _coerce(value, args[0], from_cli)
    if origin is list:
        if from_cli and isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else \
                [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {value!r}")
        return [_coerce(v, typing.get_args(tp)[0], from_cli) for v in value]
    if tp is str:
        if isinstance(value, str):
            return str(value)  # a plain str, also for a raw command-line value
        raise TypeError(f"expected a string, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise TypeError(f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise TypeError(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                f = math.nan
            if math.isfinite(f) and f.is_integer():
                return int(f)
        raise TypeError(f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise TypeError(f"expected a number, got {value!r}")
        f = None
        if isinstance(value, (int, float)):
            f = float(value)
        elif isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                pass
        if f is not None and math.isnan(f):
            raise TypeError(f"expected a number, got {value!r} (not a number)")
        if f is not None:
            return f
        raise TypeError(f"expected a number, got {value!r}")
    raise TypeError(f"unsupported field type {tp}")


def _check_bounds(key: str, value: Any, md: dict, problems: list[str]) -> None:
    if value is None:
        return
    items = value if isinstance(value, list) else [value]
    for v in items:
        if isinstance(v, float) and math.isinf(v) and not md.get("infinite"):
            problems.append(f"{key}: expected a finite number, got {v}")
            continue
        if md.get("choices") is not None and v not in md["choices"]:
            msg = f"{key}: {v!r} is not one of {', '.join(map(str, md['choices']))}"
            close = difflib.get_close_matches(str(v), [str(c) for c in md["choices"]], n=1)
            problems.append(msg + (f"; did you mean {close[0]!r}?" if close else ""))
        if md.get("min") is not None and isinstance(v, (int, float)) and v < md["min"]:
            problems.append(f"{key}: {v} is below the minimum {md['min']}")
        if md.get("max") is not None and isinstance(v, (int, float)) and v > md["max"]:
            problems.append(f"{key}: {v} is above the maximum {md['max']}")


# ----------------------------------------------------------------------------- loading

class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last one
    silently: a second ``order:`` section would drop the first's keys)."""


def _unique_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {key!r} is given twice (lines {seen[key] + 1} and "
                f"{key_node.start_mark.line + 1}): merge them into one", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_yaml(path: str, _seen: Optional[tuple] = None) -> dict:
    """Read a config file, resolving ``include:`` (a path or list, relative to the file) first,
    so that the including file's keys override the included ones."""
    path = os.path.abspath(path)
    _seen = _seen or ()
    if path in _seen:
        raise ConfigError([f"include cycle: {' -> '.join(_seen + (path,))}"], path)
    if not os.path.isfile(path):
        raise ConfigError([f"config file not found: {path}"], path)
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_UniqueKeys) or {}  # noqa: S506 (a safe loader)
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], path) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"not a text file (byte {exc.start} is not UTF-8): give a YAML "
                           "config such as configs/tiny-cpu.yaml"], path) from None
    except OSError as exc:
        raise ConfigError([f"cannot read it: {exc.strerror}"], path) from None
    if not isinstance(data, dict):
        raise ConfigError(["the top level must be a mapping of sections"], path)
    includes = data.pop("include", None) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict = {}
    for inc in includes:
        _deep_merge(merged, read_yaml(os.path.join(os.path.dirname(path), inc), _seen + (path,)))
    _deep_merge(merged, data)
    return merged


def _deep_merge(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v
    return dst


def parse_overrides(overrides: list[str] | tuple[str, ...], problems: list[str]) -> dict:
    """``["order.kind=block", "run_dir=/tmp/x"]`` -> nested dict of raw strings."""
    nested: dict = {}
    for item in overrides:
        if "=" not in item:
            problems.append(f"override {item!r} is not of the form section.key=value")
            continue
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = nested
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                problems.append(f"override {item!r} conflicts with an earlier override")
                break
        else:
            node[parts[-1]] = _CliValue(value)
    return nested


class _CliValue(str):
    """A raw command-line string, parsed according to the field it lands in."""


def _build(cls: type, raw: dict, prefix: str, problems: list[str]):
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            what = ("no longer a setting (remove it)" if key in RETIRED.get(prefix[:-1], ())
                    else "unknown key")
            problems.append(f"{dotted}: {what}"
                            + _suggest(dotted, all_keys() + list(_sections())))
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(f"{dotted}: expected a section (mapping), got {value!r}")
                continue
            kwargs[key] = _build(tp, value, f"{dotted}.", problems)
            continue
        from_cli = isinstance(value, _CliValue)
        if from_cli and tp is not str:
            # numbers, booleans, lists, null: YAML syntax; strings stay raw
            value = yaml.safe_load(str(value)) if str(value).strip() else None
            value = str(value) if tp is str else value
        try:
            kwargs[key] = _coerce(value, tp, from_cli)
        except TypeError as exc:
            problems.append(f"{dotted}: {exc} (type {_type_name(tp)})")
    obj = cls(**kwargs)
    for f in dataclasses.fields(cls):
        if not dataclasses.is_dataclass(hints[f.name]):
            _check_bounds(f"{prefix}{f.name}", getattr(obj, f.name), dict(f.metadata), problems)
    return obj


def load_config(path: Optional[str] = None, overrides: list[str] | tuple[str, ...] = (),
                check: bool = True) -> Config:
    """Build a :class:`Config` from a YAML file and ``section.key=value`` overrides.

    Raises :class:`ConfigError` listing every problem (unknown keys with suggestions, wrong
    types, out-of-range values, conflicting settings)."""
    source = path or "defaults"
    if overrides:
        source += " + command-line overrides"
    problems: list[str] = []
    raw = read_yaml(path) if path else {}
    _deep_merge(raw, parse_overrides(list(overrides), problems))
    cfg = _build(Config, raw, "", problems)
    resolve_attention_backend(cfg)
    resolve_dimensions(cfg.model)
    fit_warmup(cfg)
    if check:
        problems += _cross_checks(cfg, problems)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def fit_warmup(cfg: Config) -> None:
    """A warm-up longer than the run (a config's 2,000 steps, a 10-step try of it) is the
    whole run, in place, said in one line: a short run of a long config just works."""
    opt, steps = cfg.optimizer, cfg.train.steps
    if isinstance(opt.warmup_steps, int) and isinstance(steps, int) and \
            0 < steps < opt.warmup_steps:
        from setdiff_dist.errors import rank_and_world

        if rank_and_world()[0] == 0:
            import sys

            print(f"note: optimizer.warmup_steps={opt.warmup_steps} is longer than "
                  f"train.steps={steps}: the LR warms up over all {steps} steps",
                  file=sys.stderr)
        opt.warmup_steps = steps


def resolve_dimensions(m: ModelConfig) -> None:
    """The widths a model config may leave null, in place, once, where a config is loaded (the
    saved config names them; nothing downstream falls back): ``num_query_groups`` (null = one
    per query head), ``ffn_hidden_size`` (null = 4 x hidden_size) and ``head_dim`` (null =
    hidden_size / num_attention_heads; left null when that does not divide, which validation
    then says)."""
    if m.num_query_groups is None:
        m.num_query_groups = m.num_attention_heads
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = 4 * m.hidden_size
    if m.head_dim is None and m.num_attention_heads and \
            m.hidden_size % m.num_attention_heads == 0:
        m.head_dim = m.hidden_size // m.num_attention_heads


def resolved_model(saved: dict) -> dict:
    """A ``model`` section as saved (a manifest's, a config file's: keys added since take their
    defaults, null widths what :func:`resolve_dimensions` makes of them), comparable with a
    loaded config's ``to_dict()["model"]``; keys this version no longer has stay as they
    are."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    m = dataclasses.replace(ModelConfig(), **{k: v for k, v in saved.items() if k in names})
    resolve_dimensions(m)
    return dict(saved, **dataclasses.asdict(m))


def resolve_attention_backend(cfg: Config) -> None:
    """``model.attention_backend=auto`` becomes the cheapest backend for the order, in place
    (the saved config names the one that ran):

    - the causal LM: ``sdpa`` (causal, no mask tensor);
    - singleton orders (autoregressive, staggered): ``permuted_causal``, causal kernels on the
      reveal order, no mask at all (docs/method.md §3);
    - in-set orders (block, masked): ``flex`` on a GPU (a block mask, built once per
      micro-batch), ``sdpa`` with the dense boolean mask on a CPU;
    - with attention dropout, which only ``sdpa`` has: ``sdpa``."""
    m = cfg.model
    if m.attention_backend != "auto" or cfg.order.kind not in order_kinds():
        return  # (an unknown kind is reported as such)
    order = order_of(cfg.order)
    if order.causal_lm or m.attention_dropout > 0:
        m.attention_backend = "sdpa"
    elif order.singleton:
        m.attention_backend = "permuted_causal"
    elif cfg.parallel.context > 1:  # (flex has no context parallelism)
        m.attention_backend = "sdpa"
    else:
        import torch  # (only here: the config module is read by --help without torch)

        m.attention_backend = "flex" if torch.cuda.is_available() else "sdpa"


def _cross_checks(cfg: Config, field_problems: list[str]) -> list[str]:
    """:func:`validate`, minus conflicts that involve a key already reported as invalid (its
    value was replaced by the default, so the conflict would be about a value nobody wrote)."""
    bad = {p.split(":", 1)[0].split("=", 1)[0] for p in field_problems}
    return [p for p in validate(cfg) if not any(
        re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", p) for k in bad)]


# keys a saved config may hold that this version no longer has (read by nothing): ignored when
# a checkpoint's config is read, refused with a suggestion in a user's config
RETIRED = {"data": ("shuffle_buffer",),
           "optimizer": ("torch_adam",)}  # (torch's AdamW is always the optimizer)


def config_from_dict(raw: dict, check: bool = True) -> Config:
    """Rebuild a config saved with :meth:`Config.to_dict` (e.g. from a checkpoint)."""
    problems: list[str] = []
    raw = dict(raw)
    for section, keys in RETIRED.items():
        if isinstance(raw.get(section), dict):
            raw[section] = {k: v for k, v in raw[section].items() if k not in keys}
    cfg = _build(Config, raw, "", problems)
    resolve_attention_backend(cfg)
    resolve_dimensions(cfg.model)
    fit_warmup(cfg)
    if check:
        problems += _cross_checks(cfg, problems)
    if problems:
        raise ConfigError(problems, "saved config")
    return cfg


def describe() -> str:
    """Every key with its type, default and help: the text behind ``setdiff-config --keys``."""
    lines = []
    defaults = Config()
    for f in dataclasses.fields(Config):
        sec = getattr(defaults, f.name)
        if dataclasses.is_dataclass(sec):
            lines.append(f"{f.name}:")
            hints = _hints(type(sec))
            for g in dataclasses.fields(sec):
                lines.append(_describe_field(f"  {f.name}.{g.name}", hints[g.name],
                                             getattr(sec, g.name), g.metadata))
        else:
            lines.append(_describe_field(f.name, _hints(Config)[f.name], sec, f.metadata))
    return "\n".join(lines)


def _describe_field(key: str, tp: Any, default: Any, md: Any) -> str:
    extra = f" [{' | '.join(map(str, md['choices']))}]" if md.get("choices") else ""
    return f"{key} ({_type_name(tp)}, default {default!r}){extra}: {md.get('help', '')}"
