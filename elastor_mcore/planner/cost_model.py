"""Analytic cost model: predicted step time and memory per GPU of a layout.

Time, per micro-batch and stage (forward + backward; activation recomputation, the
recipe's ``training.recompute_*``, adds a second forward of the recomputed layers, or of
their core attention when selective):

* compute: the stage's layers' FLOPs (QKV, causal attention, output projection, SwiGLU
  MLP; backward = 2 x forward) at ``peak x efficiency(tp) x tp``, plus the output
  layer's logits on the last stage. A measured table in the hardware profile replaces
  a layer's analytic time (compute and TP communication, as a measurement sees both).
* TP communication: four collectives of ``b x s x h`` activations per layer (two
  forward, two backward; all-reduce, or all-gather + reduce-scatter with sequence
  parallelism, same volume), ring cost over intra-node links (TP never spans nodes).
* P2P: one activation (forward) or gradient (backward) message per neighbour stage.

Measured profiles (``elastor profile``; ``hardware.RecipeMeasurements``) replace the
first two terms for a recipe of the measured shape: a stage of ``n`` layers at TP ``t``
costs ``stage[t] + n x layer[t]`` plus ``embedding[t]`` first and ``output[t]`` last,
as timed on the runtime's own stages in their TP groups (TP collectives included);
only the measured TP degrees are planned with, and measured P2P latency and bandwidth
replace the intra-node link for P2P.

Per pipeline, 1F1B with its bubble: ``(micro_batches + stages - 1) x slowest stage``.
Per step, the critical path: slowest pipeline + the cross-pipeline gradient all-reduce
(ring over the pipelines; each GPU's fp32 gradient shard approximated by its
pipeline's average ``parameters / GPUs``, so the term depends on the pipelines' sizes,
not on the split) + the slowest stage's optimizer step (measured ns per local
parameter; with ZeRO-1 each rank steps ``1 / pipelines`` of its stage's parameters).
With ``training.overlap_grad_reduce`` (Megatron-LM's loop starts the reduction bucket
by bucket during the last micro-batch's backward) the all-reduce is hidden behind the
slowest pipeline's bottleneck stage's backward of one micro-batch (two thirds of its
forward + backward); with ZeRO-1 only its reduce-scatter half is, and with
``training.overlap_param_gather`` its all-gather half behind that stage's next forward
(one third), as far as each lasts (``hidden_grad_sync_s``).

CPU slots share cores, so a step also takes at least its CPU work over what its busy
slots achieve together: every stage's CPU time per micro-batch (its TP group's,
measured: ranks waiting in a collective or idle in the 1F1B bubble leave their core to
others) x its micro-batches, every slot's gradient all-reduce and optimizer step. That
work is done while the pipelines run in their steady phase: in the 1F1B fill and drain
(``(stages - 1) x slowest stage``, of the deepest such pipeline) stages wait for each
other's hand-offs, and the steady phase's work cannot move there. With ``d = CPU work /
(critical path - fill and drain)`` slots busy at once, which together compute
``cores_worth(d)`` slots' worth (measured with 1, 2, .. slots busy at once), the step
time is the critical path x ``contention = max(1, d / cores_worth(d))`` (1 on GPUs,
which compute on their own): the stages of a pipeline are a chain, so a stage slowed by
sharing its core slows the whole chain, fill and drain included.

P2P and gradient traffic use intra-node links when every used GPU sits on one node,
inter-node links otherwise: the cost of a layout then depends only on each stage's TP
degree, layer count and position, and on whether the layout spans nodes. The search
relies on this (groups of equal size are interchangeable).

Memory per GPU: weights (params dtype), fp32 gradients, optimizer state (fp32 master
copy when params are bf16, two Adam moments; with ZeRO-1, ``training.distributed_optimizer``,
an fp32 main copy and two moments of each element, 12 bytes, split over the ranks that
hold it, see ``stage_memory``), activations of the micro-batches 1F1B
keeps in flight at the stage (``stages - position``; the planner keeps at least as many
micro-batches as stages), embedding on the first stage, output layer and fp32 logits on
the last, and the profile's reserved memory. With measured tables, a stage's
activations are the measured saved activations (layers, embedding, output layer and
loss, as ``--report-memory`` counts them) per in-flight micro-batch, unless full
recomputation changes what is kept; the memory one more layer costs (which bounds a
stage's layers) is its state, counted from its parameters (the profile's measured
``state_mib`` is the same count), plus those activations. Sequence parallelism (the
recipe's ``training.sequence_parallel`` unless the caller says otherwise) splits the norms'
activations by TP; full recomputation keeps only each recomputed chunk's input per
in-flight micro-batch, plus one chunk's activations while it is recomputed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from elastor_mcore.planner.hardware import HardwareProfile
from elastor_mcore.config.recipe import Recipe

GIB = 1024**3
GRAD_BYTES = 4          # Megatron accumulates gradients in fp32 (main_grad)
ADAM_MOMENT_BYTES = 8   # exp_avg + exp_avg_sq, fp32
ZERO1_STATE_BYTES = 12  # ZeRO-1 keeps an fp32 main copy of every owned element, any dtype
LOGIT_BYTES = 4         # the loss works on fp32 logits
TP_COLLECTIVES_PER_LAYER = 4
TP_COLLECTIVES_EMBEDDING = 2  # vocab-parallel embedding / output layer, forward + backward


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU of one stage (predicted here, measured by ``runtime.memory``)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    reserved: float = 0.0
    """The profile's reserve (none in a measurement)."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.reserved


