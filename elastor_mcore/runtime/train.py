"""The training loop for one layout, run inside an initialised torch.distributed world.

Reads top to bottom: build groups, build and initialise this rank's stage, plan the
gradient reduction, then per step: 1F1B over the pipeline's micro-batches, reduce
gradients across pipelines, clip by the global norm, AdamW (``runtime/optimizer.py``:
fp32 main parameters, mcore's lr schedule; with ``training.distributed_optimizer``,
ZeRO-1 in ``runtime/distributed_optimizer.py`` reduces, clips and steps instead).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist

from elastor_mcore import checkpoint, planner
from elastor_mcore.runtime.state import (
    check_lr_schedule, check_resumable, chunk_policy, data_fields, describe_load,
    ensure_optimizer_state, manifest_fields, restore_non_tensor_state, set_position,
    state_replicas, state_shards)
from elastor_mcore.config.data import DataConfig
from elastor_mcore.config.run import RunSettings
from elastor_mcore.data.samples import (SampleSource, SyntheticTokens, pipeline_sample_indices,
                                        tp_shared_micro_batches)
from elastor_mcore.data.source import build_sample_source
from elastor_mcore.runtime.distributed_optimizer import DistributedOptimizer, ShardPlan
from elastor_mcore.runtime import memory
from elastor_mcore.runtime.grad_sync import (GradientSynchronizer, SequenceParallelGrads,
                                             grad_buffer)
from elastor_mcore.planner.cost_model import MemoryBreakdown
from elastor_mcore.runtime.memory import RankMemory, SavedTensorMeter
from elastor_mcore.parallel.groups import GroupCache, RankGroups, build_groups, install
from elastor_mcore.parallel.layout import Layout
from elastor_mcore.runtime import reshard
from elastor_mcore.runtime.hooks import Recovery, StepHooks
from elastor_mcore.runtime.memory_tier import MemoryTier
from elastor_mcore.runtime.model import build_stage_model, initialize_weights
from elastor_mcore.runtime.optimizer import StageOptimizer
from elastor_mcore.runtime.p2p import StageCommunicator, stage_links
from elastor_mcore.config.recipe import Recipe
from elastor_mcore.config.shipped import shipped_path
from elastor_mcore.runtime.schedule import run_1f1b

log = logging.getLogger(__name__)

CPU_PROFILE = shipped_path("hardware profile", "cpu-slots-measured")
"""The default profile of CPU runs' predicted step time (``elastor profile`` of the
tiny recipe; other recipes get its links and core sharing with analytic layers)."""


@dataclass(frozen=True)
class StepMetrics:
    step: int               # 1-based number of the step just taken
    loss: float             # mean loss over every token of the global batch
    grad_norm: float        # global gradient norm before clipping
    time_s: float           # wall time of the step on the reporting rank
    lr: float | None = None  # learning rate of the step (training.lr_schedule)
    save_block_s: float | None = None  # time the save after this step blocked training
    save_in_flight: bool = False       # a background save was running as the step began
    data_wait_s: float = 0.0           # time the step took to get its micro-batches


@dataclass(frozen=True)
class OptimizerMemory:
    """One rank's optimizer state (``--report-memory``)."""

    rank: int
    params: int              # parameters of its stage
    state_bytes: int         # fp32 main parameters + moments, measured on the tensors
    expected_bytes: float    # 12 B/param, divided by the replica count under ZeRO-1
    sharded: bool            # training.distributed_optimizer (ZeRO-1)


@dataclass
class RunConfig:
    """One rank's run: the loaded recipe and layout, the run settings they came from,
    and the callbacks."""

    recipe: Recipe
    layout: Layout
    settings: RunSettings
    """Steps, saving, resuming, data (every flag ``elastor train`` passes a rank)."""
    on_step: Callable[[StepMetrics], None] | None = None
    """Called on the reporting rank (the lowest active rank) after every step."""
    hooks: StepHooks = field(default_factory=StepHooks)
    """Callbacks on every active rank (under the supervisor: heartbeats, events,
    injected failures)."""
    recovery: Recovery | None = None
    """Recovery in place (under the supervisor); None: a failed step ends the run."""
    on_memory: Callable[[list[OptimizerMemory]], None] | None = None
    """With ``settings.report_memory``: called on the reporting rank before the first
    step with every active rank's optimizer state."""
    on_peak_memory: Callable[[list[RankMemory]], None] | None = None
    """With ``settings.report_memory``: called on the reporting rank after the first
    step with every active rank's measured memory and the planner's prediction."""

    @property
    def seed(self) -> int:
        return self.settings.seed_for(self.recipe.training.seed)


