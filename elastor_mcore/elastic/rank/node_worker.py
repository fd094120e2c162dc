"""Entry point of every rank of a multi-node job: torch's elastic agent starts it on
each node at every rendezvous round (``elastic.node`` builds the command).

The round's ranks agree on a layout (``rendezvous_round``), train it from the latest
committed checkpoint, or idle when the layout leaves their device out. The end of the
job (finished, or given up because the healthy devices cannot hold the model) goes to
the node's ``outcome.json`` for its launcher; either way the ranks exit 0, so torch
does not restart a round that cannot do better.
"""

from __future__ import annotations

import time

STARTED_AT = time.time()
"""When this worker began (before its imports): the relaunch phase starts here."""

import argparse
import logging
import os
import sys
import warnings
from dataclasses import replace

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from elastor_mcore.compat.process import die_with_parent
from elastor_mcore.config.launch import RoundSettings
from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.config.run import RunSettings
from elastor_mcore.elastic.job import Trainer
from elastor_mcore.elastic.rank.hooks import from_settings
from elastor_mcore.elastic.rank.rendezvous_round import (
    NodeContext, RoundPlan, agree, mark_done, record_round, wait_done, write_outcome)
from elastor_mcore.elastic.rank.worker import MetricsPrinter, init_distributed
from elastor_mcore.parallel.layout import layout_from_dict
from elastor_mcore.planner import load_hardware
from elastor_mcore.runtime.hooks import StepHooks
from elastor_mcore.runtime.train import Prediction, RunConfig, train


def parse_args(argv: list[str] | None = None) -> tuple[RunSettings, RoundSettings]:
    """The run settings (the round plans the layout) and the node launcher's."""
    parser = argparse.ArgumentParser(prog="elastor_mcore.elastic.rank.node_worker")
    RunSettings.add_arguments(parser, "worker", {"layout": {"required": False}})
    RoundSettings.add_arguments(parser, "node-worker")
    args = parser.parse_args(argv)
    return RunSettings.from_args(args, "worker"), RoundSettings.from_args(args, "node-worker")


def run_round(ctx: NodeContext, settings: RunSettings, plan: RoundPlan, recipe) -> None:
    """Train this round's layout on the ranks it holds; the others idle."""
    out = ctx.round_dir(plan.round)
    out.mkdir(parents=True, exist_ok=True)
    layout = layout_from_dict(plan.layout)
    if ctx.local_rank == 0:
        (out / "layout.yaml").write_text(layout.to_yaml())
    rank = dist.get_rank()
    active = plan.active(rank)
    settings = replace(
        settings, layout=str(out / "layout.yaml"), metrics_out=str(out / "metrics.jsonl"),
        load_dir=settings.save_dir if plan.resumed_from is not None else None,
        elastic_dir=str(out), rank_slots=tuple(m.slot for m in plan.members))
    reporter = rank == min(layout.ranks)
    prediction = Prediction(plan.predicted_step_s, settings.hardware) \
        if plan.predicted_step_s is not None else None
    printer = MetricsPrinter(settings.metrics_out, prediction) if reporter else None
    try:
        train(RunConfig(recipe, layout, settings, on_step=printer,
                        hooks=from_settings(settings, rank) if active else StepHooks()))
    finally:
        if printer:
            printer.close()
    if reporter:
        mark_done(ctx, plan.round)
    wait_done(ctx, plan.round)


@record
def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=os.environ.get("ELASTOR_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(name)s: %(message)s")
    die_with_parent()  # if the agent is SIGKILLed, no rank trains on unseen
    settings, round_settings = parse_args(argv)
    ctx = NodeContext(round_settings)
    recipe = load_recipe(settings.recipe)
    init_distributed()
    try:
        plan = agree(ctx, Trainer(settings), recipe, load_hardware(settings.hardware),
                     settings.save_dir, round_settings.use_all_slots, STARTED_AT)
        record_round(ctx, plan)
        if plan.layout is None:
            write_outcome(ctx, False, plan.reason)
            return 0
        run_round(ctx, settings, plan, recipe)
        write_outcome(ctx, True, f"finished {settings.steps} steps in round {plan.round}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
