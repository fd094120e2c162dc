"""What a training rank does for the supervisor: heartbeats, events, injected failures.

``elastor launch`` passes the worker three flags (``worker_args``); the worker turns
them into an :class:`ElasticHooks` (``from_args``) that ``train`` calls on every
active rank. Torchrun ranks are contiguous (0..n-1) while the survivors' slots are
not, so ``--slots`` maps each rank to its physical slot.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Sequence

from elastor_mcore.elastic.events import EVENTS_FILE, append_event
from elastor_mcore.elastic.failures import Failure, inject, load_failure_plan
from elastor_mcore.elastic.heartbeat import HEARTBEAT_DIR, HeartbeatWriter
from elastor_mcore.train import RankHooks


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--elastic-dir", default=None,
                        help="set by elastor launch: heartbeats and events of this launch")
    parser.add_argument("--slots", default=None,
                        help="physical slot of each rank, comma-separated, in rank order")
    parser.add_argument("--failure-plan", default=None, help="failure plan YAML to inject")


def worker_args(elastic_dir: str | os.PathLike, slots: Sequence[int],
                failure_plan: str | os.PathLike | None) -> list[str]:
    """The flags ``add_worker_args`` reads, for a launch on ``slots`` (rank order)."""
    args = ["--elastic-dir", str(elastic_dir), "--slots", ",".join(map(str, slots))]
    if failure_plan:
        args += ["--failure-plan", str(failure_plan)]
    return args


class ElasticHooks(RankHooks):
    """Heartbeat after setup and every step; record the load, the first step and any
    injected failure; fail as the failure plan says when this slot reaches its step."""

    def __init__(self, elastic_dir: str | os.PathLike, rank: int, slot: int,
                 failures: Sequence[Failure] = ()) -> None:
        self.rank, self.slot = rank, slot
        self.events = Path(elastic_dir) / EVENTS_FILE
        self.heartbeat = HeartbeatWriter(Path(elastic_dir) / HEARTBEAT_DIR, slot, rank)
        self.failures = {f.step: f for f in failures if f.slot == slot}
        self.stepped = False
        self.heartbeat.beat(0, stepping=False)  # the supervisor learns our pid early

    def ready(self, start_step: int, load_s: float) -> None:
        append_event(self.events, "ready", rank=self.rank, slot=self.slot,
                     start_step=start_step, load_s=load_s)
        self.heartbeat.beat(start_step, stepping=False)

    def step_start(self, step: int) -> None:
        failure = self.failures.get(step)
        if failure:
            append_event(self.events, "failure", rank=self.rank, slot=self.slot, step=step,
                         kind=failure.kind)
            inject(failure)

    def step_end(self, step: int) -> None:
        if not self.stepped:
            append_event(self.events, "first_step", rank=self.rank, slot=self.slot, step=step)
            self.stepped = True
        self.heartbeat.beat(step, stepping=True)


def from_args(args: argparse.Namespace, rank: int) -> RankHooks:
    """The hooks for this rank: elastic ones under ``elastor launch``, else no-ops."""
    if not args.elastic_dir:
        return RankHooks()
    slots = [int(s) for s in args.slots.split(",")] if args.slots else None
    slot = slots[rank] if slots else rank
    failures = load_failure_plan(args.failure_plan) if args.failure_plan else ()
    return ElasticHooks(args.elastic_dir, rank, slot, failures)
