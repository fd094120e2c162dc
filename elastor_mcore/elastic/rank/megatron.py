"""Entry point of every rank of a Megatron-LM job under the launcher (``elastic.megatron``
builds the command):

    torchrun ... -m elastor_mcore.elastic.rank.megatron <settings> -- <pretrain_gpt.py flags>

It arms the parent-death signal, watches Megatron-LM's loop through the integration's
hooks (``MegatronHooks``, the installation's ``LoopObserver``: the heartbeats and events
the trainer's ranks write, a metrics line per iteration from the rank that logs the
loss, the failure plan's injections) and runs ``pretrain_gpt.py`` in this process, as
``python pretrain_gpt.py <flags>`` would.

A rank of a multi-node round (the node launcher's flags present) first agrees on the
round's layout with the others (``rendezvous_round.agree``). Megatron-LM needs work on
every rank of its world, so the ranks the layout holds then leave the round's world for
one of their own (``sub_world``), renumbered so that the highest holds a last stage;
the others idle until the run is over.
"""

from __future__ import annotations

import time

STARTED_AT = time.time()
"""When this worker began (before its imports): the relaunch phase starts here."""

import argparse
import json
import logging
import os
import runpy
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from elastor_mcore.compat.process import die_with_parent
from elastor_mcore.config.failure_plan import load_failure_plan
from elastor_mcore.config.launch import MegatronSettings, RoundSettings
from elastor_mcore.elastic.job import renumbered
from elastor_mcore.elastic.megatron import MegatronLM, from_settings
from elastor_mcore.elastic.rank.hooks import ElasticHooks
from elastor_mcore.elastic.rank.rendezvous_round import (
    NodeContext, RoundPlan, agree, mark_done, record_round, wait_done, write_outcome)
from elastor_mcore.integrations.megatron_lm.installation import LoopObserver
from elastor_mcore.parallel.layout import Layout, layout_from_dict
from elastor_mcore.planner import load_hardware

log = logging.getLogger(__name__)


class MegatronHooks(ElasticHooks, LoopObserver):
    """The trainer's elastic hooks, fed by Megatron-LM's loop; the reporting rank also
    writes ``{step, loss, time_s}`` per iteration to ``metrics_out``."""

    def __init__(self, settings: MegatronSettings, rank: int, reporter: bool) -> None:
        slot = settings.rank_slots[rank] if settings.rank_slots else rank
        failures = load_failure_plan(settings.failure_plan) if settings.failure_plan else ()
        super().__init__(settings.elastic_dir, rank, slot, failures)
        self.metrics = settings.metrics_out if reporter else None

    def loaded(self, iteration: int, load_s: float) -> None:
        self.ready(iteration, load_s)

    def iteration_start(self, iteration: int) -> None:
        self.step_start(iteration)

    def iteration_end(self, iteration: int, loss: float | None, time_s: float) -> None:
        self.step_end(iteration)
        if self.metrics and loss is not None:
            with open(self.metrics, "a") as out:
                out.write(json.dumps({"step": iteration, "loss": loss, "time_s": time_s})
                          + "\n")


def run_pretrain(settings: MegatronSettings, megatron_argv: Sequence[str], rank: int,
                 world_size: int) -> None:
    """``pretrain_gpt.py`` with ``megatron_argv`` in this process, watched by
    ``MegatronHooks`` (the highest rank reports: Megatron-LM logs the loss there)."""
    from elastor_mcore.integrations.megatron_lm.args import install_hooks

    script = Path(settings.script)
    sys.path.insert(0, str(script.parent))  # as `python pretrain_gpt.py` has it
    sys.argv = [str(script), *megatron_argv]
    install_hooks().observer = MegatronHooks(settings, rank, rank == world_size - 1)
    runpy.run_path(str(script), run_name="__main__")


