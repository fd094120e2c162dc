"""The layout: how a run's ranks form pipelines, stages and tensor-parallel groups.

A layout is plain data (no torch.distributed here). Each pipeline is one data-parallel
replica with its own stages and micro-batch count; each stage has its own TP degree,
its own number of consecutive layers and the ranks that hold it.

YAML form::

    pipelines:
      - micro_batches: 8
        stages:
          - {tp: 2, layers: 4}
          - {tp: 2, layers: 4, ranks: [4, 5]}   # ranks: optional

Ranks not given explicitly are assigned pipeline-major, then stage, then TP rank,
skipping ranks listed explicitly elsewhere. The shorthand ``dp2-tp2-pp2`` builds a
uniform layout whose ranks follow Megatron-Core's default order (TP fastest, then DP,
then PP), so its groups are exactly those ``initialize_model_parallel`` would build.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml

from elastor_mcore.config.recipe import Recipe
from elastor_mcore.config.shipped import find_input, shipped
from elastor_mcore.config.yaml_file import read_yaml_file


class LayoutError(ValueError):
    """A layout that cannot run; the message names the field and the fix."""


@dataclass(frozen=True)
class Stage:
    tp: int
    layers: int
    ranks: tuple[int, ...]
    """Ascending: a rank's TP rank is its index here. ``torch.distributed.new_group``
    orders a group's members by global rank, and mcore takes the TP rank from the
    group, so a stage listed as ``[1, 0]`` holds TP rank 0 on rank 0 all the same;
    keeping the layout in that order keeps every TP rank derived from it (P2P
    pairing, replica sets) equal to the one mcore shards by."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(sorted(self.ranks)))


@dataclass(frozen=True)
class Pipeline:
    micro_batches: int
    stages: tuple[Stage, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for s in self.stages for r in s.ranks)


@dataclass(frozen=True)
class RankPosition:
    """Where one rank sits in a layout."""

    pipeline: int
    stage: int
    tp_rank: int


