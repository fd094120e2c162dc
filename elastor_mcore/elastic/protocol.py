"""The file protocol between the supervisor (or a node launcher) and the ranks it
starts: the names of the files inside a launch directory, the event log and the
heartbeat files, with how each side writes and reads them, and the environment
variable that points ranks to a pre-imported worker.

A leaf: standard library only, importing nothing of ours, so the supervisor side of
``elastic/`` (no torch) and the rank side (``elastic/rank/``, inside torchrun
processes) share one definition. A hung collective leaves every process alive, so
exit codes cannot reveal it; a heartbeat file per rank costs one small atomic write
per step and needs no extra process or connection.
"""

from __future__ import annotations

import collections
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"
"""The event log's name inside a launch directory (ranks append: ready, first step,
injected failure, memory)."""
HEARTBEAT_DIR = "heartbeat"
"""The heartbeat files' folder inside a launch directory (``slot<N>`` per rank)."""

ZYGOTE_ENV = "ELASTOR_ZYGOTE"
"""The environment variable naming a pre-imported worker's socket, which the rank's
keeper asks to fork the rank (``elastic.prestart``, ``elastic.rank.zygote``)."""

# A node directory of a multi-node job (``elastic.node``, ``elastic.rank.node_worker``):
LAUNCHER_EVENTS = "launcher.jsonl"
"""The node launcher's event log (the agent's lines, hang kills)."""
ROUNDS_FILE = "rounds.jsonl"
"""One record per rendezvous round the node took part in (members, plan)."""
ROUNDS_DIR = "rounds"
"""``rounds/<R>/``: a round's layout, rank events, heartbeats and metrics."""
OUTCOME_FILE = "outcome.json"
"""How the job ended, written by the node's local rank 0 for its launcher."""
STEP_WINDOW = 1000
"""Steps a heartbeat's percentile covers: the latest, so it follows the run's pace."""


def append_event(path: str | os.PathLike, event: str, **fields: Any) -> None:
    """Append one event, in one ``write`` (processes append to one log at once)."""
    record = {"event": event, "time": time.time(), **fields}
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_events(path: str | os.PathLike, event: str | None = None) -> list[dict[str, Any]]:
    """Every complete event in the file (optionally only those named ``event``)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a SIGKILL mid-write
        if event is None or record.get("event") == event:
            records.append(record)
    return records


@dataclass(frozen=True)
class Beat:
    slot: int
    rank: int
    pid: int
    """The rank's process; also its process group (torchrun starts each worker in a
    new session), so the supervisor can stop the rank's children too."""
    step: int
    """Steps done (1-based number of the last finished step; the resumed step at setup)."""
    stepping: bool
    """Whether the rank has finished a step since it started (short timeout applies)."""
    time: float
    """Wall-clock time of the beat (``time.time()``)."""
    busy: str | None = None
    """What the rank does between two steps that is not a step (``save``,
    ``evaluation``): the start-up timeout applies until its next beat."""
    steps_timed: int = 0
    """Steps of this launch whose duration the rank measured (of its latest layout,
    after a recovery in place: a new layout has its own pace)."""
    step_p99_s: float | None = None
    """The 99th percentile of the last ``STEP_WINDOW`` of those durations: each from the
    rank's previous beat (the end of the previous step, of a save or of the load) to
    the end of the step."""


class HeartbeatWriter:
    """The rank side: one file, replaced atomically at each beat. It times every step
    (from the previous beat to the step's beat) for the supervisor's hang timeout."""

    def __init__(self, directory: str | os.PathLike, slot: int, rank: int) -> None:
        self.path = Path(directory) / f"slot{slot}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.slot, self.rank = slot, rank
        self.durations: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)
        self.timed = 0
        self._last: tuple[int, float] | None = None
        """(step, time) of the previous beat."""

    def new_layout(self) -> None:
        """Forget the step times measured so far: the steps of the layout a recovery in
        place chose take their own time."""
        self.durations.clear()
        self.timed = 0

    def beat(self, step: int, stepping: bool, busy: str | None = None) -> None:
        """A ``busy`` beat (a save inside a step) leaves the step's timing running: the
        step's beat times all of it."""
        now = time.time()
        if self._last is not None and stepping and busy is None and \
                step == self._last[0] + 1:
            self.durations.append(now - self._last[1])
            self.timed += 1
        if busy is None:
            self._last = (step, now)
        beat = Beat(self.slot, self.rank, os.getpid(), step, stepping, now, busy,
                    self.timed, percentile(sorted(self.durations), 0.99))
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(beat)))
        os.replace(tmp, self.path)


def percentile(ordered: list[float], q: float) -> float | None:
    """The ``q`` quantile of the sorted ``ordered`` (nearest rank); None if empty."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def read_beats(directory: str | os.PathLike) -> dict[int, Beat]:
    """The supervisor side: the latest beat of every slot that has beaten, by slot."""
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
