"""The scale model: what one training step costs at a given layout and world size.

:func:`step_flows` lists the bytes of every collective a rank issues per optimizer step on our
training path (DeepSpeed's data-parallel reduction and parameter all-gather, megatron's tensor-
and sequence-parallel collectives, the pipeline's sends, the context-parallel key/value gathers);
:func:`predict` turns them into time over the link each group uses (NVLink inside a node, the
GPU's own NIC across nodes), takes off what overlap hides, and adds the compute at the
hardware's peak and the pipeline bubble: the step time and MFU ``setdiff-train --dry-run
--hardware`` prints and ``benchmarks/scale_model.py`` tabulates. The tests hold the bytes to
what a recording wrapper of ``torch.distributed`` counts on gloo ranks.

Bytes on the wire follow the ring algorithms' convention (what NCCL's bus bandwidth measures):
for a collective over ``w`` ranks on a tensor of ``n`` bytes (all-gather: the gathered output;
reduce-scatter: the whole input), each rank sends ``2 (w-1)/w n`` for an all-reduce and
``(w-1)/w n`` for a reduce-scatter, all-gather, reduce or broadcast (a reduce or broadcast's
root sends nothing and the others about ``n``: ``(w-1)/w n`` is the mean over the ranks that
take turns as root); a point-to-point send is ``n``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

_RING = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "reduce": 1.0,
         "broadcast": 1.0, "all_to_all": 1.0}


def wire_bytes(kind: str, nbytes: float, world: int) -> float:
    """Bytes one rank sends for a collective ``kind`` of ``nbytes`` over ``world`` ranks."""
    if kind == "send":
        return float(nbytes)
    if world <= 1:
        return 0.0
    return _RING[kind] * (world - 1) / world * nbytes


# -- hardware --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    bf16: float          # dense peak FLOP/s of one GPU
    fp8: float
    nvlink: float        # bytes/s one GPU sends inside its node (NVLink, one direction)
    network: float       # bytes/s one GPU sends to other nodes (its own NIC)
    gpus_per_node: int
    source: str


HARDWARE = {
    "h100": Hardware("H100 SXM", 989e12, 1979e12, 450e9, 50e9, 8,
                     "NVIDIA H100 datasheet (dense BF16 989 TFLOP/s, FP8 1979; NVLink 4 900 "
                     "GB/s both ways); DGX H100: one 400 Gb/s ConnectX-7 per GPU"),
    "h200": Hardware("H200 SXM", 989e12, 1979e12, 450e9, 50e9, 8,
                     "NVIDIA H200 datasheet (the H100's compute and NVLink 4, 141 GB HBM3e); "
                     "DGX H200: one 400 Gb/s ConnectX-7 per GPU"),
    "b200": Hardware("B200", 2250e12, 4500e12, 900e9, 50e9, 8,
                     "NVIDIA DGX B200 datasheet (72 PFLOP/s FP8 training per 8 GPUs: 4.5 dense "
                     "per GPU, BF16 half of it; NVLink 5 1.8 TB/s both ways; one 400 Gb/s "
                     "ConnectX-7 per GPU)"),
}
# what real kernels reach of those peaks: NCCL's bus bandwidth is about 80% of the link's on
# NVLink and InfiniBand (nccl-tests); large bf16 GEMMs about 70% of the dense peak
LINK_EFFICIENCY = 0.8
COMPUTE_EFFICIENCY = 0.7


# -- what a step sends -----------------------------------------------------------------------

@dataclasses.dataclass
class Flow:
    """One kind of traffic of a step on one rank: ``calls`` collectives ``kind`` of ``nbytes``
    each over the ``group`` of ``size`` ranks; ``overlap``: what it can hide behind (``None``,
    ``"last_backward"``: the last micro-batch's backward, ``"backward"``: every backward,
    ``"first_forward"``: the next step's first forward, its first call exposed)."""
    name: str
    group: str
    size: int
    kind: str
    nbytes: float
    calls: float
    overlap: Optional[str] = None

    @property
    def wire(self) -> float:
        """Bytes this rank sends for it per step."""
        return wire_bytes(self.kind, self.nbytes, self.size) * self.calls


def step_flows(cfg, plan, stage: int, backend: str = "nccl") -> list[Flow]:
    """The traffic of one optimizer step on a rank of pipeline stage ``stage`` of the dry run's
    ``plan`` (:class:`setdiff_dist.train.plan.Plan`: its world size, data-parallel size,
    micro-batches, and each stage's parameters and layers), as our training path issues it
    (``backend="gloo"``: with gloo's stand-ins where it lacks a collective)."""
    from setdiff_dist.checkpoint.manifest import optimizer_form
    from setdiff_dist.diffusion.kinds import order_of

    par, d, m, z = cfg.parallel, cfg.data, cfg.model, cfg.zero
    tp, pp, cp = par.tensor, par.pipeline, par.context
    zero_dp = plan.data                   # DeepSpeed's data-parallel group: data x context
    micro = plan.micro_batches
    params, layers = plan.stages[stage].params, plan.stages[stage].layers
    e = 2 if cfg.train.precision in ("bf16", "fp8") else 4
    b = d.micro_batch_size
    seq = order_of(cfg.order).model_len(d.seq_len) // cp    # a rank's share of the sequence
    h = m.hidden_size
    first, last = stage == 0, stage == pp - 1
    recompute = cfg.train.recompute == "full"
    flows = []

    # data parallel (ZeRO over data x context-parallel ranks): gradients in fp32
    if zero_dp > 1:
        grads = 4.0 * params
        overlapped = z.overlap_comm
        form = optimizer_form(cfg.to_dict())
        if z.stage == 0 or form == "bf16_optimizer":
            flows.append(Flow("gradient all-reduce", "data", zero_dp, "all_reduce", grads, 1))
        elif z.stage == 1:
            flows.append(Flow("gradient reduce-scatter", "data", zero_dp, "reduce", grads, 1,
                              "last_backward" if overlapped else None))
        else:  # ZeRO-2/3 reduce each micro-batch's gradients
            flows.append(Flow("gradient reduce-scatter", "data", zero_dp, "reduce", grads,
                              micro, "backward" if overlapped else None))
        if z.stage in (1, 2) and z.overlap_param_gather and form == "zero":
            # each bucket broadcast by its owner during the next step's forward
            # (setdiff_dist.train.param_gather): the all-gather's bytes, in buckets
            buckets = zero_dp * math.ceil(params / zero_dp / z.reduce_bucket_size)
            flows.append(Flow("parameter all-gather", "data", zero_dp, "broadcast",
                              e * params / buckets, buckets, "first_forward"))
        elif z.stage in (1, 2):
            flows.append(Flow("parameter all-gather", "data", zero_dp, "all_gather",
                              e * params, 1))
        elif z.stage == 3:  # gathered for each micro-batch's forward and backward
            flows.append(Flow("parameter all-gather", "data", zero_dp, "all_gather",
                              e * params, 2 * micro, "backward"))

    # tensor parallel, per layer and micro-batch: two all-reduces of [s, b, h] forward and two
    # backward; with sequence parallelism an all-gather before each column-parallel linear and a
    # reduce-scatter after each row-parallel one, their transposes in the backward, and the
    # column-parallel inputs gathered again there for the weight gradients. Full recompute runs
    # the forward's twice.
    if tp > 1:
        act = seq * b * h * e             # this rank's [s, b, h] (its context-parallel share)
        logits_in = d.seq_len // cp * b * h * e   # the output projection sees the L noisy tokens
        again = 2 if recompute else 1
        sp = par.sequence_parallel
        if sp:
            gathers, scatters = layers * (2 * again + 4), layers * (2 * again + 2)
            gathers += (1 if first else 0) + (1 if last else 0)  # embedding's split, final gather
            flows.append(Flow("sequence-parallel gathers", "tensor", tp, "all_gather", act,
                              gathers * micro))
            flows.append(Flow("sequence-parallel reduce-scatters", "tensor", tp,
                              "reduce_scatter", act, scatters * micro))
            # the norms' weight gradients are partial sums over the sequence shards
            norms = (2 * layers + (1 if last else 0)) * h * e
            flows.append(Flow("norm gradient all-reduce", "tensor", tp, "all_reduce", norms,
                              micro))
        else:
            flows.append(Flow("activation all-reduce", "tensor", tp, "all_reduce", act,
                              layers * 2 * (again + 1) * micro))
        if first:  # the vocab-parallel embedding sums its rows' parts
            flows.append(Flow("embedding all-reduce", "tensor", tp, "all_reduce", act, micro))
        if last:   # the output projection's input gradient; the vocab-parallel loss: the max,
            # the target logit and the sum of exponentials
            flows.append(Flow("output-input gradient all-reduce", "tensor", tp, "all_reduce",
                              logits_in, micro))
            flows.append(Flow("vocab-parallel loss", "tensor", tp, "all_reduce",
                              d.seq_len // cp * b * 4, 3 * micro))
        flows.append(Flow("batch broadcast", "tensor", tp, "broadcast",
                          _packed_batch_bytes(micro, b, d.seq_len), 1))

    # pipeline: each micro-batch's hidden states forward, their gradient backward
    if pp > 1:
        hidden = seq * b * h * e / (tp if par.sequence_parallel else 1)
        sends = (0 if last else 1) + (0 if first else 1)
        flows.append(Flow("pipeline sends", "pipeline", 2, "send", hidden, sends * micro))
        if (first or last) and m.tie_embeddings:  # its fp32 gradient, summed by both stages
            from setdiff_dist.model.dims import padded_vocab_size

            tied = padded_vocab_size(m.vocab_size, tp) // tp * h
            flows.append(Flow("tied embedding all-reduce", "embedding", 2, "all_reduce",
                              4.0 * tied, 1))

    # context parallel: every layer gathers the keys and values, and sums their gradients
    if cp > 1:
        kv = m.num_query_groups * m.head_dim // tp
        gathered = 2 * (seq * cp) * b * kv * e     # K and V of the whole sequence
        fwd = layers * (2 if recompute else 1)
        flows.append(Flow("context-parallel K/V gather", "context", cp, "all_gather",
                          gathered / 2, 2 * fwd * micro))
        flows.append(Flow("context-parallel K/V gradient", "context", cp,
                          "all_reduce" if backend == "gloo" else "reduce_scatter",
                          gathered / 2, 2 * layers * micro))
    return flows


def _packed_batch_bytes(micro: int, b: int, seq_len: int) -> float:
    from setdiff_dist.data.loader import Batch

    return 8.0 * Batch.packed_size(micro, b, seq_len)


# -- what a step costs -----------------------------------------------------------------------

@dataclasses.dataclass
class StepPrediction:
    hardware: Hardware
    world_size: int
    compute: float       # seconds of model FLOPs at the achievable peak (recompute included)
    bubble: float        # the 1F1B pipeline's idle time
    comm: dict           # flow name -> (bytes per GPU per step, seconds, hidden seconds)
    exposed: float
    step: float
    tokens: int          # data tokens per step
    model_flops: float   # per step, all GPUs

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.world_size * self.hardware.bf16 * self.step)

    def table(self) -> str:
        rows = [f"predicted step on {self.world_size} x {self.hardware.name}: "
                f"{self.step * 1e3:,.0f} ms = compute {self.compute * 1e3:,.0f} ms + bubble "
                f"{self.bubble * 1e3:,.0f} ms + exposed communication {self.exposed * 1e3:,.0f} "
                f"ms; MFU {self.mfu * 100:.1f}%, {self.tokens / self.step / 1e6:,.2f}M tokens/s",
                f"  {'per GPU per step':<34} {'bytes':>10} {'time':>9} {'hidden':>9}"]
        for name, (nbytes, seconds, hidden) in self.comm.items():
            rows.append(f"  {name:<34} {nbytes / 1e9:>8.3f}GB {seconds * 1e3:>7.1f}ms "
                        f"{hidden * 1e3:>7.1f}ms")
        rows.append(f"  (peaks: {self.hardware.source}; kernels at {COMPUTE_EFFICIENCY:.0%} of "
                    f"the compute peak and {LINK_EFFICIENCY:.0%} of the links)")
        return "\n".join(rows)


def _crosses_nodes(cfg, group: str, world: int, gpus_per_node: int) -> bool:
    """Whether ``group``'s ranks sit on several nodes (megatron's rank order tp-cp-dp-pp:
    a group spans the ranks up to its stride times its size)."""
    tp, cp, pp = cfg.parallel.tensor, cfg.parallel.context, cfg.parallel.pipeline
    span = {"tensor": tp, "context": tp * cp, "data": world // pp,
            "pipeline": world, "embedding": world}[group]
    return span > gpus_per_node


def predict(cfg, plan, hardware: str) -> StepPrediction:
    """The predicted step of ``cfg`` on the dry run's ``plan`` (its world size, micro-batches
    and stages) on GPUs of ``hardware``. The slowest stage sets the step."""
    from setdiff_dist.diffusion.kinds import order_of
    from setdiff_dist.model.flops import training_flops_per_token

    hw = HARDWARE[hardware]
    world_size, micro = plan.world_size, plan.micro_batches
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    flops = training_flops_per_token(cfg.model, cfg.data.seq_len,
                                     causal_lm=order_of(cfg.order).causal_lm) * tokens
    peak = (hw.fp8 if cfg.train.precision == "fp8" else hw.bf16) * COMPUTE_EFFICIENCY
    hardware_flops = flops * (4 / 3 if cfg.train.recompute == "full" else 1.0)
    compute = hardware_flops / world_size / peak
    bubble = compute * (cfg.parallel.pipeline - 1) / micro
    backward = compute * 2 / 3            # the backward's share of a step's FLOPs
    best = None
    for stage in range(cfg.parallel.pipeline):
        comm, exposed = {}, 0.0
        for f in step_flows(cfg, plan, stage):
            link = hw.network if _crosses_nodes(cfg, f.group, world_size, hw.gpus_per_node) \
                else hw.nvlink
            seconds = f.wire / (link * LINK_EFFICIENCY)
            room = {"last_backward": backward / micro, "backward": backward,
                    "first_forward": (compute - backward) / micro}.get(f.overlap, 0.0)
            if f.overlap == "first_forward":  # the first layer waits for the first bucket
                tail = seconds / f.calls
            elif f.overlap:  # the last bucket's reduction starts when the backward ends
                tail = seconds * min(1.0, cfg.zero.reduce_bucket_size * 4.0 / max(f.nbytes, 1.0))
            else:
                tail = seconds
            hidden = min(seconds - tail, room) if f.overlap else 0.0
            comm[f.name] = (f.wire, seconds, hidden)
            exposed += seconds - hidden
        if best is None or exposed > best[1]:
            best = (comm, exposed)
    comm, exposed = best
    return StepPrediction(hw, world_size, compute, bubble, comm, exposed,
                          compute + bubble + exposed, tokens, flops)
