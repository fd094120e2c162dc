"""Checkpoint save/load across a 4-rank gloo world (library level, no mcore model).

One world runs every case (see ``tests/workers/checkpoint_world.py``): save from TP-4
quarters held twice each, load as halves / 3-way uneven / whole, save from a sub-group.
"""

from __future__ import annotations

import json

import pytest

from tests.checkpoint_checks import (
    MAX_READ_AMPLIFICATION, amplification, assert_balanced, assert_units_tile)
from tests.conftest import run_world


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_world")
    run_world(4, "tests.workers.checkpoint_world", ["--out", str(out)], timeout=240)
    return json.loads((out / "result.json").read_text())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["halves", "uneven", "whole"])
def test_resharded_load_is_bit_exact(world, layout):
    for report in world["ranks"]:
        assert report[layout]["mismatches"] == [], report["rank"]


@pytest.mark.timeout(300)
def test_each_cell_written_once_and_spread(world):
    assert_units_tile(world["units"], {k: tuple(v) for k, v in world["shapes"].items()})
    assert all(writer in holders for *_, holders, writer in world["units"])
    assert_balanced(world["bytes_by_rank"])


@pytest.mark.timeout(300)
def test_aligned_reshard_reads_only_what_it_needs(world):
    for report in world["ranks"]:
        halves = report["halves"]
        assert amplification(halves["bytes_read"], halves["bytes_needed"]) \
            <= MAX_READ_AMPLIFICATION


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["halves", "whole"])
def test_replicas_read_once_per_job(world, layout):
    """Ranks needing the same bytes (replicas) share one read: storage serves the job
    each byte about once, not once per replica."""
    job_read = sum(report[layout]["bytes_read"] for report in world["ranks"])
    unique = world["ranks"][0][layout]["tensor_bytes"]
    needed = sum(report[layout]["bytes_needed"] for report in world["ranks"])
    assert needed >= 2 * unique
    assert amplification(job_read, unique) <= MAX_READ_AMPLIFICATION


@pytest.mark.timeout(300)
def test_subgroup_save_without_idle_rank(world):
    for report in world["ranks"]:
        assert report["subgroup"] == {"mismatches": [], "writers": 3}
