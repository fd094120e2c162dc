"""The suite's own scheduling (``conftest.pytest_xdist_make_scheduler``): the modules
that share a session world must be found, or each worker builds that world again."""

import re
from pathlib import Path

from tests.conftest import SHARED_WORLDS, recorded_unit_seconds, shared_world_of

TESTS = Path(__file__).resolve().parent


def test_every_shared_world_is_found_in_the_modules_that_use_it():
    worlds = {path.name: shared_world_of(path) for path in TESTS.glob("test_*.py")}
    for world in SHARED_WORLDS:
        users = sorted(name for name, found in worlds.items() if found == world)
        assert len(users) >= 2, (world, users)  # shared, or it needs no grouping
    for path in TESTS.glob("test_*.py"):
        if re.search(r"^def train_world_part\(", path.read_text(), re.MULTILINE):
            assert worlds[path.name] == "train_world", path.name
    assert worlds["test_parallel_state.py"] == worlds["test_checkpoint_mcore.py"] == "mcore_world"
    assert worlds["test_geometry.py"] is None


def test_the_recorded_unit_seconds_name_work_units_that_exist():
    """A unit renamed or removed would keep a stale cost, and its tests (under their new
    unit) would go last: record again (``pytest --record-unit-seconds``)."""
    recorded = recorded_unit_seconds()
    assert recorded, "tests/unit_seconds.json is missing or empty"
    units = {f"tests/{path.name}" for path in TESTS.glob("test_*.py")
             if shared_world_of(path) is None} | set(SHARED_WORLDS)
    assert set(recorded) <= units, sorted(set(recorded) - units)
    assert all(seconds >= 0 for seconds in recorded.values())
