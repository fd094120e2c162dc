"""The supervisor's parts without a torchrun world: failure plan validation, hang
detection, rank remapping, the timeline and the CUDA probe's timeout."""

import collections
import importlib.util
import json
import os
from pathlib import Path

import pytest

from elastor_mcore import cli
from elastor_mcore.config.failure_plan import (Failure, FailurePlanError, parse_failure_plan,
                                            validate)
from elastor_mcore.config.launch import MegatronSettings
from elastor_mcore.config.run import RunSettings
from elastor_mcore.elastic import node, protocol
from elastor_mcore.elastic.heartbeat import HangPolicy
from elastor_mcore.elastic.job import Trainer, latest_readable, renumbered
from elastor_mcore.elastic.megatron import (LAZY_CORE_IMPORTS, MegatronLM, rank_core_imports,
                                            script_core_imports)
from elastor_mcore.elastic.probe import probe_cuda
from elastor_mcore.integrations.megatron_lm.launch_flags import MegatronJob
from elastor_mcore.elastic.protocol import (EVENTS_FILE, Beat, HeartbeatWriter, append_event,
                                            read_beats)
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
    beats = read_beats(tmp_path)
    t = max(b.time for b in beats.values())
    policy = HangPolicy(startup_timeout_s=100, floor_s=2)
    assert policy.silent_slots([0, 2], beats, t, t + 99, last_step=8) == {}
    silent = policy.silent_slots([0, 2, 5], beats, t, t + 101, last_step=8)
    assert sorted(silent) == [0, 2, 5]  # 5 never beat: from the launch's start
    assert silent[0].rule == "start-up timeout 100s (before the first step)"
    assert silent[5].rule == "start-up timeout 100s (no heartbeat yet)"


def beat(step: int, timed: int, p99: float | None, busy: str | None = None) -> Beat:
    return Beat(slot=0, rank=0, pid=1, step=step, stepping=True, time=1000.0, busy=busy,
                steps_timed=timed, step_p99_s=p99)


def test_hang_timeout_follows_the_measured_step_times():
    """Three times the p99 of the rank's own step times once it has timed three steps,
    never under the floor; the start-up timeout until then, during a save or an
    evaluation, and after the last step."""
    policy = HangPolicy(startup_timeout_s=300, floor_s=2)
    paced = policy.timeout(beat(6, 5, 1.5), last_step=20)
    assert paced.seconds == pytest.approx(4.5)
    assert paced.rule == "4.5s = max(3 x p99 step 1.50s over 5 steps, floor 2s)"
    assert policy.timeout(beat(6, 5, 0.1), last_step=20).seconds == 2  # the floor
    for early in (beat(3, 2, 1.5), beat(6, 5, 1.5, busy="save"), beat(20, 19, 1.5)):
        assert policy.timeout(early, last_step=20).seconds == 300
    assert "2 of 3 steps timed" in policy.timeout(beat(3, 2, 1.5), 20).rule
    assert "during a save" in policy.timeout(beat(6, 5, 1.5, busy="save"), 20).rule
    silent = policy.silent_slots([0], {0: beat(6, 5, 1.5)}, 0.0, 1004.4, last_step=20)
    assert silent == {}
    silent = policy.silent_slots([0], {0: beat(6, 5, 1.5)}, 0.0, 1004.6, last_step=20)
    assert silent[0].seconds == pytest.approx(4.5)


