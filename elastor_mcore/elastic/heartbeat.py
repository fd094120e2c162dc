"""The hang policy: when a rank whose heartbeat file (``protocol.HeartbeatWriter``)
stopped advancing counts as hung.

The timeout follows the run's own pace: once a rank has timed ``min_steps`` steps of
its launch, it is ``factor`` times the 99th percentile of its step times, but never
less than a floor (``--heartbeat-timeout``). Before that (imports, model build,
checkpoint load and the first steps take tens of seconds on a loaded machine), while
a rank saves or evaluates between two steps, and after its last step (the final save)
a generous start-up timeout applies. Both come from the launcher settings
(``config.launch.LaunchSettings``); every detection says which timeout applied
(``Timeout.rule``), and the recovery timeline records it.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastor_mcore.elastic.protocol import Beat


@dataclass(frozen=True)
class Timeout:
    """The silence a rank was allowed, and why that much."""

    seconds: float
    rule: str
    """For people, e.g. ``6.2s = 3 x p99 step 2.07s over 9 steps (floor 2s)``."""


@dataclass(frozen=True)
class HangPolicy:
    startup_timeout_s: float
    """Silence allowed until a rank has timed ``min_steps`` steps of its launch, while
    it saves or evaluates, and after its last step."""
    floor_s: float
    """The least silence that counts as a hang once steps are timed."""
    factor: float = 3.0
    """Times the 99th percentile of the rank's step times."""
    min_steps: int = 3
    """Steps a rank times before its own pace sets the timeout."""

    def timeout(self, beat: Beat | None, last_step: int) -> Timeout:
        """The silence allowed after ``beat`` (None: the rank has not beaten yet)."""
        def startup(why: str) -> Timeout:
            return Timeout(self.startup_timeout_s,
                           f"start-up timeout {self.startup_timeout_s:g}s ({why})")

        if beat is None:
            return startup("no heartbeat yet")
        if not beat.stepping:
            return startup("before the first step")
        if beat.busy is not None:
            return startup(f"during a {beat.busy}")
        if beat.step >= last_step:
            return startup("after the last step")
        if beat.steps_timed < self.min_steps or beat.step_p99_s is None:
            return startup(f"{beat.steps_timed} of {self.min_steps} steps timed")
        paced = self.factor * beat.step_p99_s
        return Timeout(max(paced, self.floor_s),
                       f"{max(paced, self.floor_s):.1f}s = max({self.factor:g} x p99 step "
                       f"{beat.step_p99_s:.2f}s over {beat.steps_timed} steps, floor "
                       f"{self.floor_s:g}s)")

    def silent_slots(self, slots: list[int], beats: dict[int, Beat], launched_at: float,
                     now: float, last_step: int) -> dict[int, Timeout]:
        """Slots whose rank has been silent longer than its timeout allows, with that
        timeout."""
        silent = {}
        for slot in slots:
            beat = beats.get(slot)
            allowed = self.timeout(beat, last_step)
            if now - (beat.time if beat else launched_at) > allowed.seconds:
                silent[slot] = allowed
        return silent