@dataclass(frozen=True)
class Prediction:
    """The planner's step time for a run's layout, from one hardware profile."""

    step_s: float
    profile: str


def hardware_profile(settings: RunSettings) -> tuple[planner.HardwareProfile, str] | None:
    """The profile the planner's predictions use and its path: ``settings.hardware``
    (default on CPU: ``CPU_PROFILE``); None if there is none to use."""
    path = settings.hardware or (str(CPU_PROFILE) if device_for_rank().type == "cpu"
                                 and CPU_PROFILE.is_file() else None)
    if path is None:
        return None
    try:
        return planner.load_hardware(path), path
    except planner.HardwareError as exc:
        log.warning("no planner prediction: %s", exc)
        return None


def predict_step(settings: RunSettings, recipe: Recipe, layout: Layout) -> Prediction | None:
    """The profile's step time for the layout, its ranks mapped to their physical
    slots; None if there is no profile to use."""
    profile = hardware_profile(settings)
    if profile is None:
        return None
    hardware, path = profile
    return Prediction(planner.predicted_step_s(recipe, hardware, layout, settings.rank_slots),
                      path)


def predict_memory(settings: RunSettings, recipe: Recipe,
                   groups: RankGroups) -> MemoryBreakdown | None:
    """The cost model's memory for this rank's stage, less the profile's reserve (None
    without a profile); under ZeRO-1 with the optimizer state the layout gives it."""
    profile = hardware_profile(settings)
    if profile is None:
        return None
    pos = groups.position
    cost = planner.layout_cost(planner.CostModel(recipe, profile[0]), groups.layout,
                               profile[0].gpus_per_node)
    return replace(cost.pipelines[pos.pipeline].stages[pos.stage].memory, reserved=0.0)


def device_for_rank() -> torch.device:
    """This rank's device, decided here only: CUDA device ``LOCAL_RANK`` where CUDA
    is available (torchrun starts one rank per device), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@dataclass
class StageRunner:
    """One rank's stage: model, optimizer, communicator and gradient reduction."""

    recipe: Recipe
    groups: RankGroups
    model: torch.nn.Module
    optimizer: StageOptimizer | DistributedOptimizer
    grad_sync: GradientSynchronizer | DistributedOptimizer
    """Gradient reduction, norm and clipping: the optimizer itself under ZeRO-1."""
    comm: StageCommunicator
    device: torch.device
    sequence_parallel_grads: SequenceParallelGrads
    """Norm gradients summed over the TP group first (``training.sequence_parallel``)."""
    startup: memory.StartupMemory | None = None
    """Measured as the optimizer was built (``setup_stage(measure_startup=True)``)."""
    mask: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    data_wait_s: float = field(init=False, default=0.0)
    """Time the last ``train_step`` took to get its micro-batches (waiting on data)."""

    def __post_init__(self) -> None:
        seq, mbs = self.recipe.model.seq_length, self.recipe.training.micro_batch_size
        self.mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=self.device),
                               diagonal=1)[None, None]
        self.positions = torch.arange(seq, device=self.device)[None].expand(mbs, seq)

    def train_step(self, source: SampleSource, step: int) -> tuple[float, float]:
        """One optimizer step (0-based ``step``); returns (this rank's loss part, norm)."""
        recipe, groups = self.recipe, self.groups
        training = recipe.training
        pipeline = groups.layout.pipelines[groups.position.pipeline]
        needs_data = groups.is_first_stage or groups.is_last_stage
        began = time.perf_counter()
        micro = tp_shared_micro_batches(
            source, groups.layout, groups.position.pipeline, step, training.global_batch_size,
            training.micro_batch_size, recipe.model.seq_length + 1, groups.tp,
            self.device) if needs_data else []
        self.data_wait_s = time.perf_counter() - began
        tokens_per_batch = training.global_batch_size * recipe.model.seq_length
        loss_sum = torch.zeros((), dtype=torch.float64)

        def forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
            nonlocal loss_sum
            if x is not None:
                self.model.set_input_tensor(x)
            tokens = micro[i].tokens.to(self.device) if groups.is_first_stage else None
            if not groups.is_last_stage:
                return self.model(tokens, self.positions, attention_mask=self.mask)
            per_token = self.model(tokens, self.positions, attention_mask=self.mask,
                                   labels=micro[i].labels.to(self.device))
            loss = per_token.float().sum() / tokens_per_batch
            loss_sum += loss.detach().double().cpu()
            return loss

        self.optimizer.zero_grad()
        run_1f1b(pipeline.micro_batches, groups.position.stage, groups.num_stages,
                 self.comm, forward)
        self.sequence_parallel_grads.reduce()
        self.grad_sync.reduce()
        norm = self.grad_sync.global_norm(groups.active)
        clip = training.optimizer.clip_grad
        if clip > 0 and norm > clip:
            self.grad_sync.scale_(clip / (norm + 1e-6))
        self.optimizer.step()
        reports_loss = groups.is_last_stage and groups.position.tp_rank == 0
        return (float(loss_sum) if reports_loss else 0.0), norm


