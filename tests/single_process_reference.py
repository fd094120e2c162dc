"""The uninterrupted single-process run that the recovery tests (``test_elastic``,
``test_elastic_nodes``) compare against, run once per session: a torchrun world costs
seconds of start-up, and the tiny recipe's constant learning rate makes the first N
steps of a longer run the N-step run itself."""

from pathlib import Path

from elastor_mcore.elastic.report import read_metrics
from tests.conftest import TINY, run_world

STEPS = 16
SAVE_INTERVAL = 8


def run_reference(out: Path) -> Path:
    """Train into ``out``: ``metrics.jsonl`` of STEPS steps on dp1-tp1-pp1 and ``ckpt/``
    with the weights after every SAVE_INTERVAL steps (all kept). The conftest's session
    fixture ``single_process_reference`` runs it once."""
    run_world(1, "elastor_mcore.elastic.rank.worker",
              ["--recipe", str(TINY), "--layout", "dp1-tp1-pp1", "--steps", str(STEPS),
               "--metrics-out", str(out / "metrics.jsonl"), "--save", str(out / "ckpt"),
               "--save-interval", str(SAVE_INTERVAL),
               "--keep-checkpoints", str(STEPS // SAVE_INTERVAL)])
    return out


def reference_losses(run: Path, steps: int) -> dict[int, float]:
    """The reference's loss of each step 1..``steps`` (``run``: ``run_reference``'s)."""
    assert steps <= STEPS, f"the reference runs {STEPS} steps, not {steps}"
    losses = {m["step"]: m["loss"] for m in read_metrics(run / "metrics.jsonl")}
    assert sorted(losses) == list(range(1, STEPS + 1)), sorted(losses)
    return {s: loss for s, loss in losses.items() if s <= steps}
