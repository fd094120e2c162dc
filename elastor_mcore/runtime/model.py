"""Build this rank's stage of the Llama-style mcore ``GPTModel`` and initialise it
independently of the layout.

mcore bakes the TP degree into its modules at construction, so the stage is built
under the rank's own ``parallel_state`` view (``groups.install``). Layer numbering is
global: the stage's layers come from ``pipeline_model_parallel_layout``, built from the
layout's layers per stage, so checkpoint keys and initial values are the same whichever
stage holds a layer.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import torch

from elastor_mcore.parallel.groups import RankGroups
from elastor_mcore.parallel.layout import mcore_pipeline_layout
from elastor_mcore.config.recipe import Recipe
from elastor_mcore.parallel.shards import sharded_tensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformer_config(recipe: Recipe, tp: int, stage_layers: list[int]):
    """The mcore ``TransformerConfig`` for one stage of a pipeline with ``stage_layers``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model, training = recipe.model, recipe.training
    dtype = DTYPES[training.params_dtype]
    pipeline_layout = mcore_pipeline_layout(stage_layers) if len(stage_layers) > 1 else None
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size,
        kv_channels=model.kv_channels,
        layernorm_epsilon=model.norm_epsilon,
        init_method_std=model.init_method_std,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=len(stage_layers),
        pipeline_model_parallel_layout=pipeline_layout,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        sequence_parallel=training.sequence_parallel and tp > 1,
        recompute_granularity=training.recompute_granularity,
        recompute_method=training.recompute_method,
        recompute_num_layers=training.recompute_num_layers,
        use_cpu_initialization=True,
        perform_initialization=False,
    )


class SequenceParallelRMSNorm:
    """``torch.nn.RMSNorm`` for mcore's local spec under sequence parallelism.

    mcore's torch norm refuses ``sequence_parallel`` only because it does not mark its
    weight (Apex's and TE's norms do): an RMSNorm is per token, so it is exact on a
    slice of the sequence, and a weight marked ``sequence_parallel`` has its gradient
    summed over the TP group (``grad_sync.SequenceParallelGrads``), as mcore's
    ``finalize_model_grads`` does.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(config=None, num_layers: int | None = None):
    """Transformer Engine's layer spec where TE is installed, mcore's local one otherwise.

    Under sequence parallelism (``config.sequence_parallel``) the local spec's norms are
    ``SequenceParallelRMSNorm``, and it is a block spec of the stage's ``num_layers``
    layers so that the final norm is one too.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        local = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
        if config is None or not config.sequence_parallel:
            return local
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_block import (TransformerBlock,
                                                                 TransformerBlockSubmodules)

        norm = SequenceParallelRMSNorm
        layer = replace(local, submodules=replace(local.submodules, input_layernorm=norm,
                                                  pre_mlp_layernorm=norm))
        return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
            layer_specs=[layer] * num_layers, layer_norm=norm))
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()


def build_stage_model(recipe: Recipe, groups: RankGroups, pg_collection) -> torch.nn.Module:
    """The rank's stage of the GPTModel (call after ``groups.install``)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    pipeline = groups.layout.pipelines[groups.position.pipeline]
    stage = pipeline.stages[groups.position.stage]
    config = transformer_config(recipe, stage.tp, [s.layers for s in pipeline.stages])
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, stage.layers),
        vocab_size=recipe.model.padded_vocab_size,
        max_sequence_length=recipe.model.max_position_embeddings or recipe.model.seq_length,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=recipe.model.rotary_base,
        pg_collection=pg_collection,
    )
    # The local spec's norms are torch modules created in fp32; Megatron's
    # Float16Module casts the whole stage, so every weight and activation is bf16.
    return model.to(config.params_dtype)


def parameter_seed(seed: int, key: str) -> int:
    """A seed for one global tensor, from the run seed and the tensor's global key."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(key: str, global_shape: tuple[int, ...], recipe: Recipe,
                  seed: int) -> torch.Tensor:
    """The full initial value of a global tensor (fp32), as Megatron initialises it:
    norms to one, ``linear_proj``/``linear_fc2`` from N(0, std/sqrt(2L)), the rest from
    N(0, std)."""
    if key.endswith("layer_norm_weight") or key.endswith("layernorm.weight"):
        return torch.ones(global_shape)
    std = recipe.model.init_method_std
    if key.endswith("linear_proj.weight") or key.endswith("linear_fc2.weight"):
        std /= math.sqrt(2.0 * recipe.model.num_layers)
    generator = torch.Generator().manual_seed(parameter_seed(seed, key))
    return torch.empty(global_shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def initialize_weights(model: torch.nn.Module, recipe: Recipe, seed: int) -> None:
    """Overwrite every local shard with its slice of the seeded global tensor.

    Each global tensor is generated whole from its own seed, so every layout sees the
    same full weights (a layout-independent "load from a seeded generator").
    """
    for st in sharded_tensors(model):
        full = initial_value(st.key, tuple(st.global_shape), recipe, seed)
        box = tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.local_shape))
        st.data.copy_(full[box])