def setup_stage(recipe: Recipe, layout: Layout, seed: int, cache: GroupCache,
                initialize: bool = True, measure_startup: bool = False) -> StageRunner | None:
    """Build everything a rank needs for ``layout``; None on idle ranks. Without
    ``initialize`` the weights are left as built (a restore fills them next).

    Every world rank must call this (group creation and the reduction plan are
    collective over the world). ``measure_startup``: the tensors the optimizer's
    construction allocates are measured (``StageRunner.startup``).
    """
    groups = build_groups(layout, cache)
    model = None
    device = device_for_rank()
    if groups is not None:
        pg_collection = install(groups)
        model = build_stage_model(recipe, groups, pg_collection)
        if initialize:
            initialize_weights(model, recipe, seed)
        model.to(device)
    before = memory.held_bytes(model) if measure_startup and model is not None else 0
    meter = memory.AllocationMeter() if measure_startup else None
    with meter or contextlib.nullcontext():
        optimizer, grad_sync = _build_optimizer(recipe, layout, model, cache)
    if groups is None:
        return None
    model_cfg = recipe.model
    shape = (model_cfg.seq_length, recipe.training.micro_batch_size, model_cfg.hidden_size)
    dtype = next(model.parameters()).dtype
    links = stage_links(layout, groups.rank, recipe.training.sequence_parallel)
    comm = StageCommunicator(links, shape, dtype, device)
    return StageRunner(recipe, groups, model, optimizer, grad_sync, comm, device,
                       SequenceParallelGrads(model, groups.tp),
                       memory.StartupMemory.measured(before, meter) if meter else None)


def _build_optimizer(recipe: Recipe, layout: Layout, model: torch.nn.Module | None,
                     cache: GroupCache):
    """(optimizer, gradient reduction); collective over the world (idle ranks: no
    model, no optimizer). ZeRO-1 allocates the fp32 state of the rank's shard only."""
    if recipe.training.distributed_optimizer:
        plan = ShardPlan.build(layout, model, cache, chunk_policy(recipe))
        optimizer = DistributedOptimizer(model, recipe, plan, cache) if model is not None \
            else None
        return optimizer, optimizer
    optimizer = StageOptimizer(model, recipe) if model is not None else None
    return optimizer, GradientSynchronizer(layout, model, cache)  # after main_grad buffers


