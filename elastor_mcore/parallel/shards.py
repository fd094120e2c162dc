"""Where a rank's tensors sit in the global ones, from mcore's ``sharded_state_dict()``.

Tensor identity comes from mcore's ShardedTensors (per-layer keys, SwiGLU ``fc1``
split into its ``_w``/``_v`` halves by ``apply_factories``), never from parameter
names. Everything that must not depend on the layout goes through this module:
initialisation, gradient reduction, the gradient norm, and the checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from elastor_mcore.geometry import Box, ShardInfo

if TYPE_CHECKING:
    from elastor_mcore.config.recipe import ModelConfig
    from elastor_mcore.parallel.layout import Layout

SHARDED_METADATA = {"singleton_local_shards": True}
"""Per-layer keys: with stacked layer keys a heterogeneous layout's shards overlap."""


def sharded_tensors(model: torch.nn.Module) -> list:
    """The model's ShardedTensors (per-layer keys, factories applied), sorted by key.

    ShardedObjects (``_extra_state``) carry nothing for these models and are dropped.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model.sharded_state_dict(metadata=dict(SHARDED_METADATA))
    apply_factories(state)
    found = [v for v in nested_values(state) if isinstance(v, ShardedTensor)]
    return sorted(found, key=lambda st: st.key)


def shard_info(st) -> ShardInfo:
    return ShardInfo(
        key=st.key,
        global_shape=tuple(st.global_shape),
        box=Box(tuple(st.global_offset), tuple(st.local_shape)),
        dtype=str(st.dtype).replace("torch.", ""),
    )


def owning_parameter(model: torch.nn.Module, data: torch.Tensor) -> torch.nn.Parameter:
    """The parameter ``data`` (a ShardedTensor's data) is a view of: the one whose part
    of their storage holds it (parameters may share one storage: Megatron's DDP keeps
    them in one buffer under the distributed optimizer)."""
    ptr, start = data.untyped_storage().data_ptr(), data.storage_offset()
    for p in model.parameters():
        if p.untyped_storage().data_ptr() == ptr and \
                p.storage_offset() <= start < p.storage_offset() + max(1, p.numel()):
            return p
    raise KeyError("sharded tensor data is not a view of any parameter of the model")


def tp_split_dim(model: torch.nn.Module, st, tp: int) -> int | None:
    """The dimension a stage's TP ranks split ShardedTensor ``st``'s tensor along (None:
    each holds it whole): where its box is narrower than the tensor; at TP 1, where
    every box is whole, the one mcore marks on the parameter (``partition_dim``; set
    for weights only when mcore initialises them) or the one its layer splits weights
    along (column-parallel and embedding layers the first, row-parallel the second;
    Transformer Engine's by ``parallel_mode``)."""
    narrow = [d for d, (n, g) in enumerate(zip(st.local_shape, st.global_shape)) if n != g]
    if narrow or tp > 1:
        return narrow[0] if narrow else None
    param = owning_parameter(model, st.data)
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim)
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding)

    for module in model.modules():
        if dict(module.named_parameters(recurse=False)).get("weight") is param:
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                return 0
            if isinstance(module, RowParallelLinear):
                return 1
            return {"column": 0, "row": 1}.get(getattr(module, "parallel_mode", None))
    return None


