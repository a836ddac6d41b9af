"""The scale model: what one training step costs at a given layout and world size.

:func:`step_flows` lists every collective a rank issues per optimizer step (how many calls, of
how many bytes, over which group) as a training stack issues them: ours as the config runs it
(:func:`ours`), or another :class:`System` (megatron's distributed optimizer, FSDP) for the
published runs ``benchmarks/scale_model.py`` checks the model against. :func:`predict` turns
them into time with an alpha-beta model of NCCL (:func:`collective_seconds`: a latency by
algorithm, protocol and rank count from NCCL's own tuning tables, plus the bytes over a bus
bandwidth that tells NVLink inside a node from the NICs between nodes, every NIC of a node in
parallel), adds the compute by operation class (:func:`stage_compute`: GEMMs, attention,
memory-bound element-wise work, the optimizer step, kernel launches), takes off only the
communication the system overlaps, and adds the pipeline bubble. Every constant is in
:data:`CONSTANTS` with its source; the fitted ones can be replaced by a file the GPU script
writes from a measured step (``SETDIFF_EFFICIENCY=path``, :func:`load_efficiency`).

Bytes on the wire follow the ring algorithms' convention (what NCCL's bus bandwidth measures):
for a collective over ``w`` ranks on a tensor of ``n`` bytes (all-gather: the gathered output;
reduce-scatter: the whole input), each rank sends ``2 (w-1)/w n`` for an all-reduce and
``(w-1)/w n`` for a reduce-scatter, all-gather, reduce or broadcast (a reduce or broadcast's
root sends nothing and the others about ``n``: ``(w-1)/w n`` is the mean over the ranks that
take turns as root); a point-to-point send is ``n``. The tests hold these bytes to what a
recording wrapper of ``torch.distributed`` counts on gloo ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
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


# -- every constant, with its source ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Constant:
    value: float
    unit: str
    source: str


NCCL_TUNING = "NVIDIA/nccl src/graph/tuning.cc, ncclTunerConstantsDefaults (master, 2026-06)"
NCCL_ALGO_BW = "NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel's busBw factors"
FIT = ("fitted by benchmarks/scale_model.py --fit to Megatron-LM's published H100 table "
       "(Megatron-Core r0.8: 1.7B-32B, MFU 41-49%); tests/gpu/run.sh refits it from a measured "
       "step")
CONSTANTS: dict[str, Constant] = {}


def _const(name: str, value: float, unit: str, source: str) -> None:
    CONSTANTS[name] = Constant(value, unit, source)


PROTOCOLS = ("LL", "LL128", "Simple")
for _algo, _base in {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4),
                     "pat": (8.0, 8.0, 8.0)}.items():
    for _p, _v in zip(PROTOCOLS, _base):
        _const(f"nccl.base_latency.{_algo}.{_p}", _v, "us", NCCL_TUNING + " (baseLatencies)")
for _link, _table in {"nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4),
                                 "pat": (0.0, 0.0, 4.0)},
                      "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0),
                              "pat": (0.0, 0.0, 14.0)}}.items():
    for _algo, _lats in _table.items():
        for _p, _v in zip(PROTOCOLS, _lats):
            _const(f"nccl.hop_latency.{_link}.{_algo}.{_p}", _v, "us",
                   NCCL_TUNING + " (hwLatencies)")
_const("nccl.pat_rank_latency", 2.8, "us per rank", NCCL_TUNING + " (PAT's linear term)")
# the share of the bus bandwidth each algorithm and protocol reaches
for _algo, _factors in {"ring": (0.5, 0.92, 1.0), "tree": (1 / 3.8, 0.92 * 0.85, 0.92 * 0.85),
                        "pat": (0.0, 0.0, 0.75)}.items():
    for _p, _v in zip(PROTOCOLS, _factors):
        _const(f"nccl.bandwidth_share.{_algo}.{_p}", _v, "x bus bandwidth", NCCL_ALGO_BW)
_const("link.nvlink_efficiency", 0.8, "x NVLink peak",
       "nccl-tests all_reduce_perf on 8x H100 SXM: ring ~360 GB/s bus bandwidth of 450 "
       "(NVLink SHARP reaches 460-480: docs.alayanew.com 'NCCL-tests in practice', 2026-05)")
_const("link.nic_efficiency", 0.9, "x NIC line rate",
       "nccl-tests across nodes: 8 x 400 Gb/s ConnectX-7 per node give ~360 GB/s bus bandwidth "
       "per GPU (45 of 50 GB/s per NIC)")
# compute: each kernel costs a fixed time plus its work at its class's efficiency
_const("gemm.efficiency", 0.66, "x dense peak", FIT)
_const("gemm.fixed_us", 0.0, "us per GEMM", FIT)
for _kernel, (_fwd, _bwd, _src) in {
        "cudnn": (0.60, 0.45, "FlashAttention-3 (Shah et al. 2024) figs. 5-6, bf16 head dim 128 "
                              "at 4k-16k tokens on H100 SXM: 600-740 TFLOP/s forward, 450-550 "
                              "backward; cuDNN's fused attention (Transformer Engine) is close"),
        "flash": (0.35, 0.30, "FlashAttention-3 paper: FlashAttention-2 (torch's sdpa flash "
                              "kernel) reaches ~35% of the H100's peak"),
        "flex": (0.32, 0.26, "PyTorch FlexAttention blog (2024-08): ~90% of FlashAttention-2 "
                             "forward, ~85% backward"),
        "dense": (0.20, 0.15, "estimate: sdpa's memory-efficient kernel with a dense mask "
                              "(no Hopper tensor-memory path, computes every pair)")}.items():
    _const(f"attention.{_kernel}.forward", _fwd, "x dense peak", _src)
    _const(f"attention.{_kernel}.backward", _bwd, "x dense peak", _src)
_const("step.fixed_ms", 90.0, "ms per step", FIT + " (the iteration's host-side work: data, "
       "logging, the optimizer's launches)")
_const("hbm.efficiency", 0.9, "x HBM peak",
       "STREAM-like copy kernels on H100 reach ~3.0 of 3.35 TB/s (nvbandwidth, device memcpy)")
_const("kernel.fixed_us", 4.0, "us per non-GEMM kernel",
       "estimate: CUDA launch and tail of a small kernel (~2-5 us on H100, eager PyTorch)")
_const("optimizer.bytes_per_param", 30.0, "bytes per parameter of a shard",
       "AdamW on fp32 master weights: read and write master, m, v (24), read the fp32 gradient "
       "(4), write the bf16 weight (2)")
_const("grad_accum.bytes_per_param", 10.0, "bytes per parameter per micro-batch",
       "DeepSpeed's fp32 accumulation of each bf16 gradient outside the GEMM: read 2 + 4, "
       "write 4 (megatron fuses it into the weight-gradient GEMM: 0)")
# memory a GPU process holds beyond its tensors
_const("fsdp.copy_bytes_per_param", 22.0, "bytes per parameter per micro-batch",
       "FSDP2's copies around its collectives (torch.distributed.fsdp _fsdp_collectives: the "
       "all-gather's copy-out into each parameter, twice: 2 x (2 + 2); the reduce-scatter's "
       "copy-in of the gradients, cast to fp32: 2 + 4 + 4, and the reduced shard: 4)")
_const("memory.cuda_context", 0.5 * 2 ** 30, "bytes",
       "estimate: a CUDA 12 context with lazy module loading on H100 (~500 MiB in nvidia-smi "
       "after torch.cuda.init())")
_const("memory.nccl_per_channel_peer", 9.4 * 2 ** 20, "bytes",
       "NCCL init.cc default buffers per channel and peer: Simple 4 MiB + LL128 4.9 MB "
       "(120 x 640 x 8 steps x 8 B) + LL 512 KiB (8 x 512 x 8 steps x 16 B)")
_const("memory.nccl_channels", 16, "channels per communicator",
       "estimate: NCCL opens 16-32 channels on H100 NVLink; ring and tree peers: 2")
_const("memory.fragmentation", 0.05, "x allocated",
       "caching allocator reserve over peak allocated in nanotron's H100 bench_cluster logs "
       "(peak_reserved / peak_allocated 1.01-1.05)")
# start-up
_const("startup.imports", 12.0, "s",
       "measured here: import torch + megatron.core (7.5 s) + deepspeed (3 s), model build")
_const("startup.group", 1e-4, "s per process group",
       "estimate: every rank calls new_group for every group megatron builds (its bookkeeping; "
       "torch's new_group has no barrier unless TORCH_DIST_INIT_BARRIER=1, and NCCL connects "
       "a group's ranks at its first collective)")
_const("startup.nccl_init", 0.5, "s per communicator",
       "estimate: topology detection and connection setup of ncclCommInitRank on a DGX node")
_const("startup.nccl_bootstrap_step", 100e-6, "s per rank of a communicator",
       "NVIDIA/nccl PR #1791: bootstrap all-gather takes N-1 TCP steps; NVIDIA/nccl #1156: "
       "2.5 minutes of init at several thousand GPUs")


def const(name: str) -> float:
    """A constant's value, with the fitted efficiencies of ``SETDIFF_EFFICIENCY`` if set."""
    fitted = load_efficiency()
    return fitted[name] if name in fitted else CONSTANTS[name].value