@dataclass(frozen=True)
class StageCost:
    tp: int
    layers: int
    compute_s: float
    """Compute of the stage's layers (and output layer), forward + backward, per micro-batch."""
    tp_comm_s: float
    p2p_s: float
    tp_comm_bytes: float
    """Bytes each GPU sends in TP collectives per micro-batch (ring: 2(tp-1)/tp per
    all-reduce)."""
    p2p_bytes: float
    """Bytes the stage sends to its neighbour stages per micro-batch."""
    memory: MemoryBreakdown

    @property
    def time_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.p2p_s


def pipeline_time_s(micro_batches: int, num_stages: int, bottleneck_s: float) -> float:
    """1F1B: fill and drain cost ``stages - 1`` slots of the slowest stage."""
    return (micro_batches + num_stages - 1) * bottleneck_s


def pipelines_fill_s(pipelines: Iterable[tuple[int, float]]) -> float:
    """The longest 1F1B fill and drain, ``(stages - 1) x slowest stage``, of
    ``[(stages, slowest stage s), ...]``."""
    return max(((n - 1) * b for n, b in pipelines), default=0.0)


@dataclass(frozen=True)
class PipelineCost:
    micro_batches: int
    stages: tuple[StageCost, ...]

    @property
    def bottleneck_s(self) -> float:
        return max(s.time_s for s in self.stages)

    @property
    def time_s(self) -> float:
        return pipeline_time_s(self.micro_batches, len(self.stages), self.bottleneck_s)


@dataclass(frozen=True)
class StepCost:
    pipelines: tuple[PipelineCost, ...]
    grad_sync_s: float
    optimizer_s: float = 0.0
    """The slowest stage's optimizer step."""
    contention: float = 1.0
    """How much longer than its critical path the step takes because its slots share
    cores (``CostModel.contention``; 1 on GPUs)."""
    grad_sync_hidden_s: float = 0.0
    """Of ``grad_sync_s``, what overlaps compute (``CostModel.hidden_grad_sync_s``)."""

    @property
    def step_s(self) -> float:
        return (max(p.time_s for p in self.pipelines) + self.grad_sync_s
                - self.grad_sync_hidden_s + self.optimizer_s) * self.contention


