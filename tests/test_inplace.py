"""Recovery in place, end to end on CPU slots: ``elastor launch`` (its default,
``--recovery in-place``) through a kill and a hang (4 -> 3 -> 2 slots) keeps one
launch: the survivors leave their broken groups, agree on a layout, rebuild it in the
same processes and restore the state of the last step from memory (their own copies
and the lost ranks' replicas), so no step is redone, and every step's loss and the
final weights equal an uninterrupted run's, and the demo's report shows each layout
and the recoveries' phases. A fault injected inside the recovery
(``ELASTOR_IN_PLACE_FAULT``) ends the launch and the supervisor relaunches from the
durable checkpoint. Without a world: the socket shutdown that
fails a peer's pending collective, and the supervisor's bookkeeping of failures
absorbed in place (the keeper: ``test_prestart.py``).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastor_mcore import checkpoint
from elastor_mcore.elastic.heartbeat import HangPolicy
from elastor_mcore.elastic.inplace import InPlaceWatch
from elastor_mcore.elastic.protocol import EVENTS_FILE, Beat, append_event
from elastor_mcore.elastic.report import read_metrics, segments, write_report
from elastor_mcore.elastic.timeline import LaunchRecord
from elastor_mcore.parallel.teardown import shut_connections
from tests.test_elastic import (CPU_SLOTS, HANG, HEARTBEAT_TIMEOUT_S, KILL, STEPS, TOLERANCE,
                                TINY, elastor_launch, relative, write_yaml)
from tests.test_elastic import reference  # noqa: F401  (a fixture: the uninterrupted run)

SAVE_INTERVAL = 3
"""Durable saves every 3 steps: a relaunch would redo steps, a recovery in place not."""


def launch_args(tmp: Path, run: str) -> list[str]:
    plan = write_yaml(tmp / "failures.yaml", {"failures": [KILL, HANG]})
    return ["--recipe", str(TINY), "--hardware", str(CPU_SLOTS), "--slots", "4",
            "--steps", str(STEPS), "--run-dir", str(tmp / run), "--save-interval",
            str(SAVE_INTERVAL), "--no-async-save", "--failure-plan", plan,
            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--devices", "cpu"]


@pytest.fixture(scope="module")
def recovered(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inplace")
    result = elastor_launch(launch_args(tmp, "run"))
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    run_dir = tmp / "run"
    return run_dir, json.loads((run_dir / "timeline.json").read_text()), result.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_and_hang_are_recovered_in_place_without_redoing_a_step(recovered):
    run_dir, timeline, stdout = recovered
    (launch,) = timeline["launches"]
    assert launch["outcome"] == "finished"
    kill, hang = timeline["recoveries"]
    assert [r["how"] for r in (kill, hang)] == ["in place", "in place"]
    assert kill["failure"] == "kill of slot 1 at step 4"
    assert hang["failure"] == "hang of slot 3 at step 7"
    assert "killed" in hang["detected_by"]
    assert [(r["slots_before"], r["slots_after"]) for r in (kill, hang)] == [(4, 3), (3, 2)]
    for r, failed_at in ((kill, KILL["step"]), (hang, HANG["step"])):
        assert (r["failed_at_step"], r["resumed_from"], r["steps_redone"]) == \
            (failed_at, failed_at - 1, 0)
        for phase in ("detect_s", "agree_s", "regroup_s", "load_s", "first_step_s", "total_s"):
            assert r[phase] is not None and r[phase] >= 0, (phase, r)
    assert "finished 8 steps after 2 recoveries" in stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_step_once_and_equal_to_the_uninterrupted_run(recovered, reference):
    run_dir, timeline, _ = recovered
    expected, ckpt = reference
    metrics = read_metrics(f"{timeline['launches'][0]['dir']}/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert abs(m["loss"] - expected[m["step"]]) / abs(expected[m["step"]]) <= TOLERANCE
    got, want = checkpoint.open(run_dir / "checkpoints"), checkpoint.open(ckpt)
    assert got.manifest.step == want.manifest.step == STEPS
    for info in want.tensors():
        assert relative(got.read(info.name), want.read(info.name)) <= TOLERANCE, info.name


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_report_shows_each_layout_and_the_in_place_timeline(recovered, reference,
                                                                tmp_path):
    run_dir, timeline, _ = recovered
    launches = [LaunchRecord(**l) for l in timeline["launches"]]
    layouts = segments(launches)
    assert [s.slots for s in layouts] == [[0, 1, 2, 3], [0, 2, 3], [0, 2]]
    assert [[m["step"] for m in s.metrics] for s in layouts] == \
        [[1, 2, 3], [4, 5, 6], [7, 8]]
    expected, _ = reference
    worst = write_report(tmp_path, "t", "c", {}, launches, expected,
                         ["diagram"] * len(layouts), 4, "summary")
    report = (tmp_path / "report.md").read_text()
    assert worst <= TOLERANCE
    assert "### Launch 0, in place 2: 2 slots, steps 7-8" in report
    assert "| failure (in place)" in report and "failure (relaunch)" not in report


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_failure_inside_the_recovery_falls_back_to_a_relaunch(tmp_path, reference):
    env_before = os.environ.get("ELASTOR_IN_PLACE_FAULT")
    os.environ["ELASTOR_IN_PLACE_FAULT"] = "regroup"
    try:
        args = launch_args(tmp_path, "run")
        plan = write_yaml(tmp_path / "kill.yaml", {"failures": [KILL]})
        args[args.index("--failure-plan") + 1] = plan
        result = elastor_launch(args)
    finally:
        if env_before is None:
            del os.environ["ELASTOR_IN_PLACE_FAULT"]
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    timeline = json.loads((tmp_path / "run" / "timeline.json").read_text())
    first, second = timeline["launches"]
    assert first["outcome"] == "exit" and second["outcome"] == "finished"
    (fallback,) = timeline["recoveries"]
    assert fallback["how"] == "relaunch" and fallback["failure"] == "kill of slot 1 at step 4"
    assert second["resumed_from"] == SAVE_INTERVAL  # the durable checkpoint before step 4
    expected, _ = reference
    steps = []
    for launch in (first, second):
        for m in read_metrics(f"{launch['dir']}/metrics.jsonl"):
            steps.append(m["step"])
            assert abs(m["loss"] - expected[m["step"]]) / abs(expected[m["step"]]) <= TOLERANCE
    assert steps == [*range(1, KILL["step"]), *range(SAVE_INTERVAL + 1, STEPS + 1)]


# ----- without a world --------------------------------------------------------------

ECHO = """
import socket, sys
with socket.create_server(("127.0.0.1", 0)) as server:
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    conn.sendall(conn.recv(1))
"""


def test_shutting_connections_fails_the_peer_and_keeps_the_store():
    store = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    try:
        store_address = ("127.0.0.1", int(store.stdout.readline()))
        kept = socket.create_connection(store_address)
        with socket.create_server(("127.0.0.1", 0)) as peers:
            mine = socket.create_connection(peers.getsockname())
            theirs, _ = peers.accept()
            shut = shut_connections(store_address)
            assert shut >= 2  # both ends of the peer connection live in this process
            assert theirs.recv(1) == b""  # the peer sees the connection closed
            kept.sendall(b"x")
            assert kept.recv(1) == b"x"  # the store's connection still works
            for s in (mine, theirs, kept):
                s.close()
    finally:
        store.kill()
        store.wait()


def test_watch_absorbs_a_death_and_an_injected_hang(tmp_path):
    record = LaunchRecord(index=0, dir=str(tmp_path), alive=[0, 1, 2], slots=[0, 1, 2],
                          layout={}, describe="", predicted_step_s=1.0, probe_s=0.0,
                          plan_s=0.0, launched_at=time.time() - 100)
    append_event(tmp_path / EVENTS_FILE, "failure", slot=2, step=3, kind="hang", epoch=0)
    now = time.time()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    paced = dict(steps_timed=5, step_p99_s=1.0)  # 3 x 1 s: silent after 3 s
    beats = {0: Beat(0, 0, 100, 2, True, now - 50, **paced),
             1: Beat(1, 1, 101, 2, True, now - 50, **paced),
             # its own pace allows 300 s: slot 1's silence finds it first
             2: Beat(2, 2, sleeper.pid, 2, True, now - 50, steps_timed=5, step_p99_s=100)}
    messages = []
    watch = InPlaceWatch(record, steps=10, on_message=messages.append)
    policy = HangPolicy(startup_timeout_s=300, floor_s=2)
    # Slot 0 died; slot 2 hangs (injected): silent, like slot 1 blocked behind it.
    judged = watch.absorb(
        beats, silent=lambda b: policy.silent_slots(sorted(b), b, record.launched_at,
                                                    time.time(), 10),
        running=lambda pid: pid in (101, sleeper.pid))
    assert sleeper.wait(timeout=10) == -signal.SIGKILL  # the hung rank is killed
    assert set(watch.lost) == {0, 2} and list(judged) == [1]
    assert not judged[1].stepping and judged[1].time >= now  # recovering: the long limit
    assert watch.slots == [1]
    assert any("slot 2 hung (killed)" in m for m in messages)
    killed = record.events("hang_killed")
    assert [e["slot"] for e in killed] == [2]
    assert killed[0]["timeout"].startswith("3.0s = max(3 x p99 step 1.00s over 5 steps")
    assert killed[0]["timeout"].endswith("(slot 1's)")
    # The recovering ranks' old beats count as not stepping: the start-up limit applies.
    assert policy.silent_slots([1], judged, record.launched_at, time.time(), 10) == {}