_EFFICIENCY_CACHE: dict = {}


def load_efficiency(path: Optional[str] = None) -> dict:
    """The constants a measured step refitted (``{"gemm.efficiency": ..., ...}``, written by
    ``tests/gpu/run.sh``): the file at ``path`` or ``$SETDIFF_EFFICIENCY``; ``{}`` without."""
    path = path or os.environ.get("SETDIFF_EFFICIENCY")
    if not path:
        return {}
    if path not in _EFFICIENCY_CACHE:
        with open(path) as fh:
            data = json.load(fh)
        unknown = sorted(set(data.get("constants", {})) - set(CONSTANTS))
        if unknown:
            raise ValueError(f"{path}: unknown constants {', '.join(unknown)} (known: "
                             f"setdiff_dist.train.scale.CONSTANTS)")
        _EFFICIENCY_CACHE[path] = dict(data.get("constants", {}))
    return _EFFICIENCY_CACHE[path]


def constants_table() -> str:
    """Every constant of the model, its value and its source."""
    rows = []
    for name, c in CONSTANTS.items():
        value = const(name)
        shown = f"{value / 2 ** 20:,.1f} MiB" if c.unit == "bytes" else f"{value:g} {c.unit}"
        rows.append(f"  {name:<42} {shown:<32} {c.source}")
    return "\n".join(rows)


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
    hbm: float = 3.35e12  # bytes/s of device memory
    fp32: float = 67e12   # dense FP32 (no TF32) FLOP/s


