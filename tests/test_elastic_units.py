"""The supervisor's parts without a torchrun world: failure plan validation, hang
detection, rank remapping, the timeline and the CUDA probe's timeout."""

import json

import pytest

from elastor_mcore import cli
from elastor_mcore.config.failure_plan import (Failure, FailurePlanError, parse_failure_plan,
                                            validate)
from elastor_mcore.elastic.heartbeat import HangPolicy
from elastor_mcore.elastic.probe import probe_cuda
from elastor_mcore.elastic.protocol import EVENTS_FILE, HeartbeatWriter, append_event, read_beats
from elastor_mcore.elastic.supervisor import torchrun_layout
from elastor_mcore.elastic.timeline import LaunchRecord, recoveries, table
from elastor_mcore.parallel.layout import layout_from_dict
from tests.conftest import REPO, TINY

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("data, message", [
    ([{"step": 3, "slot": 1, "kind": "explode"}], "failures[0].kind is 'explode'; use one of"),
    ([{"step": 3, "slot": 1}], "failures[0] must be a mapping with exactly step, slot and kind"),
    ([{"step": "3", "slot": 1, "kind": "kill"}], "failures[0].step must be a non-negative"),
    ("kill everything", "expected a list of {step, slot, kind} entries"),
])
def test_malformed_failure_plans_are_named(data, message):
    with pytest.raises(FailurePlanError, match=message.replace("[", r"\[").replace("]", r"\]")
                       .replace("{", r"\{").replace("}", r"\}")):
        parse_failure_plan(data)


@pytest.mark.parametrize("failures, message", [
    ([Failure(3, 9, "kill")], "failures[0].slot=9 is not a slot of this run; the slots are"),
    ([Failure(11, 1, "hang")], "failures[0].step=11 is outside the run; steps are 1..10"),
    ([Failure(0, 1, "hang")], "failures[0].step=0 is outside the run"),
    ([Failure(3, 1, "kill"), Failure(5, 1, "hang")], "slot 1 already fails in failures[0]"),
])
def test_failure_plans_that_do_not_fit_the_run_are_refused(failures, message):
    with pytest.raises(FailurePlanError) as info:
        validate(failures, slots=range(4), steps=10)
    assert message in str(info.value)


def test_launch_refuses_a_bad_failure_plan_before_starting(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("- {step: 5, slot: 7, kind: kill}\n")
    code = cli.main(["launch", "--recipe", str(TINY), "--hardware",
                     str(REPO / "recipes" / "hardware" / "cpu-slots.yaml"), "--slots", "4",
                     "--steps", "8", "--run-dir", str(tmp_path / "run"), "--save-interval",
                     "2", "--failure-plan", str(plan), "--devices", "cpu"])
    assert code == 2
    assert "failures[0].slot=7 is not a slot of this run" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_hang_policy_is_generous_before_the_first_step(tmp_path):
    for slot, rank in ((0, 0), (2, 1)):
        HeartbeatWriter(tmp_path, slot, rank).beat(0, stepping=False)
    HeartbeatWriter(tmp_path, 0, 0).beat(3, stepping=True)
    beats = read_beats(tmp_path)
    t = beats[0].time
    policy = HangPolicy(startup_timeout_s=100, timeout_s=10)
    assert policy.silent_slots([0, 2], beats, t, t + 5, last_step=8) == []
    assert policy.silent_slots([0, 2], beats, t, t + 11, last_step=8) == [0]
    assert policy.silent_slots([0, 2], beats, t, t + 101, last_step=8) == [0, 2]
    assert policy.silent_slots([0, 2], beats, t, t + 11, last_step=3) == []  # finishing
    assert policy.silent_slots([0, 2, 5], beats, t, t + 101, last_step=8) == [0, 2, 5]


def test_survivor_slots_become_contiguous_torchrun_ranks():
    layout = layout_from_dict({"pipelines": [
        {"micro_batches": 10, "stages": [{"tp": 1, "layers": 4, "ranks": [4]},
                                         {"tp": 1, "layers": 4, "ranks": [0]}]},
        {"micro_batches": 6, "stages": [{"tp": 2, "layers": 8, "ranks": [7, 2]}]}]})
    ranked, slots = torchrun_layout(layout)
    assert slots == (0, 2, 4, 7)
    assert [s.ranks for p in ranked.pipelines for s in p.stages] == [(2,), (0,), (1, 3)]


def test_timeline_joins_supervisor_records_and_rank_events(tmp_path):
    failed, after = tmp_path / "launch0", tmp_path / "launch1"
    failed.mkdir(), after.mkdir()
    base = dict(layout={}, describe="", predicted_step_s=0.1, probe_s=0.0, plan_s=0.01)
    l0 = LaunchRecord(index=0, dir=str(failed), alive=[0, 1], slots=[0, 1], launched_at=0.0,
                      outcome="exit", exit_code=1, detected_at=0.0, stop_s=0.2, **base)
    append_event(failed / EVENTS_FILE, "failure", slot=1, rank=1, step=5, kind="kill")
    injected = json.loads((failed / EVENTS_FILE).read_text())["time"]
    l0.detected_at = injected + 1.0
    l1 = LaunchRecord(index=1, dir=str(after), alive=[0], slots=[0], launched_at=injected + 2.0,
                      resumed_from=4, outcome="finished", **dict(base, probe_s=0.05))
    lines = [{"event": "ready", "time": injected + 12.0, "rank": 0, "slot": 0,
              "start_step": 4, "load_s": 3.0},
             {"event": "first_step", "time": injected + 14.0, "rank": 0, "slot": 0, "step": 5}]
    (after / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in lines))
    (r,) = recoveries([l0, l1])
    assert r.failure == "kill of slot 1 at step 5" and r.steps_redone == 0
    assert r.detect_s == pytest.approx(1.0) and r.stop_s == 0.2 and r.probe_s == 0.05
    assert r.relaunch_s == pytest.approx(7.0) and r.load_s == 3.0
    assert r.first_step_s == pytest.approx(2.0) and r.total_s == pytest.approx(14.0)
    assert "| kill of slot 1 at step 5 | 2 -> 1 |" in table([r])