@dataclass(frozen=True)
class Layout:
    pipelines: tuple[Pipeline, ...]

    # ----- derived views -------------------------------------------------------------
    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank the layout uses, sorted."""
        return tuple(sorted(r for p in self.pipelines for r in p.ranks))

    @property
    def world_size(self) -> int:
        """Smallest world that holds the layout (may include idle ranks)."""
        return max(self.ranks) + 1

    @property
    def num_gpus(self) -> int:
        return len(self.ranks)

    def position(self, rank: int) -> RankPosition | None:
        """(pipeline, stage, tp_rank) of ``rank``, or None for an idle rank."""
        for p, pipe in enumerate(self.pipelines):
            for s, stage in enumerate(pipe.stages):
                if rank in stage.ranks:
                    return RankPosition(p, s, stage.ranks.index(rank))
        return None

    def layer_range(self, pipeline: int, stage: int) -> range:
        """Global layer numbers held by a stage."""
        stages = self.pipelines[pipeline].stages
        start = sum(s.layers for s in stages[:stage])
        return range(start, start + stages[stage].layers)

    def sample_range(self, pipeline: int, micro_batch_size: int) -> range:
        """Which samples of each global batch (0-based, within the batch) a pipeline
        trains on: a contiguous slice in proportion to its micro-batches."""
        start = sum(p.micro_batches for p in self.pipelines[:pipeline]) * micro_batch_size
        return range(start, start + self.pipelines[pipeline].micro_batches * micro_batch_size)

    def iter_stages(self) -> Iterator[tuple[int, int, Stage]]:
        for p, pipe in enumerate(self.pipelines):
            for s, stage in enumerate(pipe.stages):
                yield p, s, stage

    @property
    def is_uniform(self) -> bool:
        """True for a layout stock Megatron can train: identical pipelines with one TP
        degree throughout (uneven layers per stage are fine)."""
        first = self.pipelines[0]
        shape = [(s.tp, s.layers) for s in first.stages]
        return len({s.tp for s in first.stages}) == 1 and all(
            [(s.tp, s.layers) for s in p.stages] == shape and p.micro_batches == first.micro_batches
            for p in self.pipelines)

    def describe(self) -> str:
        """A one-line summary, e.g. ``P0[tp2x4L|tp2x4L]x8mb P1[...]``."""
        parts = []
        for p, pipe in enumerate(self.pipelines):
            stages = "|".join(f"tp{s.tp}x{s.layers}L" for s in pipe.stages)
            parts.append(f"P{p}[{stages}]x{pipe.micro_batches}mb")
        return " ".join(parts)

    # ----- validation ----------------------------------------------------------------
    def validate(self, recipe: Recipe) -> None:
        """Check the layout against a recipe; raise LayoutError naming the field."""
        model, training = recipe.model, recipe.training
        for p, pipe in enumerate(self.pipelines):
            total_layers = sum(s.layers for s in pipe.stages)
            if total_layers != model.num_layers:
                raise LayoutError(
                    f"pipelines[{p}]: stage layers sum to {total_layers} but the model has "
                    f"num_layers={model.num_layers}; make the 'layers' of its stages add up "
                    f"to {model.num_layers}")
            for s, stage in enumerate(pipe.stages):
                where = f"pipelines[{p}].stages[{s}]"
                for what, size in (("num_attention_heads", model.num_attention_heads),
                                    ("num_query_groups", model.num_query_groups),
                                    ("ffn_hidden_size", model.ffn_hidden_size)):
                    if size % stage.tp:
                        raise LayoutError(
                            f"{where}.tp={stage.tp} does not divide {what}={size}; use one of "
                            f"the TP sizes this model allows: {model.valid_tp_sizes}")
                if training.sequence_parallel and model.seq_length % stage.tp:
                    raise LayoutError(
                        f"{where}.tp={stage.tp} does not divide model.seq_length="
                        f"{model.seq_length}, which training.sequence_parallel splits across "
                        f"the stage's TP ranks; use a TP size that divides it, a seq_length "
                        f"divisible by {stage.tp}, or sequence_parallel: false")
                if training.recompute_method == "uniform" and \
                        stage.layers % training.recompute_num_layers:
                    raise LayoutError(
                        f"{where}.layers={stage.layers} is not a multiple of "
                        f"training.recompute_num_layers={training.recompute_num_layers} "
                        f"(recompute_method 'uniform' recomputes chunks of that many layers); "
                        f"pick a recompute_num_layers dividing every stage's layers, or "
                        f"recompute_method 'block'")
        micro = sum(p.micro_batches for p in self.pipelines)
        if micro * training.micro_batch_size != training.global_batch_size:
            raise LayoutError(
                f"pipelines[*].micro_batches sum to {micro}, and {micro} x micro_batch_size="
                f"{training.micro_batch_size} != global_batch_size="
                f"{training.global_batch_size}; make the micro_batches add up to "
                f"{training.total_micro_batches}")

    # ----- YAML ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"pipelines": [
            {"micro_batches": p.micro_batches,
             "stages": [{"tp": s.tp, "layers": s.layers, "ranks": list(s.ranks)}
                        for s in p.stages]}
            for p in self.pipelines]}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{where} must be a positive integer, got {value!r}")
    return value


def layout_from_dict(data: Any) -> Layout:
    """Build a Layout from its YAML/dict form, assigning ranks not given explicitly."""
    if not isinstance(data, dict) or not isinstance(data.get("pipelines"), list) \
            or not data["pipelines"]:
        raise LayoutError("a layout needs a non-empty 'pipelines' list")
    explicit: dict[int, str] = {}
    parsed = []
    for p, pipe in enumerate(data["pipelines"]):
        if not isinstance(pipe, dict) or not isinstance(pipe.get("stages"), list) \
                or not pipe["stages"]:
            raise LayoutError(f"pipelines[{p}] needs a non-empty 'stages' list")
        unknown = set(pipe) - {"micro_batches", "stages"}
        if unknown:
            raise LayoutError(f"pipelines[{p}]: unknown field(s) {sorted(unknown)}")
        mb = _positive_int(pipe.get("micro_batches"), f"pipelines[{p}].micro_batches")
        stages = []
        for s, stage in enumerate(pipe["stages"]):
            where = f"pipelines[{p}].stages[{s}]"
            if not isinstance(stage, dict):
                raise LayoutError(f"{where} must be a mapping like {{tp: 2, layers: 4}}")
            unknown = set(stage) - {"tp", "layers", "ranks"}
            if unknown:
                raise LayoutError(f"{where}: unknown field(s) {sorted(unknown)}")
            tp = _positive_int(stage.get("tp"), f"{where}.tp")
            layers = _positive_int(stage.get("layers"), f"{where}.layers")
            ranks = stage.get("ranks")
            if ranks is not None:
                if not isinstance(ranks, list) or len(ranks) != tp:
                    raise LayoutError(f"{where}.ranks must list exactly tp={tp} ranks, got {ranks!r}")
                for r in ranks:
                    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                        raise LayoutError(f"{where}.ranks: {r!r} is not a rank number")
                    if r in explicit:
                        raise LayoutError(
                            f"{where}.ranks: rank {r} is also used by {explicit[r]}; "
                            f"every rank may hold only one stage")
                    explicit[r] = where
                ranks = tuple(ranks)
            stages.append((tp, layers, ranks))
        parsed.append((mb, stages))

    free = (r for r in range(10**9) if r not in explicit)
    pipelines = []
    for mb, stages in parsed:
        built = []
        for tp, layers, ranks in stages:
            if ranks is None:
                ranks = tuple(next(free) for _ in range(tp))
            built.append(Stage(tp=tp, layers=layers, ranks=ranks))
        pipelines.append(Pipeline(micro_batches=mb, stages=tuple(built)))
    return Layout(pipelines=tuple(pipelines))


def mcore_pipeline_layout(stage_layers: Sequence[int]) -> list[list[str]]:
    """mcore's ``pipeline_model_parallel_layout`` for a pipeline with these layers per
    stage: the embedding on the first stage, the loss on the last."""
    stages = [["decoder"] * n for n in stage_layers]
    stages[0].insert(0, "embedding")
    stages[-1].append("loss")
    return stages


_SHORTHAND = re.compile(r"^dp(\d+)-tp(\d+)-pp(\d+)$")


def uniform_layout(dp: int, tp: int, pp: int, recipe: Recipe) -> Layout:
    """A Megatron-style layout with ranks in mcore's default order (tp-dp-pp)."""
    model, training = recipe.model, recipe.training
    if model.num_layers % pp:
        raise LayoutError(
            f"pp={pp} does not divide num_layers={model.num_layers}; write a layout YAML "
            f"with uneven 'layers' per stage instead of the shorthand")
    if training.total_micro_batches % dp:
        raise LayoutError(
            f"dp={dp} does not divide the {training.total_micro_batches} micro-batches of a "
            f"global batch; write a layout YAML with unequal 'micro_batches' instead")
    return layout_from_dict({"pipelines": [
        {"micro_batches": training.total_micro_batches // dp,
         "stages": [{"tp": tp, "layers": model.num_layers // pp,
                     "ranks": [t + tp * d + tp * dp * s for t in range(tp)]}
                    for s in range(pp)]}
        for d in range(dp)]})


def load_layout(spec: str | Path, recipe: Recipe) -> Layout:
    """A layout from a shorthand (``dp2-tp2-pp2``) or a YAML file, validated."""
    match = _SHORTHAND.match(str(spec))
    if match:
        dp, tp, pp = (int(g) for g in match.groups())
        for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
            if value <= 0:
                raise LayoutError(f"layout shorthand {spec}: {name} must be positive")
        layout = uniform_layout(dp, tp, pp, recipe)
    else:
        path = find_input(spec, "layout")
        if not path.is_file():
            raise LayoutError(
                f"layout {spec!s} is neither a shorthand like dp2-tp2-pp2, an existing YAML "
                f"file, nor a shipped layout ({', '.join(shipped('layout')) or 'none'})")
        layout = layout_from_dict(read_yaml_file(path, "layout file", LayoutError))
    layout.validate(recipe)
    return layout
