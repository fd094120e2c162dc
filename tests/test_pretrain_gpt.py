"""Megatron-LM's real ``pretrain_gpt.py`` (patched copy of $MEGATRON_LM_DIR) with Elastor's
flags, on CPU/gloo under torchrun: uniform layouts, bf16, distributed and plain
optimizer, async zarr saves to S3 (``--save s3://``, a real S3 server on 127.0.0.1,
``tests/s3_server.py``) resumed from there under another uniform layout and under a
heterogeneous one (bf16 through the hooked schedule); Megatron's distributed optimizer
on heterogeneous layouts, saved and resumed under another; and Elastor's flags through
Megatron-LM's own argument parser and validation.

Noise floor: the same 8 iterations (same weights by ``--use-cpu-initialization``,
same mock data) trained as TP2 x DP2 with the plain optimizer and as TP1 x DP4
with the distributed one differ only by bf16 rounding and reduction order; that measured
difference bounds what a resume under another layout may differ by (``FLOOR_FACTOR``).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastor_mcore import checkpoint
from elastor_mcore.checkpoint import megatron_dir
from elastor_mcore.checkpoint.storage.object_store import ObjectPath
from tests.conftest import REPO, max_relative_difference
from tests.pretrain_gpt_run import default_args, run_pretrain_gpt, shimmed_env
from tests.s3_server import s3_environment

ITERS, SAVE_AT = 8, 4
COMMON = ["--global-batch-size", "16", "--train-iters", str(ITERS), "--bf16",
          "--use-cpu-initialization"]
DISTOPT = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
FLOOR_FACTOR = 3.0
"""A resumed run may differ from the uninterrupted one by 3x the measured floor."""
FLOOR_MIN = 1e-4
"""...or by 1e-4 relative when the floor happens to measure smaller (bf16 has 8 bits)."""
FLOOR_MAX = 5e-3
"""The floor itself: two uniform layouts of one bf16 run agree to 0.5% per step."""
BUCKET = "megatron-lm"
SAVE_URL = f"s3://{BUCKET}/save"


def _run(megatron_lm, nproc, args, workdir, cold: bool = False):
    run = run_pretrain_gpt(megatron_lm, nproc, COMMON + args, workdir, timeout=900,
                           cold=cold)
    if run.returncode:
        pytest.fail(f"pretrain_gpt.py failed\n{run.tail()}")
    return run


@pytest.fixture(scope="module")
def s3():
    """A real S3 server, reachable from every run of the module (AWS environment)."""
    with s3_environment(BUCKET, REPO) as server:
        yield server


@pytest.fixture(scope="module")
def uniform_runs(patched_megatron_lm, tmp_path_factory, s3):
    """Three 4-rank runs: TP2 x DP2 from --elastor-layout with the plain optimizer and
    async zarr saves to S3; TP1 x DP4 from Megatron's own flags with the distributed
    optimizer and no Elastor flag (the floor); the first one's iteration-4 checkpoint
    resumed from S3 as TP1 x PP2 x DP2. The first runs cold, as a user's ``torchrun
    pretrain_gpt.py`` does (the module's other runs fork from the pre-imported worker)."""
    root = tmp_path_factory.mktemp("pretrain_gpt")
    layout_run = _run(patched_megatron_lm, 4, [
        "--elastor-layout", "dp2-tp2-pp1", "--async-save",
        "--elastor-ckpt-format", "zarr", "--save", SAVE_URL,
        "--save-interval", str(SAVE_AT)], root / "a", cold=True)
    plain_run = _run(patched_megatron_lm, 4, DISTOPT, root / "c")
    return root, layout_run, plain_run


HETERO_LAYOUT = ("pipelines:\n"
                 "  - {micro_batches: 6, stages: [{tp: 2, layers: 5}, {tp: 1, layers: 3}]}\n"
                 "  - {micro_batches: 10, stages: [{tp: 1, layers: 8}]}\n")
"""4 ranks: a ``[tp2 | tp1]`` pipeline of uneven layers beside a one-stage TP1 one, 6 and
10 micro-batches of the global 16."""
HETERO_EXIT = SAVE_AT + 2
"""The heterogeneous resume trains two iterations (``iteration_losses`` needs two)."""


DISTOPT_LAYOUT = ("pipelines:\n"
                  + "  - {micro_batches: 6, stages: [{tp: 1, layers: 5}, {tp: 1, layers: 3}]}\n" * 2
                  + "  - {micro_batches: 4, stages: [{tp: 1, layers: 8}]}\n")
"""5 ranks: two ``[5 | 3 layers]`` pipelines (each stage's distributed optimizer sharded
over its 2 replicas) beside a one-stage pipeline, 6, 6 and 4 micro-batches."""


def _resumed_run(patched_megatron_lm, root: Path, layout: str = "dp2-tp1-pp2",
                 name: str = "b", *args: str):
    """Iteration ``SAVE_AT`` (the tracker names the later one) loaded from S3."""
    return _run(patched_megatron_lm, 4, [
        "--elastor-layout", layout, "--elastor-ckpt-format", "zarr",
        "--load", SAVE_URL, "--ckpt-step", str(SAVE_AT), *args], root / name)


def _floor(layout_run, plain_run) -> float:
    steps = list(range(1, ITERS + 1))
    floor = max_relative_difference([layout_run.losses[i] for i in steps],
                                    [plain_run.losses[i] for i in steps])
    assert floor <= FLOOR_MAX, (floor, layout_run.losses, plain_run.losses)
    return floor


def _against(run, reference, after: list[int], floor: float) -> tuple[float, float]:
    """``run``'s largest relative loss difference from ``reference`` over the iterations
    ``after`` (which ``run`` must have logged, exactly), and the tolerance ``floor``
    allows."""
    assert sorted(run.losses) == after, run.losses
    difference = max_relative_difference([run.losses[i] for i in after],
                                         [reference.losses[i] for i in after])
    return difference, max(FLOOR_FACTOR * floor, FLOOR_MIN)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_layout_derives_megatron_parallel_sizes(uniform_runs):
    _, layout_run, plain_run = uniform_runs
    for run, tp, dp in ((layout_run, 2, 2), (plain_run, 1, 4)):
        assert f"tensor_model_parallel_size ...................... {tp}" in run.stdout
        assert f"data_parallel_size .............................. {dp}" in run.stdout
    assert sorted(layout_run.losses) == sorted(plain_run.losses) == list(range(1, ITERS + 1))
    assert set(layout_run.skipped) == {0}
    floor = _floor(layout_run, plain_run)
    print(f"\nnoise floor (TP2xDP2 plain vs TP1xDP4 distopt, {ITERS} steps): {floor:.2e}")
    for it in (SAVE_AT, ITERS):  # the async saves to S3, the tracker after them
        assert megatron_dir.is_zarr_checkpoint(f"{SAVE_URL}/iter_{it:07d}")
    tracker = ObjectPath(SAVE_URL) / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == str(ITERS)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_zarr_saved_async_and_resumed_under_another_layout_continues_the_loss(
        uniform_runs, patched_megatron_lm):
    root, layout_run, plain_run = uniform_runs
    resumed = _resumed_run(patched_megatron_lm, root)
    floor = _floor(layout_run, plain_run)
    difference, tolerance = _against(resumed, layout_run,
                                     list(range(SAVE_AT + 1, ITERS + 1)), floor)
    print(f"\nnoise floor (TP2xDP2 plain vs TP1xDP4 distopt, {ITERS} steps): {floor:.2e}; "
          f"resumed TP1xPP2xDP2 vs uninterrupted: {difference:.2e} (tolerance "
          f"{tolerance:.2e})")
    assert difference <= tolerance, (difference, tolerance, resumed.losses,
                                     layout_run.losses)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_bf16_heterogeneous_resume_continues_the_loss(uniform_runs, patched_megatron_lm):
    """The TP2 x DP2 run's iteration-4 zarr checkpoint resumed on a heterogeneous layout
    (per-stage TP, uneven layers, pipelines of 2 and 1 stages and 6 and 10 micro-batches)
    in bf16 through Megatron-LM's loop continues the uninterrupted run within the floor."""
    root, layout_run, plain_run = uniform_runs
    layout = root / "hetero.yaml"
    layout.write_text(HETERO_LAYOUT)
    resumed = _resumed_run(patched_megatron_lm, root, str(layout), "hetero",
                           "--exit-interval", str(HETERO_EXIT))
    floor = _floor(layout_run, plain_run)
    after = list(range(SAVE_AT + 1, HETERO_EXIT + 1))
    difference, tolerance = _against(resumed, layout_run, after, floor)
    assert set(resumed.skipped) == {0}
    print(f"\nnoise floor {floor:.2e}; heterogeneous bf16 resume (iterations {after}) vs "
          f"uninterrupted TP2xDP2: {difference:.2e} (tolerance {tolerance:.2e})")
    assert difference <= tolerance, (difference, tolerance, resumed.losses,
                                     layout_run.losses)


DISTOPT_RTOL = 1e-4
"""The distributed optimizer against the plain one on the same layout, and a resume
against the uninterrupted run: bf16 reduction order only (measured at core_v0.16.1:
1.4e-5, and 6.2e-6 after one resumed update). An Adam step lost
or counted wrong on resume moved the loss by 7e-4."""
PLAIN_EXIT = 3
"""The plain-optimizer run of ``DISTOPT_LAYOUT`` trains 3 iterations (two updates)."""


@pytest.fixture(scope="module")
def distopt_hetero(uniform_runs, patched_megatron_lm):
    """Fresh starts on ``DISTOPT_LAYOUT``: with the distributed optimizer (zarr saves
    every ``SAVE_AT``) and with the plain one; then the first one's iteration-``SAVE_AT``
    checkpoint resumed on ``HETERO_LAYOUT`` (other TP per stage, no replicas) with the
    distributed optimizer again."""
    root, _, _ = uniform_runs
    (root / "distopt.yaml").write_text(DISTOPT_LAYOUT)
    (root / "hetero.yaml").write_text(HETERO_LAYOUT)
    ckpt = root / "distopt-ckpt"
    layout = ["--elastor-layout", str(root / "distopt.yaml")]
    trained = _run(patched_megatron_lm, 5, [
        *layout, *DISTOPT, "--elastor-ckpt-format", "zarr", "--save", str(ckpt),
        "--save-interval", str(SAVE_AT), "--exit-interval", str(HETERO_EXIT)], root / "d")
    plain = _run(patched_megatron_lm, 5, [*layout, "--exit-interval", str(PLAIN_EXIT)],
                 root / "p")
    resumed = _run(patched_megatron_lm, 4, [
        "--elastor-layout", str(root / "hetero.yaml"), *DISTOPT,
        "--elastor-ckpt-format", "zarr", "--load", str(ckpt), "--ckpt-step", str(SAVE_AT),
        "--exit-interval", str(HETERO_EXIT)], root / "e")
    uniform = _run(patched_megatron_lm, 4, [
        "--elastor-layout", "dp2-tp1-pp2", *DISTOPT, "--elastor-ckpt-format", "zarr",
        "--load", str(ckpt), "--ckpt-step", str(SAVE_AT),
        "--exit-interval", str(HETERO_EXIT)], root / "u")
    return ckpt, trained, plain, resumed, uniform


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_distributed_optimizer_on_heterogeneous_layouts_trains_and_resumes(distopt_hetero):
    """From a fresh start (replicas in other pipelines made equal first), ZeRO-1 across
    pipelines trains as the plain optimizer does, each element's optimizer state on one
    rank of the job (Megatron's own distributed optimizer would keep one copy per
    pipeline shape: two here); its fully reshardable zarr checkpoint resumed on another
    heterogeneous layout continues the uninterrupted run: the same weights (the first
    resumed loss) and the same Adam state (the loss after one resumed update)."""
    ckpt, trained, plain, resumed, _ = distopt_hetero
    steps, after = list(range(1, HETERO_EXIT + 1)), list(range(SAVE_AT + 1, HETERO_EXIT + 1))
    assert sorted(trained.losses) == steps and sorted(resumed.losses) == after
    assert sorted(plain.losses) == list(range(1, PLAIN_EXIT + 1))
    assert set(trained.skipped) == set(plain.skipped) == set(resumed.skipped) == {0}
    tensors = checkpoint.open(ckpt / f"iter_{SAVE_AT:07d}").tensors()
    mains = [t for t in tensors if t.name.startswith("optimizer.state.param.")]
    assert mains, sorted(t.name for t in tensors)[:20]
    owned = zero_state_bytes(trained.stdout)
    elements = sum(math.prod(t.shape) for t in mains)
    print(f"\nZeRO-1 optimizer state per rank (bytes): {owned}; 12 B x {elements} "
          f"elements = {12 * elements}")
    assert sorted(owned) == list(range(5)), trained.stdout[-3000:]
    assert sum(owned.values()) == 12 * elements
    saves = SAVE_LINE.findall(trained.stdout)
    print(f"zarr saves (path, job-wide calls, replica classes, grid tensors): {saves}")
    # the weights planned over the layout's 3 replica classes (two [5|3] pipelines' stages
    # and the one-stage pipeline), ZeRO-1's state on its grid, objects and common.pt in
    # the same 2 job-wide steps: 2 exchanges of 2 calls, the finish's sum and broadcast
    assert len(saves) >= 5 and all(
        (calls, classes) == ("6", "3") and int(grid) > 0 for _, calls, classes, grid in saves)
    early = list(range(1, PLAIN_EXIT + 1))
    vs_plain = max_relative_difference([trained.losses[i] for i in early],
                                       [plain.losses[i] for i in early])
    vs_trained = max_relative_difference([resumed.losses[i] for i in after],
                                         [trained.losses[i] for i in after])
    print(f"\ndistributed vs plain optimizer, iterations {early}: {vs_plain:.2e}; resumed "
          f"on another heterogeneous layout vs uninterrupted, iterations {after}: "
          f"{vs_trained:.2e} (tolerance {DISTOPT_RTOL:.0e})")
    assert vs_plain <= DISTOPT_RTOL, (trained.losses, plain.losses)
    assert vs_trained <= DISTOPT_RTOL, (resumed.losses, trained.losses)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_zero_checkpoint_resumes_under_megatrons_distributed_optimizer(uniform_runs,
                                                                        distopt_hetero):
    """The heterogeneous layout's ZeRO-1 checkpoint (each rank's owned boxes, in
    Megatron's fully reshardable format) resumed on the uniform TP1 x PP2 x DP2 layout
    by Megatron's own distributed optimizer continues the uninterrupted run within the
    noise floor of two layouts."""
    _, layout_run, plain_run = uniform_runs
    _, trained, _, _, uniform = distopt_hetero
    after = list(range(SAVE_AT + 1, HETERO_EXIT + 1))
    floor = _floor(layout_run, plain_run)
    difference, tolerance = _against(uniform, trained, after, floor)
    print(f"\nnoise floor {floor:.2e}; ZeRO-1 checkpoint resumed by Megatron's "
          f"distributed optimizer on TP1xPP2xDP2 (iterations {after}) vs uninterrupted: "
          f"{difference:.2e} (tolerance {tolerance:.2e})")
    assert difference <= tolerance, (uniform.losses, trained.losses)


ZERO_LINE = re.compile(r"rank (\d+): ZeRO-1 over \d+ replica sets, optimizer state (\d+) bytes")
SAVE_LINE = re.compile(r"saved Megatron-LM checkpoint (\S+) in the elastor zarr format: "
                       r"(\d+) job-wide calls, (\d+) replica classes, (\d+) tensors on a grid")
"""``megatron_dir``'s log line of each rank's save."""


def zero_state_bytes(stdout: str) -> dict[int, int]:
    """Rank -> bytes of optimizer state it owns, from ``ZeroShards``' log line
    (Megatron-LM's log handler prints INFO records to stdout)."""
    return {int(m.group(1)): int(m.group(2)) for m in ZERO_LINE.finditer(stdout)}


# ----------------------------------------------------------------- arguments


TIED = "<tied embeddings>"
"""In a case's argv: leave ``--untie-embeddings-and-output-weights`` out of
``default_args()``."""
NO_FFN = "<no --ffn-hidden-size>"
"""In a case's argv: leave ``--ffn-hidden-size`` out (Megatron-LM derives it)."""


def _case_argv(argv: list[str]) -> list[str]:
    base = default_args()
    if TIED in argv:
        base.remove("--untie-embeddings-and-output-weights")
    if NO_FFN in argv:
        at = base.index("--ffn-hidden-size")
        del base[at:at + 2]
    return base + [a for a in argv if a not in (TIED, NO_FFN)]


def _check_args(megatron_lm: Path, cases: list[tuple[int, list[str]]], tmp_path: Path):
    """Each case through Megatron-LM's own parse_args + validate_args, in one process."""
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps([{"world_size": n, "argv": _case_argv(argv)}
                                for n, argv in cases]))
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "pretrain_gpt_args_check.py"),
         str(megatron_lm), str(spec)], capture_output=True, text=True, timeout=600,
        env=shimmed_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(cases), result.stdout
    return lines


