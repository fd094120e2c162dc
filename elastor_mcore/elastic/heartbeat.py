"""Heartbeats: each rank rewrites ``<dir>/slot<N>`` after setup and after every step;
the supervisor declares a hang when a rank's file stops advancing.

A hung collective leaves every process alive, so exit codes cannot reveal it; a
file per rank costs one small atomic write per step and needs no extra process or
connection. Timeouts are generous until a rank has finished its first step of a
launch (imports, model build and checkpoint load take tens of seconds on a loaded
machine) and short afterwards.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from elastor_mcore.runtime.rank_hooks import Beat


def read_beats(directory: str | os.PathLike) -> dict[int, Beat]:
    """The latest beat of every slot that has beaten, by slot."""
    beats = {}
    for path in Path(directory).glob("slot*"):
        if path.suffix == ".tmp":
            continue
        try:
            beat = Beat(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # replaced while we read it: the next poll sees the new one
        beats[beat.slot] = beat
    return beats


@dataclass(frozen=True)
class HangPolicy:
    startup_timeout_s: float = 300.0
    """Silence allowed before a rank's first step of a launch (imports, build, load)."""
    timeout_s: float = 60.0
    """Silence allowed between two beats once the rank is stepping."""

    def silent_slots(self, slots: list[int], beats: dict[int, Beat], launched_at: float,
                     now: float, last_step: int) -> list[int]:
        """Slots whose rank has been silent longer than its phase allows. A rank past
        ``last_step`` only finishes its last save and exits: the generous limit applies."""
        silent = []
        for slot in slots:
            beat = beats.get(slot)
            if beat is None or not beat.stepping or beat.step >= last_step:
                if now - (beat.time if beat else launched_at) > self.startup_timeout_s:
                    silent.append(slot)
            elif now - beat.time > self.timeout_s:
                silent.append(slot)
        return silent
