"""Iteration time of Megatron-LM's loop on a heterogeneous layout with and without
each communication overlap, beside Megatron-LM's own uniform layout on the same ranks,
in one run (``docs/benchmarks.md``, "Megatron-LM's loop on a heterogeneous layout").

    MEGATRON_LM_DIR=.ci/megatron-lm-v0.16.1 python tools/bench_megatron_lm.py

Every configuration is the real patched ``pretrain_gpt.py`` under torchrun on 6 CPU
ranks with gloo and the CPU shims (``tests/pretrain_gpt_run.py``), the tiny Llama in
fp32, ``--sequence-parallel``, the same global batch and iterations. The time of an
iteration is Megatron-LM's own ``elapsed time per iteration`` (``--log-interval 1``);
the median over the iterations after ``--warmup`` is reported, and every configuration's
ratio to Megatron-LM's own TP2 x DP3 run with the same optimizer.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.pretrain_gpt_run import run_pretrain_gpt  # noqa: E402

LAYOUT = {"pipelines": [
    {"micro_batches": 5, "stages": [{"tp": 2, "layers": 4}, {"tp": 1, "layers": 2},
                                    {"tp": 2, "layers": 2}]},
    {"micro_batches": 7, "stages": [{"tp": 1, "layers": 8}]},
]}
"""6 ranks: ``[tp2 | tp1 | tp2]`` beside a one-stage TP1 pipeline (the tests' layout)."""
UNIFORM = ["--tensor-model-parallel-size", "2"]
"""Megatron-LM's own grid on the same 6 ranks: TP 2 x DP 3, no Elastor flag."""
SP = ["--sequence-parallel"]
DISTOPT = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
OVERLAP_GRAD = ["--overlap-grad-reduce"]
OVERLAP_PARAM = ["--overlap-param-gather"]
_TIME = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")

CONFIGS = (
    # name, uniform (Megatron's own grid) or heterogeneous, flags
    ("megatron TP2xDP3", True, SP),
    ("hetero", False, SP),
    ("hetero +overlap-grad-reduce", False, SP + OVERLAP_GRAD),
    ("megatron TP2xDP3 distopt", True, SP + DISTOPT),
    ("megatron TP2xDP3 distopt +both overlaps", True, SP + DISTOPT + OVERLAP_GRAD + OVERLAP_PARAM),
    ("hetero distopt", False, SP + DISTOPT),
    ("hetero distopt +overlap-grad-reduce", False, SP + DISTOPT + OVERLAP_GRAD),
    ("hetero distopt +both overlaps", False, SP + DISTOPT + OVERLAP_GRAD + OVERLAP_PARAM),
)


def iteration_times(stdout: str, warmup: int) -> list[float]:
    """Megatron-LM's ``elapsed time per iteration`` (s) after ``warmup`` iterations."""
    return [float(ms) / 1000 for it, ms in _TIME.findall(stdout) if int(it) > warmup]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12, help="iterations per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="iterations not timed")
    parser.add_argument("--global-batch-size", type=int, default=12)
    args = parser.parse_args(argv)
    megatron_lm = os.environ.get("MEGATRON_LM_DIR")
    if not megatron_lm:
        parser.error("set MEGATRON_LM_DIR to a Megatron-LM checkout (.ci/megatron-lm-v0.16.1)")
    work = Path(tempfile.mkdtemp(prefix="bench-megatron-lm-"))
    layout = work / "layout.yaml"
    layout.write_text(yaml.safe_dump(LAYOUT))
    common = ["--global-batch-size", str(args.global_batch_size), "--train-iters",
              str(args.iters)]
    results: dict[str, float] = {}
    for name, uniform, flags in CONFIGS:
        placement = UNIFORM if uniform else ["--elastor-layout", str(layout)]
        run = run_pretrain_gpt(Path(megatron_lm), 6, [*common, *placement, *flags],
                               work / name.replace(" ", "_"), timeout=1800, cold=True)
        if run.returncode:
            print(run.tail(), file=sys.stderr)
            return 1
        times = iteration_times(run.stdout, args.warmup)
        results[name] = statistics.median(times)
        print(f"{name:<42} median {results[name] * 1000:8.1f} ms over {len(times)} "
              f"iterations (min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f})",
              flush=True)
    print("\nratios (iteration time):")
    for name, uniform, flags in CONFIGS:
        reference = "megatron TP2xDP3 distopt" if "distopt" in name else "megatron TP2xDP3"
        base = "hetero distopt" if "distopt" in name else "hetero"
        line = f"  {name:<42} / {reference}: {results[name] / results[reference]:5.2f}"
        if not uniform and name != base:
            line += f";  / {base}: {results[name] / results[base]:5.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
