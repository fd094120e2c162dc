"""Recovery by relaunch (``--recovery relaunch``; recovery in place, the default, is
``test_inplace.py``) end to end, on CPU slots: ``elastor launch`` through a kill and a hang
(4 -> 3 -> 2 slots) resumes each time from the last checkpoint before the failure and
ends with the weights and losses of an uninterrupted run; on an ``s3://`` checkpoint
root, a relaunch resumes from S3 and a failure that leaves too few slots gives up with
a clear message and keeps the last checkpoint; a latest step that lost a file is
resumed from the step before. One supervised run serves the recovery
tests (worlds cost seconds each); it saves synchronously, so which step each relaunch
resumes from is determined (an asynchronous save may still be in flight when a rank
fails).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastor_mcore import checkpoint
from elastor_mcore.checkpoint.format import step_dir_name
from elastor_mcore.checkpoint.storage.object_store import ObjectPath
from elastor_mcore.elastic.report import read_metrics
from tests.conftest import REPO, TINY
from tests.s3_server import s3_environment
from tests.single_process_reference import (SAVE_INTERVAL as SAVE_INTERVAL_REFERENCE,
                                            STEPS as REFERENCE_STEPS, reference_losses)

STEPS = 8
SAVE_INTERVAL = 2
TOLERANCE = 1e-5
KILL = {"step": 4, "slot": 1, "kind": "kill"}
HANG = {"step": 7, "slot": 3, "kind": "hang"}
CPU_SLOTS = REPO / "recipes" / "hardware" / "cpu-slots.yaml"
S3_BUCKET = "elastor-launch"
# The hang is detected this long after the hung rank's last beat: a beat comes after every
# step (~0.3 s here, a synchronous save ~1 s), so 8 s of silence leaves a margin of 5x.
HEARTBEAT_TIMEOUT_S = 8


def last_save_before(step: int) -> int | None:
    """The committed step a failure as ``step`` begins resumes from: saves are synchronous
    (committed before the next step begins), every SAVE_INTERVAL steps; None: none yet."""
    return (step - 1) // SAVE_INTERVAL * SAVE_INTERVAL or None


# Launch i starts after the checkpoint of the failure before it and runs until its own
# failure (exclusive) or the end: 4 -> 3 -> 2 slots.
RESUMED = [None, last_save_before(KILL["step"]), last_save_before(HANG["step"])]
RAN = [range(1, KILL["step"]), range(RESUMED[1] + 1, HANG["step"]),
       range(RESUMED[2] + 1, STEPS + 1)]


def elastor_launch(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "elastor_mcore.cli", "launch", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def write_yaml(path, data):
    path.write_text(yaml.safe_dump(data))
    return str(path)


def relative(got, ref) -> float:
    """The training tests' metric: max abs difference over the reference's max abs."""
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def reference(single_process_reference) -> tuple[dict[int, float], Path]:
    """The same steps uninterrupted on one process: each step's loss, and the checkpoint
    of step STEPS (the session's single-process run, shared with test_elastic_nodes)."""
    assert STEPS % SAVE_INTERVAL_REFERENCE == 0
    ckpt = single_process_reference / "ckpt" / step_dir_name(STEPS)
    return reference_losses(single_process_reference, STEPS), ckpt


@pytest.fixture(scope="module")
def recovered(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("elastic")
    plan = write_yaml(tmp / "failures.yaml", {"failures": [KILL, HANG]})
    run_dir = tmp / "run"
    result = elastor_launch(
        ["--recipe", str(TINY), "--hardware", str(CPU_SLOTS), "--slots", "4",
         "--steps", str(STEPS), "--run-dir", str(run_dir), "--save-interval",
         str(SAVE_INTERVAL), "--no-async-save", "--failure-plan", plan,
         "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--devices", "cpu",
         "--recovery", "relaunch"])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return run_dir, json.loads((run_dir / "timeline.json").read_text()), result.stdout


@pytest.mark.timeout(900)
def test_kill_and_hang_are_each_recovered_from(recovered):
    _, timeline, stdout = recovered
    launches = timeline["launches"]
    assert [l["slots"] for l in launches] == [[0, 1, 2, 3], [0, 2, 3], [0, 2]]
    assert [l["outcome"] for l in launches] == ["exit", "hang", "finished"]
    kill, hang = timeline["recoveries"]
    assert kill["failure"] == "kill of slot 1 at step 4"
    assert hang["failure"] == "hang of slot 3 at step 7"
    assert "heartbeat" in hang["detected_by"]
    assert RESUMED == [None, 2, 6]   # the derivation above, spelt out
    assert [l["resumed_from"] for l in launches] == RESUMED
    for r, failed_at, resumed in ((kill, KILL["step"], RESUMED[1]),
                                  (hang, HANG["step"], RESUMED[2])):
        assert (r["failed_at_step"], r["resumed_from"]) == (failed_at, resumed)
        assert r["steps_redone"] == failed_at - 1 - resumed
        for phase in ("detect_s", "stop_s", "probe_s", "plan_s", "relaunch_s", "load_s",
                      "first_step_s", "total_s"):
            assert r[phase] is not None and r[phase] >= 0, (phase, r)
    assert "finished 8 steps after 2 recoveries" in stdout


@pytest.mark.timeout(900)
def test_every_step_matches_the_uninterrupted_run(recovered, reference):
    run_dir, timeline, _ = recovered
    expected, _ = reference
    assert sorted(expected) == list(range(1, STEPS + 1))
    for launch, ran in zip(timeline["launches"], RAN, strict=True):
        metrics = read_metrics(f"{launch['dir']}/metrics.jsonl")
        # Each relaunch re-runs only the steps after the checkpoint it resumed from.
        assert [m["step"] for m in metrics] == list(ran), launch["dir"]
        for m in metrics:
            assert abs(m["loss"] - expected[m["step"]]) / abs(expected[m["step"]]) <= TOLERANCE


@pytest.mark.timeout(900)
def test_final_weights_equal_the_uninterrupted_run(recovered, reference):
    run_dir, _, _ = recovered
    got, want = checkpoint.open(run_dir / "checkpoints"), checkpoint.open(reference[1])
    assert got.manifest.step == want.manifest.step == STEPS
    keys = [t.name for t in want.tensors()]
    assert sorted(t.name for t in got.tensors()) == sorted(keys)
    for key in keys:
        diff = relative(got.read(key), want.read(key))
        assert diff <= TOLERANCE, f"{key}: relative difference {diff:.2e}"


@pytest.mark.timeout(900)
def test_relaunch_resumes_from_s3_until_too_few_survivors_give_up(tmp_path, reference):
    """The checkpoint root is an ``s3://`` URL on a real S3 server (moto, 127.0.0.1): the
    lease, every save, the relaunch's latest committed step, its load and the pruning
    go there. Slots so small that the tiny model needs two of them: 3 slots, a kill,
    2 slots resume from S3, a kill, and 1 slot cannot hold the model: the run gives up
    and keeps the last checkpoint. (The recovery tests above keep a local root.)"""
    profile = yaml.safe_load(CPU_SLOTS.read_text())
    profile.update(memory_per_gpu_gib=0.005, memory_reserved_gib=0.0)
    hardware = write_yaml(tmp_path / "small-slots.yaml", profile)
    # Each kill a step after a save's: the reporting rank (rank 0, the coordinator) may
    # take a garbage collection's time to report the step of a save (the collector is
    # paused during the save), while a kill at the next step's start comes at once.
    plan = write_yaml(tmp_path / "failures.yaml", [{"step": 4, "slot": 1, "kind": "kill"},
                                                    {"step": 6, "slot": 2, "kind": "kill"}])
    run_dir, root = tmp_path / "run", ObjectPath(f"s3://{S3_BUCKET}/launch")
    with s3_environment(S3_BUCKET, REPO):
        # Synchronous saves: step 2 (4) is committed before step 3 (5) begins.
        result = elastor_launch(
            ["--recipe", str(TINY), "--hardware", hardware, "--slots", "3", "--steps", "8",
             "--run-dir", str(run_dir), "--checkpoint-dir", str(root), "--save-interval",
             "2", "--keep-checkpoints", "1", "--no-async-save", "--failure-plan", plan,
             "--devices", "cpu", "--recovery", "relaunch"])
        assert result.returncode == 1, result.stdout[-5000:] + result.stderr[-5000:]
        print("\n".join(l for l in result.stdout.splitlines() if "step " not in l))
        assert f"checkpoints: {root}" in result.stdout
        assert ("gave up: the 1 surviving slots [0] cannot hold the model: tiny-llama does "
                "not fit on 1 alive GPUs") in result.stdout
        assert checkpoint.committed_steps(root) == [4]  # step 2 pruned (keep 1)
        assert {p.name for p in root.iterdir()} == {"step_00000004", "latest"}  # no lease
        kept = checkpoint.open(root)
        assert kept.manifest.step == 4
        for info in kept.tensors():
            assert kept.read(info.name).isfinite().all()
    timeline = json.loads((run_dir / "timeline.json").read_text())
    launches = timeline["launches"]
    assert [l["slots"] for l in launches] == [[0, 1, 2], [0, 2]]
    assert [l["resumed_from"] for l in launches] == [None, 2]
    assert timeline["recoveries"][0]["slots_after"] == 2
    assert timeline["recoveries"][1]["slots_after"] is None
    expected, _ = reference
    for launch, ran in zip(launches, (range(1, 4), range(3, 6)), strict=True):
        metrics = read_metrics(f"{launch['dir']}/metrics.jsonl")
        assert [m["step"] for m in metrics] == list(ran), launch["dir"]
        for m in metrics:
            assert abs(m["loss"] - expected[m["step"]]) / abs(expected[m["step"]]) <= TOLERANCE


@pytest.mark.timeout(600)
def test_a_damaged_latest_step_is_resumed_from_the_step_before(tmp_path,
                                                               single_process_reference):
    """The run's latest committed step lost a file: the first launch cannot load it and
    says so (``load_failed``), the next resumes from the committed step before and
    continues the uninterrupted run's losses; the damaged step is saved again."""
    expected = reference_losses(single_process_reference, REFERENCE_STEPS)
    root = tmp_path / "checkpoints"
    shutil.copytree(single_process_reference / "ckpt", root)
    latest = REFERENCE_STEPS
    assert checkpoint.committed_steps(root) == [latest - SAVE_INTERVAL_REFERENCE, latest]
    key = "decoder.layers.0.self_attention.linear_proj.weight"
    lost = next((root / step_dir_name(latest) / key / "c").glob("*/*"))
    lost.unlink()
    result = elastor_launch(
        ["--recipe", str(TINY), "--hardware", str(CPU_SLOTS), "--slots", "2",
         "--steps", str(latest), "--run-dir", str(tmp_path / "run"), "--checkpoint-dir",
         str(root), "--save-interval", str(SAVE_INTERVAL_REFERENCE), "--no-async-save",
         "--devices", "cpu"])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    before = latest - SAVE_INTERVAL_REFERENCE
    assert (f"launch 0 could not load step {latest} (CheckpointError:" in result.stdout
            and f"{lost} is missing" in result.stdout
            and f"the next launch resumes from step {before}, the committed one before it"
            in result.stdout), result.stdout[-5000:]
    launches = json.loads((tmp_path / "run" / "timeline.json").read_text())["launches"]
    assert [l["resumed_from"] for l in launches] == [latest, before]
    metrics = read_metrics(f"{launches[1]['dir']}/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(before + 1, latest + 1))
    for m in metrics:
        assert abs(m["loss"] - expected[m["step"]]) / abs(expected[m["step"]]) <= TOLERANCE
    assert checkpoint.open(root).read(key).isfinite().all()  # step 16 again, whole
