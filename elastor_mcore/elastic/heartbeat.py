"""The hang policy: when a rank whose heartbeat file (``protocol.HeartbeatWriter``)
stopped advancing counts as hung.

Timeouts are generous until a rank has finished its first step of a launch (imports,
model build and checkpoint load take tens of seconds on a loaded machine) and short
afterwards; both come from the launcher settings (``config.launch.LaunchSettings``).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastor_mcore.elastic.protocol import Beat


@dataclass(frozen=True)
class HangPolicy:
    startup_timeout_s: float
    """Silence allowed before a rank's first step of a launch (imports, build, load)."""
    timeout_s: float
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
