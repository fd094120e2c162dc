"""Launcher settings: how ``elastor launch`` (and ``elastor demo``) supervise a run,
defined once, as the run settings are (``config.flags``).

- ``LaunchSettings``: the supervision of a run on one host or on one node of several
  (``elastic.job.JobConfig`` holds them for the supervisor and the node launcher);
- ``NodeSettings``: a job of several nodes (torch elastic's c10d rendezvous);
- ``RoundSettings``: what a node's launcher tells the ranks its agent starts at every
  rendezvous round (``node-worker``), as argv (``to_argv``) they read back;
- ``MegatronSettings``: a Megatron-LM job (``--megatron-lm``), and what the launcher
  tells each rank of ``pretrain_gpt.py`` besides Megatron-LM's own flags
  (``megatron-worker``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from elastor_mcore.config.flags import Command, Flags, int_list, render_list, setting
from elastor_mcore.config.shipped import HARDWARE_HELP

Devices = Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True, kw_only=True)
class LaunchSettings(Flags):
    """How a run is supervised, beside what it trains (``RunSettings``)."""

    hardware: str = field(metadata=setting(f"{HARDWARE_HELP}, for the planner", ("launch",)))
    measure_profile: bool = field(default=False, metadata=setting(
        "unless --hardware or DIR/hardware-profile.yaml was measured on this machine for "
        "the recipe (elastor profile), measure one first and cache it there; either "
        "measured profile replaces --hardware for planning", ("launch",), negatable=False))
    """With a profile not measured here for the recipe: measure one (once per run
    directory) before the first launch."""
    slots: int | None = field(default=None, metadata=setting(
        "slots 0..N-1 (node-major, the profile's gpus_per_node per node; default: one node "
        "on CPU, every visible GPU on CUDA)", ("launch", "demo"), metavar="N",
        aliases=("--nproc-per-node",)))
    run_dir: str = field(metadata=setting(
        "checkpoints, per-launch logs and timeline.json go here", ("launch",), metavar="DIR"))
    checkpoint_dir: str | None = field(default=None, metadata=setting(
        "checkpoint root instead of DIR/checkpoints: a directory or s3://BUCKET/PREFIX "
        "(endpoint and credentials from the AWS environment); every launch saves there and "
        "a relaunch resumes from its latest committed step", ("launch",), metavar="DIR"))
    """None: ``<run_dir>/checkpoints``. The lease, the relaunch's latest committed step
    and pruning all work on it."""
    max_restarts: int = field(default=3, metadata=setting(
        "give up after N recoveries (default %(default)s); with several nodes, torch's "
        "--max-restarts of each node's agent (a node joining does not count)", ("launch",),
        metavar="N"))
    heartbeat_timeout: float = field(default=2.0, metadata=setting(
        "the least silence that makes a rank hung once it has timed 3 steps of its launch; "
        "the timeout is 3 x the 99th percentile of its step times when that is longer "
        "(default %(default)g)", ("launch", "demo"), metavar="S"))
    """The floor of the hang timeout (``elastic.heartbeat.HangPolicy``)."""
    startup_timeout: float = field(default=300.0, metadata=setting(
        "silence allowed before a rank has timed 3 steps of a launch (imports, model "
        "build, checkpoint load, first steps), during a save or an evaluation, and after "
        "its last step (default %(default)g)", ("launch", "demo"), metavar="S"))
    devices: Devices = field(default="auto", metadata=setting(
        "cuda probes each GPU after a failure (default: cuda if available)", ("launch",)))
    """``auto`` until the command resolves it; the supervisor and node launcher get
    ``cpu`` or ``cuda``."""
    probe_timeout: float = field(default=60.0, metadata=setting(
        "after a failure, a GPU whose probe (a small kernel) has not finished within S "
        "seconds counts dead (default %(default)g)", ("launch",), metavar="S"))
    zygote: bool = field(default=True, metadata=setting(
        "start every rank from a pre-imported worker that holds torch and Megatron-Core "
        "(forked in a fraction of a second) rather than a new interpreter importing "
        "them (default: on)", ("launch", "demo", "train")))
    """One host (``elastic.prestart``); ``elastor train`` takes this flag alone."""
    use_all_slots: bool = False
    """Keep every alive slot busy (``planner.plan(use_all=True)``): for CPU slots that
    stand for GPUs (``elastor demo``), where the fastest layout on fewer cores than slots
    would leave slots idle, and the failures meant for them with them."""

    def __post_init__(self) -> None:
        for name in ("max_restarts", "heartbeat_timeout", "startup_timeout", "probe_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got "
                                 f"{getattr(self, name)}")
        if self.slots is not None and self.slots <= 0:
            raise ValueError(f"--slots must be positive, got {self.slots}")


@dataclass(frozen=True, kw_only=True)
class NodeSettings(Flags):
    """One node of a job of several: every node gets the same endpoint, id and node
    counts; torch's elastic agent does the rendezvous (see docs/elastic.md)."""

    nnodes: str | None = field(default=None, metadata=setting(
        "nodes in the job: the rounds start with at least MIN and take up to MAX",
        ("launch",), metavar="MIN:MAX"))
    rdzv_endpoint: str | None = field(default=None, metadata=setting(
        "the rendezvous store; the node on HOST hosts it (it must stay up for the whole "
        "job)", ("launch",), metavar="HOST:PORT"))
    rdzv_id: str | None = field(default=None, metadata=setting(
        "the job's id, the same on every node", ("launch",), metavar="ID"))
    node_name: str | None = field(default=None, metadata=setting(
        "this node's name in the job and its files (default: the hostname; must differ "
        "between nodes)", ("launch",), metavar="NAME"))
    rdzv_conf: str | None = field(default=None, metadata=setting(
        "torchrun's --rdzv-conf, e.g. last_call_timeout=5 (the wait for more nodes once "
        "MIN are there; torch's default is 30 s); liveness_timeout=S evicts a lost node "
        "after S seconds without its agent's liveness (default 1.5; 0: at its keep-alive "
        "expiry)", ("launch",), metavar="K=V,..."))
    health_file: str | None = field(default=None, metadata=setting(
        "a list of this node's dead slots, read at every round (an external health check "
        "may write it)", ("launch",), metavar="YAML"))

    @property
    def several(self) -> bool:
        """Whether these flags ask for a job of several nodes (``--rdzv-endpoint``)."""
        return self.rdzv_endpoint is not None

    def check(self) -> None:
        """Raise ``ValueError`` naming the flag when the flags do not describe a job:
        the rendezvous flags need each other, and the node flags need them."""
        if not self.several:
            stray = [f"--{name.replace('_', '-')}" for name in
                     ("nnodes", "rdzv_id", "node_name", "rdzv_conf", "health_file")
                     if getattr(self, name)]
            if stray:
                raise ValueError(f"{', '.join(stray)} need --rdzv-endpoint (a job of several "
                                 f"nodes); without it elastor launch runs on this host alone")
            return
        missing = [flag for flag, value in (("--nnodes", self.nnodes),
                                            ("--rdzv-id", self.rdzv_id)) if value is None]
        if missing:
            raise ValueError(f"--rdzv-endpoint needs {' and '.join(missing)} too (the same on "
                             f"every node), e.g. --nnodes 1:4 --rdzv-id myjob")
        if not re.fullmatch(r"\d+(:\d+)?", self.nnodes):
            raise ValueError(f"--nnodes must be N or MIN:MAX, got {self.nnodes!r}")
        if not re.fullmatch(r"[^:]+:\d+", self.rdzv_endpoint):
            raise ValueError(f"--rdzv-endpoint must be HOST:PORT, got {self.rdzv_endpoint!r}")


