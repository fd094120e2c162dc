"""One torchrun world for every test module that trains cases of the tiny recipe.

Each rank of a world pays ~6 CPU-s of imports (torch, megatron.core, TensorStore) before
its first step, about 25 s of wall time for an 8-rank world on two cores, so the
modules that train many small cases (``workers/train_matrix.py``) share one world: a
module joins by defining ``train_world_part(out) -> TrainWorldPart``, and its tests take
its directory from the session fixture ``train_world`` (``conftest.py``), which runs the
cases of every collected module that joined, and only theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

WORLD_SIZE = 8
"""Ranks of the shared world: the largest layout any part trains (idle ranks sit out)."""
TIMEOUT = 2400
"""Seconds for the whole world (every part), and so for each test that may start it:
pytest-timeout counts a fixture's setup in the first test that needs it. About 310 s on
an idle 2-core machine."""
WORKER = "tests.workers.train_matrix"


@dataclass(frozen=True)
class TrainWorldPart:
    """One module's share of the world: ``train_matrix`` ``--case`` specs, and the cases
    to measure after training (``--memory``, ``--native-check``), named relative to the
    module's directory (their outputs land in ``<module dir>/<case name>/``)."""

    cases: list[str]
    memory: list[str] = field(default_factory=list)
    native_check: list[str] = field(default_factory=list)

    def worker_args(self, prefix: str) -> list[str]:
        """The worker's arguments, every case name under ``prefix/``."""
        args: list[str] = []
        for spec in self.cases:
            args += ["--case", f"{prefix}/{spec}"]
        for name in self.memory:
            args += ["--memory", f"{prefix}/{name}"]
        for name in self.native_check:
            args += ["--native-check", f"{prefix}/{name}"]
        return args


def module_dir_name(module_name: str) -> str:
    """``tests.test_training`` -> ``test_training``."""
    return module_name.rsplit(".", 1)[-1]


def world_args(root: Path, parts: dict[str, TrainWorldPart]) -> list[str]:
    """The worker's command line for ``parts`` (by module name), outputs under ``root``."""
    args = ["--out", str(root)]
    for module_name, part in parts.items():
        args += part.worker_args(module_dir_name(module_name))
    return args
