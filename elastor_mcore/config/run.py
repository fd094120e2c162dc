"""Run settings: every setting of a training run, defined once.

Each field of :class:`RunSettings` says, in its metadata (``config.flags.setting``),
which commands take it as a flag (``elastor train``, ``elastor launch``, ``elastor
demo`` and the torchrun ``worker``), with its help. From that one definition come the
sub-commands' flags (``add_arguments``), the worker's argv (``to_argv("worker")``) and
the worker's parsing of it (``from_args``): a new setting reaches every process by
being added here, once. How a run saves (``SaveOptions``) is its own group of fields,
which ``checkpoint.SavePolicy`` extends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from elastor_mcore.config.data import DataConfig
from elastor_mcore.config.flags import Command, Flags, int_list, nested, render_list, setting
from elastor_mcore.config.shipped import RECIPE_HELP

ALL: tuple[Command, ...] = ("train", "launch", "demo", "worker")
SAVING: tuple[Command, ...] = ("train", "launch", "worker")


@dataclass(frozen=True, kw_only=True)
class SaveOptions(Flags):
    """How a run saves: the run's flags of ``checkpoint.SavePolicy``, which adds what is
    not a flag (its commit timeouts) and checks the values."""

    keep: int = field(default=2, metadata=setting(
        "committed checkpoints to keep (default %(default)s)", SAVING,
        flag="--keep-checkpoints", metavar="N"))
    """Committed steps to keep."""
    asynchronous: bool = field(default=True, metadata=setting(
        "write checkpoints in the background; training blocks only for a copy into host "
        "buffers (default: on)", SAVING, flag="--async-save"))
    """Block only for the copy into host buffers; write and commit in the background."""
    when_busy: Literal["wait", "skip"] = field(default="wait", metadata=setting(
        "a save due while the previous one is still being written: wait for it, or skip "
        "the new one (default: %(default)s)", SAVING, flag="--save-when-busy"))
    """A save due while the previous one is still being written: ``wait`` for it to
    commit, or ``skip`` the new one (logged). Either way at most one is in flight."""
    on_error: Literal["stop", "continue"] = field(default="stop", metadata=setting(
        "a failed save (e.g. a full disk) stops the run, or is logged and training "
        "continues; the previous checkpoint stays loadable either way (default: "
        "%(default)s)", SAVING, flag="--on-save-error"))
    """A failed save (full disk, I/O error): raise ``CheckpointError`` on every rank,
    or log it and keep training. The previous committed step stays loadable."""


@dataclass(frozen=True, kw_only=True)
class RunSettings(Flags):
    """What a training run does, as its commands and every rank see it. Objects built
    from these settings (the loaded recipe and layout, callbacks) live in ``RunConfig``
    and ``SupervisorConfig``, which hold a ``RunSettings``."""

    recipe: str = field(metadata=setting(RECIPE_HELP, ALL))
    layout: str | None = field(default=None, metadata=setting(
        "layout YAML file, uniform shorthand like dp2-tp2-pp2, or a shipped layout's name", ("train", "worker"),
        required=True))
    """Under the supervisor, each launch's planned layout (set per launch)."""
    steps: int = field(metadata=setting("optimizer steps to run", ALL))
    seed: int | None = field(default=None, metadata=setting(
        "override the recipe's seed; the run's seed initialises the weights and orders "
        "--shuffle-data epochs", ("train", "launch", "worker")))
    metrics_out: str | None = field(default=None, metadata=setting(
        "write JSON lines {step, loss, grad_norm, lr, time_s, data_wait_s, save_block_s, "
        "save_in_flight, predicted_s} "
        "here", ("train", "worker")))
    save_dir: str | None = field(default=None, metadata=setting(
        "checkpoint root, a directory or s3://BUCKET/PREFIX (endpoint and credentials "
        "from the AWS environment): saves step_<N>/ every --save-interval steps and at "
        "the end",
        ("train", "worker"), flag="--save", metavar="DIR"))
    save_interval: int = field(default=0, metadata=setting(
        "with --save: also save every K steps (default 0: only at the end)", ALL,
        metavar="K"))
    saving: SaveOptions = field(default_factory=SaveOptions, metadata=nested())
    load_dir: str | None = field(default=None, metadata=setting(
        "resume from the latest committed step under DIR (or s3://BUCKET/PREFIX), under "
        "the current layout "
        "(weights, optimizer, RNG, data position, step)", ("train", "worker"),
        flag="--load", metavar="DIR"))
    report_memory: bool = field(default=False, metadata=setting(
        "print every rank's optimizer-state bytes (fp32 main parameters and Adam "
        "moments, measured on its tensors) next to the formula: 12 bytes per parameter, "
        "divided by its replica count under training.distributed_optimizer; after the "
        "first step, every rank's measured weights, gradients, optimizer state, peak "
        "activations saved for backward and RSS (CUDA allocator peak on GPU) next to "
        "the planner's prediction for its stage",
        ("train", "worker")))
    allow_data_change: bool = field(default=False, metadata=setting(
        "resume even if the corpus or tokenizer differs from the checkpoint's (the "
        "sample stream changes; logged as a warning)", ("train", "launch", "worker")))
    data: DataConfig = field(default_factory=DataConfig, metadata=setting(
        "DataConfig as JSON (the commands' data flags build it)", ("worker",),
        flag="--data-config", parse=DataConfig.from_json, render=DataConfig.to_json))
    failure_plan: str | None = field(default=None, metadata=setting(
        "inject failures: a list of {step, slot, kind: kill|hang}", ("launch", "worker"),
        metavar="YAML"))
    hardware: str | None = field(default=None, metadata=setting(
        "hardware profile for the planner's predicted step time of the layout, printed "
        "beside the measured median (default on CPU: recipes/hardware/cpu-slots-measured"
        ".yaml)", ("train", "worker"), metavar="YAML"))
    """Under the supervisor, the profile it plans with."""
    memory_interval: int = field(default=1, metadata=setting(
        "every K steps, copy each rank's training state into host memory, with a replica "
        "in a peer's host memory (on another node when there is one), in the background; "
        "recovery in place restores from it (0: off; default %(default)s)", ALL,
        metavar="K"))
    """The in-memory tier (``runtime.memory_tier``); the zarr tier keeps
    ``save_interval``."""
    recovery: Literal["in-place", "relaunch"] = field(default="in-place", metadata=setting(
        "after a failure the survivors re-plan and continue in the same processes from "
        "the state in memory (in-place), falling back to a relaunch from the durable "
        "checkpoint if that fails; or always relaunch (default: %(default)s)",
        ("launch", "demo", "worker")))
    """How the supervisor recovers (``elastic.inplace``; one host)."""
    replan_all_slots: bool = field(default=False, metadata=setting(
        "set by elastor launch: a recovery in place plans layouts that keep every "
        "surviving slot busy", ("worker",), negatable=False))
    """``LaunchSettings.use_all_slots``, for the ranks' own planning."""
    elastic_dir: str | None = field(default=None, metadata=setting(
        "set by elastor launch: heartbeats and events of this launch", ("worker",)))
    rank_slots: tuple[int, ...] | None = field(default=None, metadata=setting(
        "set by elastor launch: physical slot of each rank, comma-separated, in rank "
        "order", ("worker",), parse=int_list, render=render_list))
    """Torchrun ranks are contiguous (0..n-1), the survivors' slots are not."""

    def seed_for(self, recipe_seed: int) -> int:
        """The seed of the run: ``seed`` if given, else the recipe's."""
        return recipe_seed if self.seed is None else self.seed
