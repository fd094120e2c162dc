"""What a training rank does for its supervisor: heartbeats, events, injected failures.

The rank side of the file protocol (``elastic.protocol``), as the training loop's step
hooks (``runtime.hooks.StepHooks``). ``elastor launch`` sets three run settings of the
worker (``elastic_dir``, ``rank_slots``, ``failure_plan``); the entry point turns them
into an :class:`ElasticHooks` (``from_settings``). Torchrun ranks are contiguous
(0..n-1) while the survivors' slots are not, so ``rank_slots`` maps each rank to its
physical slot.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Sequence

from elastor_mcore.config.failure_plan import Failure, load_failure_plan
from elastor_mcore.config.run import RunSettings
from elastor_mcore.elastic.protocol import (EVENTS_FILE, HEARTBEAT_DIR, HeartbeatWriter,
                                            append_event)
from elastor_mcore.runtime.hooks import StepHooks

log = logging.getLogger(__name__)


def inject(failure: Failure) -> None:
    """Fail this process now, as ``failure.kind`` says; never returns."""
    log.warning("injecting %s of slot %d at step %d", failure.kind, failure.slot,
                failure.step)
    if failure.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # a hung collective: alive, silent, never finishing the step
        threading.Event().wait(3600)


class ElasticHooks(StepHooks):
    """Heartbeat after setup and every step; record the load, the first step and any
    injected failure; fail as the failure plan says when this slot reaches its step."""

    def __init__(self, elastic_dir: str | os.PathLike, rank: int, slot: int,
                 failures: Sequence[Failure] = ()) -> None:
        self.rank, self.slot = rank, slot
        self.events = Path(elastic_dir) / EVENTS_FILE
        self.heartbeat = HeartbeatWriter(Path(elastic_dir) / HEARTBEAT_DIR, slot, rank)
        self.failures = {f.step: f for f in failures if f.slot == slot}
        self.stepped = False
        self.step = 0
        """The last step done (or resumed from)."""
        self.epoch = 0
        """Recoveries in place so far (``elastic.rank.inplace`` counts them); the events
        of each are told apart by it."""
        self.heartbeat.beat(0, stepping=False)  # the supervisor learns our pid early

    def load_failed(self, error: BaseException) -> None:
        append_event(self.events, "load_failed", rank=self.rank, slot=self.slot,
                     error=f"{type(error).__name__}: {error}"[:1000])

    def ready(self, start_step: int, load_s: float) -> None:
        append_event(self.events, "ready", rank=self.rank, slot=self.slot,
                     start_step=start_step, load_s=load_s, epoch=self.epoch)
        self.stepped = False
        self.step = start_step
        self.heartbeat.beat(start_step, stepping=False)

    def step_start(self, step: int) -> None:
        failure = self.failures.get(step)
        if failure:
            append_event(self.events, "failure", rank=self.rank, slot=self.slot, step=step,
                         kind=failure.kind, epoch=self.epoch)
            inject(failure)

    def step_end(self, step: int) -> None:
        if not self.stepped:
            append_event(self.events, "first_step", rank=self.rank, slot=self.slot, step=step,
                         epoch=self.epoch)
            self.stepped = True
        self.step = step
        self.heartbeat.beat(step, stepping=True)

    def busy(self, what: str) -> None:
        self.heartbeat.beat(self.step, self.stepped, busy=what)

    def idle(self) -> None:
        """After ``busy`` between two iterations (Megatron-LM's loop): the next step is
        timed from here."""
        self.heartbeat.beat(self.step, self.stepped)

    def recovering(self, step: int) -> None:
        """Silent through a recovery in place: the generous limit applies until the
        next step (``heartbeat.HangPolicy``), whose timeout then follows the new
        layout's step times."""
        self.heartbeat.new_layout()
        self.heartbeat.beat(step - 1, stepping=False)


def from_settings(settings: RunSettings, rank: int) -> StepHooks:
    """The hooks for this rank: elastic ones under ``elastor launch``, else no-ops."""
    if not settings.elastic_dir:
        return StepHooks()
    slot = settings.rank_slots[rank] if settings.rank_slots else rank
    failures = load_failure_plan(settings.failure_plan) if settings.failure_plan else ()
    return ElasticHooks(settings.elastic_dir, rank, slot, failures)
