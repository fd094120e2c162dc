"""A supervised job, as the supervisor (one host) and the node launcher (one node of
several) share it: what its ranks run (``Workload``), what they train
(``RunSettings``), how they are supervised (``LaunchSettings``), the failure plan, and
where the checkpoints go.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from elastor_mcore.checkpoint.storage import Location, as_path
from elastor_mcore.config.failure_plan import Failure, validate
from elastor_mcore.config.launch import LaunchSettings, RoundSettings
from elastor_mcore.config.recipe import Recipe
from elastor_mcore.config.run import RunSettings
from elastor_mcore.elastic.heartbeat import HangPolicy


@dataclass(frozen=True)
class RankCommand:
    """What torchrun starts on every rank: ``python -m module *args``."""

    module: str
    args: list[str]


@dataclass(frozen=True)
class Workload:
    """What the ranks of a job run, given each launch's run settings (the launcher sets
    their layout, checkpoint and elastic paths). One host's launches start ``module``
    under ``torchrun --standalone``; on several nodes, each node's elastic agent starts
    ``node_module`` at every rendezvous round, which also gets the node launcher's
    ``RoundSettings`` and agrees on the round's layout itself."""

    module: str
    node_module: str
    in_place: bool = False
    """Whether its ranks recover in place (``elastic.inplace``); else every failure
    relaunches."""

    def launch_command(self, settings: RunSettings) -> RankCommand:
        """One launch on one host."""
        return RankCommand(self.module, settings.to_argv("worker"))

    def round_command(self, settings: RunSettings, node: RoundSettings) -> RankCommand:
        """Every round of one node of several."""
        return RankCommand(self.node_module,
                           [*settings.to_argv("worker"), *node.to_argv("node-worker")])


TRAINER = Workload("elastor_mcore.elastic.rank.worker", "elastor_mcore.elastic.rank.node_worker",
                   in_place=True)
"""The project's trainer (``runtime.train`` under ``elastic.rank``'s entry points)."""


@dataclass(frozen=True, kw_only=True)
class JobConfig(ABC):
    """What the supervisor and the node launcher share; each adds where its slots are."""

    settings: RunSettings
    """What every launch trains (recipe file, steps, saving, seed, data, failure plan).
    Prepare the data once beforehand (``data.source.prepare_data``)."""
    launch: LaunchSettings
    """How the job is supervised, ``devices`` resolved to ``cpu`` or ``cuda``."""
    recipe: Recipe
    """``settings.recipe`` loaded, for the planner."""
    failures: tuple[Failure, ...] = ()
    """The content of ``settings.failure_plan``, on ``failure_slots``."""
    workload: Workload = TRAINER
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        steps, save_interval = self.settings.steps, self.settings.save_interval
        if steps <= 0:
            raise ValueError(f"steps must be positive, got {steps}")
        if save_interval <= 0:
            raise ValueError(f"save_interval must be positive (recovery resumes from the "
                             f"latest checkpoint), got {save_interval}")
        if self.launch.devices not in ("cpu", "cuda"):
            raise ValueError(f"devices must be resolved to cpu or cuda, got "
                             f"{self.launch.devices!r}")
        validate(self.failures, self.failure_slots, steps,
                 self.settings.failure_plan or "failure plan")

    @property
    @abstractmethod
    def failure_slots(self) -> Sequence[int]:
        """The slots a failure plan names."""

    @property
    def run_dir(self) -> Path:
        return Path(self.launch.run_dir)

    @property
    def hardware_path(self) -> Path:
        return Path(self.launch.hardware)

    @property
    def checkpoint_dir(self) -> Location:
        """Where the launches save and resume: ``--checkpoint-dir`` (a directory or
        ``s3://BUCKET/PREFIX``, endpoint and credentials from the AWS environment), else
        ``<run_dir>/checkpoints``. The lease, the relaunch's latest committed step and
        pruning all work on it."""
        root = self.launch.checkpoint_dir
        return self.run_dir / "checkpoints" if root is None else as_path(root)

    @property
    def hang(self) -> HangPolicy:
        return HangPolicy(startup_timeout_s=self.launch.startup_timeout,
                          timeout_s=self.launch.heartbeat_timeout)