HARDWARE = {
    "h100": Hardware("H100 SXM", 989e12, 1979e12, 450e9, 50e9, 8,
                     "NVIDIA H100 datasheet (dense BF16 989 TFLOP/s, FP8 1979, HBM3 3.35 TB/s; "
                     "NVLink 4 900 GB/s both ways); DGX H100: one 400 Gb/s ConnectX-7 per GPU",
                     3.35e12),
    "h200": Hardware("H200 SXM", 989e12, 1979e12, 450e9, 50e9, 8,
                     "NVIDIA H200 datasheet (the H100's compute and NVLink 4, 141 GB HBM3e at "
                     "4.8 TB/s); DGX H200: one 400 Gb/s ConnectX-7 per GPU", 4.8e12),
    "b200": Hardware("B200", 2250e12, 4500e12, 900e9, 50e9, 8,
                     "NVIDIA DGX B200 datasheet (72 PFLOP/s FP8 training per 8 GPUs: 4.5 dense "
                     "per GPU, BF16 half of it; NVLink 5 1.8 TB/s both ways; HBM3e 8 TB/s; one "
                     "400 Gb/s ConnectX-7 per GPU)", 8e12, 80e12),
}


# -- one collective --------------------------------------------------------------------------

def _bus_bandwidth(ranks: int, nodes: int, hw: Hardware) -> float:
    """Bytes/s of bus bandwidth of a group of ``ranks`` over ``nodes`` nodes: NVLink inside a
    node; across nodes the NICs of the group's GPUs in each node carry rings in parallel (one
    channel per NIC), so a group with ``g`` GPUs per node gets ``g`` NICs, up to NVLink's."""
    nvlink = hw.nvlink * const("link.nvlink_efficiency")
    if nodes <= 1:
        return nvlink
    per_node = max(1, ranks // nodes)
    return min(nvlink, per_node * hw.network * const("link.nic_efficiency"))


def _algorithms(kind: str, per_node: int) -> tuple:
    if kind == "all_reduce":
        return ("ring", "tree")
    if kind in ("reduce_scatter", "all_gather"):
        return ("ring", "pat") if per_node == 1 else ("ring",)
    return ("ring",)  # reduce, broadcast: rings (chains) only


def collective_seconds(kind: str, nbytes: float, ranks: int, nodes: int, hw: Hardware):
    """``(seconds, "algorithm/protocol")`` of one collective ``kind`` on ``nbytes`` (see the
    module docstring) over ``ranks`` ranks on ``nodes`` nodes, the fastest NCCL would pick:
    latency (NCCL's base latency plus its per-hop latency for each step of the algorithm, NVLink
    hops inside a node, network hops between) plus the bytes this rank sends over the bus
    bandwidth the algorithm and protocol reach.

    One departure from NCCL's tuner: a reduce or broadcast is charged a hop per rank (the first
    chunk crosses every rank of the chain), where NCCL's tuner charges one when its channels
    match: at 1024 ranks that is the difference between ~10 us and ~10 ms per call."""
    if ranks <= 1:
        return 0.0, "-"
    nodes = max(1, nodes)
    per_node = max(1, ranks // nodes)
    link = "net" if nodes > 1 else "nvlink"
    if kind == "send":
        bw = (hw.network * const("link.nic_efficiency") if nodes > 1
              else hw.nvlink * const("link.nvlink_efficiency"))
        lat = const("nccl.base_latency.ring.Simple") + const(
            f"nccl.hop_latency.{link}.ring.Simple")
        return lat * 1e-6 + nbytes / bw, "p2p"
    wire = wire_bytes(kind, nbytes, ranks)
    bus = _bus_bandwidth(ranks, nodes, hw)
    steps = {"all_reduce": 2 * (ranks - 1), "reduce_scatter": ranks - 1,
             "all_gather": ranks - 1}.get(kind, ranks)
    inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if kind == "all_reduce" else nodes - 1)
    best = None
    for algo in _algorithms(kind, per_node):
        for proto in PROTOCOLS:
            share = const(f"nccl.bandwidth_share.{algo}.{proto}")
            if share <= 0:
                continue
            base = const(f"nccl.base_latency.{algo}.{proto}")
            intra = const(f"nccl.hop_latency.nvlink.{algo}.{proto}")
            # (NCCL: with one rank per node the ring pays the tree's network latency)
            net_algo = "tree" if per_node == 1 and algo == "ring" else algo
            inter = const(f"nccl.hop_latency.net.{net_algo}.{proto}")
            if algo == "ring":
                lat = base + (steps - inter_steps) * intra + inter_steps * inter
            elif algo == "tree":
                lat = base + 2 * ((per_node - 1) * intra + math.log2(nodes) * inter)
            else:  # PAT: a logarithmic part and a linear one
                lat = base + math.log2(nodes) * inter / 3.5 + ranks * const(
                    "nccl.pat_rank_latency")
            seconds = lat * 1e-6 + wire / (bus * share)
            if best is None or seconds < best[0]:
                best = (seconds, f"{algo}/{proto}")
    return best


# -- how a stack runs a step -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class System:
    """What sets a training stack's step time apart, for the scale model.

    ``dp``: how the data-parallel ranks share gradients and parameters:
      ``per_owner``: DeepSpeed's ZeRO-1/2 (each parameter group one flat buffer cut into one
      contiguous partition per rank): a ``reduce`` per (bucket, owner) of the gradients, and
      the parameters' gather after the step (DeepSpeed's all-gather in buckets, or with
      ``overlap_param_gather`` one broadcast per owner per bucket during the next forward);
      ``bucket_sharded``: every bucket cut over all ranks (megatron-core's distributed
      optimizer, ``zero.implementation=megatron``): one reduce-scatter and one all-gather per
      bucket, buckets of ``max(bucket, min_bucket_per_rank x DP)`` elements (megatron's rule);
      ``allreduce``: one all-reduce per bucket (ZeRO-0, DeepSpeed's BF16_Optimizer at ZeRO-1)
      and, sharded, DeepSpeed's all-gather after the step;
      ``zero3``: DeepSpeed ZeRO-3, parameters gathered for every micro-batch's forward and
      backward, gradients reduce-scattered in buckets each micro-batch;
      ``fsdp``: PyTorch FSDP2 per transformer block: all-gather before its forward and again
      before its backward, reduce-scatter of its gradients, each prefetched behind the
      neighbouring block's compute.
    ``overlap_grad`` / ``overlap_param``: where the system overlaps the reduction with the
    backward and the gather with the next forward. ``tp_overlap``: tensor-parallel
    collectives hidden behind the GEMMs (Transformer Engine's userbuffers). ``fused``: norms,
    rotary and activations in fused kernels. ``attention``: the kernel family
    (:data:`CONSTANTS` ``attention.*``). ``grad_accum_fused``: gradients accumulate in fp32
    inside the weight-gradient GEMM. ``grad_bytes``: bytes per gradient element on the wire."""
    name: str
    dp: str = "per_owner"
    overlap_grad: bool = True
    overlap_param: bool = True
    tp_overlap: bool = False
    fused: bool = False
    fused_norm: bool = True
    attention: str = "flash"
    grad_accum_fused: bool = False
    grad_bytes: int = 4
    recompute_gemm: float = 0.0  # the share of the forward's GEMMs recomputed in the backward
    bucket: Optional[float] = None
    dp_groups: int = 2   # DeepSpeed's parameter groups (weight decay, none): partitioned apart
    min_bucket_per_rank: float = 1e6  # bucket_sharded: buckets of max(bucket, this x DP)


def ours(cfg) -> System:
    """How our training path runs ``cfg`` (what ``setdiff-train --dry-run --hardware`` predicts:
    overlap is credited only where the code overlaps)."""
    from setdiff_dist.config import zero_implementation
    from setdiff_dist.diffusion.kinds import order_of
    from setdiff_dist.train.optimizer_state import optimizer_form

    z, m = cfg.zero, cfg.model
    form = optimizer_form(cfg.to_dict())
    bucket = z.reduce_bucket_size
    if z.stage == 3:
        dp = "zero3"
    elif zero_implementation(cfg) == "megatron":
        dp = "bucket_sharded"
    elif zero_implementation(cfg) == "fsdp":
        dp = "fsdp_zero2"
    elif z.stage == 0 or form == "bf16_optimizer":
        dp = "allreduce"
    else:
        dp = "per_owner"
    backend = m.attention_backend
    if backend == "te":
        attention = "cudnn"
    elif backend == "flex":
        attention = "flex"
    elif backend == "permuted_causal" or order_of(cfg.order).causal_lm:
        attention = "flash"
    else:
        attention = "dense"
    return System("setdiff-dist", dp=dp, overlap_grad=z.overlap_comm,
                  overlap_param=z.overlap_param_gather and form in ("zero", "megatron", "fsdp")
                  and z.stage in (1, 2),
                  fused=backend == "te", attention=attention, bucket=bucket,
                  min_bucket_per_rank=getattr(z, "min_bucket_per_rank", 1_000_000))


# -- what a step sends -----------------------------------------------------------------------

@dataclasses.dataclass
class Flow:
    """One kind of traffic of a step on one rank: ``calls`` collectives ``kind`` of ``nbytes``
    each over the ``group`` of ``size`` ranks; ``overlap``: what it can hide behind (``None``;
    ``"last_backward"``: the last micro-batch's backward, its last call exposed;
    ``"backward"``: every backward, its last call exposed; ``"first_forward"``: the next step's
    first forward, its first call exposed; ``"compute"``: the whole step's compute, one call
    exposed; ``"gemm"``: the GEMMs it is pipelined with)."""
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


def _stage_groups(cfg, stage: int, plan, tp: int) -> list[float]:
    """The stage's parameters on a rank split as DeepSpeed's parameter groups: the ones with
    weight decay (matrices) and the ones without (norms, the input embedding)."""
    from setdiff_dist.model.dims import padded_vocab_size

    params = plan.stages[stage].params
    m = cfg.model
    no_decay = (2 * plan.stages[stage].layers + 1) * m.hidden_size
    if stage == 0:
        no_decay += padded_vocab_size(m.vocab_size, tp) // tp * m.hidden_size
    no_decay = min(no_decay, params)
    return [g for g in (params - no_decay, no_decay) if g > 0]


def _dp_flows(cfg, plan, stage: int, system: System) -> list[Flow]:
    z = cfg.zero
    zero_dp = plan.data                   # DeepSpeed's data-parallel group: data x context
    if zero_dp <= 1:
        return []
    micro = plan.micro_batches
    params, layers = plan.stages[stage].params, plan.stages[stage].layers
    e = 2 if cfg.train.precision in ("bf16", "fp8") else 4
    g = system.grad_bytes
    bucket = system.bucket or z.reduce_bucket_size
    grads = g * params
    flows = []
    if system.dp == "allreduce":
        flows.append(Flow("gradient all-reduce", "data", zero_dp, "all_reduce",
                          grads / math.ceil(params / bucket), math.ceil(params / bucket)))
        if z.stage in (1, 2):
            n = math.ceil(params / bucket)
            flows.append(Flow("parameter all-gather", "data", zero_dp, "all_gather",
                              e * params / n, n))
    elif system.dp == "per_owner":
        groups = _stage_groups(cfg, stage, plan, cfg.parallel.tensor)
        # a reduce per (bucket, owner): every owner's partition boundary and every bucket
        # boundary starts a new one, in each parameter group
        reduces = sum(math.ceil(p / bucket) + zero_dp - 1 for p in groups)
        if z.stage == 1:
            flows.append(Flow("gradient reduce-scatter", "data", zero_dp, "reduce",
                              grads / reduces, reduces,
                              "last_backward" if system.overlap_grad else None))
        else:  # ZeRO-2 reduces each micro-batch's gradients
            flows.append(Flow("gradient reduce-scatter", "data", zero_dp, "reduce",
                              grads / reduces, reduces * micro,
                              "backward" if system.overlap_grad else None))
        if system.overlap_param:
            # each bucket of each owner's partition broadcast by its owner during the next
            # forward (setdiff_dist.train.param_gather)
            buckets = sum(zero_dp * math.ceil(p / zero_dp / bucket) for p in groups)
            flows.append(Flow("parameter all-gather", "data", zero_dp, "broadcast",
                              e * params / buckets, buckets, "first_forward"))
        else:  # DeepSpeed's all_gather_dp_groups after the step, in shards of the bucket
            n = sum(math.ceil(p / bucket) for p in groups)
            flows.append(Flow("parameter all-gather", "data", zero_dp, "all_gather",
                              e * params / n, n))
    elif system.dp == "bucket_sharded":
        size = max(bucket, system.min_bucket_per_rank * zero_dp)
        n = math.ceil(params / size)
        flows.append(Flow("gradient reduce-scatter", "data", zero_dp, "reduce_scatter",
                          grads / n, n, "last_backward" if system.overlap_grad else None))
        flows.append(Flow("parameter all-gather", "data", zero_dp, "all_gather", e * params / n,
                          n, "first_forward" if system.overlap_param else None))
    elif system.dp == "zero3":
        # a gather per module (6 per layer) for each micro-batch's forward and backward
        gathers = max(1, 6 * layers) * 2 * micro
        flows.append(Flow("parameter all-gather", "data", zero_dp, "all_gather",
                          e * params * 2 * micro / gathers, gathers, "backward"))
        n = math.ceil(params / bucket)
        flows.append(Flow("gradient reduce-scatter", "data", zero_dp, "reduce_scatter",
                          grads / n, n * micro, "backward" if system.overlap_grad else None))
    elif system.dp == "fsdp":
        units = layers + 1                # each block, and the root (embeddings, norm, output)
        flows.append(Flow("parameter all-gather", "data", zero_dp, "all_gather",
                          e * params / units, 2 * units * micro, "compute"))
        flows.append(Flow("gradient reduce-scatter", "data", zero_dp, "reduce_scatter",
                          grads / units, units * micro, "compute"))
    elif system.dp == "fsdp_zero2":
        # ours at ZeRO-2 (setdiff_dist.train.fsdp_dp): a unit's parameters gathered once a
        # step (the next layer's prefetched), its gradients reduce-scattered each micro-batch
        units = layers + 1
        flows.append(Flow("parameter all-gather", "data", zero_dp, "all_gather",
                          e * params / units, units, "first_forward"))
        flows.append(Flow("gradient reduce-scatter", "data", zero_dp, "reduce_scatter",
                          grads / units, units * micro, "backward"))
    else:
        raise ValueError(f"unknown data-parallel scheme {system.dp!r}")
    return flows


def step_flows(cfg, plan, stage: int, backend: str = "nccl",
               system: Optional[System] = None) -> list[Flow]:
    """The traffic of one optimizer step on a rank of pipeline stage ``stage`` of the dry run's
    ``plan`` (:class:`setdiff_dist.train.plan.Plan`: its world size, data-parallel size,
    micro-batches, and each stage's parameters and layers), as ``system`` issues it (default:
    ours, :func:`ours`; ``backend="gloo"``: with gloo's stand-ins where it lacks a
    collective)."""
    from setdiff_dist.diffusion.kinds import order_of

    system = system or ours(cfg)
    par, d, m = cfg.parallel, cfg.data, cfg.model
    tp, pp, cp = par.tensor, par.pipeline, par.context
    micro = plan.micro_batches
    layers = plan.stages[stage].layers
    e = 2 if cfg.train.precision in ("bf16", "fp8") else 4
    b = d.micro_batch_size
    seq = order_of(cfg.order).model_len(d.seq_len) // cp    # a rank's share of the sequence
    h = m.hidden_size
    first, last = stage == 0, stage == pp - 1
    recompute = cfg.train.recompute == "full"
    flows = _dp_flows(cfg, plan, stage, system)
    tp_overlap = "gemm" if system.tp_overlap else None

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
                              gathers * micro, tp_overlap))
            flows.append(Flow("sequence-parallel reduce-scatters", "tensor", tp,
                              "reduce_scatter", act, scatters * micro, tp_overlap))
            # the norms' weight gradients are partial sums over the sequence shards
            norms = (2 * layers + (1 if last else 0)) * h * e
            flows.append(Flow("norm gradient all-reduce", "tensor", tp, "all_reduce", norms,
                              micro))
        else:
            flows.append(Flow("activation all-reduce", "tensor", tp, "all_reduce", act,
                              layers * 2 * (again + 1) * micro, tp_overlap))
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


