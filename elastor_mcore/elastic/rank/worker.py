"""Entry point of every training rank: ``torchrun ... -m elastor_mcore.elastic.rank.worker``.

``elastor train``, ``elastor demo`` and the supervisor (``elastic.job.Trainer``)
validate everything and then start this module through torchrun, with the argv of the
run settings (``RunSettings.to_argv("worker")``); it is not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import statistics
import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from elastor_mcore.compat import cpu
from elastor_mcore.compat.process import die_with_parent
from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.config.run import RunSettings
from elastor_mcore.elastic.protocol import EVENTS_FILE, append_event
from elastor_mcore.elastic.rank.hooks import ElasticHooks, from_settings
from elastor_mcore.elastic.rank.inplace import InPlaceRecovery
from elastor_mcore.parallel.layout import load_layout
from elastor_mcore.planner import measured_step_s
from elastor_mcore.runtime.memory import memory_table, startup_table
from elastor_mcore.runtime.train import (Prediction, RunConfig, StepMetrics, device_for_rank,
                                         predict_step, train)


def parse_args(argv: list[str] | None = None) -> RunSettings:
    parser = argparse.ArgumentParser(prog="elastor_mcore.elastic.rank.worker")
    RunSettings.add_arguments(parser, "worker")
    return RunSettings.from_args(parser.parse_args(argv), "worker")


def init_distributed() -> None:
    """NCCL on CUDA (one device per local rank), gloo on CPU with mcore's CPU shims."""
    device = device_for_rank()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        cpu.apply()
        dist.init_process_group("gloo")


class MetricsPrinter:
    """Prints one line per step and appends JSON lines to ``--metrics-out``.

    Save figures: the time a save blocked training (``save 0.012s``) and, for a step
    that began while a save was still being written in the background, its overhead
    over the median of the last ``QUIET_WINDOW`` steps that ran without one
    (``bg-save +8%``; a recent median, so that slow first steps do not hide it).
    """

    QUIET_WINDOW = 5

    def __init__(self, path: str | None, prediction: Prediction | None = None,
                 fresh: bool = True) -> None:
        self.path = path
        self.file = open(path, "w") if path and fresh else None
        """Opened (appending) at the first step reported: a rank that becomes the
        reporting rank after a recovery in place continues the file."""
        self.quiet: collections.deque[float] = collections.deque(maxlen=self.QUIET_WINDOW)
        self.prediction = prediction
        self.times: list[float] = []
        if prediction:
            print(f"planner: {prediction.step_s:.3f}s per step predicted for this layout "
                  f"(profile {prediction.profile})", flush=True)

    def __call__(self, m: StepMetrics) -> None:
        record = {"step": m.step, "loss": m.loss, "grad_norm": m.grad_norm, "lr": m.lr,
                  "time_s": m.time_s, "data_wait_s": m.data_wait_s,
                  "save_block_s": m.save_block_s,
                  "save_in_flight": m.save_in_flight,
                  "predicted_s": self.prediction.step_s if self.prediction else None}
        self.times.append(m.time_s)
        line = (f"step {m.step:5d}  loss {m.loss:.6f}  grad_norm {m.grad_norm:.4f}  "
                f"time {m.time_s:.3f}s")
        if m.save_in_flight:
            if self.quiet:
                overhead = m.time_s / statistics.median(self.quiet) - 1
                record["save_overhead"] = overhead
                line += f"  bg-save {overhead:+.0%}"
            else:
                line += "  bg-save"
        else:
            self.quiet.append(m.time_s)
        if m.save_block_s is not None:
            line += f"  save {m.save_block_s:.3f}s"
        print(line, flush=True)
        if self.path and self.file is None:
            self.file = open(self.path, "a")
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        """Close the metrics file; print the measured median beside the prediction."""
        measured = measured_step_s(self.times)
        if measured is not None:
            line = f"step time: {measured:.3f}s measured (median of the steps after the first)"
            if self.prediction:
                line += (f", {self.prediction.step_s:.3f}s predicted by the planner "
                         f"({measured / self.prediction.step_s - 1:+.0%})")
            print(line, flush=True)
        if self.file:
            self.file.close()


def print_memory(reports) -> None:
    """``--report-memory``: one line per rank, then the total."""
    how = ("sharded (ZeRO-1), formula 12 B/param / replicas" if reports[0].sharded
           else "unsharded, formula 12 B/param")
    print(f"optimizer state (fp32 main params + Adam moments) per rank, {how}:", flush=True)
    for m in reports:
        print(f"  rank {m.rank:3d}  {m.params:12,d} params  {m.state_bytes:15,d} B  "
              f"(formula {m.expected_bytes:15,.0f} B)", flush=True)
    print(f"  total {sum(m.state_bytes for m in reports):,d} B", flush=True)


def print_peak_memory(reports) -> None:
    """``--report-memory``, after the first step: ``memory.memory_table``, and the
    start-up against it (``memory.startup_table``)."""
    for line in (*memory_table(reports), *startup_table(reports, "step 1")):
        print(line, flush=True)


def peak_memory_reporter(settings: RunSettings) -> Callable[[list], None]:
    """``print_peak_memory``; under the supervisor (``elastic_dir``) also a ``memory``
    event with every rank's measured and predicted bytes, which ``elastor demo``'s
    report holds against the slots' memory."""
    def report(reports) -> None:
        print_peak_memory(reports)
        if settings.elastic_dir:
            append_event(
                Path(settings.elastic_dir) / EVENTS_FILE, "memory",
                ranks=[{"rank": m.rank, "where": m.where, "measured": asdict(m.measured),
                        "predicted": asdict(m.predicted) if m.predicted else None,
                        "rss_peak": m.rss_peak} for m in reports])
    return report


@record
def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=os.environ.get("ELASTOR_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(name)s: %(message)s")
    die_with_parent()  # if torchrun is SIGKILLed, no rank trains on unseen
    settings = parse_args(argv)
    recipe = load_recipe(settings.recipe)
    layout = load_layout(settings.layout, recipe)
    init_distributed()
    reporter = dist.get_rank() == min(layout.ranks)
    printer = MetricsPrinter(settings.metrics_out,
                             predict_step(settings, recipe, layout) if reporter else None,
                             fresh=reporter)
    hooks = from_settings(settings, dist.get_rank())
    recovery = InPlaceRecovery.from_settings(settings, recipe, hooks) \
        if isinstance(hooks, ElasticHooks) and settings.recovery == "in-place" else None
    try:
        train(RunConfig(recipe, layout, settings, on_step=printer, on_memory=print_memory,
                        on_peak_memory=peak_memory_reporter(settings), hooks=hooks,
                        recovery=recovery))
    finally:
        printer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
