"""A supervised job, as the supervisor (one host) and the node launcher (one node of
several) share it: what its ranks run (``Workload``: the project's trainer,
``Trainer``, or Megatron-LM's ``pretrain_gpt.py``, ``elastic.megatron``), how they are
supervised (``LaunchSettings``), the failure plan, and where the checkpoints go.

Detection, planning, relaunch, the lease and the timeline are one code path for every
workload; a workload says only what its ranks run for a launch (``launch_command``) or
a rendezvous round (``round_command``), which checkpoints it can resume from, which
layouts it cannot run, whether its ranks start from the pre-imported worker
(``prestarted``) and whether they recover in place (``in_place``).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

from elastor_mcore import planner
from elastor_mcore.checkpoint import committed_steps
from elastor_mcore.checkpoint.format import step_dir_name
from elastor_mcore.checkpoint.storage import Location, as_path
from elastor_mcore.config.failure_plan import Failure, validate
from elastor_mcore.config.launch import LaunchSettings, RoundSettings
from elastor_mcore.config.recipe import Recipe
from elastor_mcore.config.run import RunSettings
from elastor_mcore.elastic.heartbeat import HangPolicy
from elastor_mcore.parallel.layout import Layout, layout_from_dict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankCommand:
    """What torchrun starts on every rank: ``python -m module *args``."""

    module: str
    args: list[str]


@dataclass(frozen=True)
class Launch:
    """One launch on one host, as the supervisor set it up."""

    directory: str
    """``launch<K>/``: layout, metrics, events, heartbeats."""
    layout: str
    """The layout file, on torchrun ranks 0..n-1."""
    slots: tuple[int, ...]
    """The physical slot of each torchrun rank."""
    checkpoint_dir: str
    """Where the launch saves (``JobConfig.checkpoint_dir``)."""
    load_step: int | None
    """The committed step it resumes from; None: from the start."""
    hardware: str
    """The profile the supervisor plans with."""
    use_all_slots: bool = False
    """The supervisor keeps every alive slot busy (``LaunchSettings.use_all_slots``);
    a recovery in place plans the same way."""

    @property
    def metrics_out(self) -> str:
        """The reporting rank's JSON lines, one per step (``{step, loss, time_s, ...}``),
        which the supervisor forwards as they come."""
        return str(Path(self.directory) / "metrics.jsonl")


class Workload(ABC):
    """What the ranks of a job run. A launch on one host starts ``launch_command``
    under ``torchrun --standalone``; on several nodes, each node's elastic agent starts
    ``round_command`` at every rendezvous round, whose ranks agree on the round's
    layout themselves."""

    prestarted = False
    """Whether its ranks run under a keeper, forked from the pre-imported worker when
    there is one (``elastic.prestart``)."""

    @property
    def zygote_imports(self) -> tuple[str, ...]:
        """Its ranks' heavy modules beyond what every pre-imported worker holds
        (``rank.zygote.PRELOAD``), which its pre-imported worker imports too."""
        return ()

    @property
    @abstractmethod
    def steps(self) -> int:
        """Steps (iterations) of the whole run."""

    @property
    def in_place(self) -> bool:
        """Whether its ranks recover from a failure in place (``elastic.inplace``);
        else every failure relaunches."""
        return False

    @property
    @abstractmethod
    def save_interval(self) -> int:
        """Steps between two saves: what a failure may redo."""

    @property
    @abstractmethod
    def failure_plan(self) -> str | None:
        """The failure plan file the ranks inject (tests and the demo)."""

    @property
    @abstractmethod
    def recipe_file(self) -> str:
        """The job's model and batch as a recipe file (a profile is measured for it)."""

    @abstractmethod
    def launch_command(self, launch: Launch) -> RankCommand:
        """One launch on one host."""

    @abstractmethod
    def round_command(self, node: RoundSettings, checkpoint_dir: str, hardware: str,
                      node_dir: str) -> RankCommand:
        """Every round of one node of several."""

    def committed_steps(self, root: Location) -> list[int]:
        """The steps under the checkpoint root a launch can resume from, ascending."""
        return committed_steps(root)

    def refusal(self, layout: Layout) -> str | None:
        """Why the ranks cannot run ``layout`` (None: they can), its ranks renumbered
        as torchrun numbers them (``rank_order``, ``renumbered``)."""
        return None

    def rank_order(self, layout: Layout) -> tuple[int, ...]:
        """The layout's slots in torchrun rank order (default: ascending)."""
        return layout.ranks

    def plan(self, recipe: Recipe, hardware: planner.HardwareProfile, alive: Sequence[int],
             **kwargs) -> planner.Plan:
        """The planner's fastest layout on ``alive`` that the ranks can run: when they
        cannot run the best one (``refusal``), the best one on fewer slots."""
        refused = []
        for count in range(len(alive), 0, -1):
            chosen = planner.plan(recipe, hardware, alive[:count], **kwargs)
            why = self.refusal(renumbered(chosen.layout, self.rank_order(chosen.layout)))
            if why is None:
                if refused:
                    log.warning("planned on %d of %d slots: %s", count, len(alive),
                                "; ".join(refused))
                return chosen
            refused.append(f"{chosen.layout.describe()} on {count} slots cannot run: {why}")
        raise planner.PlannerError("no layout the ranks can run: " + "; ".join(refused))