def test_cuda_probe_counts_a_stuck_device_dead():
    stuck = "import time, os\nif os.environ['CUDA_VISIBLE_DEVICES'] == '1': time.sleep(60)\n"
    # 2 s: an interpreter that imports only time and os starts in ~0.1 s (20x margin)
    assert probe_cuda([0, 1, 2], timeout_s=2, script=stuck) == [0, 2]
    assert probe_cuda([0], timeout_s=10, script="raise SystemExit(3)") == []


def test_round_plan_numbers_devices_by_node_and_maps_back_to_round_ranks():
    """Node b (group rank 0 of the round) has slots 0 and 1 with slot 1 dead; node a
    (group rank 1) slot 0: the planner sees devices 0 (b.0) and 2 (a.0), two nodes of
    2, and the layout it returns names round ranks 0 and 2."""
    from elastor_mcore.config.recipe import load_recipe
    from elastor_mcore.planner import load_hardware
    from elastor_mcore.elastic.rank.rendezvous_round import Member, plan_round, planner_slots
    members = [Member(0, "b", 0, 0, True, 0.0, 0.0), Member(1, "b", 0, 1, False, 0.0, 0.0),
               Member(2, "a", 1, 0, True, 0.0, 0.0)]
    assert planner_slots(members) == ({0: 0, 2: 2}, 2)
    plan = plan_round(members, load_recipe(TINY),
                      load_hardware(REPO / "recipes" / "hardware" / "cpu-slots.yaml"),
                      str(REPO / "no-such-checkpoint"), use_all=True, number=7)
    used = sorted(r for p in plan.layout["pipelines"] for s in p["stages"] for r in s["ranks"])
    assert (plan.round, used, plan.resumed_from) == (7, [0, 2], None)
    assert plan.active(2) and not plan.active(1)
    nothing = [Member(0, "b", 0, 0, False, 0.0, 0.0)]
    gave_up = plan_round(nothing, load_recipe(TINY),
                         load_hardware(REPO / "recipes" / "hardware" / "cpu-slots.yaml"),
                         str(REPO / "no-such-checkpoint"), use_all=False, number=8)
    assert gave_up.layout is None
    assert gave_up.reason.startswith("gave up: the 0 healthy devices [] cannot hold the model")


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "1:2"], "--nnodes need --rdzv-endpoint"),
    (["--rdzv-endpoint", "127.0.0.1:29500"], "--rdzv-endpoint needs --nnodes and --rdzv-id"),
    (["--rdzv-endpoint", "127.0.0.1", "--nnodes", "2", "--rdzv-id", "j"],
     "--rdzv-endpoint must be HOST:PORT"),
    (["--rdzv-endpoint", "h:1", "--nnodes", "two", "--rdzv-id", "j"],
     "--nnodes must be N or MIN:MAX"),
])
def test_launch_refuses_incomplete_rendezvous_flags(tmp_path, capsys, args, message):
    code = cli.main(["launch", "--recipe", str(TINY), "--hardware",
                     str(REPO / "recipes" / "hardware" / "cpu-slots.yaml"), "--steps", "4",
                     "--run-dir", str(tmp_path / "run"), "--save-interval", "2",
                     "--devices", "cpu", *args])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
