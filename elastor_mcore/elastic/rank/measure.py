"""Measure what the planner's cost model needs on the machine at hand: the torchrun
entry point of ``elastor profile`` (``python -m elastor_mcore.elastic.rank.measure``,
started by ``elastic.profiling.measure`` with its flags, ``config.profile``).

Everything is timed on the runtime's own stages (``train.setup_stage``: mcore's
GPTModel under the rank's TP group, with the loop's optimizer), one stage at a time
while every other rank waits in a barrier (which sleeps, so the stage measured has the
cores to itself):

* per TP degree, forward + backward of one micro-batch on four stage kinds: a single
  stage (embedding and output layer) with 1 and 4 layers, and the first and last stage
  of two-stage pipelines split 1|3 and 3|1. Per-layer time is the slope over the
  layer counts; the embedding, the output layer and a stage's own overhead are the
  intercepts (``planner.calibration`` solves for them);
* per stage, the CPU time its TP group spends (a rank waiting in a collective spends
  little), the bytes autograd saves for backward per micro-batch, the bytes of
  parameters, gradients and optimizer state, and the optimizer step's time;
* P2P ping-pong at two message sizes between two ranks of one node and, under a
  multi-node launch, two ranks of different nodes (told apart by torchrun's
  ``GROUP_RANK``, the node's rank); all-reduce over 2.. ranks of one node;
* the 1F1B hand-off: the runtime's own schedule and communicator on a two-stage
  pipeline of stages that do no work, at a small message (the time per micro-batch
  is what a boundary adds to a stage: posting the exchange, the message, waking the
  receiver);
* how many slots compute at full speed at once: single-layer steps on one slot alone,
  then on 2, 3, .. slots together (training runs keep that many busy).

Each figure is the median of its repetitions (of the TP group's slowest rank: ``robust_ms``),
taken in turn with the other figures of its kind so that a change in the machine's
load shifts them alike, with its spread; a kind whose worst spread exceeds
``--max-spread`` is measured again (``ATTEMPTS`` in all) and, if it still does, named
in the raw figures' ``unstable`` list (``elastor profile`` then refuses). Rank 0 writes them
as JSON (``--out``); ``planner.calibration`` turns them into a hardware profile
(``elastor profile`` does, or, with ``--profile-out``, rank 0 itself: the way to
profile under a multi-node launch, one torchrun agent per node)::

    torchrun --nnodes 2 --node-rank N --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint HOST:PORT -m elastor_mcore.elastic.rank.measure \
        --recipe R --tp-sizes 1 --out raw.json --hardware BASE --profile-out P.yaml
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist

from elastor_mcore.compat.process import die_with_parent
from elastor_mcore.config.profile import MeasureSettings
from elastor_mcore.config.recipe import Recipe, load_recipe
from elastor_mcore.elastic.rank.worker import init_distributed
from elastor_mcore.parallel.groups import GroupCache, install
from elastor_mcore.parallel.layout import Layout, layout_from_dict
from elastor_mcore.planner import load_hardware, write_hardware
from elastor_mcore.planner.calibration import (link_profile, measured_profile, provenance,
                                               robust, unstable)
from elastor_mcore.runtime.memory import SavedTensorMeter
from elastor_mcore.runtime.p2p import StageCommunicator, stage_links
from elastor_mcore.runtime.schedule import run_1f1b
from elastor_mcore.runtime.train import StageRunner, device_for_rank, setup_stage

log = logging.getLogger(__name__)

LOW, HIGH = 1, 4
"""Layer counts of the single-stage measurements; the two-stage pipelines hold
``HIGH`` layers split 1|3 and 3|1."""
SEED = 1234
WARMUP = 2
MICRO_BATCHES = 4
"""Micro-batches per timed repetition of a stage: back to back, as in the loop (a TP
group's ranks then stay awake between collectives); figures are per micro-batch."""
ATTEMPTS = 3
"""Measurements of one kind of figure before its spread is given up on."""
HANDOFF_BYTES = 256
HANDOFF_MICRO_BATCHES = 8
"""Messages of the hand-off measurement (256 bytes) and micro-batches per repetition."""


def stage_kinds() -> list[tuple[str, int, list[int]]]:
    """(name, layers of the measured model, layers per stage) of each measured layout."""
    return [("single", LOW, [LOW]), ("single", HIGH, [HIGH]),
            ("pair", HIGH, [1, HIGH - 1]), ("pair", HIGH, [HIGH - 1, 1])]


def measurement_layout(tp: int, stage_layers: list[int], micro_batches: int) -> Layout:
    """One pipeline of TP-``tp`` stages on ranks 0.. (idle ranks above)."""
    stages = [{"tp": tp, "layers": n, "ranks": list(range(i * tp, (i + 1) * tp))}
              for i, n in enumerate(stage_layers)]
    return layout_from_dict({"pipelines": [{"micro_batches": micro_batches, "stages": stages}]})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StageBench:
    """Forward + backward of one micro-batch on a rank's stage, as the loop runs it
    (input activation on later stages, output gradient on earlier ones)."""

    def __init__(self, runner: StageRunner, recipe: Recipe) -> None:
        self.runner = runner
        groups, device = runner.groups, runner.device
        b, s = recipe.training.micro_batch_size, recipe.model.seq_length
        generator = torch.Generator().manual_seed(SEED)
        vocab = recipe.model.vocab_size
        self.tokens = torch.randint(0, vocab, (b, s), generator=generator).to(device)
        self.labels = torch.randint(0, vocab, (b, s), generator=generator).to(device)
        dtype = next(runner.model.parameters()).dtype
        shape = (s, b, recipe.model.hidden_size)
        self.hidden = torch.randn(shape, generator=generator).to(device, dtype)
        self.grad = (torch.randn(shape, generator=generator) * 1e-3).to(device, dtype)
        self.first, self.last = groups.is_first_stage, groups.is_last_stage
        self.tokens_per_batch = b * s

    def forward(self) -> torch.Tensor:
        model, runner = self.runner.model, self.runner
        if not self.first:
            model.set_input_tensor(self.hidden.clone().requires_grad_(True))
        return model(self.tokens if self.first else None, runner.positions,
                     attention_mask=runner.mask, labels=self.labels if self.last else None)

    def backward(self, out: torch.Tensor) -> None:
        if self.last:
            (out.float().sum() / self.tokens_per_batch).backward()
        else:
            torch.autograd.backward(out, grad_tensors=self.grad)

    def step(self) -> None:
        self.backward(self.forward())

    def micro_batches(self) -> None:
        """``MICRO_BATCHES`` steps back to back, as the loop runs a stage's share."""
        for _ in range(MICRO_BATCHES):
            self.step()

    def saved_bytes(self) -> int:
        """Bytes autograd keeps for backward during one forward, as ``--report-memory``
        counts them (each storage once; the parameters it saves are the state's)."""
        with SavedTensorMeter(self.runner.model) as meter:
            out = self.forward()
        self.backward(out)
        return meter.peak

    def state_bytes(self) -> int:
        """Weights, fp32 gradients and optimizer state (fp32 main parameters and moments,
        made by one step) of the stage on this rank."""
        self.runner.optimizer.step()
        params = list(self.runner.model.parameters())
        grads = sum(p.numel() * 4 for p in params)
        low_precision = sum(p.numel() * p.element_size() for p in params
                            if p.dtype != torch.float32)  # fp32 weights are the main copy
        return low_precision + grads + self.runner.optimizer.state_nbytes()


def timed_once(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes (device work included)."""
    return timed_with_cpu(fn, device)[0]


def timed_with_cpu(fn: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(wall, CPU) seconds of one call of ``fn``; CPU counts all of this process's
    threads (gloo's included)."""
    sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    return time.perf_counter() - start, time.process_time() - cpu_start


def robust_ms(times: list[float], group) -> tuple[float, float]:
    """(median ms, spread) over the repetitions of the slowest rank of ``group`` (None:
    the world) in each. The median, not the fastest repetition: a training run's steps
    see the machine as it usually is, and the fastest of a few repetitions moved by
    half between runs on the same idle machine."""
    tensor = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    median, spread = robust(tensor.tolist())
    return median * 1e3, spread


def group_cpu_ms(cpu_times: list[float], group) -> float:
    """The CPU time ``group`` spends on one repetition: each rank's median, summed."""
    tensor = torch.tensor([robust(cpu_times)[0]], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return float(tensor) * 1e3


def worst_spread(spreads: list[float]) -> float:
    """The largest spread any rank holds (every rank gets the same answer)."""
    tensor = torch.tensor([max(spreads, default=0.0)], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def until_stable(what: str, measure: Callable[[], list[dict]], max_spread: float,
                 progress: Callable[[str], None]) -> list[dict]:
    """``measure()`` (records with a ``spread``) again while the worst spread exceeds
    ``max_spread``, ``ATTEMPTS`` times at most; the last attempt's records."""
    for attempt in range(1, ATTEMPTS + 1):
        records = measure()
        worst = worst_spread([r["spread"] for r in records])
        if worst <= max_spread:
            return records
        if attempt < ATTEMPTS:
            progress(f"{what}: repetitions disagree by up to {worst:.0%} (bound "
                     f"{max_spread:.0%}); measuring again ({attempt + 1}/{ATTEMPTS})")
    progress(f"{what}: repetitions still disagree by up to {worst:.0%} after {ATTEMPTS} "
             f"attempts (bound {max_spread:.0%})")
    return records


def optimizer_times(bench: StageBench, repeats: int) -> list[float]:
    """Seconds of each optimizer step of the stage (on the last step's gradients)."""
    step = bench.runner.optimizer.step
    for _ in range(WARMUP):
        step()
    return [timed_once(step, bench.runner.device) for _ in range(repeats)]


def build_stages(recipe: Recipe, tp_sizes: list[int], cache: GroupCache
                 ) -> list[tuple[int, str, int, StageBench | None]]:
    """(TP, role, layers, this rank's bench or None) of every measured stage."""
    micro = recipe.training.total_micro_batches
    slots: list[tuple[int, str, int, StageBench | None]] = []
    for tp in tp_sizes:
        for kind, num_layers, stage_layers in stage_kinds():
            measured = replace(recipe, model=replace(recipe.model, num_layers=num_layers))
            runner = setup_stage(measured, measurement_layout(tp, stage_layers, micro), SEED,
                                 cache)
            for stage, layers in enumerate(stage_layers):
                role = "single" if kind == "single" else "first" if stage == 0 else "last"
                mine = runner is not None and runner.groups.position.stage == stage
                slots.append((tp, role, layers, StageBench(runner, measured) if mine else None))
    return slots


def measure_stages(recipe: Recipe, tp_sizes: list[int], repeats: int, cache: GroupCache,
                   progress: Callable[[str], None], max_spread: float) -> list[dict]:
    """One record per (TP, layout, stage): forward+backward ms, its spread, bytes.
    Every stage of every TP degree is built first, then they are timed round-robin, one
    repetition of each in turn, so that a change in the machine's load (other jobs)
    shifts all of them alike."""
    slots = build_stages(recipe, tp_sizes, cache)
    progress(f"{len(slots)} stages built (TP {tp_sizes}); timing them round-robin ...")
    records = until_stable("stages", lambda: time_stages(slots, repeats, progress),
                           max_spread, progress)
    progress(f"stages measured (median of {repeats} repetitions, worst spread "
             f"{worst_spread([r['spread'] for r in records]):.0%})")
    gathered: list[list[dict]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, records)
    return [r for part in gathered for r in part]


def time_stages(slots: list[tuple[int, str, int, StageBench | None]], repeats: int,
                progress: Callable[[str], None]) -> list[dict]:
    """This rank's records (TP group leaders only) of one round-robin measurement."""
    times: list[list[float]] = [[] for _ in slots]
    cpu_times: list[list[float]] = [[] for _ in slots]
    for repetition in range(WARMUP + repeats):
        for i, (_, _, _, bench) in enumerate(slots):
            dist.barrier()
            if bench is not None:
                install(bench.runner.groups)  # mcore reads the TP view at call time
                elapsed, cpu = timed_with_cpu(bench.micro_batches, bench.runner.device)
                if repetition >= WARMUP:
                    times[i].append(elapsed / MICRO_BATCHES)
                    cpu_times[i].append(cpu / MICRO_BATCHES)
        if (repetition + 1) % 5 == 0:
            progress(f"repetition {repetition + 1}/{WARMUP + repeats}")
    dist.barrier()
    records = []
    for i, (tp, role, layers, bench) in enumerate(slots):
        if bench is None:
            continue
        groups = bench.runner.groups
        install(groups)
        ms, spread = robust_ms(times[i], groups.tp)
        cpu_ms = group_cpu_ms(cpu_times[i], groups.tp)
        saved, state = bench.saved_bytes(), bench.state_bytes()
        opt_ms, _ = robust_ms(optimizer_times(bench, repeats), groups.tp)
        if groups.rank == groups.tp_ranks[0]:
            records.append({"tp": tp, "role": role, "layers": layers,
                            "forward_backward_ms": ms, "spread": spread, "cpu_ms": cpu_ms,
                            "activation_bytes": saved, "state_bytes": state,
                            "optimizer_ms": opt_ms,
                            "params": sum(p.numel() for p in bench.runner.model.parameters())})
    dist.barrier()
    return records


def node_of_ranks() -> list[int]:
    """Each rank's node, from the launch itself: torchrun's ``GROUP_RANK`` (the rank of
    the rank's agent; one agent per node)."""
    nodes: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", "0")))
    return nodes


def link_pairs(nodes: list[int]) -> dict[str, tuple[int, int]]:
    """Two ranks of one node (``intra``) and rank 0 with a rank of another node
    (``inter``), where the launch has them."""
    pairs = {}
    for a in range(len(nodes)):
        same = [b for b in range(a + 1, len(nodes)) if nodes[b] == nodes[a]]
        if same:
            pairs["intra"] = (a, same[0])
            break
    other = [b for b in range(len(nodes)) if nodes[b] != nodes[0]]
    if other:
        pairs["inter"] = (0, other[0])
    return pairs


def measure_p2p(sizes: list[int], repeats: int, device: torch.device,
                pair: tuple[int, int]) -> list[dict]:
    """Ping-pong between the ranks of ``pair``: one-way time per message size."""
    out = []
    rank = dist.get_rank()
    a, b = pair
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), device=device)

        def ping_pong() -> None:
            if rank == a:
                dist.send(buf, b)
                dist.recv(buf, b)
            elif rank == b:
                dist.recv(buf, a)
                dist.send(buf, a)

        dist.barrier()
        if rank in pair:
            ms = pair_time(ping_pong, repeats, device) / 2
            if rank == a:
                out.append({"bytes": buf.numel() * 4, "ms": ms})
        dist.barrier()
    return out


def pair_time(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Median ms of ``fn`` on this rank (the two ranks of a pair run it together)."""
    for _ in range(WARMUP):
        fn()
    return robust([timed_once(fn, device) for _ in range(repeats)])[0] * 1e3


def measure_allreduce(sizes: list[int], repeats: int, cache: GroupCache,
                      device: torch.device, node_ranks: list[int]) -> list[dict]:
    """All-reduce over the first d ranks of rank 0's node (``node_ranks``) for d = 2,
    4, ... up to all of them (TP groups never span nodes)."""
    out = []
    for d in [d for d in (2, 4, 8, 16) if d <= len(node_ranks)]:
        group = cache.get(node_ranks[:d])
        for nbytes in sizes:
            dist.barrier()
            if dist.get_rank() in node_ranks[:d]:
                buf = torch.zeros(max(1, nbytes // 4), device=device)

                def reduce() -> None:
                    dist.all_reduce(buf, group=group)

                for _ in range(WARMUP):
                    reduce()
                ms, _ = robust_ms([timed_once(reduce, device) for _ in range(repeats)],
                                  group)
                if dist.get_rank() == 0:
                    out.append({"ranks": d, "bytes": buf.numel() * 4, "ms": ms})
            dist.barrier()
    return out


BLOCK = 8
"""Steps per timed block of ``measure_parallelism``: long enough (tens of ms) that the
scheduler shares the cores within a block instead of running the slots one after
another."""


def measure_parallelism(recipe: Recipe, repeats: int, cache: GroupCache, max_spread: float,
                        progress: Callable[[str], None]) -> list[dict]:
    """Blocks of single-layer TP-1 steps on the first ``k`` slots at once, for ``k`` =
    1 .. world in turn (one repetition of each, interleaved): ``{slots: k, ms, spread}``,
    the step time of the slowest busy slot (``k = 1``: one slot alone). Training runs
    keep 1 to all slots busy, and ``k`` slots on fewer cores share them with a loss
    (switching, caches) that ``k x alone / together`` measures."""
    world = dist.get_world_size()
    one = replace(recipe, model=replace(recipe.model, num_layers=1))
    micro = recipe.training.total_micro_batches
    split = [micro // world + (i < micro % world) for i in range(world)]
    layout = layout_from_dict({"pipelines": [
        {"micro_batches": max(1, m), "stages": [{"tp": 1, "layers": 1, "ranks": [r]}]}
        for r, m in enumerate(split)]})
    runner = setup_stage(one, layout, SEED, cache)
    install(runner.groups)
    bench = StageBench(runner, one)

    def block() -> None:
        for _ in range(BLOCK):
            bench.step()

    def measure() -> list[dict]:
        times: dict[int, list[float]] = {k: [] for k in range(1, world + 1)}
        for repetition in range(WARMUP + repeats):
            for k in times:
                dist.barrier()
                elapsed = (timed_once(block, runner.device) / BLOCK
                           if dist.get_rank() < k else 0.0)
                if repetition >= WARMUP:
                    times[k].append(elapsed)
        return [{"slots": k, **dict(zip(("ms", "spread"), robust_ms(values, None)))}
                for k, values in times.items()]

    return until_stable("slots busy at once", measure, max_spread, progress)


def measure_handoff(repeats: int, device: torch.device, pair: tuple[int, int]) -> list[dict]:
    """The runtime's 1F1B (``run_1f1b``, ``StageCommunicator``) on a two-stage pipeline
    between the ranks of ``pair`` whose stages do (next to) no work, with messages of
    ``HANDOFF_BYTES``: ``[{bytes, us, spread}]`` per micro-batch (one record, on the
    pair's first rank), i.e. what one boundary adds to a stage's time per micro-batch
    in the cost model's ``(micro_batches + stages - 1) x stage`` (the exchange's
    posting, the message and the receiver's wake-up)."""
    a, b = pair
    rank = dist.get_rank()
    micro = HANDOFF_MICRO_BATCHES
    layout = layout_from_dict({"pipelines": [{"micro_batches": micro, "stages": [
        {"tp": 1, "layers": 1, "ranks": [a]}, {"tp": 1, "layers": 1, "ranks": [b]}]}]})
    shape = (HANDOFF_BYTES // 4, 1, 1)
    times: list[float] = []
    if rank in pair:
        stage = 0 if rank == a else 1
        comm = StageCommunicator(stage_links(layout, rank), shape, torch.float32, device)
        weight = torch.ones(1, device=device, requires_grad=True)
        base = torch.zeros(shape, device=device)

        def forward(_: int, x: torch.Tensor | None) -> torch.Tensor:
            return base * weight if stage == 0 else x.sum()

        def pipeline() -> None:
            run_1f1b(micro, stage, 2, comm, forward)

        for _ in range(WARMUP):
            pipeline()
        times = [timed_once(pipeline, device) / (micro + 1) for _ in range(repeats)]
    dist.barrier()
    if rank != a:
        return []
    median, spread = robust(times)
    return [{"bytes": HANDOFF_BYTES, "us": median * 1e6, "spread": spread}]


def measure_links(recipe: Recipe, repeats: int, cache: GroupCache, device: torch.device,
                  max_spread: float, progress: Callable[[str], None]) -> dict:
    """P2P inside a node and between nodes, all-reduce inside rank 0's node, at one
    micro-batch's hidden states and at 4 MiB; the 1F1B hand-off inside a node."""
    dtype_bytes = 4 if recipe.training.params_dtype == "float32" else 2
    message = (recipe.training.micro_batch_size * recipe.model.seq_length
               * recipe.model.hidden_size * dtype_bytes)
    sizes = [message, 4 * 2**20]
    nodes = node_of_ranks()
    pairs = link_pairs(nodes)
    p2p = {kind: measure_p2p(sizes, 4 * repeats, device, pair) if pair else []
           for kind, pair in ((k, pairs.get(k)) for k in ("intra", "inter"))}
    node_ranks = [r for r, n in enumerate(nodes) if n == nodes[0]]
    allreduce = measure_allreduce(sizes, 2 * repeats, cache, device, node_ranks)
    handoff = until_stable("1F1B hand-off", lambda: measure_handoff(
        2 * repeats, device, pairs["intra"]), max_spread, progress) if "intra" in pairs else []
    gathered: list[list[dict]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, [p2p["intra"], handoff])
    intra, handoff = next((part for part in gathered if part[0]), [[], []])
    return {"p2p": intra, "p2p_inter_node": p2p["inter"], "allreduce": allreduce,
            "handoff": handoff[0] if handoff else None, "nodes": nodes}


def write_profile(settings: MeasureSettings, recipe: Recipe, raw: dict, device: str) -> None:
    """``--hardware`` with what ``raw`` measured, to ``--profile-out``."""
    base = load_hardware(settings.hardware)
    profile = (link_profile(base, raw) if settings.links_only else measured_profile(
        base, raw, recipe, provenance(settings.recipe, device, settings.repeats)))
    nodes = len(set(raw["nodes"]))
    write_hardware(profile, settings.profile_out,
                   f"Measured by: python -m elastor_mcore.elastic.rank.measure (world of "
                   f"{raw['world']} ranks on {nodes} node(s)) on top of {settings.hardware}"
                   + ("; links only" if settings.links_only else ""))


def parse_args(argv: list[str] | None) -> MeasureSettings:
    parser = argparse.ArgumentParser(prog="elastor_mcore.elastic.rank.measure")
    MeasureSettings.add_arguments(parser, "measure", {"tp_sizes": {"required": True}})
    return MeasureSettings.from_args(parser.parse_args(argv), "measure")


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    die_with_parent()
    settings = parse_args(argv)
    try:
        settings.check()
    except ValueError as exc:
        sys.exit(str(exc))
    recipe = load_recipe(settings.recipe)
    tp_sizes = list(settings.tp_sizes)
    init_distributed()
    rank = dist.get_rank()

    def progress(line: str) -> None:
        if rank == 0:
            print(f"elastor profile:   {line}", flush=True)

    cache = GroupCache()
    code = 0
    try:
        device = device_for_rank()
        started = time.perf_counter()
        stages = ([] if settings.links_only else measure_stages(
            recipe, tp_sizes, settings.repeats, cache, progress, settings.max_spread))
        links = measure_links(recipe, settings.repeats, cache, device, settings.max_spread,
                              progress)
        handoff = links["handoff"]
        progress(f"P2P and all-reduce measured ({len(links['p2p'])} + "
                 f"{len(links['p2p_inter_node'])} inter-node + {len(links['allreduce'])} "
                 f"sizes, {len(set(links['nodes']))} node(s))"
                 + (f"; 1F1B hand-off {handoff['us']:.0f} us per micro-batch (spread "
                    f"{handoff['spread']:.0%})" if handoff else ""))
        parallel = None
        if not settings.links_only:
            parallel = {"busy": measure_parallelism(recipe, settings.repeats, cache,
                                                    settings.max_spread, progress)}
            progress("parallelism: ms per layer step with k slots busy: " + ", ".join(
                f"{b['slots']}: {b['ms']:.2f} ({b['spread']:.0%})" for b in parallel["busy"]))
        if rank == 0:
            raw = {"stages": stages, **links, "parallelism": parallel,
                   "world": dist.get_world_size(), "seconds": time.perf_counter() - started,
                   "max_spread": settings.max_spread}
            raw["unstable"] = unstable(raw, settings.max_spread)
            with open(settings.raw_out, "w") as f:
                json.dump(raw, f, indent=1)
            if settings.profile_out and raw["unstable"]:
                print(f"elastor profile: not writing {settings.profile_out}: repetitions "
                      f"disagree by more than {settings.max_spread:.0%} in "
                      f"{'; '.join(raw['unstable'])}; measure again when the machine is "
                      f"quieter", file=sys.stderr)
                code = 1
            elif settings.profile_out:
                write_profile(settings, recipe, raw, device.type)
    finally:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
