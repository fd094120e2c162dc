"""Test worker: ZeRO-1 cases in one torchrun world, plus the optimizer-state bytes.

Training cases are ``train_matrix``'s (``--case``, same syntax and outputs; the recipe
of a case says whether it runs the distributed optimizer). With ``--memory NAME``,
after case NAME trained, every rank writes ``<out>/<NAME>/memory.rank<r>.json``: what
``elastor train --report-memory`` prints for it (bytes of fp32 main parameters and
moments its optimizer holds, measured on its tensors; its parameter count; the
formula, ``12 * numel / replicas`` under ZeRO-1) and under ZeRO-1 the plan's owned
bytes.

With ``--native-check NAME``, after ZeRO-1 case NAME trained, every rank reduces the
last step's gradients again both ways (``DistributedOptimizer.reduce``: gloo's
all-reduce emulation, and ``reduce_scatter_tensor`` on the padded buffer, the NCCL
path) and writes how far they differ to ``<out>/<NAME>/native.rank<r>.json``.
"""

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from elastor_mcore.compat import cpu
from elastor_mcore.parallel.groups import GroupCache
from elastor_mcore.runtime.distributed_optimizer import DistributedOptimizer, planned_state_bytes
from elastor_mcore.runtime.train import optimizer_memory
from tests.workers.train_matrix import parse_case, run_case


def measure(runner, out: Path) -> None:
    """What ``--report-memory`` reports (``train.optimizer_memory``, collective), and
    under ZeRO-1 the plan's owned bytes."""
    rank = dist.get_rank()
    mine = next(m for m in optimizer_memory(runner) if m.rank == rank)
    report = {"state_bytes": mine.state_bytes, "params": mine.params,
              "formula_bytes": mine.expected_bytes, "sharded": mine.sharded}
    if isinstance(runner.optimizer, DistributedOptimizer):
        report["planned_bytes"] = planned_state_bytes(runner.optimizer.plan.buckets, rank)[0]
    (out / f"memory.rank{rank}.json").write_text(json.dumps(report))


def check_native(runner, out: Path) -> None:
    optimizer = runner.optimizer
    optimizer.reduce(native=False)
    emulated = [g.clone() for g in optimizer.owned_grads()]
    optimizer.reduce(native=True)
    native = optimizer.owned_grads()
    flat_e = torch.cat([g.reshape(-1) for g in emulated])
    flat_n = torch.cat([g.reshape(-1) for g in native])
    report = {"elements": flat_e.numel(), "differing": int((flat_e != flat_n).sum()),
              "max_abs_diff": float((flat_e - flat_n).abs().max()),
              "max_abs": float(flat_e.abs().max())}
    (out / f"native.rank{dist.get_rank()}.json").write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", action="append", default=[])
    parser.add_argument("--memory", action="append", default=[])
    parser.add_argument("--native-check", action="append", default=[])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cpu.apply()
    dist.init_process_group("gloo")
    cache = GroupCache()
    for spec in args.case:
        case = parse_case(spec)
        runner = run_case(case, None, cache, Path(args.out))
        if runner is not None and case["name"] in args.memory:
            measure(runner, Path(args.out) / case["name"])
        if runner is not None and case["name"] in args.native_check:
            check_native(runner, Path(args.out) / case["name"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