def view_like(data: torch.Tensor, param: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The part of ``other`` (laid out like ``param``: its grad, an Adam moment) that
    corresponds to ``data``, a view into ``param``."""
    if other.shape != param.shape or other.stride() != param.stride():
        raise ValueError("tensor is not laid out like the parameter")
    offset = data.storage_offset() - param.storage_offset() + other.storage_offset()
    return other.as_strided(data.shape, data.stride(), offset)


ADAM_STATE_PREFIXES = ("", "optimizer.exp_avg.", "optimizer.exp_avg_sq.")
"""A training state's tensors per model weight: the fp32 main weight and AdamW's two
moments (``runtime.state.state_shards``; mirrored here, which imports no runtime)."""


def tp_box(shape: tuple[int, ...], dim: int | None, tp: int, tp_rank: int) -> Box:
    """The box TP rank ``tp_rank`` of ``tp`` holds of a tensor split along ``dim``
    (None: replicated), as mcore's tensor-parallel layers shard it: equal parts."""
    if dim is None:
        return Box((0,) * len(shape), tuple(shape))
    part = shape[dim] // tp
    offset = [0] * len(shape)
    offset[dim] = tp_rank * part
    local = list(shape)
    local[dim] = part
    return Box(tuple(offset), tuple(local))


def stage_tensors(model: "ModelConfig", layers: range, first: bool, last: bool
                  ) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """The global tensors of a stage holding ``layers`` (a pipeline's ``first`` and/or
    ``last`` stage), from the shapes alone: key -> (global shape, the dimension TP
    splits, None where every TP rank holds it whole). mcore's local layer spec,
    per-layer keys, SwiGLU ``fc1`` as ``_w``/``_v``, untied embeddings."""
    h, ffn, vocab = model.hidden_size, model.ffn_hidden_size, model.padded_vocab_size
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * model.kv_channels
    per_layer = {  # suffix: (global shape, TP-split dim)
        "self_attention.linear_qkv.layer_norm_weight": ((h,), None),
        "self_attention.linear_qkv.weight": ((qkv, h), 0),
        "self_attention.linear_proj.weight": ((h, h), 1),
        "mlp.linear_fc1.layer_norm_weight": ((h,), None),
        "mlp.linear_fc1.weight_w": ((ffn, h), 0),
        "mlp.linear_fc1.weight_v": ((ffn, h), 0),
        "mlp.linear_fc2.weight": ((h, ffn), 1),
    }
    tensors = {f"decoder.layers.{layer}.{suffix}": spec
               for layer in layers for suffix, spec in per_layer.items()}
    if first:
        tensors["embedding.word_embeddings.weight"] = ((vocab, h), 0)
    if last:
        tensors["decoder.final_layernorm.weight"] = ((h,), None)
        tensors["output_layer.weight"] = ((vocab, h), 0)
    return tensors


def layout_shard_infos(model: "ModelConfig", layout: "Layout", rank: int, dtype: str = "float32",
                       prefixes: Iterable[str] = ADAM_STATE_PREFIXES) -> list[ShardInfo]:
    """What ``rank`` holds under ``layout``, from the shapes alone: the ShardInfos of
    its stage's ShardedTensors (mcore's local layer spec, per-layer keys, SwiGLU
    ``fc1`` as ``_w``/``_v``), once per ``prefixes`` entry, sorted by key.

    No model is built, so a 405B model
    on 16,384 ranks can be planned on paper (``tools/bench_scale.py``);
    ``tests/test_bench_scale.py`` checks it against real ``sharded_state_dict()``s.
    """
    position = layout.position(rank)
    if position is None:
        return []
    stages = layout.pipelines[position.pipeline].stages
    tp, t = stages[position.stage].tp, position.tp_rank
    tensors = stage_tensors(model, layout.layer_range(position.pipeline, position.stage),
                            position.stage == 0, position.stage == len(stages) - 1)
    return sorted((ShardInfo(prefix + key, shape, tp_box(shape, dim, tp, t), dtype)
                   for key, (shape, dim) in tensors.items() for prefix in prefixes),
                  key=lambda info: info.key)


def replica_classes(layout: "Layout") -> tuple[tuple[int, ...], ...]:
    """The ranks that hold the same ShardedTensors under ``layout``, with the same
    boxes (``layout_shard_infos``' geometry: the same layers, TP degree and TP rank,
    and the same ends of the pipeline): each stage's data-parallel replicas, as
    ``checkpoint.plan.Replicas`` takes them. Not under ZeRO-1, whose replicas hold
    different parts of the optimizer state."""
    classes: dict[tuple, list[int]] = {}
    for p, pipeline in enumerate(layout.pipelines):
        last = len(pipeline.stages) - 1
        for s, stage in enumerate(pipeline.stages):
            layers = layout.layer_range(p, s)
            for tp_rank, rank in enumerate(stage.ranks):
                classes.setdefault((layers.start, layers.stop, s == 0, s == last, stage.tp,
                                    tp_rank), []).append(rank)
    return tuple(sorted(tuple(sorted(members)) for members in classes.values()))