class CostModel:
    """Costs of stages, pipelines and steps for one recipe on one kind of hardware.

    ``intra_node`` arguments say whether the whole layout sits on one node (P2P and
    gradient traffic then use intra-node links).
    """

    def __init__(self, recipe: Recipe, hardware: HardwareProfile,
                 sequence_parallel: bool | None = None) -> None:
        self.recipe = recipe
        self.hardware = hardware
        self.sequence_parallel = (recipe.training.sequence_parallel
                                  if sequence_parallel is None else sequence_parallel)
        """Sequence parallelism (default: the recipe's ``training.sequence_parallel``)."""
        model, training = recipe.model, recipe.training
        self.num_layers = model.num_layers
        self.total_micro_batches = training.total_micro_batches
        self._b, self._s, self._h = training.micro_batch_size, model.seq_length, model.hidden_size
        self._v = model.padded_vocab_size
        self._kv = model.num_query_groups * model.kv_channels
        self._f = model.ffn_hidden_size
        self._param_bytes = 2 if training.params_dtype == "bfloat16" else 4
        self.shards_optimizer = training.distributed_optimizer
        """ZeRO-1: each element's optimizer state is split over the ranks holding it."""
        master = 4 if training.params_dtype == "bfloat16" else 0
        self._optimizer_bytes = (ZERO1_STATE_BYTES if self.shards_optimizer
                                 else master + ADAM_MOMENT_BYTES)
        """Optimizer state per element (before ZeRO-1's split)."""
        self._state_bytes_per_param = self._param_bytes + GRAD_BYTES + self._optimizer_bytes
        self._act_bytes = self._param_bytes
        self._measured = hardware.measured_layer_ms.get(recipe.name, {})
        self.tables = hardware.measurements_for(recipe)
        """``elastor profile``'s tables for this recipe (None: analytic model)."""
        self.capacity_bytes = (hardware.memory_per_gpu_gib - hardware.memory_reserved_gib) * GIB
        self._memo: dict[tuple, float | int] = {}

    def _memoised(self, key: tuple, compute) -> float | int:
        """The search asks for the same few stage slots many times."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    # ----- sizes ------------------------------------------------------------------------
    @cached_property
    def layer_params(self) -> int:
        h = self._h
        return 2 * h * h + 2 * h * self._kv + 3 * h * self._f + 2 * h

    @cached_property
    def total_params(self) -> int:
        return self.recipe.model.parameter_count()

    @property
    def model_state_bytes(self) -> float:
        """Weights, gradients and optimizer state of the whole model in one pipeline: the
        least any layout needs in total (more pipelines add weights and gradients; ZeRO-1
        keeps each element's optimizer state once, however many pipelines)."""
        return self.total_params * self._state_bytes_per_param

    def replica_key(self, replicas: int) -> int:
        """``replicas`` where memory depends on it (ZeRO-1), else 1: the key under which
        the search shares what it computed for other pipeline counts."""
        return replicas if self.shards_optimizer else 1

    def _bytes_per_param(self, replicas: int) -> float:
        """Weights, gradient and optimizer state of one element held in ``replicas``
        pipelines."""
        return (self._param_bytes + GRAD_BYTES
                + self._optimizer_bytes / self.replica_key(replicas))

    @property
    def _message_bytes(self) -> float:
        """One micro-batch's hidden states: what crosses a stage boundary or a TP collective."""
        return self._b * self._s * self._h * self._act_bytes

    def _p2p_message_bytes(self, tp: int) -> float:
        """What one rank of a TP-``tp`` stage sends (and receives) at a boundary: its
        sequence rows under SP (the runtime re-splits them at every boundary), the whole
        hidden states otherwise."""
        return self._message_bytes / (tp if self.sequence_parallel else 1)

    # ----- time -------------------------------------------------------------------------
    def _flops_rate(self, tp: int) -> float:
        return tp * self.hardware.peak_tflops * 1e12 * self.hardware.efficiency(tp)

    def _collective_s(self, tp: int, nbytes: float, count: int) -> float:
        """Ring all-reduce (or all-gather + reduce-scatter) inside a node."""
        if tp == 1:
            return 0.0
        hw = self.hardware
        one = (2 * (tp - 1) / tp * nbytes / (hw.intra_node_bandwidth_gb_s * 1e9)
               + 2 * (tp - 1) * hw.intra_node_latency_us * 1e-6)
        return count * one

    def layer_compute_s(self, tp: int) -> float:
        """Forward + backward FLOPs of one layer on one micro-batch, at TP degree ``tp``."""
        b, s, h = self._b, self._s, self._h
        gemm = 2 * b * s * (2 * h * h + 2 * h * self._kv + 3 * h * self._f)
        attention = 2 * b * s * s * h  # QK^T and AV, causal half of 4bs^2h
        return 3 * (gemm + attention) / self._flops_rate(tp)

    def layer_tp_comm_s(self, tp: int) -> float:
        return self._collective_s(tp, self._message_bytes, TP_COLLECTIVES_PER_LAYER)

    def contention(self, critical_s: float, cpu_s: float, fill_s: float = 0.0) -> float:
        """How much longer than ``critical_s`` a step takes whose slots need ``cpu_s`` of
        CPU on the profile's shared cores (1 on GPUs): ``d = cpu_s / (critical_s -
        fill_s)`` slots are busy at once, and together they achieve ``cores_worth(d)``.
        ``fill_s`` is the 1F1B fill and drain (``pipelines_fill_s``): there the stages
        wait for each other's hand-offs, so the steady phase's work cannot spread into
        it, and the whole chain runs at the steady phase's contention."""
        span = critical_s - fill_s
        if span <= 0 or cpu_s <= 0:
            return 1.0
        busy = cpu_s / span
        worth = self.hardware.cores_worth(busy)
        return 1.0 if worth is None else max(1.0, busy / worth)

    def stage_cpu_s(self, tp: int, layers: int, position: int, num_stages: int) -> float:
        """CPU seconds a stage's TP group spends per micro-batch (measured; without a
        CPU table, every rank busy for the stage's time)."""
        first, last = position == 0, position == num_stages - 1
        if self.tables and tp in self.tables.cpu_ms:
            return self.tables.cpu_ms[tp].total(layers, first, last) / 1000
        return tp * self.stage_cost(tp, layers, position, num_stages, True).time_s

    def stage_optimizer_s(self, tp: int, layers: int, position: int, num_stages: int,
                          replicas: int) -> float:
        """One rank's optimizer step: its local parameters (split over ``replicas``
        with ZeRO-1) at the measured ns per parameter (0 when not measured)."""
        per_param = self.tables.optimizer_ns_per_param if self.tables else None
        if not per_param:
            return 0.0
        first, last = position == 0, position == num_stages - 1
        params = self._stage_params(tp, layers, first, last)
        if self.recipe.training.distributed_optimizer:
            params /= replicas
        return params * per_param * 1e-9

    def pipelines_work(self, pipelines: list[tuple[int, list[tuple[int, int]]]],
                       grad_sync_s: float, copies: Sequence[int] | None = None
                       ) -> tuple[float, float]:
        """(slowest optimizer step, CPU seconds of the whole step) of ``[(micro_batches,
        [(tp, layers), ...]), ...]`` whose gradient all-reduce takes ``grad_sync_s``;
        ``copies``: how many alike pipelines each entry stands for (default 1 each)."""
        copies = [1] * len(pipelines) if copies is None else copies
        replicas = sum(copies)
        slowest = cpu = 0.0
        for (micro_batches, stages), alike in zip(pipelines, copies):
            for j, (tp, layers) in enumerate(stages):
                opt = self._memoised(("opt", tp, layers, j, len(stages), replicas),
                                     lambda: self.stage_optimizer_s(tp, layers, j,
                                                                    len(stages), replicas))
                busy = self._memoised(("cpu", tp, layers, j, len(stages)),
                                      lambda: self.stage_cpu_s(tp, layers, j, len(stages)))
                slowest = max(slowest, opt)
                cpu += alike * (micro_batches * busy + tp * (opt + grad_sync_s))
        return slowest, cpu

    @property
    def measured_tp_sizes(self) -> tuple[int, ...] | None:
        """TP degrees the profile measured for this recipe (None: no tables)."""
        return self.tables.tp_sizes if self.tables else None

    def _stage_table_s(self, tp: int, layers: int, first: bool, last: bool) -> float:
        return self.tables.forward_backward_ms[tp].total(layers, first, last) / 1000

    def layer_time_s(self, tp: int) -> float:
        """Time one layer adds to a stage per micro-batch (measured when the profile has
        it), with the recomputation that every layer runs (``layer_recompute_s``)."""
        return self._layer_time_s(tp) + self.layer_recompute_s(tp)

    def _layer_time_s(self, tp: int) -> float:
        if self.tables:
            return self.tables.forward_backward_ms[tp].layer / 1000
        if tp in self._measured:
            return self._measured[tp] / 1000
        return self._memoised(("layer", tp),
                              lambda: self.layer_compute_s(tp) + self.layer_tp_comm_s(tp))

    # ----- activation recomputation (training.recompute_*) ------------------------------
    @property
    def recompute(self) -> str:
        """What the model assumes is recomputed, in the recipe's words."""
        t = self.recipe.training
        if t.recompute_granularity == "full":
            return f"full, {t.recompute_method}, {t.recompute_num_layers} layer(s)"
        return t.recompute_granularity or "none"

    def layer_recompute_s(self, tp: int) -> float:
        """Extra forward time per layer that every layer pays: a second forward of each
        layer under full uniform recomputation (a third of forward + backward), of its
        core attention (QK^T, softmax, AV) under selective."""
        t = self.recipe.training
        if t.recompute_granularity == "full" and t.recompute_method == "uniform":
            return self._layer_time_s(tp) / 3
        if t.recompute_granularity == "selective":
            return 2 * self._b * self._s * self._s * self._h / self._flops_rate(tp)
        return 0.0

    def block_recompute_s(self, tp: int, layers: int) -> float:
        """Full block recomputation: a second forward of the stage's first
        ``recompute_num_layers`` layers."""
        t = self.recipe.training
        if t.recompute_granularity != "full" or t.recompute_method != "block":
            return 0.0
        return min(layers, t.recompute_num_layers) * self._layer_time_s(tp) / 3

    def output_layer_compute_s(self, tp: int) -> float:
        return 3 * 2 * self._b * self._s * self._h * self._v / self._flops_rate(tp)

    def p2p_s(self, intra_node: bool, tp: int = 1) -> float:
        """One boundary message of a rank of a TP-``tp`` stage."""
        hw, message = self.hardware, self._p2p_message_bytes(tp)
        if intra_node and hw.p2p_latency_us and hw.p2p_bandwidth_gb_s:
            return hw.p2p_latency_us * 1e-6 + message / (hw.p2p_bandwidth_gb_s * 1e9)
        if intra_node:
            return hw.intra_node_latency_us * 1e-6 + message / (
                hw.intra_node_bandwidth_gb_s * 1e9)
        return hw.inter_node_latency_us * 1e-6 + message / (hw.inter_node_bandwidth_gb_s * 1e9)

    def _embedding_comm_s(self, tp: int, first: bool, last: bool) -> float:
        count = (TP_COLLECTIVES_EMBEDDING // 2) * first + TP_COLLECTIVES_EMBEDDING * last
        return self._collective_s(tp, self._message_bytes, count)

    def _neighbours(self, position: int, num_stages: int) -> int:
        return (position > 0) + (position < num_stages - 1)

    def stage_fixed_s(self, tp: int, position: int, num_stages: int, intra_node: bool) -> float:
        """Time of a stage that does not scale with its layers: embedding/output, P2P."""
        first, last = position == 0, position == num_stages - 1
        neighbours = self._neighbours(position, num_stages)
        block = self.block_recompute_s(tp, self.num_layers)  # stages hold >= that many
        if self.tables:
            return self._memoised(
                ("fixed", tp, first, last, neighbours, intra_node),
                lambda: (self._stage_table_s(tp, 0, first, last)
                         + neighbours * self.p2p_s(intra_node, tp) + block))
        return self._memoised(
            ("fixed", tp, first, last, neighbours, intra_node),
            lambda: ((self.output_layer_compute_s(tp) if last else 0.0)
                     + self._embedding_comm_s(tp, first, last)
                     + neighbours * self.p2p_s(intra_node, tp) + block))

    def grad_sync_s(self, num_pipelines: int, min_pipeline_gpus: int, intra_node: bool) -> float:
        """Cross-pipeline gradient all-reduce (ring over the pipelines)."""
        if num_pipelines <= 1:
            return 0.0
        hw = self.hardware
        bw, lat = ((hw.intra_node_bandwidth_gb_s, hw.intra_node_latency_us) if intra_node
                   else (hw.inter_node_bandwidth_gb_s, hw.inter_node_latency_us))
        nbytes = GRAD_BYTES * self.total_params / min_pipeline_gpus
        d = num_pipelines
        return 2 * (d - 1) / d * nbytes / (bw * 1e9) + 2 * (d - 1) * lat * 1e-6

    def hidden_grad_sync_s(self, grad_sync_s: float, bottleneck_s: float) -> float:
        """Of the gradient all-reduce ``grad_sync_s``, what overlaps compute whose
        bottleneck stage takes ``bottleneck_s`` per micro-batch (see the module): none
        without ``training.overlap_grad_reduce``."""
        training = self.recipe.training
        if not training.overlap_grad_reduce:
            return 0.0
        backward, forward = 2 * bottleneck_s / 3, bottleneck_s / 3
        if not self.shards_optimizer:
            return min(grad_sync_s, backward)
        half = grad_sync_s / 2  # reduce-scatter, then all-gather of the weights
        return min(half, backward) + (min(half, forward) if training.overlap_param_gather
                                      else 0.0)

    # ----- memory -----------------------------------------------------------------------
    def _layer_activation_bytes(self, tp: int) -> float:
        """Activations one layer keeps for backward, per micro-batch and GPU (flash
        attention, no recomputation): norm inputs/outputs (split by sequence parallelism),
        QKV, attention output, and the SwiGLU fc1 output and product."""
        h, tp_sp = self._h, (tp if self.sequence_parallel else 1)
        per_token = 4 * h / tp_sp + (2 * h + 2 * self._kv + 3 * self._f) / tp
        return self._b * self._s * per_token * self._act_bytes

    def _sequence_parallel_saving(self, tp: int) -> float:
        """What sequence parallelism saves of one layer's activations per micro-batch
        (the norms' share of ``_layer_activation_bytes``, split by TP): measured tables
        are taken without it."""
        if not self.sequence_parallel or tp == 1:
            return 0.0
        return self._b * self._s * 4 * self._h * (1 - 1 / tp) * self._act_bytes

    def _layer_input_bytes(self, tp: int) -> float:
        """What a recomputed chunk of layers keeps: its input (split by sequence
        parallelism)."""
        return self._b * self._s * self._h / (tp if self.sequence_parallel else 1) \
            * self._act_bytes

    def _uniform_recompute_layers(self) -> int:
        """Layers per recomputed chunk under full uniform recomputation (0: none)."""
        t = self.recipe.training
        full_uniform = t.recompute_granularity == "full" and t.recompute_method == "uniform"
        return t.recompute_num_layers if full_uniform else 0

    def stage_activation_bytes(self, tp: int, layers: int, in_flight: int) -> float:
        """Activations of a stage's layers with ``in_flight`` micro-batches alive: every
        layer's (``_layer_activation_bytes``) without recomputation; with full
        recomputation a recomputed chunk keeps its input per micro-batch, plus the
        activations of the one chunk being recomputed in a backward. Selective
        recomputation frees the core attention's scores, which flash attention (what
        ``_layer_activation_bytes`` assumes) does not keep anyway."""
        t = self.recipe.training
        full = self._layer_activation_bytes(tp)
        if t.recompute_granularity != "full" or layers == 0:
            return in_flight * layers * full
        n = t.recompute_num_layers
        if t.recompute_method == "uniform":
            return in_flight * -(-layers // n) * self._layer_input_bytes(tp) + min(n, layers) * full
        recomputed = min(n, layers)
        return in_flight * (recomputed * self._layer_input_bytes(tp)
                            + (layers - recomputed) * full) + full

    def _sharded_layer_params(self, tp: int) -> float:
        return (self.layer_params - 2 * self._h) / tp + 2 * self._h

    def layer_memory_bytes(self, tp: int, position: int, num_stages: int,
                           replicas: int = 1) -> float:
        """Memory one more layer costs a stage's GPU in a layout of ``replicas``
        pipelines: its state (counted from its parameters, as ``stage_memory`` does; a
        profile's measured ``state_mib`` is the same count) and its activations (measured
        when the profile has them)."""
        in_flight = num_stages - position
        chunk = self._uniform_recompute_layers()
        if chunk:
            activation = self._layer_input_bytes(tp) / chunk
        elif self.tables:
            activation = self.tables.activation_mib[tp].layer * 2**20
        else:
            activation = self._layer_activation_bytes(tp)
        return (self._sharded_layer_params(tp) * self._bytes_per_param(replicas)
                + in_flight * activation)

    def _stage_params(self, tp: int, layers: int, first: bool, last: bool) -> float:
        """Parameters of one rank of a stage."""
        params = layers * self._sharded_layer_params(tp)
        if first:
            params += self._v * self._h / tp
        if last:
            params += self._v * self._h / tp + self._h
        return params

    def _replicated_params(self, layers: int, last: bool) -> int:
        """Parameters every TP rank of a stage holds whole: each layer's two norms, and
        the final norm on the last stage."""
        return layers * 2 * self._h + (self._h if last else 0)

    def optimizer_bytes(self, tp: int, layers: int, position: int, num_stages: int,
                        replicas: int = 1, norm_replicas: Sequence[int] | None = None
                        ) -> float:
        """One rank's optimizer state.

        Without ZeRO-1 it holds the state of all its parameters. With ZeRO-1
        (``training.distributed_optimizer``, ``runtime/distributed_optimizer.py``) each
        element's 12 bytes are split over every rank holding it: a TP-split piece (the
        embedding, projections, MLP and output layer) is held once per pipeline, by
        ``replicas`` ranks, as every pipeline holds every layer; a norm by every TP rank of
        the stage holding it in each pipeline: ``norm_replicas`` lists them for each of the
        stage's layers, then for the final norm on the last stage (default: ``replicas``
        each, at most what they are, since each pipeline holds a norm at least once). This
        is the even share (12 bytes x elements / holders); the runtime cuts each replica
        set's buffer at inner-chunk rows, so a rank owns that within one chunk per cut."""
        last = position == num_stages - 1
        params = self._stage_params(tp, layers, position == 0, last)
        if not self.shards_optimizer:
            return params * self._optimizer_bytes
        replicated = self._replicated_params(layers, last)
        if norm_replicas is None:
            norms = replicated / replicas
        else:
            if len(norm_replicas) != layers + last:
                raise ValueError(f"norm_replicas: {len(norm_replicas)} counts for a stage of "
                                 f"{layers} layers{' and the final norm' if last else ''}")
            counts = list(norm_replicas)
            norms = (sum(2 * self._h / r for r in counts[:layers])
                     + (self._h / counts[-1] if last else 0.0))
        return self._optimizer_bytes * ((params - replicated) / replicas + norms)

    def stage_memory(self, tp: int, layers: int, position: int, num_stages: int,
                     replicas: int = 1, norm_replicas: Sequence[int] | None = None
                     ) -> MemoryBreakdown:
        """One rank's memory in a layout of ``replicas`` pipelines (the optimizer state:
        ``optimizer_bytes``; without ZeRO-1 ``replicas`` changes nothing)."""
        first, last = position == 0, position == num_stages - 1
        params = self._stage_params(tp, layers, first, last)
        in_flight = num_stages - position
        if (self.tables and tp in self.tables.activation_mib
                and self.recipe.training.recompute_granularity != "full"):
            activations = in_flight * (self.tables.activation_mib[tp].total(
                layers, first, last) * 2**20 - layers * self._sequence_parallel_saving(tp))
        else:
            activations = self.stage_activation_bytes(tp, layers, in_flight)
            if last:
                activations += self._b * self._s * self._v / tp * LOGIT_BYTES
        return MemoryBreakdown(
            weights=params * self._param_bytes,
            gradients=params * GRAD_BYTES,
            optimizer=self.optimizer_bytes(tp, layers, position, num_stages, replicas,
                                           norm_replicas),
            activations=activations,
            reserved=self.hardware.memory_reserved_gib * GIB)

    def max_layers(self, tp: int, position: int, num_stages: int, replicas: int = 1) -> int:
        """Most layers a stage can hold in memory in a layout of ``replicas`` pipelines
        (0 if not even its fixed part fits), its norms' state split ``replicas`` ways."""
        first, last = position == 0, position == num_stages - 1
        fixed, fixed_state, per_layer, layer_state = self._memoised(
            ("memory_terms", tp, first, last, num_stages - position),
            lambda: self._memory_terms(tp, position, num_stages))
        share = 1 / self.replica_key(replicas)  # of the optimizer state
        room = self.capacity_bytes - (fixed - fixed_state * (1 - share))
        return 0 if room < 0 else int(room // (per_layer - layer_state * (1 - share)))

    def _memory_terms(self, tp: int, position: int, num_stages: int
                      ) -> tuple[float, float, float, float]:
        """(bytes of a stage slot without layers, of which optimizer state, bytes one more
        layer costs, of which optimizer state), the optimizer state unsplit: what
        ``max_layers`` needs for any number of pipelines (the state scales with 1 /
        pipelines; the search asks for many)."""
        empty = self.stage_memory(tp, 0, position, num_stages)
        return (empty.total - empty.reserved, empty.optimizer,
                self.layer_memory_bytes(tp, position, num_stages),
                self._sharded_layer_params(tp) * self._optimizer_bytes)

    # ----- whole stages / layouts ------------------------------------------------------
    def stage_cost(self, tp: int, layers: int, position: int, num_stages: int,
                   intra_node: bool, replicas: int = 1,
                   norm_replicas: Sequence[int] | None = None) -> StageCost:
        """Times and memory of one stage (memory as ``stage_memory`` in a layout of
        ``replicas`` pipelines)."""
        first, last = position == 0, position == num_stages - 1
        if self.tables:
            compute, comm = self._stage_table_s(tp, layers, first, last), 0.0
        elif tp in self._measured:
            compute, comm = layers * self._layer_time_s(tp), 0.0
        else:
            compute, comm = layers * self.layer_compute_s(tp), layers * self.layer_tp_comm_s(tp)
        if last and not self.tables:
            compute += self.output_layer_compute_s(tp)
        compute += layers * self.layer_recompute_s(tp) + self.block_recompute_s(tp, layers)
        collectives = (layers * TP_COLLECTIVES_PER_LAYER + (TP_COLLECTIVES_EMBEDDING // 2) * first
                       + TP_COLLECTIVES_EMBEDDING * last)
        neighbours = self._neighbours(position, num_stages)
        return StageCost(
            tp=tp, layers=layers, compute_s=compute,
            tp_comm_s=comm + (0.0 if self.tables else self._embedding_comm_s(tp, first, last)),
            p2p_s=neighbours * self.p2p_s(intra_node, tp),
            tp_comm_bytes=collectives * 2 * (tp - 1) / tp * self._message_bytes,
            p2p_bytes=neighbours * self._p2p_message_bytes(tp),
            memory=self.stage_memory(tp, layers, position, num_stages, replicas,
                                     norm_replicas))

    def norm_replicas(self, pipelines: list[tuple[int, list[tuple[int, int]]]]
                      ) -> list[list[tuple[int, ...]]]:
        """Per pipeline and stage of ``[(micro_batches, [(tp, layers), ...]), ...]``, the
        ranks holding each of its layers' norms, then the final norm's on the last stage
        (``optimizer_bytes``' ``norm_replicas``): every TP rank of the stage holding
        them, in every pipeline."""
        change = [0] * (self.num_layers + 1)  # of the holders, from one layer to the next
        final = 0
        for _, stages in pipelines:
            layer = 0
            for tp, layers in stages:
                change[layer] += tp
                change[layer + layers] -= tp
                layer += layers
            final += stages[-1][0]
        per_layer = list(itertools.accumulate(change[:-1]))
        out = []
        for _, stages in pipelines:
            layer, counts = 0, []
            for j, (_, layers) in enumerate(stages):
                last = (final,) if j == len(stages) - 1 else ()
                counts.append(tuple(per_layer[layer:layer + layers]) + last)
                layer += layers
            out.append(counts)
        return out

    def step_cost(self, pipelines: list[tuple[int, list[tuple[int, int]]]],
                  intra_node: bool) -> StepCost:
        """Cost of ``[(micro_batches, [(tp, layers), ...]), ...]``; each stage's memory
        with the optimizer state the layout gives it (``optimizer_bytes``)."""
        norms = self.norm_replicas(pipelines)
        costs = tuple(
            PipelineCost(micro_batches=mb, stages=tuple(
                self.stage_cost(tp, layers, j, len(stages), intra_node, len(pipelines),
                                norms[p][j])
                for j, (tp, layers) in enumerate(stages)))
            for p, (mb, stages) in enumerate(pipelines))
        min_gpus = min(sum(tp for tp, _ in stages) for _, stages in pipelines)
        grad = self.grad_sync_s(len(pipelines), min_gpus, intra_node)
        optimizer, cpu = self.pipelines_work(pipelines, grad)
        slowest = max(costs, key=lambda p: p.time_s)
        hidden = self.hidden_grad_sync_s(grad, slowest.bottleneck_s)
        critical = slowest.time_s + grad - hidden + optimizer
        fill = pipelines_fill_s((len(p.stages), p.bottleneck_s) for p in costs)
        return StepCost(pipelines=costs, grad_sync_s=grad, optimizer_s=optimizer,
                        contention=self.contention(critical, cpu, fill),
                        grad_sync_hidden_s=hidden)