def test_heartbeats_time_each_step_from_the_previous_beat(tmp_path, monkeypatch):
    """A rank times every step from its previous beat (the load, the previous step, or
    the end of a save: a save between two steps, Megatron-LM's, is not a step's time; a
    save inside a step, the trainer's, is); the beat carries the p99 of those times."""
    now = [100.0]
    monkeypatch.setattr(protocol.time, "time", lambda: now[0])
    writer = HeartbeatWriter(tmp_path, 3, 1)

    def at(t: float, step: int, stepping: bool = True, busy: str | None = None) -> Beat:
        now[0] = t
        writer.beat(step, stepping, busy)
        return read_beats(tmp_path)[3]

    at(100.0, 4, stepping=False)                     # loaded step 4
    assert at(102.0, 5).steps_timed == 1              # 2 s
    at(103.0, 6)                                      # 1 s
    assert at(103.5, 6, busy="save").busy == "save"   # a save of step 6 begins ...
    at(110.0, 6)                                      # ... and ends 6.5 s later
    last = at(111.5, 7)                               # 1.5 s, the save left out
    assert (last.steps_timed, last.step_p99_s, last.busy) == (3, 2.0, None)
    assert writer.durations == collections.deque([2.0, 1.0, 1.5])
    # The trainer saves inside a step (``StepHooks.busy`` before its ``step_end``): the
    # step's beat times the step with its save, so the save never reads as a hang.
    assert at(112.0, 7, busy="save").busy == "save"  # step 8's save begins after 0.5 s
    assert at(115.5, 8).step_p99_s == 4.0            # step 8 with its save: 4 s
    # A recovery in place (``ElasticHooks.recovering``): the new layout's own pace.
    writer.new_layout()
    assert at(116.0, 8, stepping=False).steps_timed == 0  # recovering, from step 8
    restored = at(116.5, 9)                               # 0.5 s on the new layout
    assert (restored.steps_timed, restored.step_p99_s) == (1, 0.5)


def test_survivor_slots_become_contiguous_torchrun_ranks():
    layout = layout_from_dict({"pipelines": [
        {"micro_batches": 10, "stages": [{"tp": 1, "layers": 4, "ranks": [4]},
                                         {"tp": 1, "layers": 4, "ranks": [0]}]},
        {"micro_batches": 6, "stages": [{"tp": 2, "layers": 8, "ranks": [7, 2]}]}]})
    slots = Trainer(RunSettings(recipe=str(TINY), steps=4)).rank_order(layout)
    assert slots == (0, 2, 4, 7)
    ranked = renumbered(layout, slots)
    assert [s.ranks for p in ranked.pipelines for s in p.stages] == [(2,), (0,), (1, 3)]


def test_megatron_ranks_increase_along_every_pipeline():
    """Megatron-Core takes a rank's stage from its place in its pipeline group (ordered
    by rank), and Megatron-LM logs the loss from its highest rank: torchrun ranks go
    pipeline by pipeline, stage by stage."""
    layout = layout_from_dict({"pipelines": [
        {"micro_batches": 16, "stages": [{"tp": 2, "layers": 4, "ranks": [6, 7]},
                                         {"tp": 1, "layers": 4, "ranks": [1]}]},
        {"micro_batches": 4, "stages": [{"tp": 1, "layers": 8, "ranks": [0]}]}]})
    job = MegatronJob(recipe={}, train_iters=8, save_interval=2, save=None, load=None,
                      arguments={"micro_batch_size": 1, "global_batch_size": 20,
                                 "untie_embeddings_and_output_weights": True})
    workload = MegatronLM(MegatronSettings(), (), job, "recipe.yaml")
    order = workload.rank_order(layout)
    assert order == (6, 7, 1, 0)
    ranked = renumbered(layout, order)
    assert max(ranked.ranks) in ranked.pipelines[-1].stages[-1].ranks
    # the layout an elastic run planned on slots [0, 2, 4, 5, 7, 1], whose last stage
    # held torchrun rank 0 under the former order: every rank built a stage's modules
    # by its place in an ordered pipeline group, so a middle stage built the loss
    planned = layout_from_dict({"pipelines": [{"micro_batches": 16, "stages": [
        {"tp": 1, "layers": 1, "ranks": [2]}, {"tp": 1, "layers": 1, "ranks": [5]},
        {"tp": 2, "layers": 3, "ranks": [4, 7]}, {"tp": 2, "layers": 3, "ranks": [0, 1]}]}]})
    stages = renumbered(planned, workload.rank_order(planned)).pipelines[0].stages
    assert [list(s.ranks) for s in stages] == [[0], [1], [2, 3], [4, 5]]
    # Megatron-LM's loop refuses the layout on its slots' own order, not on this one
    assert "not a last stage" in workload.refusal(renumbered(layout, sorted(layout.ranks)))
    assert workload.refusal(ranked) is None


