"""Megatron-LM's arguments as an Elastor job: the model and batch as a ``Recipe``, the
``--elastor-layout`` validated against it, and the Megatron-LM flags the layout sets.

One translation for every caller: ``pretrain_gpt.py``'s parser (``args.py``, before
Megatron-LM validates the arguments), the hooks' options once they are validated, and
a launcher that holds only the user's argv (it parses them with Megatron-LM's own
parser and calls these). ``args`` is Megatron-LM's parsed namespace, before or after
its ``validate_args``; what validation would derive (the FFN width, selective
recompute from ``--recompute-activations``) is derived here the same way.

A leaf of the integration: it imports neither Megatron-LM, Megatron-Core nor
torch.distributed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from elastor_mcore.checkpoint.storage import is_url
from elastor_mcore.config.recipe import ModelConfig, Recipe, TrainingConfig
from elastor_mcore.config.yaml_file import read_yaml_file
from elastor_mcore.parallel.layout import Layout, LayoutError, layout_from_dict, load_layout

LAYOUT_FLAGS = {"tensor_model_parallel_size": "--tensor-model-parallel-size",
                "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
                "global_batch_size": "--global-batch-size"}
"""Megatron-LM's flags an ``--elastor-layout`` determines (destination -> flag)."""


def recipe_from_args(args: argparse.Namespace, vocab_size: int | None = None) -> Recipe:
    """The model, batch and memory settings Megatron-LM's arguments describe, as a Recipe
    (what the planner and ``Layout.validate`` read): layers, hidden, FFN, heads, query
    groups, sequence length, vocabulary and its padding, micro and global batch, bf16 or
    fp32, sequence parallelism, activation recompute, the distributed optimizer and the
    communication overlaps.

    ``vocab_size`` is the tokenizer's (unpadded) vocabulary; without it ``--vocab-size``
    is used, never Megatron's ``padded_vocab_size`` (padding it again would record a
    wrong vocabulary)."""
    heads = args.num_attention_heads
    vocab = vocab_size or args.vocab_size
    if not vocab:
        raise ValueError("the vocabulary size is unknown: pass --vocab-size (or a tokenizer "
                         "that defines it) with --elastor-layout / --elastor-ckpt-format")
    model = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else heads,
        ffn_hidden_size=ffn_hidden_size(args),
        vocab_size=vocab,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        rotary_base=int(args.rotary_base),
        norm_epsilon=args.layernorm_epsilon,
        init_method_std=args.init_method_std,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )
    granularity, method, recompute_layers = recompute(args)
    training = TrainingConfig(
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        seed=args.seed, params_dtype="bfloat16" if args.bf16 else "float32",
        distributed_optimizer=bool(args.use_distributed_optimizer),
        sequence_parallel=requested_sequence_parallel(args),
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
        overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
        recompute_granularity=granularity, recompute_method=method,
        recompute_num_layers=recompute_layers)
    return Recipe(name="megatron-lm", model=model, training=training)


def requested_sequence_parallel(args: argparse.Namespace) -> bool:
    """``--sequence-parallel`` as given: Megatron-LM's validation turns it off at TP 1,
    the placeholder of a heterogeneous layout, so the parser records it
    (``elastor_sequence_parallel``) for the stages of TP > 1."""
    return bool(getattr(args, "elastor_sequence_parallel", args.sequence_parallel))


def ffn_hidden_size(args: argparse.Namespace) -> int:
    """``--ffn-hidden-size``, or what Megatron-LM's validation makes of its absence:
    4 x hidden, or with ``--swiglu`` two thirds of that rounded down to 64."""
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    if args.swiglu:
        return int((4 * args.hidden_size * 2 / 3) / 64) * 64
    return 4 * args.hidden_size


def recompute(args: argparse.Namespace) -> tuple[str | None, str | None, int | None]:
    """(granularity, method, layers) of activation recompute: ``--recompute-activations``
    means selective (Megatron-LM's validation turns it into that), and without a
    granularity Megatron-Core ignores ``--recompute-method`` and ``--recompute-num-layers``."""
    granularity = "selective" if getattr(args, "recompute_activations", False) \
        else args.recompute_granularity
    if granularity is None:
        return None, None, None
    return granularity, args.recompute_method, args.recompute_num_layers


def llama_differences(args: argparse.Namespace) -> list[str]:
    """How Megatron-LM's arguments differ from the Llama-style decoder a ``ModelConfig``
    describes (RMSNorm, SwiGLU, RoPE, no biases, untied embeddings); empty if none."""
    checks = (("--normalization RMSNorm", args.normalization == "RMSNorm"),
              ("--swiglu", args.swiglu),
              ("--position-embedding-type rope", args.position_embedding_type == "rope"),
              ("--disable-bias-linear", not args.add_bias_linear),
              ("--untie-embeddings-and-output-weights",
               args.untie_embeddings_and_output_weights),
              ("no --qk-layernorm", not getattr(args, "qk_layernorm", False)),
              ("no --num-experts", not getattr(args, "num_experts", None)))
    return [flag for flag, holds in checks if not holds]


def explicit_flags(argv: Sequence[str]) -> dict[str, str]:
    """Destinations of ``LAYOUT_FLAGS`` given on the command line -> the value given
    (Megatron-LM's parser takes no abbreviations)."""
    given = {}
    for i, token in enumerate(argv):
        for dest, flag in LAYOUT_FLAGS.items():
            if token == flag and i + 1 < len(argv):
                given[dest] = argv[i + 1]
            elif token.startswith(flag + "="):
                given[dest] = token.split("=", 1)[1]
    return given


