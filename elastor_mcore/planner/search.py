"""Search for the fastest layout of a set of alive GPUs under the cost model.

The space: every node's alive GPUs are cut into TP groups (any size allowed by the
model and the node, GPUs may stay idle); groups are arranged into pipelines (ordered
stages); each pipeline splits the layers over its stages (every stage >= 1 layer, within
its memory) and gets micro-batches (at least its stage count; all pipelines together
exactly the global batch).

How it is searched (steps 1-3 are exact; 4-5 are exact for small clusters and pools):

1. **Groups are interchangeable by size.** The cost model charges a stage by TP degree,
   layer count and position only (see ``cost_model``), plus whether the layout spans
   nodes. So a node contributes a *partition* of its alive count (a multiset of sizes),
   and a set of nodes a *pool* of group counts. Partitions that leave GPUs idle are not
   needed: an unused group is idle anyway. Single-node pools (cheaper links) are searched
   separately from the multi-node pool.
2. **Pipeline shapes.** For each multiset of TP sizes the best pipeline is computed once
   (memoised): for each distinct stage order, the exact min-max layer split under
   memory caps starts from the continuous optimum rounded down and gives each further
   layer to the stage whose time grows least (optimal for a maximum of increasing
   functions). Small multisets try every
   distinct order; large ones try big-TP-first orders with each size as last stage
   (first stages keep the most micro-batches in flight; the last carries the output
   layer).
3. **Micro-batches, exact.** For a set of pipelines the smallest time ``T`` with
   ``sum(floor(T / t_i) - stages_i + 1) >= micro_batches`` is found among the candidate
   values ``k x t_i`` between the continuous bounds; every pipeline then gets its
   capacity at ``T``, trimmed from the slowest ones.
4. **Packing pipelines.** Small pools (<= ``EXACT_POOL_GROUPS`` groups) enumerate every
   multiset of pipeline shapes that fits the pool, i.e. every number of pipelines and
   assignment of groups, by branch and bound: a partial packing is dropped when even
   ideal pipelines on its remaining groups cannot beat the best layout so far (the bound
   carries over from pool to pool). Large pools consider pipelines of at most
   ``EXTRA_STAGES`` more stages than the fewest that hold the model; they first fill
   most groups of a plentiful size with copies of a uniform pipeline of that size (its
   two best stage counts by a continuous estimate; all groups, or one pipeline's worth
   fewer), then enumerate packings of the small residual (partial nodes and left-over
   plentiful groups, so residual pipelines may mix sizes; past ``RESIDUAL_GROUPS`` the
   smallest groups stay idle).
5. **Pools.** Nodes with equal alive counts form a class. Small clusters
   (<= ``EXACT_CLUSTER_GPUS``) try every mix of partitions within each class. Larger
   ones cut all nodes of a class alike: every partition for a class of few nodes
   (typically the nodes with dead GPUs), else greedily into the largest groups up to a
   cap, for every cap (``[8]``, ``[4, 4]``, ``[2, 2, 2, 2]``, ... for full nodes).

**ZeRO-1** (``training.distributed_optimizer``) splits each weight's optimizer state over
the pipelines (every pipeline holds every layer), so a stage's memory, and with it the
best pipeline of a TP multiset, depends on the number of pipelines ``D`` of the whole
layout. ``ShapeBook`` computes best pipelines for a given ``D`` (sharing them between
counts with equal memory caps). Step 4 enumerates with the best pipelines for the most
pipelines a packing of the pool can have (its group count): caps only grow with ``D``,
so these are a relaxation, every pipeline that fits with fewer is among them, at most as
slow, and every bound stays a lower bound. Each packing is then re-sized for its own
``D`` (a shape that still fits stays the best; one that does not is replaced by the best
for ``D``, or the packing dropped) and bounded by its exact 1F1B time before it is
evaluated. So the search stays exact where it was (steps 1-3 and small pools). It
charges each norm's state over ``D`` holders, at least what the layout gives (norms are
held by every TP rank of their stage in each pipeline); the plan's reported memory
counts them exactly (``CostModel.step_cost``).

The result is the best layout found, with deterministic tie-breaks (fewer GPUs, fewer
pipelines). The test suite checks it against brute force on small clusters, with and
without ZeRO-1.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from elastor_mcore.planner.cost_model import CostModel, pipeline_time_s, pipelines_fill_s

log = logging.getLogger(__name__)

EXACT_POOL_GROUPS = 10
"""Pools with at most this many TP groups enumerate every packing."""
RESIDUAL_GROUPS = 8
"""Groups left next to the uniform bulk of a large pool, whose packings are enumerated."""
ALL_ORDERS_LIMIT = 30
"""Pipelines with at most this many distinct stage orders try them all."""
EXACT_CLUSTER_GPUS = 16
"""Clusters with at most this many alive GPUs try every partition of every node."""
FEW_NODES = 2
"""In larger clusters, a class of at most this many nodes still tries every partition."""
BULK_SHAPES = 2
"""Stage counts tried for the uniform bulk of each plentiful group size."""
EXTRA_STAGES = 2
"""Large pools consider pipelines of up to (fewest stages that fit the model) + this."""
REL_TOL = 1e-9


@dataclass(frozen=True)
class PipelineShape:
    """The best ordered pipeline for a multiset of TP sizes."""

    tps: tuple[int, ...]
    layers: tuple[int, ...]
    bottleneck_s: float

    @property
    def num_stages(self) -> int:
        return len(self.tps)

    def time_s(self, micro_batches: int) -> float:
        """Its 1F1B time for ``micro_batches``."""
        return pipeline_time_s(micro_batches, self.num_stages, self.bottleneck_s)

    @property
    def gpus(self) -> int:
        return sum(self.tps)


@dataclass(frozen=True)
class Candidate:
    """A searched layout before GPUs are placed: pipelines with their micro-batches."""

    pipelines: tuple[tuple[PipelineShape, int], ...]
    intra_node: bool
    pipeline_s: float
    grad_sync_s: float
    partitions: tuple[tuple[int, tuple[int, ...]], ...]
    """(node, TP sizes of its groups) for the nodes whose groups this layout may use."""
    optimizer_s: float = 0.0
    contention: float = 1.0
    """``CostModel.contention`` of its CPU work (>= 1, and the optimizer step >= 0, so
    the bounds below, computed without them, stay lower bounds)."""

    @property
    def step_s(self) -> float:
        return (self.pipeline_s + self.grad_sync_s + self.optimizer_s) * self.contention

    @property
    def gpus(self) -> int:
        return sum(shape.gpus for shape, _ in self.pipelines)


def better(a: Candidate | None, b: Candidate | None) -> Candidate | None:
    """The better of two candidates: faster, then fewer GPUs, then fewer pipelines;
    ``a`` on a full tie, so the first one found wins (the search order is fixed)."""
    if a is None or b is None:
        return a or b
    if abs(a.step_s - b.step_s) > REL_TOL * max(a.step_s, b.step_s):
        return a if a.step_s < b.step_s else b
    return a if (a.gpus, len(a.pipelines)) <= (b.gpus, len(b.pipelines)) else b


# ----- node partitions ------------------------------------------------------------------
def node_partitions(alive: int, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every multiset of group sizes (descending) that sums to ``alive``."""
    out: list[tuple[int, ...]] = []

    def rec(rest: int, allowed: tuple[int, ...], acc: tuple[int, ...]) -> None:
        if rest == 0:
            out.append(acc)
            return
        for i, size in enumerate(allowed):
            if size <= rest:
                rec(rest - size, allowed[i:], acc + (size,))

    rec(alive, tuple(sorted(sizes, reverse=True)), ())
    return out