@dataclass(frozen=True)
class Trainer(Workload):
    """The project's trainer (``runtime.train`` under ``elastic.rank``'s entry points),
    given what every launch trains; the launcher sets its layout, checkpoint, metrics
    and elastic paths."""

    settings: RunSettings
    """Recipe file, steps, saving, seed, data, failure plan. Prepare the data once
    beforehand (``data.prepare.prepare_data``)."""
    module = "elastor_mcore.elastic.rank.worker"
    node_module = "elastor_mcore.elastic.rank.node_worker"
    prestarted = True

    @property
    def steps(self) -> int:
        return self.settings.steps

    @property
    def save_interval(self) -> int:
        return self.settings.save_interval

    @property
    def failure_plan(self) -> str | None:
        return self.settings.failure_plan

    @property
    def recipe_file(self) -> str:
        return self.settings.recipe

    @property
    def in_place(self) -> bool:
        return self.settings.recovery == "in-place"

    def launch_command(self, launch: Launch) -> RankCommand:
        load = None if launch.load_step is None else \
            str(as_path(launch.checkpoint_dir) / step_dir_name(launch.load_step))
        return RankCommand(self.module, replace(
            self.settings, layout=launch.layout, metrics_out=launch.metrics_out,
            save_dir=launch.checkpoint_dir, load_dir=load, elastic_dir=launch.directory,
            rank_slots=launch.slots, hardware=launch.hardware,
            replan_all_slots=launch.use_all_slots).to_argv("worker"))

    def round_command(self, node: RoundSettings, checkpoint_dir: str, hardware: str,
                      node_dir: str) -> RankCommand:
        settings = replace(self.settings, save_dir=checkpoint_dir, hardware=hardware,
                           elastic_dir=node_dir)
        return RankCommand(self.node_module,
                           [*settings.to_argv("worker"), *node.to_argv("node-worker")])


def renumbered(layout: Layout, order: Sequence[int]) -> Layout:
    """``layout`` on ranks 0..n-1, rank ``r`` where ``order[r]`` was (torchrun's ranks
    are contiguous, a plan's slots or a round's healthy ranks are not)."""
    rank_of = {old: new for new, old in enumerate(order)}
    data = layout.to_dict()
    for pipe in data["pipelines"]:
        for stage in pipe["stages"]:
            stage["ranks"] = [rank_of[r] for r in stage["ranks"]]
    return layout_from_dict(data)


def latest_readable(steps: Iterable[int], unreadable: Iterable[int]) -> int | None:
    """The newest of ``steps`` not known ``unreadable`` (a load of it failed)."""
    bad = set(unreadable)
    return max((s for s in steps if s not in bad), default=None)


@dataclass(frozen=True, kw_only=True)
class JobConfig(ABC):
    """What the supervisor and the node launcher share; each adds where its slots are."""

    workload: Workload
    launch: LaunchSettings
    """How the job is supervised, ``devices`` resolved to ``cpu`` or ``cuda``."""
    recipe: Recipe
    """The workload's model and batch, for the planner."""
    failures: tuple[Failure, ...] = ()
    """The content of the workload's failure plan, on ``failure_slots``."""
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        steps, save_interval = self.workload.steps, self.workload.save_interval
        if steps <= 0:
            raise ValueError(f"steps must be positive, got {steps}")
        if save_interval <= 0:
            raise ValueError(f"save_interval must be positive (recovery resumes from the "
                             f"latest checkpoint), got {save_interval}")
        if self.launch.devices not in ("cpu", "cuda"):
            raise ValueError(f"devices must be resolved to cpu or cuda, got "
                             f"{self.launch.devices!r}")
        validate(self.failures, self.failure_slots, steps,
                 self.workload.failure_plan or "failure plan")

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
                          floor_s=self.launch.heartbeat_timeout)
