"""Recovery in place, the supervisor's side (``--recovery in-place``, the default on
one host): a failed rank does not end the launch; the survivors re-plan and continue
in their processes (``elastic/rank/inplace.py``), and the supervisor only watches.

- Each rank runs under a keeper (``elastic/rank/keeper.py``) with ``--in-place``, so
  torchrun does not stop the launch when one rank dies (``prestart.keeper_command``).
- A rank process gone is absorbed: the survivors find out by themselves (their
  collectives with it fail) and recover; the supervisor stops counting the slot.
- A rank into which the failure plan injected a hang is killed (SIGKILL) once any
  rank is silent past its hang timeout (every rank of the hung collective falls
  silent; each has its own timeout), and then recovered from as a death. A hang nobody injected has no known culprit (every
  rank of a hung collective is silent): it ends the launch, as with ``relaunch``.
- The ranks of a recovery are silent while they recover; the beats they last wrote
  count as written when the failure was absorbed, and as not yet stepping, so the
  generous start-up limit applies until their next step.
- A recovery in place that fails ends the launch (its ranks exit non-zero) and the
  supervisor relaunches from the durable checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from elastor_mcore.elastic.heartbeat import Timeout
from elastor_mcore.elastic.protocol import EVENTS_FILE, Beat, append_event
from elastor_mcore.elastic.timeline import LaunchRecord

log = logging.getLogger(__name__)

class InPlaceWatch:
    """The failures of one launch that its ranks recover from in place."""

    def __init__(self, record: LaunchRecord, steps: int,
                 on_message: Callable[[str], None] = log.info) -> None:
        self.record, self.steps, self.on_message = record, steps, on_message
        self.lost: dict[int, float] = {}
        """Slots lost, with when the supervisor absorbed their failure."""
        self.since: float | None = None
        """When the latest failure was absorbed."""

    @property
    def slots(self) -> list[int]:
        """The slots the launch trains on now: the latest in-place layout's (else the
        launch's), less those lost since."""
        plans = self.record.events("inplace_plan")
        slots = plans[-1]["slots"] if plans else self.record.slots
        return [s for s in slots if s not in self.lost and s not in self.left()]

    def left(self) -> set[int]:
        """Slots whose rank leaves the launch on purpose (not in a new layout)."""
        return {e["slot"] for e in self.record.events("regroup") if not e["in_layout"]}

    def absorb(self, beats: dict[int, Beat],
               silent: Callable[[dict[int, Beat]], dict[int, Timeout]],
               running: Callable[[int], bool]) -> dict[int, Beat]:
        """The beats the supervisor should judge, with this launch's failures absorbed:
        lost and departed slots left out, a new death or an injected hang (``silent``
        of the beats: the slots silent too long) taken as a failure to recover from."""
        now = time.time()
        beats = {s: b for s, b in beats.items() if s not in self.lost and s not in self.left()}
        dead = [s for s, b in beats.items() if b.step < self.steps and not running(b.pid)]
        injected = {e["slot"] for e in self.record.failures() if e["kind"] == "hang"}
        timeouts = silent({s: b for s, b in beats.items() if s not in dead})
        # A hung collective silences every rank in it, each past its own timeout (its
        # own step times) in turn: once one is, a rank hung by injection is the culprit.
        hung = [s for s in beats if s in injected and s not in dead] if timeouts else []
        for slot in hung:
            with contextlib.suppress(ProcessLookupError):
                os.kill(beats[slot].pid, signal.SIGKILL)
            first = slot if slot in timeouts else min(timeouts)
            append_event(Path(self.record.dir) / EVENTS_FILE, "hang_killed", slot=slot,
                         pid=beats[slot].pid, silent_s=now - beats[slot].time,
                         timeout=timeouts[first].rule
                         + ("" if first == slot else f" (slot {first}'s)"))
        for slot in dead + hung:
            self.lost[slot] = now
            self.since = now
            beats.pop(slot)
            self.on_message(f"launch {self.record.index}: slot {slot} "
                            f"{'hung (killed)' if slot in hung else 'died'}; the survivors "
                            f"recover in place")
        if self.since is not None:
            beats = {s: b if b.time > self.since else replace(b, time=self.since,
                                                                 stepping=False)
                     for s, b in beats.items()}
        return beats
