"""Storage faults, through the storage interface: ``FaultyStorage`` (tests/faulty_storage.py)
in front of the real file backend and of the real local S3 server fails, times out
or cuts short a seeded share of its requests.

* A run saving every step under faults goes on (``on_error='continue'``, the setting
  ``elastor train --on-save-error`` passes to ``SavePolicy``); the failed saves leave
  nothing a loader sees, and every committed step loads bit for bit as it was saved.
  With ``on_error='stop'`` the run stops at the first failure and the previous step
  loads.
* Loads retry transient errors and return the right bytes; a permanent error (or
  one that outlasts the retries) names the object and the fix.
* On 2 ranks (``tests/workers/checkpoint_faults.py``), where the writers' markers and
  the committer's wait meet faults too, both ranks report the same failed saves.

Each case prints its figures: requests, failed requests, saves lost, steps lost.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from elastor_mcore import checkpoint as ck
from elastor_mcore.checkpoint import storage
from elastor_mcore.checkpoint.format import step_dir_name
from tests.conftest import REPO, run_world
from tests.faulty_storage import Faults, FaultyStorage
from tests.s3_server import s3_environment
from tests.workers.checkpoint_faults import STEPS as STEPS_2

BUCKET = "elastor-faults"
STEPS = 16
SHAPES = {"decoder.weight": (64, 48), "decoder.bias": (48,), "embedding": (96, 16)}


@pytest.fixture(scope="module")
def s3():
    with s3_environment(BUCKET, REPO) as server:
        yield server


@pytest.fixture(params=["file", "s3"])
def faulty(request, tmp_path):
    """(faults, root URL): a ``faulty://`` root in front of a fresh real root."""
    if request.param == "s3":
        request.getfixturevalue("s3")
        inner = f"s3://{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}"
    else:
        inner = str(tmp_path / "ckpt")
    faults = Faults(seed=7)
    backend = FaultyStorage(storage.storage_for(inner), faults)
    storage.register("faulty", backend)
    yield faults, backend.url(inner)


def state_at(step: int) -> dict[str, torch.Tensor]:
    """The training state after ``step`` steps (a seeded draw per step)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return {key: torch.randn(shape, generator=generator) for key, shape in SHAPES.items()}


def shards(state: dict[str, torch.Tensor]) -> list[ck.LocalShard]:
    return [ck.LocalShard(key, tuple(t.shape), (0,) * t.dim(), t) for key, t in state.items()]


def train(root: str, faults: Faults, share: float, on_error: str,
          faults_from: int = 1) -> tuple[ck.CheckpointManager, int]:
    """Save the state after every step, asynchronously, with ``share`` of the storage
    requests failing from the save of step ``faults_from`` on; the steps run (all of
    them, unless ``stop`` stops the run)."""
    manager = ck.CheckpointManager(root, policy=ck.SavePolicy(on_error=on_error, keep=STEPS))
    state = {key: torch.zeros(shape) for key, shape in SHAPES.items()}
    step = 0
    try:
        for step in range(1, STEPS + 1):
            if step == faults_from:
                manager.wait()  # the saves before it commit without faults
                faults.share = share
            for key, value in state_at(step).items():
                state[key].copy_(value)  # the optimizer step
            manager.save(step, shards(state))
        manager.close()
    finally:
        faults.share = 0.0
    return manager, step


def assert_committed_steps_load_exactly(root: str) -> list[int]:
    committed = ck.committed_steps(root)
    for step in committed:
        reader = ck.open(f"{root}/{step_dir_name(step)}")
        for key, expected in state_at(step).items():
            assert torch.equal(reader.read(key), expected), (step, key)
    return committed


def failed_steps(manager: ck.CheckpointManager) -> list[int]:
    return [int(re.search(r"Step (\d+) was not saved", str(e)).group(1))
            for e in manager.failures]


@pytest.mark.timeout(300)
def test_saves_under_faults_fail_without_committing_and_training_goes_on(faulty):
    faults, root = faulty
    manager, last = train(root, faults, share=0.04, on_error="continue")
    assert last == STEPS  # training went on through every failed save
    failed = failed_steps(manager)
    committed = assert_committed_steps_load_exactly(root)
    latest = ck.latest_step(root)
    lost = [s for s in failed if s not in committed]
    print(f"\n{'s3' if '://s3://' in root else 'file'}: {faults.requests} requests, "
          f"{faults.failed_total} failed {dict(faults.failed)}; {STEPS} saves, "
          f"{len(failed)} reported failed ({len(lost)} lost, {len(failed) - len(lost)} "
          f"committed all the same: a write's lost reply); steps lost at the end: "
          f"{STEPS - latest}")
    assert faults.failed_total > 0 and failed, "no save failed: the test injected nothing"
    # A restart resumes from ``latest``: a committed step, no older than the last save
    # that succeeded (a failed save's committed step is not pointed at, unless its
    # ``latest`` went through and only the reply was lost).
    assert latest in committed
    assert latest >= max(set(range(1, STEPS + 1)) - set(failed))
    assert set(range(1, STEPS + 1)) == set(committed) | set(lost)
    for error in manager.failures:
        assert "checkpoint save of step" in str(error) and "injected" in str(error)
    # Nothing a failed save left is visible: the root lists only committed steps.
    visible = {e.name for e in storage.as_path(root).iterdir() if e.name.startswith("step_")}
    assert visible - {step_dir_name(s) for s in committed} <= \
        {step_dir_name(s) for s in lost}  # in-place leftovers, without a manifest
    for name in visible - {step_dir_name(s) for s in committed}:
        with pytest.raises(ck.CheckpointError, match="the save never committed"):
            ck.open(f"{root}/{name}")


@pytest.mark.timeout(300)
def test_stop_policy_stops_at_the_first_failed_save(faulty):
    faults, root = faulty
    with pytest.raises(ck.CheckpointError, match=r"Step \d+ was not saved") as stopped:
        train(root, faults, share=0.15, on_error="stop", faults_from=4)
    failed = int(re.search(r"Step (\d+) was not saved", str(stopped.value)).group(1))
    committed = assert_committed_steps_load_exactly(root)
    print(f"\nstopped at the failed save of step {failed} after {faults.requests} requests "
          f"({faults.failed_total} failed); committed {committed}")
    assert failed >= 4 and set(range(1, failed)) <= set(committed) <= set(range(1, failed + 1))
    intact = committed[-1] if committed[-1] != failed else committed[-2]
    assert f"the previous checkpoint (step {intact}) is intact" in str(stopped.value)


def saved_root(root: str, steps: int = 3) -> None:
    for step in range(1, steps + 1):
        ck.save(root, step, shards(state_at(step)), keep=steps)


def targets() -> list[ck.LocalShard]:
    """Each tensor's second half along dim 0 (a resharded load), zeroed."""
    out = []
    for key, shape in SHAPES.items():
        half = shape[0] // 2
        out.append(ck.LocalShard(key, shape, (half,) + (0,) * (len(shape) - 1),
                                 torch.zeros((shape[0] - half, *shape[1:]))))
    return out


