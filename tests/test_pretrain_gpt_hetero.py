"""Heterogeneous layouts through Megatron-LM's own loop: the real patched
``pretrain_gpt.py`` under torchrun on CPU/gloo (``tests/pretrain_gpt_run.py``), with
``--elastor-layout`` file that varies TP per stage, layers per stage, stage counts and
micro-batch counts (``elastor_mcore/integrations/megatron_lm/training.py``).

Megatron-LM initialises weights differently under every layout, so every run starts
from one checkpoint: Megatron-LM's own run (no Elastor flag, 1 rank) saves ``torch_dist``
at iteration ``START`` and trains on to ``SAVE``; ``elastor convert --to zarr`` turns
that checkpoint into a zarr one, which the other runs resume with ``--elastor-layout``.
The uniform run resumed from it continues Megatron-LM's own losses to the log's print
precision (the same arithmetic); the heterogeneous run continues them, and the uniform
run's, to reduction order (fp32). Every run has the same ``--train-iters`` (one lr
schedule) and stops early with ``--exit-interval``.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path

import pytest
import yaml

from elastor_mcore.cli import main as elastor_cli
from tests.pretrain_gpt_run import PretrainRun, run_pretrain_gpt

GLOBAL_BATCH = 12
START, SAVE, ITERS = 2, 4, 5

LAYOUT_TWO_PIPELINES = {"pipelines": [
    {"micro_batches": 5, "stages": [{"tp": 2, "layers": 5}, {"tp": 1, "layers": 3}]},
    {"micro_batches": 7, "stages": [{"tp": 1, "layers": 2}, {"tp": 1, "layers": 3},
                                    {"tp": 1, "layers": 3}]},
]}
"""A ``[tp2 | tp1]`` pipeline beside a ``[tp1 | tp1 | tp1]`` one, uneven layers, 5 and 7
micro-batches (6 ranks)."""
FP32_RTOL = 2e-5
"""Reduction order only (the per-token sums and the cross-pipeline reduction add in
another order than DDP's average); measured 1.6e-7 relative on iterations 3-4 at
core_v0.16.1 (printed with ``-rP``)."""
PRINT_RTOL = 5e-7
"""Identical arithmetic, as far as the log shows it: Megatron-LM prints 7 significant
digits, and a resumed run's second loss is recovered from its printed mean
(``iteration_losses``), so equal losses agree to 2.5e-7 relative at worst."""
HANG_GUARD_S = 2400
"""Per test, for a loaded 2-core host (the first test runs two of the module's runs)."""
_VALIDATION = re.compile(r"validation loss at iteration\s+(\d+)[^|]*\| lm loss value: "
                         r"([-+0-9.eE]+)")
_CONSUMED = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+)")


def validation_losses(run: PretrainRun) -> dict[int, float]:
    return {int(i): float(v) for i, v in _VALIDATION.findall(run.stdout)}


def consumed_samples(run: PretrainRun) -> dict[int, int]:
    return {int(i): int(n) for i, n in _CONSUMED.findall(run.stdout)}


def relative_difference(run: dict[int, float], reference: dict[int, float],
                        iterations) -> float:
    missing = [i for i in iterations if i not in run or i not in reference]
    assert not missing, f"no loss logged for iterations {missing}"
    return max(abs(run[i] - reference[i]) / abs(reference[i]) for i in iterations)


class Runner:
    """Runs in one work directory, each saving zarr checkpoints there; each must succeed."""

    def __init__(self, megatron_lm_dir: Path, workdir: Path, tied_embeddings: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.megatron_lm_dir, self.workdir = megatron_lm_dir, workdir
        self.tied_embeddings, self.env = tied_embeddings, env or {}

    def layout_file(self, name: str, layout: dict) -> str:
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(layout))
        return str(path)

    def __call__(self, name: str, nproc: int, layout: str, *args: str) -> PretrainRun:
        return self.megatron(name, nproc, "--elastor-layout", layout,
                             "--elastor-ckpt-format", "zarr", "--save-interval", "1000",
                             *args)

    def megatron(self, name: str, nproc: int, *args: str) -> PretrainRun:
        """A run with Megatron-LM's flags only (torch_dist saves) and ``args``."""
        run = run_pretrain_gpt(
            self.megatron_lm_dir, nproc,
            ["--global-batch-size", str(GLOBAL_BATCH), "--save", str(self.workdir / name),
             *args], self.workdir / f"{name}.run", timeout=900,
            env={key: value.format(name=name) for key, value in self.env.items()},
            tied_embeddings=self.tied_embeddings)
        assert run.returncode == 0, run.tail()
        assert not any(run.skipped), f"{name}: skipped iterations\n{run.tail()}"
        return run

    def convert(self, name: str, step: int, into: str) -> None:
        """``elastor convert --to zarr`` of run ``name``'s iteration ``step`` into a new
        --load directory ``into`` (the CLI's entry point, in this process: no second
        start-up of torch)."""
        iteration = f"iter_{step:07d}"
        target = self.workdir / into
        assert elastor_cli([
            "convert", str(self.workdir / name / iteration), str(target / iteration),
            "--to", "zarr"]) == 0
        (target / "latest_checkpointed_iteration.txt").write_text(str(step))

    def resume(self, name: str, nproc: int, layout: str, load: str, step: int,
               *args: str) -> PretrainRun:
        return self(name, nproc, layout, "--load", str(self.workdir / load),
                    "--ckpt-step", str(step), *args)


EVAL = ["--eval-iters", "1", "--eval-interval", "2"]


class Runs:
    """The module's runs, each started when a test first needs it (``-k`` selects a
    subset without paying for the rest)."""

    def __init__(self, run: Runner) -> None:
        self.run = run
        self.two = run.layout_file("two_pipelines", LAYOUT_TWO_PIPELINES)
        self.iters = ["--train-iters", str(ITERS)]

    @cached_property
    def megatron(self) -> PretrainRun:
        """Megatron-LM's own run: torch_dist at ``START`` (and ``SAVE``), then ``SAVE``
        iterations, converted to zarr at ``START``."""
        run = self.run.megatron("megatron", 1, *self.iters, "--save-interval", str(START),
                                "--exit-interval", str(SAVE))
        self.run.convert("megatron", START, "converted")
        return run

    @cached_property
    def uniform(self) -> PretrainRun:
        assert self.megatron
        return self.run.resume("uniform", 1, "dp1-tp1-pp1", "converted", START,
                               *self.iters, *EVAL)

    @cached_property
    def two_pipelines(self) -> PretrainRun:
        assert self.megatron
        return self.run.resume("two_pipelines", 6, self.two, "converted", START,
                               *self.iters, *EVAL, "--exit-interval", str(SAVE))


@pytest.fixture(scope="module")
def fp32(patched_megatron_lm, megatron_lm_dir, tmp_path_factory) -> Runs:
    return Runs(Runner(megatron_lm_dir, tmp_path_factory.mktemp("hetero_fp32")))


@pytest.mark.timeout(HANG_GUARD_S)
def test_converted_megatron_checkpoint_resumes_megatron_losses(fp32):
    """Megatron-LM's own torch_dist checkpoint, converted to zarr and resumed at the
    same layout through the zarr load, continues Megatron-LM's uninterrupted run."""
    reference, run = fp32.megatron.losses, fp32.uniform.losses
    steps = range(START + 1, SAVE + 1)
    assert fp32.uniform.logged[START + 1] == fp32.megatron.logged[START + 1]
    difference = relative_difference(run, reference, steps)
    print(f"uniform resumed from the converted checkpoint: iterations {list(steps)} differ "
          f"from Megatron-LM's own run by {difference:.2e} relative (tolerance "
          f"{PRINT_RTOL:.0e})")
    assert difference <= PRINT_RTOL, (run, reference)


@pytest.mark.timeout(HANG_GUARD_S)
def test_fp32_losses_match_the_uniform_run(fp32):
    """The heterogeneous layout resumed from the converted Megatron-LM checkpoint
    continues both the uniform resumed run and Megatron-LM's uninterrupted one."""
    run = fp32.two_pipelines.losses
    steps = range(START + 1, SAVE + 1)
    assert max(run) == SAVE, run
    for name, reference in (("uniform", fp32.uniform.losses),
                            ("megatron", fp32.megatron.losses)):
        difference = relative_difference(run, reference, steps)
        print(f"two_pipelines: iterations {list(steps)} differ from the {name} run by "
              f"{difference:.2e} relative (tolerance {FP32_RTOL:.0e})")
        assert difference <= FP32_RTOL, (name, run, reference)


@pytest.mark.timeout(HANG_GUARD_S)
def test_fp32_consumed_samples_and_evaluation(fp32):
    """Each step consumes one global batch; the validation loss (forward-only schedule)
    on the heterogeneous layout matches the uniform run's at the same iteration."""
    run = fp32.two_pipelines
    assert consumed_samples(run) == {i: i * GLOBAL_BATCH for i in range(START + 1, SAVE + 1)}
    reference, losses = validation_losses(fp32.uniform), validation_losses(run)
    assert relative_difference(losses, reference, [SAVE]) <= FP32_RTOL, (losses, reference)