@dataclass(frozen=True, kw_only=True)
class RoundSettings(Flags):
    """What a node's launcher passes the ranks of every round, besides the run settings.
    None of these flags may abbreviate one of torchrun's (its parser reads the whole
    command line, ours included)."""

    node_name: str = field(metadata=setting("this node's name in the job", ("node-worker",)))
    node_dir: str = field(metadata=setting(
        "this node's launch directory (rounds, events, outcome)", ("node-worker",)))
    store_endpoint: str = field(metadata=setting(
        "the rendezvous store (HOST:PORT), which outlives the rounds", ("node-worker",)))
    job_id: str = field(metadata=setting("the rendezvous id of the job", ("node-worker",)))
    devices: Literal["cpu", "cuda"] = field(metadata=setting(
        "what a slot is: cuda probes its GPU at every round", ("node-worker",)))
    probe_timeout: float = field(metadata=setting(
        "seconds a GPU probe may take (LaunchSettings.probe_timeout)", ("node-worker",)))
    health_file: str | None = field(default=None, metadata=setting(
        "YAML list of this node's dead slots", ("node-worker",)))
    use_all_slots: bool = field(default=False, metadata=setting(
        "plan layouts that keep every healthy slot busy", ("node-worker",), negatable=False))


MEGATRON_RANK: tuple[Command, ...] = ("megatron-worker",)


@dataclass(frozen=True, kw_only=True)
class MegatronSettings(Flags):
    """A Megatron-LM job under the launcher: the script its ranks run, and what the
    launcher tells each of them besides Megatron-LM's own flags, which follow ``--``
    on their command line (``elastic.rank.megatron``)."""

    script: str | None = field(default=None, metadata=setting(
        "run Megatron-LM's pretrain_gpt.py (patched with tools/apply_megatron_patch.sh) "
        "with the Megatron-LM flags after --, instead of a recipe: every launch plans a "
        "layout from those flags and resumes from the latest committed iteration (see "
        "docs/megatron-lm.md)", ("launch", "megatron-worker"), flag="--megatron-lm",
        metavar="PRETRAIN_GPT_PY"))
    job: str | None = field(default=None, metadata=setting(
        "what Megatron-LM's parser made of the flags (JSON, written by the launcher)",
        MEGATRON_RANK))
    elastic_dir: str | None = field(default=None, metadata=setting(
        "heartbeats and events of this launch (a round: of this node)", MEGATRON_RANK))
    metrics_out: str | None = field(default=None, metadata=setting(
        "the reporting rank's JSON line per iteration {step, loss, time_s}", MEGATRON_RANK))
    rank_slots: tuple[int, ...] | None = field(default=None, metadata=setting(
        "physical slot of each rank, comma-separated, in rank order", MEGATRON_RANK,
        parse=int_list, render=render_list))
    failure_plan: str | None = field(default=None, metadata=setting(
        "inject failures: a list of {step, slot, kind: kill|hang}", MEGATRON_RANK))
    checkpoint_dir: str | None = field(default=None, metadata=setting(
        "a round's checkpoint root (it picks the iteration to resume)", MEGATRON_RANK))
    hardware: str | None = field(default=None, metadata=setting(
        "a round's hardware profile (it plans its layout)", MEGATRON_RANK))
