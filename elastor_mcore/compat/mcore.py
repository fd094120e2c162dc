"""The one place that knows how Megatron-Core versions differ (0.16 … 0.19).

Nothing else in the package checks mcore's version or probes for attributes that
only some versions have. Two things live here:

* ``install_parallel_state``: sets *every* process-group global and rank/world-size
  override that the installed ``megatron.core.parallel_state`` defines; the only
  code of the package that writes them, called only by ``parallel.groups.install``. The list is
  read from the module (its ``_UPPER_CASE`` globals), not kept by hand: each name is
  decomposed into an axis (tensor, pipeline, data, …) and a kind (group, ranks,
  override, …) and given this rank's value for that axis. A global we cannot
  classify is an error at install time, naming it, so a new mcore release that adds
  a group fails loudly before any model is built instead of with an assertion deep
  inside a forward pass (0.19 added the ``*_WITH_GTP_REMAT`` data-parallel groups,
  which 0.16-era code left unset).
* ``process_group_collection``: the ``ProcessGroupCollection`` matching those
  globals, built by mcore's own ``use_mpu_process_groups`` so its fields are the
  installed version's.

What the axes mean under an elastor layout (no context, expert or GTP-remat
parallelism, one distributed-optimizer instance, untied embeddings):

=====================================  ============================================
mcore axis                             this rank's group
=====================================  ============================================
tensor, expert-tensor, tensor+context,  its stage's TP ranks
expert tensor+model (tp-ep)
pipeline                               its stage chain (rank = stage index)
model, expert tensor-model-pipeline    every rank of its pipeline
data (any of with-CP, with-GTP-remat,  the exact replicas of its shard
intra-partial), expert data
tensor+data                            the stages of all its replicas
distributed-optimizer instance (intra) every active rank
context, expert-model, GTP remat,      the rank alone (these degrees are 1)
inter-partial, embedding, position
embedding
=====================================  ============================================

Embedding groups are the rank alone: embeddings are untied, so there is nothing to
synchronise between the first and last stage and every reduction on them is a
no-op; ``_EMBEDDING_GLOBAL_RANKS`` still lists the rank where it holds the word
embedding or the output layer (``is_rank_in_embedding_group``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


def mcore_version() -> tuple[int, ...]:
    """The installed megatron-core's (major, minor, patch)."""
    from megatron.core import package_info

    return tuple(int(p) for p in re.findall(r"\d+", package_info.__version__)[:3])


@dataclass
class Axis:
    """One of this rank's groups and its members (global ranks, in group order)."""

    group: Any
    ranks: list[int]

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class RankAxes:
    """Everything ``install_parallel_state`` needs about one active rank."""

    rank: int
    tp: Axis
    pp: Axis                    # stage chain, ranks in stage order
    dp: Axis
    model: Axis                 # the rank's whole pipeline
    tp_dp: Axis
    active: Axis
    single: Axis
    stage: int
    num_stages: int
    tp_rank: int
    dp_rank: int
    embedding_ranks: list[int] = field(default_factory=list)
    position_embedding_ranks: list[int] = field(default_factory=list)


class UnknownParallelStateGlobal(RuntimeError):
    """``parallel_state`` defines a global this module cannot give a value."""


# Name qualifiers that do not change the group under an elastor layout: gloo twins,
# all-gather twins, CP included (CP = 1), GTP remat included (GTP = 1), EGTP variants,
# intra-partial (one distributed-optimizer instance).
_QUALIFIERS = re.compile(r"_(GLOO|AG|WITH_CP|WITH_GTP_REMAT|WITH_EGTP)(?=_|$)")
_GROUP = re.compile(r"^_(?P<axis>.+?)_GROUPS?$")
_RANKS = re.compile(r"^_(?P<axis>.+?)(_GLOBAL)?_RANKS$")
_OVERRIDE = re.compile(r"^_MPU_(?P<axis>.+)_(?P<what>WORLD_SIZE|RANK)$")