def test_a_workload_that_refuses_the_best_layout_gets_one_it_runs():
    """``Workload.plan``: when the ranks cannot run the planner's best layout, the best
    one on fewer slots; when none, a PlannerError naming each refusal."""
    from elastor_mcore.config.recipe import load_recipe
    from elastor_mcore.planner import PlannerError, load_hardware

    class OnePipeline(Trainer):
        def refusal(self, layout):
            return None if len(layout.pipelines) == 1 else "one pipeline only"

    class Nothing(Trainer):
        def refusal(self, layout):
            return "nothing runs"

    recipe, hardware = load_recipe(TINY), load_hardware(REPO / "recipes/hardware/cpu-slots.yaml")
    settings = RunSettings(recipe=str(TINY), steps=4)
    best = Trainer(settings).plan(recipe, hardware, [0, 1, 2, 3])
    assert len(best.layout.pipelines) > 1
    chosen = OnePipeline(settings).plan(recipe, hardware, [0, 1, 2, 3])
    assert len(chosen.layout.pipelines) == 1 and set(chosen.layout.ranks) <= {0, 1, 2, 3}
    with pytest.raises(PlannerError, match="on 1 slots cannot run: nothing runs"):
        Nothing(settings).plan(recipe, hardware, [0, 1])


def test_the_latest_readable_step_skips_the_unreadable_ones():
    assert latest_readable([2, 4, 6], set()) == 6
    assert latest_readable([2, 4, 6], {6}) == 4
    assert latest_readable([2, 4, 6], {2, 4, 6}) is None
    assert latest_readable([], {6}) is None


def test_megatron_iterations_count_once_complete_and_tracked(tmp_path):
    """A Megatron-LM save directory's committed iterations: ``iter_*`` with
    ``metadata.json``, up to the tracker (an unfinished save and a newer directory the
    tracker does not name yet do not count)."""
    from elastor_mcore.checkpoint.megatron_dir import committed_iterations, write_config

    assert committed_iterations(tmp_path / "none") == []
    for it in (2, 4, 6, 8):
        (tmp_path / f"iter_{it:07d}").mkdir()
    for it in (2, 4, 8):
        write_config(tmp_path / f"iter_{it:07d}")
    assert committed_iterations(tmp_path) == []  # no tracker yet
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6")
    assert committed_iterations(tmp_path) == [2, 4]


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
    trainer = Trainer(RunSettings(recipe=str(TINY), steps=4))
    plan = plan_round(members, trainer, load_recipe(TINY),
                      load_hardware(REPO / "recipes" / "hardware" / "cpu-slots.yaml"),
                      str(REPO / "no-such-checkpoint"), use_all=True, number=7,
                      unreadable=set())
    used = sorted(r for p in plan.layout["pipelines"] for s in p["stages"] for r in s["ranks"])
    assert (plan.round, used, plan.resumed_from) == (7, [0, 2], None)
    assert plan.active(2) and not plan.active(1)
    nothing = [Member(0, "b", 0, 0, False, 0.0, 0.0)]
    gave_up = plan_round(nothing, trainer, load_recipe(TINY),
                         load_hardware(REPO / "recipes" / "hardware" / "cpu-slots.yaml"),
                         str(REPO / "no-such-checkpoint"), use_all=False, number=8,
                         unreadable=set())
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