def train_steps(runner: StageRunner, source: SampleSource, steps: range,
                on_step: Callable[[StepMetrics], None] | None = None,
                on_update: Callable[[int], None] | None = None) -> list[StepMetrics]:
    """Run the (0-based) ``steps``; metrics are returned on the reporting rank, the
    lowest active rank (empty elsewhere). ``on_update(done)`` runs after each optimizer
    step (the in-memory tier's copy starts there)."""
    reporter = runner.groups.rank == min(runner.groups.layout.ranks)
    metrics = []
    for step in steps:
        start = time.perf_counter()
        lr = runner.optimizer.lr
        loss_part, norm = runner.train_step(source, step)
        if on_update:
            on_update(step + 1)
        loss = torch.tensor(loss_part, dtype=torch.float64)
        dist.all_reduce(loss, group=runner.groups.active)
        if reporter:
            m = StepMetrics(step + 1, float(loss), norm, time.perf_counter() - start, lr=lr)
            metrics.append(m)
            if on_step:
                on_step(m)
    return metrics


def resume(runner: StageRunner, load_dir: str, seed: int, data: DataConfig | None = None,
           allow_data_change: bool = False) -> int:
    """Load the latest committed step into this rank's state; returns that step. With
    ``data``, a checkpoint saved on other data is refused (see ``check_resumable``)."""
    reader = checkpoint.open(load_dir)
    path, manifest = reader.path, reader.manifest
    check_resumable(manifest, runner.recipe, seed, data, allow_data_change)
    check_lr_schedule(manifest, runner.optimizer)
    checkpoint.load(path, state_shards(runner.model, runner.optimizer),
                    group=runner.groups.active,
                    replicas=state_replicas(runner.groups.layout, runner.optimizer))
    runner.optimizer.copy_main_to_model()
    restore_non_tensor_state(manifest, runner.optimizer)
    log.info(describe_load(path, manifest, runner.groups.layout))
    return manifest.step


def checkpoint_manager(runner: StageRunner, cfg: RunConfig) -> checkpoint.CheckpointManager:
    policy = checkpoint.SavePolicy(**asdict(cfg.settings.saving))
    return checkpoint.CheckpointManager(
        cfg.settings.save_dir, group=runner.groups.active, chunking=chunk_policy(cfg.recipe),
        policy=policy, replicas=state_replicas(runner.groups.layout, runner.optimizer))


def save(runner: StageRunner, cfg: RunConfig, saver: checkpoint.CheckpointManager,
         step: int) -> checkpoint.SaveReport:
    """Save the state after ``step`` steps (see ``SavePolicy`` for when it commits)."""
    return saver.save(step, state_shards(runner.model, runner.optimizer),
                      {**manifest_fields(cfg.recipe, cfg.layout, step, cfg.seed, runner.optimizer),
                       "data": data_fields(cfg.settings.data, cfg.seed)})


def open_sample_source(runner: StageRunner, cfg: RunConfig, start: int) -> SampleSource:
    """This rank's samples from step ``start`` on. Only the first rank of a first stage
    (tokens) or a last stage (labels) reads data, for its TP group
    (``tp_shared_micro_batches``); a corpus source prepares exactly its samples ahead."""
    model_cfg = cfg.recipe.model
    groups = runner.groups
    reads_data = (groups.is_first_stage or groups.is_last_stage) \
        and groups.position.tp_rank == 0
    if cfg.settings.data.kind == "synthetic" or not reads_data:
        return SyntheticTokens(model_cfg.vocab_size, model_cfg.seq_length, cfg.seed)
    training = cfg.recipe.training
    indices = pipeline_sample_indices(cfg.layout, groups.position.pipeline,
                                      training.global_batch_size, training.micro_batch_size,
                                      start, cfg.settings.steps)
    return build_sample_source(cfg.settings.data, cfg.recipe, indices, cfg.seed)


def optimizer_memory(runner: StageRunner) -> list[OptimizerMemory]:
    """Every active rank's optimizer state (collective over the active ranks), its
    moments allocated first so that they are measured."""
    ensure_optimizer_state(runner.optimizer)
    mine = OptimizerMemory(runner.groups.rank, sum(p.numel() for p in runner.model.parameters()),
                           runner.optimizer.state_nbytes(),
                           runner.optimizer.expected_state_nbytes(),
                           isinstance(runner.optimizer, DistributedOptimizer))
    gathered: list = [None] * dist.get_world_size(runner.groups.active)
    dist.all_gather_object(gathered, mine, group=runner.groups.active)
    return gathered