@pytest.mark.timeout(300)
def test_loads_retry_transient_errors(faulty, caplog):
    faults, root = faulty
    saved_root(root)
    expected = state_at(3)
    faults.share = 0.05
    loads = 20
    with caplog.at_level("WARNING", logger="elastor_mcore.checkpoint.storage"):
        for _ in range(loads):
            wanted = targets()
            manifest = ck.load(root, wanted)
            assert manifest.step == 3
            for target in wanted:
                assert torch.equal(target.data, expected[target.key][target.box.offset[0]:])
            assert torch.equal(ck.open(root).read("embedding"), expected["embedding"])
    faults.share = 0.0
    retries = caplog.text.count("retrying in")
    print(f"\n{loads} loads: {faults.requests} requests, {faults.failed_total} failed "
          f"{dict(faults.failed)}, {retries} retried; every load returned step 3 exactly")
    assert faults.failed["short"] > 0 and faults.failed_total > 2
    assert retries > 0


@pytest.mark.timeout(300)
def test_a_permanent_load_error_names_the_object_and_the_fix(faulty):
    faults, root = faulty
    saved_root(root, steps=1)
    faults.denied = {f"{step_dir_name(1)}/manifest.json"}
    with pytest.raises(ck.CheckpointError) as refused:
        ck.load(root, targets())
    message = str(refused.value)
    print(f"\npermanent: {message}")
    assert f"{root}/{step_dir_name(1)}/manifest.json" in message
    assert "permission denied: give this user read access" in message
    assert faults.failed["denied"] == 1  # not retried

    faults.denied = set()
    faults.share, faults.kinds = 1.0, ("timeout",)
    with pytest.raises(ck.CheckpointError) as outlasted:
        ck.open(f"{root}/{step_dir_name(1)}")
    message = str(outlasted.value)
    print(f"transient, every time: {message}")
    assert f"{root}/{step_dir_name(1)}" in message
    assert f"failed {storage.READ_ATTEMPTS} times" in message and "check its health" in message


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_agree_on_every_failed_save_and_commit_only_whole_steps(tmp_path):
    """2 ranks, faults on both (their markers and the committer's wait included):
    every failed save is reported on both ranks, both train to the end, and every
    committed step holds both ranks' halves exactly."""
    run_world(2, "tests.workers.checkpoint_faults", ["--out", str(tmp_path), "--share", "0.05"])
    ranks = [json.loads((tmp_path / f"result.rank{r}.json").read_text()) for r in range(2)]
    reported = [r["reported"] for r in ranks]
    exact = {int(step): ok for step, ok in ranks[0]["exact"].items()}
    failed = [int(re.search(r"Step (\d+) was not saved", m).group(1)) for m in reported[0]]
    print(f"\n2 ranks: {sum(r['requests'] for r in ranks)} requests, "
          f"{sum(sum(r['failed'].values()) for r in ranks)} failed "
          f"{[r['failed'] for r in ranks]}; {STEPS_2} saves, {len(failed)} reported failed, "
          f"committed {sorted(exact)}; steps lost at the end: {STEPS_2 - ranks[0]['latest']}")
    assert [r["last_step"] for r in ranks] == [STEPS_2, STEPS_2]
    assert reported[0] == reported[1] and failed
    assert exact and all(exact.values())
    assert set(range(1, STEPS_2 + 1)) == set(exact) | set(failed)