@pytest.mark.parametrize("args, message", [
    ([], "--recipe, --steps, --save-interval required (or run Megatron-LM's "
         "pretrain_gpt.py: --megatron-lm PATH -- <its flags>)"),
    (["--recipe", str(TINY), "--steps", "4", "--save-interval", "2", "--", "--seed", "3"],
     "unexpected arguments --seed 3: flags after -- are Megatron-LM's, with --megatron-lm"),
    (["--megatron-lm", "pretrain_gpt.py", "--steps", "4", "--no-async-save", "--",
      "--train-iters", "4"],
     "--steps, --async-save: the project trainer's flags; with --megatron-lm give "
     "Megatron-LM's own after --"),
    (["--megatron-lm", "pretrain_gpt.py", "--synthetic-data", "--", "--train-iters", "4"],
     "the data flags: the project trainer's flags"),
    (["--megatron-lm", "pretrain_gpt.py"], "give pretrain_gpt.py's flags after --"),
    (["--megatron-lm", str(REPO / "no-such-dir" / "pretrain_gpt.py"), "--",
      "--train-iters", "4"], "no such file; pass Megatron-LM's pretrain_gpt.py"),
])
def test_launch_tells_the_trainers_flags_from_megatron_lms(tmp_path, capsys, args, message):
    """Without --megatron-lm the trainer's flags are needed and nothing follows --; with
    it, Megatron-LM's flags say everything and the trainer's are refused, by name."""
    code = cli.main(["launch", "--hardware", str(REPO / "recipes/hardware/cpu-slots.yaml"),
                     "--run-dir", str(tmp_path / "run"), "--devices", "cpu", *args])
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("line, is_error", [
    ("torch.distributed.elastic.rendezvous.api.RendezvousClosedError", True),
    ("RuntimeError: [../gloo/transport/tcp/pair.cc:561] Connection closed by peer", True),
    ("torch.distributed.DistStoreError: Timed out after 61 seconds waiting for clients", True),
    ("I1204 22:38:16.940000 21907 torch/distributed/elastic/agent/server/api.py:942] "
     "[default] Worker group FAILED. 5/5 attempts left; will restart worker group", False),
    ("elastor launch: node a: step     3  loss 6.255420  grad_norm 0.7773", False),
])
def test_a_node_failure_names_the_agents_last_error_line(line, is_error):
    assert bool(node.ERROR_LINE.match(line)) is is_error


def test_the_zygote_pre_imports_the_scripts_megatron_core_modules_only(tmp_path):
    script = tmp_path / "pretrain.py"
    script.write_text("import os\nimport megatron.core.a, torch\nfrom megatron.core.b import c\n"
                      "from megatron.training import pretrain\nfrom . import near\n"
                      "from megatron.core.a import d\n"
                      "def main():\n    import megatron.core.inner\n")
    assert script_core_imports(script) == ("megatron.core.a", "megatron.core.b")
    assert script_core_imports(tmp_path / "missing.py") == ()
    checkout = os.environ.get("MEGATRON_LM_DIR")
    if checkout:  # the real script: its tokenizer module (0.16: loads transformers)
        real = script_core_imports(Path(checkout) / "pretrain_gpt.py")
        assert any(".tokenizers." in name for name in real), real
        assert not any(name.startswith("megatron.training") for name in real), real


def test_the_zygote_also_pre_imports_what_megatron_core_imports_lazily(tmp_path):
    """The lazily imported tokenizer module (Megatron-Core 0.19: 2.2 CPU-s a rank) is
    in the installed Megatron-Core, so a rename there fails here rather than leaving
    every rank to import it again behind the zygote's warning."""
    script = tmp_path / "pretrain.py"
    script.write_text("from megatron.core.tokenizers.text import x\nimport megatron.core.a\n")
    assert rank_core_imports(script) == ("megatron.core.tokenizers.text", "megatron.core.a")
    assert rank_core_imports(tmp_path / "missing.py") == LAZY_CORE_IMPORTS
    for name in LAZY_CORE_IMPORTS:
        assert importlib.util.find_spec(name) is not None, name