def peak_memory(runner: StageRunner, settings: RunSettings, activations_peak: int,
                rss: memory.PhaseHighWater) -> list[RankMemory]:
    """Every active rank's memory after a step whose saved activations peaked at
    ``activations_peak`` bytes and RSS at ``rss``, beside the planner's (collective over
    the active ranks)."""
    groups, model = runner.groups, runner.model
    pos = groups.position
    measured = memory.measure(model, runner.optimizer.adamw,
                              [grad_buffer(p) for p in model.parameters()], activations_peak)
    mine = RankMemory(groups.rank, f"P{pos.pipeline}.S{pos.stage}.tp{pos.tp_rank}", measured,
                      rss.process, memory.device_peak_bytes(runner.device),
                      predict_memory(settings, runner.recipe, groups), runner.startup,
                      rss.phase)
    gathered: list = [None] * dist.get_world_size(groups.active)
    dist.all_gather_object(gathered, mine, group=groups.active)
    return gathered


@dataclass
class Session:
    """What the loop runs one layout with: the stage, its data, its saves and its
    in-memory tier; a recovery in place replaces it."""

    cfg: RunConfig
    runner: StageRunner
    source: SampleSource
    saver: checkpoint.CheckpointManager | None
    tier: MemoryTier | None
    start: int
    """Steps done when the session began."""
    current: int = 0
    """The step running (1-based)."""

    @property
    def reporter(self) -> bool:
        return self.runner.groups.rank == min(self.cfg.layout.ranks)

    def close(self) -> None:
        if self.saver:
            self.saver.close()
        self.source.close()
        if self.tier:
            self.tier.close()


