"""The mcore adapter on a real GPTModel: save under mcore's TP=2 PP=2, load under
TP=1 PP=4 (4 ranks, ``parallel_state.initialize_model_parallel``, no elastor layout).
See ``tests/workers/checkpoint_mcore.py``; its world also runs ``test_parallel_state``'s
checks (conftest ``mcore_world``).
"""

from __future__ import annotations

import json

import pytest

from tests.checkpoint_checks import (
    MAX_READ_AMPLIFICATION, amplification, assert_balanced, assert_units_tile)


@pytest.fixture(scope="module")
def reshard(mcore_world):
    return json.loads((mcore_world / "result.json").read_text())


@pytest.mark.timeout(360)
def test_tp2pp2_to_tp1pp4_is_bit_exact(reshard):
    for report in reshard["ranks"]:
        assert report["mismatches"] == [], report["rank"]
        assert report["bytes_needed"] == 4 * report["params"]  # every fp32 byte checked


@pytest.mark.timeout(360)
def test_reads_and_writes_are_balanced_and_unique(reshard):
    assert_units_tile(reshard["units"], {k: tuple(v) for k, v in reshard["shapes"].items()})
    assert_balanced(reshard["bytes_by_rank"])
    for report in reshard["ranks"]:
        assert amplification(report["bytes_read"], report["bytes_needed"]) \
            <= MAX_READ_AMPLIFICATION