# -- what a step computes --------------------------------------------------------------------

def stage_compute(cfg, plan, stage: int, hw: Hardware, system: System) -> dict:
    """Seconds of one optimizer step's compute on a rank of ``stage``, by class: ``gemm``,
    ``attention``, ``elementwise`` (memory-bound: norms, rotary, activations, residuals, the
    loss's softmax), ``kernels`` (the fixed cost of the non-GEMM kernels), ``optimizer`` (the
    AdamW step on the rank's shard, and the fp32 gradient accumulation where it is not fused),
    and ``backward``: the share of the first four that is backward work."""
    from setdiff_dist.diffusion.kinds import order_of
    from setdiff_dist.model.dims import padded_vocab_size

    m, par, d = cfg.model, cfg.parallel, cfg.data
    tp, cp, pp = par.tensor, par.context, par.pipeline
    order = order_of(cfg.order)
    L = d.seq_len
    seq = order.model_len(L)
    tokens = d.micro_batch_size * seq / cp          # a micro-batch's tokens on this rank
    rows = d.micro_batch_size * L / cp              # the tokens that get logits
    micro, layers = plan.micro_batches, plan.stages[stage].layers
    first, last = stage == 0, stage == pp - 1
    e = 2 if cfg.train.precision in ("bf16", "fp8") else 4
    peak = {"fp8": hw.fp8, "bf16": hw.bf16}.get(cfg.train.precision, hw.fp32)
    h, dh = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * dh / tp, m.num_query_groups * dh / tp
    ffn = m.ffn_hidden_size / tp
    e_mm, t_mm = const("gemm.efficiency"), const("gemm.fixed_us") * 1e-6

    def gemm(k, n, mrows=tokens):
        return 2 * mrows * k * n / (peak * e_mm) + t_mm

    layer_gemms = [gemm(h, q + 2 * kv), gemm(q, h),
                   gemm(h, (2 if m.activation == "swiglu" else 1) * ffn), gemm(ffn, h)]
    fwd_gemm = sum(layer_gemms) * layers
    # attention: the (query, key) pairs the kernel computes
    if order.causal_lm:
        pairs = L * (L + 1) / 2
    else:
        pairs = L * L + L            # set diffusion's useful pairs (model.flops)
    if system.attention == "dense":
        pairs = seq * seq            # a dense mask: every pair
    attn_flops = 4 * (m.num_attention_heads / tp) * dh * pairs * d.micro_batch_size / cp
    fwd_attn = attn_flops / (peak * const(f"attention.{system.attention}.forward")) * layers
    bwd_attn = 2.5 * attn_flops / (peak * const(f"attention.{system.attention}.backward")) \
        * layers                     # (the backward recomputes the scores: 5 matmuls to 2)
    # memory-bound work per token and layer, forward (the backward reads and writes ~2x)
    norm = 2 * h * e + 4 if system.fused or system.fused_norm else 28 * h
    rotary = 2 * (q + kv) * e * (1 if system.fused else 3)
    act = (3 if m.activation == "swiglu" else 2) * ffn * e
    residual = 2 * 3 * h * e
    copies = 0 if system.fused else 2 * (q + 2 * kv) * e   # eager transposes around attention
    dropout = 2 * (h * e + h) if m.hidden_dropout > 0 else 0
    per_token = 2 * norm + rotary + act + residual + copies + dropout
    hbm = hw.hbm * const("hbm.efficiency")
    fwd_elem = tokens * per_token * layers / hbm
    kernels_per_layer = 12 if system.fused else 30
    fwd_kernels = kernels_per_layer * layers * const("kernel.fixed_us") * 1e-6
    fwd_extra = bwd_extra = 0.0
    if last:
        vocab = padded_vocab_size(m.vocab_size, tp) / tp
        fwd_extra += gemm(h, vocab, rows)
        bwd_extra += 2 * gemm(h, vocab, rows)
        # logits in, the fp32 softmax out, its gradient: ~4 passes of 4 bytes over [rows, V]
        fwd_extra += rows * vocab * (e + 4) / hbm
        bwd_extra += rows * vocab * 8 / hbm
    if first:
        fwd_extra += tokens * h * e * 2 / hbm      # the embedding's gather
    recompute = cfg.train.recompute
    again = 1.0 if recompute == "full" else 0.0
    fwd = fwd_gemm + fwd_attn + fwd_elem + fwd_kernels
    per_micro_fwd = fwd + fwd_extra
    per_micro_bwd = ((2 + system.recompute_gemm) * fwd_gemm + bwd_attn + 2 * fwd_elem
                     + 2 * fwd_kernels + bwd_extra + again * fwd
                     + (fwd_attn if recompute == "selective" else 0.0))
    params = plan.stages[stage].params
    shard = params / (plan.data if cfg.zero.stage >= 1 else 1)
    optimizer = shard * const("optimizer.bytes_per_param") / hbm
    if cfg.train.precision in ("bf16", "fp8") and not system.grad_accum_fused:
        optimizer += micro * params * const("grad_accum.bytes_per_param") / hbm
    if system.dp in ("fsdp", "fsdp_zero2"):  # (FSDP's copies in and out of its buffers)
        optimizer += micro * params * const("fsdp.copy_bytes_per_param") / hbm
    if cfg.zero.offload_optimizer == "cpu":
        optimizer = 0.0  # (on the host: not modelled)
    return {"gemm": micro * fwd_gemm * (3 + again + system.recompute_gemm),
            "attention": micro * (fwd_attn * (1 + again) + bwd_attn
                                  + (fwd_attn if recompute == "selective" else 0.0)),
            "elementwise": micro * fwd_elem * (3 + again),
            "kernels": micro * fwd_kernels * (3 + again),
            "head": micro * (fwd_extra + bwd_extra),
            "optimizer": optimizer,
            "forward": micro * per_micro_fwd,
            "backward": micro * per_micro_bwd}