@pytest.mark.timeout(700)
def test_layout_flags_through_megatron_parser(patched_megatron_lm, tmp_path):
    uniform = tmp_path / "uniform.yaml"
    uniform.write_text("pipelines:\n" + "  - micro_batches: 8\n    stages: "
                       "[{tp: 2, layers: 5}, {tp: 2, layers: 3}]\n" * 2)
    seven = tmp_path / "seven.yaml"
    seven.write_text(yaml.safe_dump({"pipelines": [{"micro_batches": 16, "stages": [
        {"tp": 1, "layers": n} for n in (1, 1, 1, 1, 1, 2, 1)]}]}))
    hetero = tmp_path / "hetero.yaml"
    hetero.write_text("pipelines:\n  - micro_batches: 8\n    stages: [{tp: 2, layers: 5}, "
                      "{tp: 1, layers: 3}]\n  - micro_batches: 8\n    stages: "
                      "[{tp: 1, layers: 8}]\n")
    results = _check_args(patched_megatron_lm, [
        (4, ["--elastor-layout", "dp2-tp2-pp1"]),
        (4, ["--elastor-layout", "dp2-tp2-pp1", "--global-batch-size", "16"]),
        (8, ["--elastor-layout", str(uniform)]),
        (4, ["--elastor-layout", "dp2-tp2-pp1", "--tensor-model-parallel-size", "1"]),
        (4, ["--elastor-layout", str(uniform), "--global-batch-size", "8"]),
        (8, ["--elastor-layout", "dp2-tp2-pp1"]),
        (4, ["--elastor-layout", "dp1-tp1-pp4", "--num-layers-per-virtual-pipeline-stage",
             "1"]),
        (4, ["--elastor-layout", str(hetero), "--use-distributed-optimizer"]),
        (4, ["--elastor-layout", str(hetero), *DISTOPT]),
        (4, ["--elastor-layout", str(hetero), TIED]),
        (4, ["--elastor-layout", str(hetero), "--sequence-parallel"]),
        (1, ["--elastor-ckpt-format", "zarr", "--ckpt-format", "torch"]),
        (1, ["--elastor-ckpt-keep", "-1"]),
        (4, ["--elastor-layout", "dp2-tp2-pp1", "--sequence-parallel",
             "--recompute-activations", *DISTOPT, NO_FFN]),
        (4, ["--elastor-layout", "dp2-tp1-pp2", "--recompute-granularity", "full",
             "--recompute-method", "uniform", "--recompute-num-layers", "2"]),
        (4, ["--elastor-layout", "dp1-tp4-pp1", "--sequence-parallel", "--seq-length", "30"]),
        (4, ["--elastor-layout", "dp2-tp1-pp2", "--recompute-granularity", "full",
             "--recompute-method", "uniform", "--recompute-num-layers", "3"]),
        (4, ["--elastor-layout", str(hetero), "--sequence-parallel", *DISTOPT,
             "--overlap-grad-reduce", "--overlap-param-gather"]),
        (4, ["--elastor-layout", str(hetero), "--fp16"]),
        (7, ["--elastor-layout", str(seven), "--global-batch-size", "16"]),
    ], tmp_path)
    (derived, with_batch, from_file, conflict, bad_batch, idle, virtual, distopt,
     distopt_reshardable, tied, sequence_parallel, ckpt_format, keep,
     memory, full_recompute, sp_seq_length, recompute_layers, overlap, fp16,
     seven_stages) = results
    # 8 layers on 7 TP-1 stages (what elastor launch plans on 7 small slots): Megatron-LM
    # validates the split the layout gives, not 8 layers divisible by 7
    assert {k: v for k, v in seven_stages.items() if k != "recipe"} == {
        "exit": 0, "tp": 1, "pp": 7, "dp": 1, "gbs": 16}, seven_stages
    # Megatron's default global batch (micro-batch x DP) for a shorthand; the file's
    # micro-batch counts otherwise; Megatron's validation passed on each.
    plain = {"ffn_hidden_size": 192, "params_dtype": "float32", "sequence_parallel": False,
             "distributed_optimizer": False, "recompute": [None, None, None]}
    assert derived == {"exit": 0, "tp": 2, "pp": 1, "dp": 2, "gbs": 2,
                       "recipe": {"parsed": plain, "validated": plain}}
    assert {k: v for k, v in with_batch.items() if k != "recipe"} == {
        "exit": 0, "tp": 2, "pp": 1, "dp": 2, "gbs": 16}
    assert {k: v for k, v in from_file.items() if k != "recipe"} == {
        "exit": 0, "tp": 2, "pp": 2, "dp": 2, "gbs": 16}
    # The recipe carries what the planner and Layout.validate need, the same before and
    # after Megatron's validation (which derives the FFN width and turns
    # --recompute-activations into selective recompute).
    assert memory["exit"] == 0, memory
    for when in ("parsed", "validated"):
        assert memory["recipe"][when] == {**plain, "ffn_hidden_size": 128,
                                          "sequence_parallel": True,
                                          "distributed_optimizer": True,
                                          "recompute": ["selective", None, None]}, memory
        assert full_recompute["recipe"][when]["recompute"] == ["full", "uniform", 2], \
            full_recompute
    assert sp_seq_length["exit"] == 2 and "does not divide model.seq_length=30" in \
        sp_seq_length["error"] and "sequence_parallel" in sp_seq_length["error"], sp_seq_length
    assert recompute_layers["exit"] == 2 and "recompute_num_layers=3" in \
        recompute_layers["error"], recompute_layers
    assert conflict["exit"] == 2 and "--tensor-model-parallel-size 1 conflicts with " \
        "--elastor-layout dp2-tp2-pp1" in conflict["error"], conflict
    assert bad_batch["exit"] == 2 and "micro_batches" in bad_batch["error"], bad_batch
    assert idle["exit"] == 2 and "uses 4 ranks but 8 were started" in idle["error"], idle
    assert virtual["exit"] == 2 and "virtual pipeline" in virtual["error"], virtual
    assert distopt["exit"] == 2 and "--use-distributed-optimizer on a heterogeneous " \
        "layout needs --dist-ckpt-optim-fully-reshardable" in distopt["error"], distopt
    assert distopt_reshardable["exit"] == 0, distopt_reshardable
    assert tied["exit"] == 0, tied
    # Megatron-LM turns --sequence-parallel off at the placeholder TP 1; the recipe (what
    # the planner and each TP > 1 stage read) keeps it.
    assert sequence_parallel["exit"] == 0 and sequence_parallel["tp"] == 1, sequence_parallel
    assert sequence_parallel["recipe"]["validated"]["sequence_parallel"], sequence_parallel
    assert overlap["exit"] == 0, overlap
    assert fp16["exit"] == 2 and "--fp16 on a heterogeneous layout" in fp16["error"], fp16
    assert ckpt_format["exit"] == 2 and "drop --ckpt-format torch" in ckpt_format["error"]
    assert keep["exit"] == 2 and "--elastor-ckpt-keep=-1" in keep["error"], keep


@pytest.mark.timeout(700)
def test_object_store_save_flags_through_megatron_parser(patched_megatron_lm, tmp_path):
    """``--save s3://`` only with the zarr format, and without Megatron-LM's local-only
    ``--save-retain-interval`` and ``--log-progress``: parser errors naming the fix."""
    url, zarr = f"s3://{BUCKET}/run", ["--elastor-ckpt-format", "zarr"]
    torch_dist, retain, progress = _check_args(patched_megatron_lm, [
        (1, ["--save", url, "--save-interval", "2"]),
        (1, [*zarr, "--save", url, "--save-interval", "2", "--save-retain-interval", "4"]),
        (1, [*zarr, "--save", url, "--save-interval", "2", "--log-progress"]),
    ], tmp_path)
    print("\n" + "\n".join(r["error"] for r in (torch_dist, retain, progress)))
    assert torch_dist["exit"] == 2 and "add --elastor-ckpt-format zarr" in torch_dist["error"]
    assert retain["exit"] == 2 and "use --elastor-ckpt-keep N" in retain["error"], retain
    assert progress["exit"] == 2 and "--log-progress" in progress["error"], progress