def parse_args(argv: Sequence[str]) -> tuple[MegatronSettings, RoundSettings | None, list[str]]:
    """The launcher's settings, the node launcher's (None for a launch on one host) and
    the flags of ``pretrain_gpt.py`` (after ``--``)."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ours, megatron_argv = argv[:split], argv[split + 1:]
    in_round = "--node-name" in ours
    parser = argparse.ArgumentParser(prog="elastor_mcore.elastic.rank.megatron")
    MegatronSettings.add_arguments(parser, "megatron-worker")
    if in_round:
        RoundSettings.add_arguments(parser, "node-worker")
    args = parser.parse_args(ours)
    return (MegatronSettings.from_args(args, "megatron-worker"),
            RoundSettings.from_args(args, "node-worker") if in_round else None,
            megatron_argv)


@dataclass(frozen=True)
class SubWorld:
    """The world Megatron-LM runs in during a round: the layout's ranks only."""

    rank: int | None
    """This rank in it (None: idle this round)."""
    size: int
    master: tuple[str, int]
    """Its rank 0's host and a free port there, for ``MASTER_ADDR``/``MASTER_PORT``."""
    slots: tuple[int, ...]
    """The local slot of each of its ranks (on its own node)."""
    layout: Layout
    """The round's layout on the new ranks."""


def sub_world(plan: RoundPlan, workload: MegatronLM) -> SubWorld:
    """Agree, inside the round's world, on Megatron-LM's world: the layout's ranks in
    ``workload.rank_order``."""
    layout = layout_from_dict(plan.layout)
    order = workload.rank_order(layout)
    new_rank = {old: new for new, old in enumerate(order)}
    with socket.socket() as s:  # a free port, in case this rank becomes the new rank 0
        s.bind(("", 0))
        port = s.getsockname()[1]
    addresses: list = [None] * dist.get_world_size()
    dist.all_gather_object(addresses, (socket.getfqdn(), port))
    slot_of = {m.rank: m.slot for m in plan.members}
    return SubWorld(new_rank.get(dist.get_rank()), len(order), addresses[order[0]],
                    tuple(slot_of[r] for r in order), renumbered(layout, order))


def run_round(settings: MegatronSettings, node: RoundSettings,
              megatron_argv: Sequence[str]) -> None:
    """One rendezvous round: agree, then run Megatron-LM in the layout's world or idle."""
    ctx = NodeContext(node)
    workload = from_settings(settings, megatron_argv)
    dist.init_process_group("gloo")
    try:
        plan = agree(ctx, workload, workload.recipe, load_hardware(settings.hardware),
                     settings.checkpoint_dir, node.use_all_slots, STARTED_AT)
        record_round(ctx, plan)
        world = sub_world(plan, workload) if plan.layout is not None else None
    finally:
        dist.destroy_process_group()
    if world is None:
        write_outcome(ctx, False, plan.reason)
        return
    out = ctx.round_dir(plan.round)
    out.mkdir(parents=True, exist_ok=True)
    if world.rank is not None:
        layout = out / "layout.yaml"
        tmp = out / f".layout.{os.getpid()}.yaml"  # every rank writes the same content
        tmp.write_text(world.layout.to_yaml())
        os.replace(tmp, layout)
        # torch.distributed's env:// rendezvous for Megatron-LM: our own store, not the
        # elastic agent's
        os.environ.update(RANK=str(world.rank), WORLD_SIZE=str(world.size),
                          MASTER_ADDR=world.master[0], MASTER_PORT=str(world.master[1]),
                          TORCHELASTIC_USE_AGENT_STORE="False")
        rank_settings = replace(settings, elastic_dir=str(out),
                                metrics_out=str(out / "metrics.jsonl"), rank_slots=world.slots)
        run_pretrain(rank_settings, workload.megatron_argv(
            str(layout), settings.checkpoint_dir, plan.resumed_from), world.rank, world.size)
        if world.rank == world.size - 1:
            mark_done(ctx, plan.round)
    wait_done(ctx, plan.round)
    write_outcome(ctx, True, f"finished {workload.steps} iterations in round {plan.round}")


@record
def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("ELASTOR_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(name)s: %(message)s")
    die_with_parent()  # if torchrun or the agent is SIGKILLed, no rank trains on unseen
    settings, node, megatron_argv = parse_args(sys.argv[1:] if argv is None else argv)
    if node is not None:
        run_round(settings, node, megatron_argv)
        return 0
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_pretrain(settings, megatron_argv, rank, world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