# -- what a step costs -----------------------------------------------------------------------

@dataclasses.dataclass
class StepPrediction:
    hardware: Hardware
    world_size: int
    compute: float       # seconds of the slowest stage's compute (forward + backward + step)
    bubble: float        # the 1F1B pipeline's idle time
    comm: dict           # flow name -> (bytes per GPU per step, seconds, hidden, calls, algo)
    exposed: float
    step: float
    tokens: int          # data tokens per step
    model_flops: float   # per step, all GPUs
    breakdown: dict = dataclasses.field(default_factory=dict)   # compute seconds by class
    system: Optional[System] = None
    startup: Optional[dict] = None

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.world_size * self.hardware.bf16 * self.step)

    @property
    def collectives(self) -> float:
        """Collective calls per step on the slowest stage's ranks."""
        return sum(row[3] for row in self.comm.values())

    def table(self) -> str:
        rows = [f"predicted step on {self.world_size} x {self.hardware.name}: "
                f"{self.step * 1e3:,.0f} ms = compute {self.compute * 1e3:,.0f} ms + bubble "
                f"{self.bubble * 1e3:,.0f} ms + exposed communication {self.exposed * 1e3:,.0f} "
                f"ms; MFU {self.mfu * 100:.1f}%, {self.tokens / self.step / 1e6:,.2f}M tokens/s",
                "  compute: " + ", ".join(f"{k} {v * 1e3:,.0f} ms" for k, v in
                                          self.breakdown.items()),
                f"  collectives per step: {self.collectives:,.0f}",
                f"  {'per GPU per step':<34} {'calls':>7} {'bytes':>10} {'time':>9} "
                f"{'hidden':>9}  algorithm"]
        for name, (nbytes, seconds, hidden, calls, algo) in self.comm.items():
            rows.append(f"  {name:<34} {calls:>7,.0f} {nbytes / 1e9:>8.3f}GB "
                        f"{seconds * 1e3:>7.1f}ms {hidden * 1e3:>7.1f}ms  {algo}")
        if self.startup:
            s = self.startup
            rows.append(f"  start-up: ~{s['seconds']:,.0f} s to the first step ({s['groups']:,} "
                        f"process groups created, {s['communicators']} NCCL communicators on "
                        f"this rank, {s['broadcasts']:,} parameter broadcasts)")
        rows.append(f"  (peaks: {self.hardware.source}; every other constant and its source: "
                    f"setdiff-train --dry-run --constants)")
        return "\n".join(rows)