# ----- pipeline shapes ------------------------------------------------------------------
def _permutations(counts: dict[int, int]) -> list[tuple[int, ...]]:
    """Distinct orders of a multiset, without generating duplicates."""
    if not any(counts.values()):
        return [()]
    out = []
    for size in sorted((s for s, c in counts.items() if c), reverse=True):
        counts[size] -= 1
        out += [(size,) + rest for rest in _permutations(counts)]
        counts[size] += 1
    return out


def _distinct_orders(tps: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The stage orders tried for the TP sizes ``tps`` (see ``search``'s step 2)."""
    counts = Counter(tps)
    n_orders = math.factorial(len(tps)) // math.prod(math.factorial(c) for c in counts.values())
    if n_orders <= ALL_ORDERS_LIMIT:
        return _permutations(dict(counts))
    desc = tuple(sorted(tps, reverse=True))
    orders = {desc}
    for last in counts:
        rest = list(desc)
        rest.remove(last)
        orders.add(tuple(rest) + (last,))
    return sorted(orders, reverse=True)


class ShapeBook:
    """Memoised best pipelines by TP multiset and pipeline count, for one cost model and
    link kind.

    The pipeline count (``replicas``) matters only under ZeRO-1, through the memory caps:
    a stage's optimizer state is split over the pipelines. Best pipelines are shared
    between counts whose caps are equal (the split depends on nothing else)."""

    def __init__(self, cost: CostModel, intra_node: bool) -> None:
        self.cost = cost
        self.intra_node = intra_node
        self._stage = lru_cache(maxsize=None)(self._stage_terms)
        self._times = lru_cache(maxsize=None)(self._time_terms)
        self._orders = lru_cache(maxsize=None)(_distinct_orders)
        self._by_caps: dict[tuple, PipelineShape | None] = {}
        self._by_count: dict[tuple[tuple[int, ...], int], PipelineShape | None] = {}
        self._min_stages: dict[tuple[int, int], int | None] = {}

    def _time_terms(self, tp: int, position: int, num_stages: int) -> tuple[float, float]:
        """(time per layer, fixed time) of a stage slot."""
        return (self.cost.layer_time_s(tp),
                self.cost.stage_fixed_s(tp, position, num_stages, self.intra_node))

    def _stage_terms(self, tp: int, position: int, num_stages: int, replicas: int
                     ) -> tuple[float, float, int]:
        """(time per layer, fixed time, most layers in memory) of a stage slot in a
        layout of ``replicas`` pipelines."""
        cap = self.cost.max_layers(tp, position, num_stages, replicas)
        return (*self._times(tp, position, num_stages), min(cap, self.cost.num_layers))

    def split(self, order: tuple[int, ...], replicas: int = 1
              ) -> tuple[tuple[int, ...], float] | None:
        """Exact min-max layer split of an ordered pipeline under memory caps.

        Starts from the continuous optimum rounded down (no optimal split has fewer
        layers on any stage), then gives each remaining layer to the stage whose time
        grows least: optimal for a maximum of increasing functions.
        """
        n, total = len(order), self.cost.num_layers
        if n > total:
            return None
        replicas = self.cost.replica_key(replicas)
        terms = [self._stage(tp, j, n, replicas) for j, tp in enumerate(order)]
        if min(cap for _, _, cap in terms) < 1 or sum(cap for _, _, cap in terms) < total:
            return None
        t_cont = (total + sum(c / a for a, c, _ in terms)) / sum(1 / a for a, _, _ in terms)
        layers = [max(1, min(cap, math.floor((t_cont - c) / a))) for a, c, cap in terms]
        if sum(layers) > total:  # only when the ">= 1 layer" floor lifted some stage
            layers = [1] * n
        heap = [(a * (layers[j] + 1) + c, j) for j, (a, c, cap) in enumerate(terms)
                if layers[j] < cap]
        heapq.heapify(heap)
        for _ in range(total - sum(layers)):
            _, j = heapq.heappop(heap)
            layers[j] += 1
            a, c, cap = terms[j]
            if layers[j] < cap:
                heapq.heappush(heap, (a * (layers[j] + 1) + c, j))
        bottleneck = max(a * l + c for (a, c, _), l in zip(terms, layers))
        return tuple(layers), bottleneck

    def min_stages(self, tp: int, replicas: int = 1) -> int | None:
        """Fewest stages of TP degree ``tp`` that hold the model in a layout of
        ``replicas`` pipelines (None: no count does)."""
        key = (tp, self.cost.replica_key(replicas))
        if key not in self._min_stages:
            found = None
            for n in range(1, self.cost.num_layers + 1):
                caps = [self._stage(tp, j, n, key[1])[2] for j in range(n)]
                if caps[0] < 1:  # the first stage only gets tighter with more stages
                    break
                if min(caps) >= 1 and sum(caps) >= self.cost.num_layers:
                    found = n
                    break
            self._min_stages[key] = found
        return self._min_stages[key]

    def best(self, tps: tuple[int, ...], replicas: int = 1) -> PipelineShape | None:
        """The best ordered pipeline of the TP sizes ``tps`` in a layout of ``replicas``
        pipelines (None: no order fits in memory)."""
        key = (tps, self.cost.replica_key(replicas))
        if key not in self._by_count:
            n = len(tps)
            caps = tuple(self._stage(tp, j, n, key[1])[2]
                         for tp in sorted(set(tps)) for j in range(n))
            if (tps, caps) not in self._by_caps:
                self._by_caps[tps, caps] = self._best(tps, key[1])
            self._by_count[key] = self._by_caps[tps, caps]
        return self._by_count[key]

    def fits(self, shape: PipelineShape, replicas: int) -> bool:
        """Whether every stage of ``shape`` fits in memory in a layout of ``replicas``
        pipelines. Then ``shape``, if it is the best for more pipelines (looser caps), is
        also a best one for ``replicas``: every split that fits here fits there too."""
        n, replicas = shape.num_stages, self.cost.replica_key(replicas)
        return all(layers <= self._stage(tp, j, n, replicas)[2]
                   for j, (tp, layers) in enumerate(zip(shape.tps, shape.layers)))

    def _best(self, tps: tuple[int, ...], replicas: int) -> PipelineShape | None:
        best: PipelineShape | None = None
        for order in self._orders(tps):
            result = self.split(order, replicas)
            if result is None:
                continue
            layers, bottleneck = result
            if best is None or bottleneck < best.bottleneck_s * (1 - REL_TOL):
                best = PipelineShape(tps=order, layers=layers, bottleneck_s=bottleneck)
        return best


# ----- micro-batches --------------------------------------------------------------------
def _capacity(t: float, shape: PipelineShape) -> int:
    """Micro-batches ``shape`` trains within ``t`` (1F1B)."""
    return math.floor(t / shape.bottleneck_s * (1 + 1e-12)) - shape.num_stages + 1


def pipelines_time(shapes: list[tuple[PipelineShape, int]], total: int) -> float | None:
    """Exact min over integer splits of ``total`` micro-batches of ``max_i (m_i + stages_i
    - 1) x bottleneck_i`` (``shapes`` lists (shape, copies)), or None when even ``m_i =
    stages_i`` everywhere exceeds ``total``: the smallest time ``T`` with ``sum(floor(T /
    t_i) - stages_i + 1) >= total``, a multiple of some ``t_i``, found by bisection
    among those between the continuous bounds."""
    if sum(s.num_stages * c for s, c in shapes) > total:
        return None
    rate = sum(c / s.bottleneck_s for s, c in shapes)
    floor_t = max(s.time_s(s.num_stages) for s, _ in shapes)
    lo = max(floor_t, (total + sum(c * (s.num_stages - 1) for s, c in shapes)) / rate)
    hi = max(floor_t, (total + sum(c * s.num_stages for s, c in shapes)) / rate)
    candidates = sorted({k * s.bottleneck_s for s, _ in shapes
                         for k in range(math.ceil(lo / s.bottleneck_s * (1 - 1e-12)),
                                        math.floor(hi / s.bottleneck_s * (1 + 1e-12)) + 1)}
                        | {floor_t, hi})
    candidates = [t for t in candidates if t >= floor_t * (1 - 1e-12)]
    lo_i, hi_i = 0, len(candidates) - 1
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        if sum(c * _capacity(candidates[mid], s) for s, c in shapes) >= total:
            hi_i = mid
        else:
            lo_i = mid + 1
    return candidates[lo_i]


def balance_micro_batches(shapes: list[tuple[PipelineShape, int]], total: int
                          ) -> tuple[float, list[list[int]]] | None:
    """``pipelines_time`` and the micro-batches of every copy that achieve it: each
    gets its capacity at that time, trimmed from the slowest ones."""
    t_star = pipelines_time(shapes, total)
    if t_star is None:
        return None
    micro = [[_capacity(t_star, s)] * c for s, c in shapes]
    surplus = sum(map(sum, micro)) - total
    heap = [(-s.time_s(m), i, k)
            for i, (s, c) in enumerate(shapes) for k, m in enumerate(micro[i])]
    heapq.heapify(heap)
    while surplus > 0:
        _, i, k = heapq.heappop(heap)
        shape = shapes[i][0]
        if micro[i][k] > shape.num_stages:
            micro[i][k] -= 1
            surplus -= 1
            heapq.heappush(heap, (-shape.time_s(micro[i][k]), i, k))
    time_s = max(s.time_s(m) for (s, _), ms in zip(shapes, micro) for m in ms)
    return time_s, micro


# ----- packing pipelines into a pool ----------------------------------------------------
def _sub_multisets(pool: dict[int, int], max_size: int) -> list[tuple[int, ...]]:
    sizes = sorted(pool, reverse=True)
    out = []
    for counts in itertools.product(*(range(pool[s] + 1) for s in sizes)):
        n = sum(counts)
        if 1 <= n <= max_size:
            out.append(tuple(s for s, c in zip(sizes, counts) for _ in range(c)))
    return out


class PoolSearch:
    """Best packing of pipelines into one pool of TP groups."""

    def __init__(self, cost: CostModel, book: ShapeBook, min_gpus: int = 0) -> None:
        self.cost = cost
        self.book = book
        self.min_gpus = min_gpus
        """Packings on fewer GPUs are not candidates (``search``'s ``min_gpus``)."""
        self._evaluated: dict[tuple[tuple[PipelineShape, int], ...], Candidate | None] = {}

    def evaluate(self, shapes: list[tuple[PipelineShape, int]],
                 partitions: tuple[tuple[int, tuple[int, ...]], ...]) -> Candidate | None:
        """The candidate of a packing (None if it cannot take the global batch); the
        same packing found in several pools costs the same (``cost_model``)."""
        key = tuple(shapes)
        if key not in self._evaluated:
            self._evaluated[key] = self._evaluate(shapes, partitions)
        found = self._evaluated[key]
        return found and dataclasses.replace(found, partitions=partitions)

    def _evaluate(self, shapes: list[tuple[PipelineShape, int]],
                  partitions: tuple[tuple[int, tuple[int, ...]], ...]) -> Candidate | None:
        if sum(s.gpus * n for s, n in shapes) < self.min_gpus:
            return None
        balanced = balance_micro_batches(shapes, self.cost.total_micro_batches)
        if balanced is None:
            return None
        pipeline_s, micro = balanced
        pipelines = tuple((s, m) for (s, _), ms in zip(shapes, micro) for m in ms)
        grad = self.cost.grad_sync_s(len(pipelines), min(s.gpus for s, _ in pipelines),
                                     self.book.intra_node)
        alike = Counter(pipelines)
        optimizer, cpu = self.cost.pipelines_work(
            [(m, list(zip(s.tps, s.layers))) for s, m in alike], grad, list(alike.values()))
        return Candidate(pipelines=pipelines, intra_node=self.book.intra_node,
                         pipeline_s=pipeline_s, grad_sync_s=grad, partitions=partitions,
                         optimizer_s=optimizer,
                         contention=self.cost.contention(
                             pipeline_s + grad + optimizer, cpu,
                             pipelines_fill_s((s.num_stages, s.bottleneck_s)
                                              for s, _ in pipelines)))

    def _enumerate(self, pool: dict[int, int], fixed: list[tuple[PipelineShape, int]],
                   max_stages: int, partitions: tuple[tuple[int, tuple[int, ...]], ...],
                   incumbent: Candidate | None, widest: int) -> Candidate | None:
        """Every multiset of shapes that fits ``pool`` (plus the ``fixed`` pipelines),
        branch and bound: a partial packing is dropped when even perfectly efficient
        pipelines on all its remaining groups could not beat the incumbent.

        Under ZeRO-1 a stage's memory, and so the best pipeline of a TP multiset, depends
        on the number of pipelines. The shapes enumerated (and ``fixed``) are the best
        with ``widest`` pipelines, at least as many as a packing can have (the pool's
        groups): the loosest memory caps, so every pipeline that fits with fewer is
        among them and their bottlenecks are at most its own, and the bounds stay lower
        bounds. Each packing is then evaluated with its pipelines' best shapes for its
        own count (``resize``)."""
        cost, total = self.cost, self.cost.total_micro_batches
        shapes = [s for tps in _sub_multisets(pool, max_stages)
                  if (s := self.book.best(tps, widest)) is not None]
        shapes.sort(key=lambda s: (-1 / (s.bottleneck_s * s.gpus), s.tps))
        sizes = sorted(pool, reverse=True)
        need = [tuple(s.tps.count(size) for size in sizes) for s in shapes]
        # upper bound on the micro-batch rate a group can add: all layers at its speed
        group_rate = {tp: 1 / (cost.layer_time_s(tp) * cost.num_layers) for tp in sizes}
        best = incumbent
        found: Candidate | None = None
        chosen: list[tuple[PipelineShape, int]] = []
        intra = self.book.intra_node

        def lower_bound(rate: float, bubble: int, pipes: int, min_gpus: float,
                        extra_rate: float) -> float:
            grad = cost.grad_sync_s(pipes, int(min_gpus), intra) if pipes else 0.0
            if rate + extra_rate <= 0:
                return math.inf
            return (total + bubble) / (rate + extra_rate) + grad

        def beaten(bound: float) -> bool:
            return best is not None and bound > best.step_s * (1 + REL_TOL)

        def rec(i: int, left: list[int], rate: float, bubble: int, stages: int, pipes: int,
                min_gpus: float) -> None:
            """Visit the packing ``chosen`` (unused groups idle), then every extension
            by shapes ``i`` and later, each multiset of shapes exactly once."""
            nonlocal best, found
            left_rate = sum(c * group_rate[size] for c, size in zip(left, sizes))
            if beaten(lower_bound(rate, bubble, pipes, min_gpus, left_rate)):
                return
            if pipes:
                packing = self.resize(fixed + chosen, pipes)
                pipeline_s = packing and pipelines_time(packing, total)
                if pipeline_s is not None and not beaten(
                        pipeline_s + cost.grad_sync_s(pipes, int(min_gpus), intra)):
                    candidate = self.evaluate(packing, partitions)
                    if candidate is not None and better(best, candidate) is candidate:
                        best = found = candidate
            for j in range(i, len(shapes)):
                shape, n = shapes[j], need[j]
                rest = [a - b for a, b in zip(left, n)]
                if min(rest) < 0 or stages + shape.num_stages > total:
                    continue
                if chosen and chosen[-1][0] is shape:
                    chosen[-1] = (shape, chosen[-1][1] + 1)
                else:
                    chosen.append((shape, 1))
                rec(j, rest, rate + 1 / shape.bottleneck_s, bubble + shape.num_stages - 1,
                    stages + shape.num_stages, pipes + 1, min(min_gpus, shape.gpus))
                if chosen[-1][1] > 1:
                    chosen[-1] = (shape, chosen[-1][1] - 1)
                else:
                    chosen.pop()

        fixed = [(self.book.best(s.tps, widest), c) for s, c in fixed]
        rate0 = sum(c / s.bottleneck_s for s, c in fixed)
        rec(0, [pool[s] for s in sizes], rate0, sum(c * (s.num_stages - 1) for s, c in fixed),
            sum(c * s.num_stages for s, c in fixed), sum(c for _, c in fixed),
            min((s.gpus for s, _ in fixed), default=math.inf))
        return found

    def search(self, pool: dict[int, int], partitions: tuple[tuple[int, tuple[int, ...]], ...],
               incumbent: Candidate | None) -> Candidate | None:
        """A candidate from this pool better than ``incumbent``, or None."""
        pool = {tp: c for tp, c in pool.items() if c > 0}
        groups = sum(pool.values())
        gpus = sum(tp * c for tp, c in pool.items())
        if gpus * self.cost.capacity_bytes < self.cost.model_state_bytes:
            return None  # not even the weights, gradients and optimizer state fit
        if groups <= EXACT_POOL_GROUPS:
            return self._enumerate(pool, [], groups, partitions, incumbent, groups)
        # fewest stages with the optimizer state unsplit (under ZeRO-1 more pipelines may
        # need fewer, which the window includes), else with it split over every group
        min_stages = ([n for tp in pool if (n := self.book.min_stages(tp, 1)) is not None]
                      or [n for tp in pool if (n := self.book.min_stages(tp, groups))])
        if not min_stages:
            return None
        max_stages = min(min_stages) + EXTRA_STAGES
        best, found = incumbent, None
        for bulk in self._bulk_options(pool, max_stages):
            residual = dict(pool)
            for shape, copies in bulk:
                residual[shape.tps[0]] -= copies * shape.num_stages
            residual = self._trim(residual)
            candidate = self._enumerate(residual, bulk, max_stages, partitions, best, groups)
            if candidate is not None:
                best = found = candidate
        return found

    def resize(self, packing: list[tuple[PipelineShape, int]], pipelines: int
               ) -> list[tuple[PipelineShape, int]] | None:
        """Best shapes of ``packing``'s TP multisets in a layout of ``pipelines``
        pipelines (None if one no longer fits): the shapes themselves where they fit
        (``ShapeBook.fits``), and always without ZeRO-1."""
        if not self.cost.shards_optimizer:
            return packing
        out = []
        for shape, copies in packing:
            sized = shape if self.book.fits(shape, pipelines) \
                else self.book.best(shape.tps, pipelines)
            if sized is None:
                return None
            out.append((sized, copies))
        return out

    def _trim(self, residual: dict[int, int]) -> dict[int, int]:
        """Keep the residual small enough to enumerate: smallest groups go idle first."""
        residual = {tp: c for tp, c in residual.items() if c > 0}
        while sum(residual.values()) > RESIDUAL_GROUPS:
            smallest = min(residual)
            residual[smallest] -= 1
            if residual[smallest] == 0:
                del residual[smallest]
        return residual

    def _bulk_options(self, pool: dict[int, int], max_stages: int
                      ) -> list[list[tuple[PipelineShape, int]]]:
        """Uniform pipelines for each plentiful size: its two best stage counts (by the
        continuous step-time estimate), with all its groups or one pipeline's worth
        fewer in the bulk (the residual may do better with them). Under ZeRO-1 each
        count is judged in memory with the pipelines of its own (``_enumerate`` sizes
        the bulk again for each packing's pipeline count)."""
        per_size = []
        for tp in sorted(pool, reverse=True):
            if pool[tp] <= RESIDUAL_GROUPS:
                continue
            ranked = []
            for n in range(1, min(max_stages, pool[tp]) + 1):
                pipes = pool[tp] // n
                shape = self.book.best((tp,) * n, pipes)
                if shape is None:
                    continue
                estimate = (self.cost.total_micro_batches + pipes * (n - 1)) \
                    * shape.bottleneck_s / pipes
                ranked.append((estimate, n, shape))
            choices = [(shape, copies) for _, n, shape in sorted(ranked)[:BULK_SHAPES]
                       for copies in (pool[tp] // n, pool[tp] // n - 1) if copies > 0]
            if choices:
                per_size.append(choices)
        return [list(combo) for combo in itertools.product(*per_size)]


# ----- pools ----------------------------------------------------------------------------
def greedy_partitions(alive: int, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """For each cap, the node cut greedily into the largest groups up to that cap."""
    out = []
    for cap in sorted(sizes, reverse=True):
        rest, partition = alive, []
        for size in sorted((s for s in sizes if s <= cap), reverse=True):
            while rest >= size:
                partition.append(size)
                rest -= size
        if tuple(partition) not in out:
            out.append(tuple(partition))
    return out


def _class_options(nodes: list[int], partitions: list[tuple[int, ...]], exact: bool
                   ) -> list[tuple[tuple[int, tuple[int, ...]], ...]]:
    """Ways to cut a class of equally alive nodes into groups: every mix of partitions
    when ``exact``, else one partition for all of them."""
    if exact:
        combos = itertools.combinations_with_replacement(partitions, len(nodes))
    else:
        combos = ((p,) * len(nodes) for p in partitions)
    return [tuple(zip(nodes, combo)) for combo in combos]


def search(cost: CostModel, alive_by_node: dict[int, int], tp_sizes: tuple[int, ...],
           min_gpus: int = 0) -> Candidate | None:
    """Best candidate for ``alive_by_node`` (node -> alive GPU count) over ``tp_sizes``,
    among those that use at least ``min_gpus`` GPUs."""
    classes: dict[int, list[int]] = {}
    for node, alive in sorted(alive_by_node.items()):
        if alive > 0:
            classes.setdefault(alive, []).append(node)
    exact = sum(alive_by_node.values()) <= EXACT_CLUSTER_GPUS
    parts = {alive: (node_partitions if exact or len(nodes) <= FEW_NODES else greedy_partitions)(
                 alive, tuple(t for t in tp_sizes if t <= alive))
             for alive, nodes in classes.items()}
    best: Candidate | None = None

    # a single node: intra-node links
    book = ShapeBook(cost, intra_node=True)
    pool_search = PoolSearch(cost, book, min_gpus)
    for alive, nodes in classes.items():
        for partition in parts[alive]:
            best = pool_search.search(Counter(partition), ((nodes[0], partition),),
                                      best) or best
    # the whole cluster: inter-node links
    if sum(len(nodes) for nodes in classes.values()) > 1:
        book = ShapeBook(cost, intra_node=False)
        pool_search = PoolSearch(cost, book, min_gpus)
        options = [_class_options(nodes, parts[alive], exact) for alive, nodes in classes.items()]
        for choice in itertools.product(*options):
            partitions = tuple(sorted(p for cls in choice for p in cls))
            pool = Counter(tp for _, partition in partitions for tp in partition)
            best = pool_search.search(pool, partitions, best) or best
    if best is not None:
        log.info("planner: best of the search %.4f s/step on %d GPUs in %d pipelines",
                 best.step_s, best.gpus, len(best.pipelines))
    return best