def _axis_of(axes: RankAxes, name: str) -> Axis:
    """This rank's group for a ``parallel_state`` axis name (qualifiers removed)."""
    table = {
        "TENSOR_MODEL_PARALLEL": axes.tp,
        "TENSOR_AND_CONTEXT_PARALLEL": axes.tp,
        "EXPERT_TENSOR_PARALLEL": axes.tp,
        "EXPERT_TENSOR_AND_MODEL_PARALLEL": axes.tp,
        "PIPELINE_MODEL_PARALLEL": axes.pp,
        "PIPELINE": axes.pp,
        "MODEL_PARALLEL": axes.model,
        "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL": axes.model,
        "DATA_PARALLEL": axes.dp,
        "EXPERT_DATA_PARALLEL": axes.dp,
        "HYBRID_DP_CP": axes.dp,
        "TENSOR_AND_DATA_PARALLEL": axes.tp_dp,
        "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE": axes.active,
        "CONTEXT_PARALLEL": axes.single,
        "HIERARCHICAL_CONTEXT_PARALLEL": axes.single,
        "EXPERT_MODEL_PARALLEL": axes.single,
        "GTP_WEIGHT_REMAT": axes.single,
        "EXPERT_GTP_WEIGHT_REMAT": axes.single,
        "INTER_PARTIAL_EXPERT_DATA_PARALLEL": axes.single,
        "EMBEDDING": Axis(axes.single.group, axes.embedding_ranks),
        "POSITION_EMBEDDING": Axis(axes.single.group, axes.position_embedding_ranks),
    }
    if name not in table:
        raise KeyError(name)
    return table[name]


def _override(axes: RankAxes, axis: str, what: str) -> int | None:
    """Values for the ``_MPU_*`` overrides, which mcore's getters read first.

    The data-parallel pair is cleared rather than set: its getter then reads the DP
    group, which gives the same answer, and mcore's ``destroy_model_parallel`` (0.16
    to 0.19) does not reset it, so a value set here would outlive the layout and
    override a later ``initialize_model_parallel`` in the same process.
    """
    values = {
        "TENSOR_MODEL_PARALLEL": (axes.tp.size, axes.tp_rank),
        "EXPERT_TENSOR_PARALLEL": (axes.tp.size, axes.tp_rank),
        "PIPELINE_MODEL_PARALLEL": (axes.num_stages, axes.stage),
        "DATA_PARALLEL": (None, None),
        "EXPERT_MODEL_PARALLEL": (1, 0),
    }
    size, rank = values[axis]
    return size if what == "WORLD_SIZE" else rank


def parallel_state_globals() -> list[str]:
    """Every process-group global, ranks list, override and buffer ``parallel_state``
    defines (its ``_UPPER_CASE`` module globals)."""
    from megatron.core import parallel_state as ps

    return sorted(n for n in vars(ps) if re.fullmatch(r"_[A-Z][A-Z0-9_]*", n))


def global_values(axes: RankAxes, names: list[str]) -> dict[str, Any]:
    """The value of each global in ``names`` for this rank (buffers excluded)."""
    values: dict[str, Any] = {}
    unknown = []
    for name in names:
        try:
            values[name] = _value(axes, name)
        except KeyError:
            unknown.append(name)
        except _Skip:
            pass
    if unknown:
        raise UnknownParallelStateGlobal(
            f"megatron.core.parallel_state (mcore {'.'.join(map(str, mcore_version()))}) "
            f"defines globals elastor cannot set for a layout: {', '.join(unknown)}; "
            f"teach elastor_mcore/compat/mcore.py what they mean")
    return values


class _Skip(Exception):
    """A global that is not ours to set (buffers)."""