def layout_from_args(args: argparse.Namespace) -> Layout:
    """``--elastor-layout``, validated against the recipe of ``args`` (the vocabulary,
    which may be unknown until the tokenizer exists, constrains no layout)."""
    return load_layout(args.elastor_layout, recipe_from_args(args, 1))


def is_heterogeneous(args: argparse.Namespace) -> bool:
    """Whether ``--elastor-layout`` names a layout Megatron-LM's own loop cannot train
    (its TP and PP arguments are then placeholders until each rank knows its stage)."""
    return bool(getattr(args, "elastor_layout", None)) and not layout_from_args(args).is_uniform


def _provisional_global_batch(args: argparse.Namespace, world_size: int) -> int:
    """The global batch the layout implies: a YAML layout's micro-batch counts, or for a
    shorthand (which has none) Megatron's default, one micro-batch per pipeline."""
    spec = args.elastor_layout
    if Path(spec).is_file():
        layout = layout_from_dict(read_yaml_file(spec, "layout file", LayoutError))
        return sum(p.micro_batches for p in layout.pipelines) * args.micro_batch_size
    args.global_batch_size = args.micro_batch_size * world_size  # any multiple of dp
    return args.micro_batch_size * len(layout_from_args(args).pipelines)


def apply_layout_args(args: argparse.Namespace, explicit: dict[str, str],
                      world_size: int) -> Layout:
    """Set TP, PP and the global batch of ``args`` from ``--elastor-layout`` (before
    Megatron-LM validates them) and return the validated layout. An explicit flag that
    disagrees, or a layout Megatron-LM cannot run on ``world_size`` ranks whatever the
    loop, is a ValueError naming the fix."""
    spec = args.elastor_layout
    if "global_batch_size" not in explicit:
        args.global_batch_size = _provisional_global_batch(args, world_size)
    layout = layout_from_args(args)
    if layout.is_uniform:
        stages = layout.pipelines[0].stages
        derived = {"tensor_model_parallel_size": stages[0].tp,
                   "pipeline_model_parallel_size": len(stages)}
        if len({s.layers for s in stages}) > 1 and not uneven_split_given(args):
            # Megatron-LM validates PP against the layers before each rank's stage is set
            # (``args.adapt_args``): without the split, 8 layers on 7 stages fail there.
            args.pipeline_model_parallel_layout = pipeline_layout_string(
                [s.layers for s in stages])
    else:  # each rank's values are set with its stage; these only pass Megatron's checks
        derived = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    for dest, value in derived.items():
        if dest in explicit and layout.is_uniform and int(explicit[dest]) != value:
            raise ValueError(
                f"{LAYOUT_FLAGS[dest]} {explicit[dest]} conflicts with --elastor-layout "
                f"{spec} ({layout.describe()} has {value}); drop {LAYOUT_FLAGS[dest]}: "
                f"the layout sets it")
        if dest not in explicit:
            setattr(args, dest, value)
    if layout.num_gpus != world_size:
        raise ValueError(
            f"--elastor-layout {spec}: the layout uses {layout.num_gpus} ranks but "
            f"{world_size} were started; Megatron-LM needs work on every rank: start "
            f"exactly {layout.num_gpus} (torchrun --nproc-per-node ...)")
    if getattr(args, "virtual_pipeline_model_parallel_size", None) or getattr(
            args, "num_layers_per_virtual_pipeline_stage", None):
        raise ValueError(
            f"--elastor-layout {spec}: virtual pipeline stages are not supported; drop "
            f"--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size")
    return layout


def uneven_split_given(args: argparse.Namespace) -> bool:
    """Whether Megatron-LM's own flags already say how layers split over stages."""
    return any(getattr(args, name, None) is not None for name in (
        "pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers"))


def pipeline_layout_string(stage_layers: Sequence[int]) -> str:
    """``--pipeline-model-parallel-layout`` for these layers per stage: the embedding
    (``E``) on the first stage, the loss (``L``) on the last, ``t`` per decoder layer."""
    stages = ["t" * n for n in stage_layers]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return "|".join(stages)


def check_checkpoint_flags(args: argparse.Namespace) -> None:
    """Elastor's checkpoint flags against Megatron-LM's (a ValueError naming both)."""
    if args.elastor_ckpt_keep < 0:
        raise ValueError(f"--elastor-ckpt-keep={args.elastor_ckpt_keep}: use 0 (keep all) "
                         f"or a positive count")
    ckpt_format = getattr(args, "ckpt_format", "torch_dist")
    if args.elastor_ckpt_format and ckpt_format != "torch_dist":
        raise ValueError(f"--elastor-ckpt-format {args.elastor_ckpt_format} replaces the "
                         f"torch_dist backend; drop --ckpt-format {ckpt_format} (the default, "
                         f"torch_dist, is needed)")
    save = getattr(args, "save", None)
    if save and is_url(save) and args.elastor_ckpt_format != "zarr":
        raise ValueError(f"--save {save}: Megatron-LM's own formats write local directories; "
                         f"add --elastor-ckpt-format zarr to save to object storage, or "
                         f"save to a local directory")
    if save and is_url(save) and getattr(args, "save_retain_interval", None):
        raise ValueError(f"--save-retain-interval deletes local directories; with --save "
                         f"{save} use --elastor-ckpt-keep N instead")
    if save and is_url(save) and getattr(args, "log_progress", False):
        raise ValueError(f"--log-progress writes progress.txt into a local --save "
                         f"directory; drop it with --save {save}")
