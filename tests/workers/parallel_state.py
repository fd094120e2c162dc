"""Worker: every ``parallel_state`` getter answers after ``groups.install``.

Three installs, in the 4-rank gloo world of ``checkpoint_mcore`` (``run``):

* ``hetero``: one pipeline TP2 (ranks 0-1) | TP1 (rank 2) | TP1 (rank 3): every
  getter of the installed mcore is called (every combination of its boolean keyword
  arguments) and must answer; the values must be this rank's.
* ``dp2-tp1-pp2`` and ``dp1-tp2-pp2``: uniform layouts, where each answer must equal
  the one mcore's own ``initialize_model_parallel`` gives (groups compared by ranks).

Rank 0 writes ``result.json`` (each rank's failures) into the directory ``run`` is given.
"""

from __future__ import annotations

import inspect
import itertools
import json
from pathlib import Path

import torch.distributed as dist

HETERO = {"pipelines": [{"micro_batches": 16, "stages": [
    {"tp": 2, "layers": 3}, {"tp": 1, "layers": 3}, {"tp": 1, "layers": 2}]}]}

# Not parallel-state getters, or not ours to create (see tests/test_parallel_state.py).
EXCLUDED = {
    "get_nccl_options": "NCCL option lookup by group name, not state",
    "get_global_symmetric_memory_buffer":
        "0.16 inference buffer on CUDA symmetric memory; mcore's own "
        "initialize_model_parallel does not create it either",
}
# Argument combinations mcore rejects by contract ("Partial DP for Optimizer needs to
# include CP"), whatever the groups.
def _rejected(kwargs: dict) -> bool:
    return kwargs.get("partial_data_parallel") and not kwargs.get("with_context_parallel", False)


def getter_calls(ps, dp_size: int):
    """(label, function, kwargs) for every getter and boolean-argument combination."""
    for name in sorted(vars(ps)):
        fn = getattr(ps, name)
        if not (name.startswith(("get_", "is_")) and inspect.isfunction(fn)) \
                or fn.__module__ != ps.__name__ or name in EXCLUDED:
            continue
        params = inspect.signature(fn).parameters
        flags = [p for p, v in params.items()
                 if isinstance(v.default, bool) and p != "check_initialized"]
        base = {"check_initialized": True} if "check_initialized" in params else {}
        if "group_size" in params:           # hybrid DP-CP groups, keyed by size
            base["group_size"] = dp_size
        for values in itertools.product([False, True], repeat=len(flags)):
            kwargs = dict(base, **dict(zip(flags, values)))
            if not _rejected(kwargs):
                label = name + "(" + ",".join(f"{k}={v}" for k, v in kwargs.items()) + ")"
                yield label, fn, kwargs


def answer(value):
    """A comparable form of a getter's answer (groups by their global ranks)."""
    if isinstance(value, dist.ProcessGroup):
        return ("group", dist.get_process_group_ranks(value))
    if isinstance(value, (list, tuple)):
        return [answer(v) for v in value]
    if isinstance(value, dict):
        return {str(k): answer(v) for k, v in value.items()}
    if isinstance(value, (int, str, bool)) or value is None:
        return value
    return type(value).__name__


def call_all(ps, dp_size: int) -> dict[str, object]:
    """label -> answer, or "ERROR ..." where the getter raised."""
    out = {}
    for label, fn, kwargs in getter_calls(ps, dp_size):
        try:
            out[label] = answer(fn(**kwargs))
        except Exception as e:  # noqa: BLE001 - every failure is reported
            out[label] = f"ERROR {type(e).__name__}: {e}"
    return out


