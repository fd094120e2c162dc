"""What one installation of Elastor into a Megatron-LM or Megatron-Core process holds:
its options, this rank's groups, the heterogeneous loop's state and the originals of
every replaced function. One ``Installation`` per process (``hooks.install``); every
replacement function gets it from the patch that made it, none reads a module global.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from elastor_mcore.checkpoint.megatron_dir import ZarrSaveSettings
from elastor_mcore.checkpoint.plan import NO_REPLICAS, Replicas
from elastor_mcore.integrations.megatron_lm.memory_report import MemoryReport
from elastor_mcore.integrations.megatron_lm.overlap import GradReadiness
from elastor_mcore.parallel.groups import GroupCache, RankGroups
from elastor_mcore.parallel.layout import Layout
from elastor_mcore.runtime.distributed_optimizer import ZeroShards
from elastor_mcore.runtime.grad_sync import GradientSynchronizer, SequenceParallelGrads
from elastor_mcore.runtime.memory import StartupMemory
from elastor_mcore.runtime.p2p import StageCommunicator

CKPT_FORMATS = ("zarr",)


@dataclass(frozen=True)
class ElastorOptions:
    """What the hooks do in this process."""

    layout: Layout | None = None
    """Build this layout's groups instead of Megatron's uniform grid (None: Megatron's)."""
    ckpt_format: str | None = None
    """``"zarr"`` saves in the elastor format; None leaves saving to Megatron-Core."""
    save: ZarrSaveSettings = field(default_factory=ZarrSaveSettings)
    report_memory: bool = False
    """``--elastor-report-memory``: measure a training step's memory beside the
    planner's prediction (``memory_report.py``)."""
    hardware: str | None = None
    """``--elastor-hardware``: the profile of that prediction."""
    sequence_parallel: bool = False
    """The job's ``--sequence-parallel``: every stage of TP > 1 splits the rows of its
    activations over its TP group, so a stage boundary re-splits them (a rank's own
    ``args.sequence_parallel`` is its stage's, off at TP 1)."""

    def __post_init__(self) -> None:
        if self.ckpt_format not in (None, *CKPT_FORMATS):
            raise ValueError(f"ckpt_format={self.ckpt_format!r}: use one of {CKPT_FORMATS} "
                             f"or None")


OnParallelState = Callable[[RankGroups | None, Layout], None]
"""Called once the layout's groups are installed (``None``: this rank is idle)."""


class LoopObserver:
    """What a launcher watching the job sees of Megatron-LM's loop, on every rank
    (``loop.py`` reports it; ``elastor launch --megatron-lm`` observes it through
    ``elastic.rank.megatron``). Iterations are 1-based, as Megatron-LM logs them. The
    base class sees nothing."""

    def loaded(self, iteration: int, load_s: float) -> None:
        """``load_checkpoint`` took ``load_s`` seconds; training resumes after
        ``iteration`` (0: from the start)."""

    def load_failed(self, error: BaseException) -> None:
        """``load_checkpoint`` raised ``error`` (which goes on to stop the rank)."""

    def iteration_start(self, iteration: int) -> None:
        """Iteration ``iteration`` is about to run."""

    def iteration_end(self, iteration: int, loss: float | None, time_s: float) -> None:
        """Iteration ``iteration`` took ``time_s``; ``loss``: the global batch's mean
        loss on a last pipeline stage, None elsewhere."""

    def busy(self, what: str) -> None:
        """Something other than an iteration (``save``, ``evaluation``) begins."""

    def idle(self) -> None:
        """It is over; the next iteration follows."""


@dataclass
class ScheduleState:
    """What the heterogeneous schedule keeps between steps (built on the first step:
    collective)."""

    groups: RankGroups
    grad_sync: GradientSynchronizer | ZeroShards
    comm: StageCommunicator
    last_stages: Any            # every rank of every last stage (the loss reports)
    sequence_parallel_grads: SequenceParallelGrads
    """The norms' gradients summed over the TP group first (``--sequence-parallel``)."""
    overlap: GradReadiness | None = None
    """``GradReadiness`` under ``--overlap-grad-reduce`` (None: the reduction
    runs after the last backward)."""
    norm: float | None = None   # this step's global gradient norm


@dataclass
class Installation:
    """Elastor's state in this process (see the module docstring)."""

    provider: Callable[[], ElastorOptions]
    """Gives the options on first use (Megatron-LM parses its arguments after install)."""
    on_parallel_state: OnParallelState | None = None
    originals: list[tuple[Any, str, Any]] = field(default_factory=list)
    """(module, name, original) of every replaced attribute, in patch order."""
    resolved: ElastorOptions | None = None
    groups: RankGroups | None = None
    """This rank's groups under the layout (None: idle, or no layout installed yet)."""
    pg_collection: Any = None
    """The ``ProcessGroupCollection`` matching ``groups``."""
    cache: GroupCache = field(default_factory=GroupCache)
    """The heterogeneous loop's groups: the start-up weight broadcast's and every
    step's (created once)."""
    zero: ZeroShards | None = None
    """The ZeRO-1 shards under ``--use-distributed-optimizer`` (built with the optimizer)."""
    state_replicas: Replicas = NO_REPLICAS
    """Which ranks hold the same checkpointed tensors, for the zarr saves' and loads'
    plans (``zarr_format.state_replicas``, set as the optimizer is built)."""
    schedule: ScheduleState | None = None
    startup_memory: StartupMemory | None = None
    """Under ``--elastor-report-memory``: measured as the optimizer was built."""
    memory_report: MemoryReport | None = None
    """Under ``--elastor-report-memory`` (made when the loop first asks for its schedule)."""
    observer: LoopObserver = field(default_factory=LoopObserver)
    """Who watches the loop (``loop.py``); the base class: nobody."""

    def options(self) -> ElastorOptions:
        """The options in force (the provider is called once, on first use)."""
        if self.resolved is None:
            self.resolved = self.provider()
        return self.resolved

    def reconfigure(self, provider: Callable[[], ElastorOptions],
                    on_parallel_state: OnParallelState | None) -> None:
        """New options for the installed patches (read again on next use)."""
        self.provider, self.resolved, self.on_parallel_state = provider, None, on_parallel_state

    @property
    def layout(self) -> Layout | None:
        return self.options().layout

    def heterogeneous(self) -> bool:
        """Whether the layout is one Megatron-LM's own loop cannot train: the loop's
        replacements act only then."""
        layout = self.layout
        return layout is not None and not layout.is_uniform