def _nodes(cfg, group: str, size: int, world: int, gpus_per_node: int) -> int:
    """How many nodes ``group``'s ranks span (megatron's rank order tp-cp-dp-pp: a group of
    ``size`` ranks ``stride`` apart; a pipeline send goes one stage, ``world / PP`` ranks,
    away; the embedding group joins the first and the last stage)."""
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    stage = world // pp
    stride = {"tensor": 1, "context": tp, "data": tp, "pipeline": stage,
              "embedding": stage * max(pp - 1, 1)}[group]
    span = stride * (size - 1) + 1
    if span <= gpus_per_node:
        return 1
    return min(size, math.ceil(span / gpus_per_node))


def predict(cfg, plan, hardware, system: Optional[System] = None,
            startup: Optional[dict] = None) -> StepPrediction:
    """The predicted step of ``cfg`` on the dry run's ``plan`` (its world size, micro-batches
    and stages) on GPUs of ``hardware`` (a name of :data:`HARDWARE`, or a hardware entry of
    one's own), run by ``system`` (default: ours). The slowest stage sets the step."""
    from setdiff_dist.diffusion.kinds import order_of
    from setdiff_dist.model.flops import training_flops_per_token

    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    system = system or ours(cfg)
    world_size, micro = plan.world_size, plan.micro_batches
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    flops = training_flops_per_token(cfg.model, cfg.data.seq_len,
                                     causal_lm=order_of(cfg.order).causal_lm) * tokens
    vpp = cfg.parallel.virtual_pipeline or 1
    best = None
    for stage in range(cfg.parallel.pipeline):
        work = stage_compute(cfg, plan, stage, hw, system)
        compute = work["forward"] + work["backward"] + work["optimizer"] \
            + const("step.fixed_ms") * 1e-3
        # what each window has left to hide communication behind
        room = {"last_backward": work["backward"] / micro, "backward": work["backward"],
                "first_forward": work["forward"] / micro, "compute": compute,
                # (Transformer Engine's userbuffers pipeline a layer's TP collectives with
                # its GEMMs in chunks, the rest of the layer's compute running beside them)
                "gemm": work["forward"] + work["backward"]}
        comm, exposed = {}, 0.0
        for f in step_flows(cfg, plan, stage, system=system):
            nodes = _nodes(cfg, f.group, f.size, world_size, hw.gpus_per_node)
            one, algo = collective_seconds(f.kind, f.nbytes, f.size, nodes, hw)
            seconds = one * f.calls
            hidden = 0.0
            if f.overlap in room:
                # the call that cannot overlap: the first bucket of the gather, the last of
                # the reduction (a whole micro-batch's worth when the calls are per micro-batch)
                tail = one if f.overlap != "gemm" else 0.0
                hidden = max(0.0, min(seconds - tail, room[f.overlap]))
                room[f.overlap] -= hidden
                if f.overlap in ("last_backward", "backward"):
                    room["compute"] -= hidden
            comm[f.name] = (f.wire, seconds, hidden, f.calls, algo)
            exposed += seconds - hidden
        bubble = (work["forward"] + work["backward"]) * (cfg.parallel.pipeline - 1) \
            / (micro * vpp)
        step = compute + bubble + exposed
        if best is None or step > best[0]:
            breakdown = {k: work[k] for k in ("gemm", "attention", "elementwise", "kernels",
                                              "head", "optimizer")}
            best = (step, compute, bubble, comm, exposed, breakdown)
    step, compute, bubble, comm, exposed, breakdown = best
    return StepPrediction(hw, world_size, compute, bubble, comm, exposed, step, tokens, flops,
                          breakdown, system, startup)