def check_hetero(ps, groups, pg) -> list[str]:
    """Every getter answers, with this rank's values."""
    rank = dist.get_rank()
    answers = call_all(ps, len(groups.dp_ranks))
    bad = [f"{k}: {v}" for k, v in answers.items() if isinstance(v, str) and v.startswith("ERROR")]
    stage = groups.layout.pipelines[0].stages[groups.position.stage]
    expect = {   # getter (called with its defaults) -> this rank's value
        "get_tensor_model_parallel_world_size": stage.tp,
        "get_tensor_model_parallel_rank": groups.tp.rank(),
        "get_pipeline_model_parallel_world_size": 3,
        "get_pipeline_model_parallel_rank": groups.position.stage,
        "get_data_parallel_world_size": 1,
        "get_context_parallel_world_size": 1,
        "get_expert_model_parallel_world_size": 1,
        "get_expert_model_parallel_rank": 0,
        "get_expert_tensor_parallel_world_size": stage.tp,
        "get_pipeline_model_parallel_first_rank": groups.pp_ranks[0],
        "get_pipeline_model_parallel_last_rank": groups.pp_ranks[-1],
        "is_pipeline_first_stage": groups.position.stage == 0,
        "is_pipeline_last_stage": groups.position.stage == 2,
    }
    for name, want in expect.items():
        try:
            got = getattr(ps, name)()
        except Exception as e:  # noqa: BLE001
            got = f"ERROR {type(e).__name__}: {e}"
        if got != want:
            bad.append(f"{name}() = {got!r}, want {want!r}")
    for label, value in answers.items():   # every group answered holds this rank
        for kind, ranks in _groups_in(value):
            if rank not in ranks:
                bad.append(f"{label}: group {ranks} does not hold rank {rank}")
    if answers.get("get_tensor_model_parallel_group(check_initialized=True)") != \
            ("group", sorted(stage.ranks)):
        bad.append("TP group is not the stage's ranks")
    for field in vars(pg):
        value = getattr(pg, field)
        for _, ranks in _groups_in(answer(value)):
            if rank not in ranks:
                bad.append(f"ProcessGroupCollection.{field} {ranks} lacks rank {rank}")
    return bad


def _groups_in(value):
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "group":
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _groups_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _groups_in(v)


# Where our install deliberately differs from mcore's initialize_model_parallel.
DIFFERS = (
    # Embeddings are untied: the rank alone, not mcore's first+last stage pair.
    "get_embedding_group", "get_position_embedding_group",
    "is_rank_in_embedding_group", "is_rank_in_position_embedding_group",
)


def check_uniform(ps, spec: str, recipe) -> list[str]:
    """Our install answers like mcore's own initialize_model_parallel."""
    from elastor_mcore.parallel.groups import GroupCache, build_groups, install
    from elastor_mcore.parallel.layout import load_layout

    layout = load_layout(spec, recipe)
    tp = layout.pipelines[0].stages[0].tp
    pp = len(layout.pipelines[0].stages)
    dp = len(layout.pipelines)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    theirs = call_all(ps, dp)
    ps.destroy_model_parallel()
    install(build_groups(layout, GroupCache()))
    ours = call_all(ps, dp)
    bad = []
    for label, value in theirs.items():
        if isinstance(value, str) and value.startswith("ERROR"):
            if isinstance(ours[label], str) and ours[label].startswith("ERROR"):
                bad.append(f"{spec} {label}: {ours[label]}")
            continue
        if label.startswith(DIFFERS) or label.startswith("get_global_memory_buffer"):
            continue
        if ours[label] != value:
            bad.append(f"{spec} {label}: ours {ours[label]!r}, mcore {value!r}")
    return bad


def run(out: Path, recipe_path: str) -> None:
    """The three installs' checks on this (fresh) world; rank 0 writes
    ``out/result.json``. Run first in ``checkpoint_mcore``'s world (its rank start-up is
    most of either job's cost), before anything initializes ``parallel_state``."""
    from megatron.core import parallel_state as ps

    from elastor_mcore.compat import cpu
    from elastor_mcore.compat.mcore import mcore_version
    from elastor_mcore.config.recipe import load_recipe
    from elastor_mcore.parallel.groups import GroupCache, build_groups, install
    from elastor_mcore.parallel.layout import layout_from_dict

    cpu.apply_if_needed()
    groups = build_groups(layout_from_dict(HETERO), GroupCache())
    pg = install(groups)
    report = {"rank": dist.get_rank(), "hetero": check_hetero(ps, groups, pg),
              "calls": len(list(getter_calls(ps, 1)))}
    recipe = load_recipe(recipe_path)
    for spec in ("dp2-tp1-pp2", "dp1-tp2-pp2"):
        report[spec] = check_uniform(ps, spec, recipe)
    ps.destroy_model_parallel()
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(
            {"mcore": list(mcore_version()), "ranks": reports}, indent=1))