def _value(axes: RankAxes, name: str) -> Any:
    if name.startswith("_GLOBAL_") and name.endswith("MEMORY_BUFFER"):
        # Not groups: the memory buffer is created by install_parallel_state if absent;
        # the symmetric one (0.16, inference only, CUDA symmetric memory) is created on
        # demand by mcore's inference code and initialize_model_parallel leaves it too.
        raise _Skip
    if name.startswith("_VIRTUAL_PIPELINE_MODEL_PARALLEL_"):
        return None                          # no interleaved (virtual) pipeline stages
    if m := _OVERRIDE.match(name):
        return _override(axes, m["axis"], m["what"])
    base = _QUALIFIERS.sub("", name)
    base = base.replace("_INTRA_PARTIAL_", "_", 1) if base.startswith("_INTRA_PARTIAL_") else base
    if m := _RANKS.match(base):
        return list(_axis_of(axes, m["axis"]).ranks)
    if m := _GROUP.match(base):
        axis = _axis_of(axes, m["axis"])
        if name.endswith("_GROUPS"):
            if m["axis"] == "HYBRID_DP_CP":      # {group size: group}
                return {axis.size: axis.group}
            return [axis.group]                  # hierarchical CP: one level
        return axis.group
    raise KeyError(name)


def install_parallel_state(axes: RankAxes) -> None:
    """Point every ``parallel_state`` global at this rank's groups (see module doc)."""
    from megatron.core import parallel_state as ps

    for name, value in global_values(axes, parallel_state_globals()).items():
        setattr(ps, name, value)
    if getattr(ps, "_GLOBAL_MEMORY_BUFFER", None) is None:
        ps._set_global_memory_buffer()


def process_group_collection():
    """The installed version's ``ProcessGroupCollection`` from the current globals."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def set_tensor_parallel_args(args, tp: int) -> None:
    """Set Megatron-LM's parsed ``args`` to TP degree ``tp`` after its validation.

    From 0.19, ``TransformerConfig`` also takes ``tensor_parallel_num_weight_shards``
    (TP x GTP-remat), which Megatron-LM's validation resolved for the validated TP;
    it must follow the new degree or the config refuses a TP > 1 stage."""
    args.tensor_model_parallel_size = tp
    if getattr(args, "tensor_parallel_num_weight_shards", None) is not None:
        args.tensor_parallel_num_weight_shards = tp * getattr(args, "gtp_weight_remat_size", 1)


# ------------------------------------------------------------------ torch_dist checkpoints

TORCH_DIST_COMMON_FILE = "common.pt"
TORCH_DIST_COMMON_OBJECT = "common_state"


def torch_dist_common_object_key() -> str:
    """The DCP key under which mcore ≥ 0.19 stores a checkpoint's common state (a
    ``ShardedObject`` named ``common_state``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(TORCH_DIST_COMMON_OBJECT, None, (1,), (0,)).unique_key


def torch_dist_common_in_dcp() -> bool:
    """Whether the installed mcore's ``dist_checkpointing.save`` keeps the common state
    inside the DCP files (0.19) rather than in ``common.pt`` (0.16 - 0.18); both
    read either."""
    return mcore_version() >= (0, 19)


def torch_dist_common_object(common: dict) -> bytes:
    """``common`` as the bytes of mcore's ``common_state`` object (``torch.save([value])``)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save([common], buffer)
    return buffer.getvalue()


def torch_dist_common_state(checkpoint_dir, read_object) -> dict:
    """The common (non-sharded) state of a torch_dist checkpoint, wherever the mcore
    that *wrote* it put it (not the installed one: checkpoints cross versions):
    ``common.pt`` up to 0.18, the ``common_state`` object inside the DCP files from
    0.19. ``read_object(key) -> bytes | None`` reads one DCP object's raw bytes (mcore
    stores ``torch.save([value])``). Empty when the checkpoint has neither."""
    import io
    from pathlib import Path

    import torch

    file = Path(checkpoint_dir) / TORCH_DIST_COMMON_FILE
    if file.is_file():
        return torch.load(file, weights_only=False)
    data = read_object(torch_dist_common_object_key())
    if data is None:
        return {}
    return torch.load(io.BytesIO(data), weights_only=False)[0]