def startup_seconds(groups: int, memberships: list, world: int, params: int,
                    tensors: int, cfg, hardware: str) -> dict:
    """Time to the first step at ``world`` ranks: imports and model build, every rank's share
    of creating ``groups`` process groups (each a store round over all ranks), the NCCL
    communicators this rank is in (``memberships``: their sizes; NCCL creates them at their
    first collective), and DeepSpeed's start-up broadcast of each of the ``tensors`` parameter
    tensors (``params`` elements) from data-parallel rank 0."""
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    seconds = const("startup.imports")
    seconds += groups * const("startup.group")
    comms = [n for n in memberships if n > 1]
    seconds += sum(const("startup.nccl_init") + n * const("startup.nccl_bootstrap_step")
                   for n in comms)
    dp = world // (cfg.parallel.tensor * cfg.parallel.pipeline)
    broadcasts = 0
    if dp > 1:
        nodes = _nodes(cfg, "data", dp, world, hw.gpus_per_node)
        e = 2 if cfg.train.precision in ("bf16", "fp8") else 4
        one, _ = collective_seconds("broadcast", e * params / max(tensors, 1), dp, nodes, hw)
        seconds += one * tensors
        broadcasts = tensors
    return {"seconds": seconds, "groups": groups, "communicators": len(comms),
            "broadcasts": broadcasts}