def memory_tier(runner: StageRunner | None, cfg: RunConfig) -> MemoryTier | None:
    """The in-memory tier of the layout (``settings.memory_interval``; collective over
    the world, idle ranks too): replicas go to a rank on another node, nodes as the
    planner's profile counts slots (``settings.rank_slots``)."""
    if not cfg.settings.memory_interval:
        return None
    profile = hardware_profile(cfg.settings)
    per_node = profile[0].gpus_per_node if profile else 1
    slots = cfg.settings.rank_slots or tuple(range(dist.get_world_size()))
    node_of = {rank: slots[rank] // per_node for rank in cfg.layout.ranks}
    shards = state_shards(runner.model, runner.optimizer) if runner is not None else []
    return MemoryTier.build(shards, cfg.layout.ranks, node_of)


def snapshot(session: Session, done: int) -> None:
    """Start the in-memory copy of the state after ``done`` steps, if one is due."""
    tier, interval = session.tier, session.cfg.settings.memory_interval
    if tier is not None and done % interval == 0:
        tier.snapshot(done, session.runner.optimizer.scheduler.state_dict())


def begin(cfg: RunConfig, cache: GroupCache) -> Session | None:
    """Set up this rank for ``cfg.layout`` and resume if asked; None on idle ranks."""
    runner = setup_stage(cfg.recipe, cfg.layout, cfg.seed, cache,
                         measure_startup=cfg.settings.report_memory)
    tier = memory_tier(runner, cfg)
    if runner is None:
        return None
    load_start = time.perf_counter()
    try:
        start = resume(runner, cfg.settings.load_dir, cfg.seed, cfg.settings.data,
                       cfg.settings.allow_data_change) if cfg.settings.load_dir else 0
    except checkpoint.CheckpointError as exc:
        cfg.hooks.load_failed(exc)
        raise
    load_s = time.perf_counter() - load_start
    if cfg.settings.report_memory:
        state = optimizer_memory(runner)
        if cfg.on_memory and runner.groups.rank == min(cfg.layout.ranks):
            cfg.on_memory(state)
    if cfg.settings.save_dir and runner.groups.rank == min(cfg.layout.ranks):
        checkpoint.remove_stale(cfg.settings.save_dir)
    session = Session(cfg, runner, open_sample_source(runner, cfg, start),
                      checkpoint_manager(runner, cfg) if cfg.settings.save_dir else None,
                      tier, start)
    snapshot(session, start)  # a failure in the first step finds the start in memory
    cfg.hooks.ready(start, load_s)
    return session


def run_steps(session: Session, metrics: list[StepMetrics]) -> None:
    """Train from ``session.start`` to the last step, saving and copying to memory as
    due. Each step counts as done (``hooks.step_end``) once its copy is in memory."""
    cfg, runner, saver, tier = session.cfg, session.runner, session.saver, session.tier
    for step in range(session.start, cfg.settings.steps):
        session.current = step + 1
        if tier:
            tier.wait()
        cfg.hooks.step_start(step + 1)
        in_flight = saver is not None and saver.in_flight
        measured = cfg.settings.report_memory and step == session.start
        meter = SavedTensorMeter(runner.model) if measured else contextlib.nullcontext()
        rss = memory.PhaseHighWater() if measured else contextlib.nullcontext()
        with meter, rss:
            reported = train_steps(runner, session.source, range(step, step + 1),
                                   on_update=lambda done: snapshot(session, done))
        if measured:
            peaks = peak_memory(runner, cfg.settings, meter.peak, rss)
            if cfg.on_peak_memory and session.reporter:
                cfg.on_peak_memory(peaks)
        done = step + 1
        block_s = None
        if saver and ((cfg.settings.save_interval and done % cfg.settings.save_interval == 0)
                      or done == cfg.settings.steps):
            cfg.hooks.busy("save")
            report = save(runner, cfg, saver, done)
            block_s = None if report.skipped else report.block_s
        for m in reported:
            m = replace(m, save_block_s=block_s, save_in_flight=in_flight,
                        data_wait_s=runner.data_wait_s)
            metrics.append(m)
            if cfg.on_step:
                cfg.on_step(m)
        if tier:
            tier.wait()
        cfg.hooks.step_end(done)


def train(cfg: RunConfig, cache: GroupCache | None = None) -> list[StepMetrics]:
    """Set up this rank for ``cfg.layout``, resume if asked, train until step
    ``cfg.settings.steps`` and save every ``cfg.settings.save_interval`` steps. With a
    ``cfg.recovery``, a step that fails because a peer is gone is recovered from in
    place (``recover_in_place``)."""
    session = begin(cfg, cache or GroupCache())
    metrics: list[StepMetrics] = []
    while session is not None:
        try:
            run_steps(session, metrics)
        except RuntimeError as exc:  # gloo's errors when a peer is gone; DistError
            if session.cfg.recovery is None or isinstance(exc, checkpoint.CheckpointError):
                raise
            session = recover_in_place(session, exc)
            continue
        session.close()
        break
    return metrics


def recover_in_place(session: Session, error: BaseException) -> Session | None:
    """After a failed step: regroup with the survivors (``cfg.recovery``; its error if it
    gives up), build the new layout's stage in this process, restore the newest state
    the survivors' memory (and the durable checkpoint) holds, and continue from there;
    None if the new layout leaves this rank out (after it handed its copies on)."""
    cfg = session.cfg
    cfg.hooks.recovering(session.current)
    session.source.close()
    regroup = cfg.recovery.regroup(error, session.current)  # leaves the broken groups first
    copies = session.tier.abandon() if session.tier else []
    if regroup is None:
        return None
    began = time.perf_counter()
    cfg = replace(cfg, layout=regroup.layout, settings=replace(
        cfg.settings, rank_slots=regroup.rank_slots, load_dir=None))
    runner = setup_stage(cfg.recipe, cfg.layout, cfg.seed, GroupCache(), initialize=False)
    tier = memory_tier(runner, cfg)
    built = time.perf_counter()
    targets = state_shards(runner.model, runner.optimizer) if runner is not None else []
    restored = reshard.restore(targets, copies, cfg.settings.save_dir)
    if runner is None:  # idle in the new layout: its copies are handed on
        return None
    set_position(runner.optimizer, restored.step, restored.schedule)
    runner.optimizer.copy_main_to_model()
    restored_at = time.perf_counter()
    new = Session(cfg, runner, open_sample_source(runner, cfg, restored.step),
                  checkpoint_manager(runner, cfg) if cfg.settings.save_dir else None,
                  tier, restored.step)
    snapshot(new, restored.step)
    cfg.recovery.resumed(regroup, restored.step,
                         {"build": built - began, "restore": restored_at - built},
                         restored.received_bytes, restored.durable_cells)
    return new
