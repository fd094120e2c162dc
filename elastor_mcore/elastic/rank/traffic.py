"""Measure the bytes each rank moves per training step, next to the minimum.

Run under torchrun with the training worker's flags (``tools/comm_volume.py`` does
that): every rank trains one step of the layout, counting what its
``StageCommunicator`` really sent and received and what its ``GradientSynchronizer``
all-reduced; the lowest active rank prints a table.

Minimums: each rank must receive at least the rows of the activation (and of the
gradient of its input) it holds, once per micro-batch in each direction it has a
neighbour: a full copy without sequence parallelism, its slice of the sequence with
it. For gradients, a cell of a global
tensor held in ``k`` pipelines must be summed over one representative per pipeline:
a ring all-reduce sends ``2(k-1)/k`` of the cell from each representative; other TP
replicas of a norm weight need nothing on the wire to compute it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.distributed as dist

from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.data.samples import SyntheticTokens
from elastor_mcore.elastic.rank.worker import init_distributed, parse_args
from elastor_mcore.parallel.groups import GroupCache
from elastor_mcore.parallel.layout import load_layout
from elastor_mcore.runtime.train import StageRunner, setup_stage


@dataclass(frozen=True)
class RankTraffic:
    rank: int
    where: str                      # "P<pipeline>.S<stage>.tp<rank>"
    p2p_sent: int
    p2p_received: int
    p2p_received_min: int
    grad_sent: float                # ring all-reduce bytes sent
    grad_sent_min: float


def _ring_bytes(nbytes: int, participants: int) -> float:
    return 2 * (participants - 1) / participants * nbytes


def measure(runner: StageRunner) -> RankTraffic:
    """Counts of one training step already taken by ``runner``."""
    groups, comm = runner.groups, runner.comm
    pos = groups.position
    pipeline = groups.layout.pipelines[pos.pipeline]
    activation = 1
    for n in comm.local_shape:
        activation *= n
    activation *= comm.dtype.itemsize
    neighbours = (not groups.is_first_stage) + (not groups.is_last_stage)
    pipeline_of = {r: groups.layout.position(r).pipeline for r in groups.layout.ranks}
    grad_sent = grad_min = 0.0
    for reduction in runner.grad_sync.reductions():
        grad_sent += _ring_bytes(reduction.nbytes, len(reduction.holders))
        pipelines = len({pipeline_of[h] for h in reduction.holders})
        grad_min += _ring_bytes(reduction.contributed_nbytes, pipelines)
    return RankTraffic(
        rank=groups.rank, where=f"P{pos.pipeline}.S{pos.stage}.tp{pos.tp_rank}",
        p2p_sent=comm.bytes_sent, p2p_received=comm.bytes_received,
        p2p_received_min=neighbours * pipeline.micro_batches * activation,
        grad_sent=grad_sent, grad_sent_min=grad_min)


def format_table(rows: list[RankTraffic]) -> str:
    kib = 1024
    lines = [f"{'rank':>4}  {'position':<12} {'p2p sent':>10} {'p2p recv':>10} "
             f"{'recv min':>10} {'grad sent':>10} {'grad min':>10}   (KiB per step)"]
    for r in rows:
        lines.append(f"{r.rank:>4}  {r.where:<12} {r.p2p_sent / kib:>10.1f} "
                     f"{r.p2p_received / kib:>10.1f} {r.p2p_received_min / kib:>10.1f} "
                     f"{r.grad_sent / kib:>10.1f} {r.grad_sent_min / kib:>10.1f}")
    total = [sum(getattr(r, f) for r in rows) / kib for f in
             ("p2p_sent", "p2p_received", "p2p_received_min", "grad_sent", "grad_sent_min")]
    lines.append(f"{'all':>4}  {'':<12} " + " ".join(f"{t:>10.1f}" for t in total))
    return "\n".join(lines)


def main() -> None:
    settings = parse_args()
    warnings.filterwarnings("ignore")

    recipe = load_recipe(settings.recipe)
    layout = load_layout(settings.layout, recipe)
    init_distributed()
    seed = settings.seed_for(recipe.training.seed)
    runner = setup_stage(recipe, layout, seed, GroupCache())
    row = None
    if runner is not None:
        source = SyntheticTokens(recipe.model.vocab_size, recipe.model.seq_length, seed)
        runner.train_step(source, 0)
        row = measure(runner)
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        print(f"layout: {layout.describe()}")
        print(format_table([r for r in rows if r is not None]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
