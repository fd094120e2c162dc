"""Elastor's flags for Megatron-LM's ``pretrain_gpt.py``, and the hook its patch calls.

``add_elastor_args`` adds the flags (a separate ``--elastor-ckpt-format``: Megatron's
``--ckpt-format`` choices are a fixed list). ``install_hooks`` installs
``hooks`` with options read from Megatron-LM's parsed arguments on first use,
since Megatron-LM parses them inside ``pretrain`` (core_r0.16) or just before it.

Under an ``--elastor-layout`` each rank's Megatron arguments are rewritten to its own
stage (TP degree, stage count, layers per stage, layout-independent vocabulary
padding), so Megatron-LM's model provider builds exactly that rank's stage.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from elastor_mcore.integrations.megatron_lm import hooks
from elastor_mcore.checkpoint import ChunkPolicy
from elastor_mcore.checkpoint.storage import is_url
from elastor_mcore.compat.mcore import set_tensor_parallel_args
from elastor_mcore.parallel.groups import RankGroups
from elastor_mcore.parallel.layout import (
    Layout, LayoutError, layout_from_dict, load_layout, mcore_pipeline_layout)
from elastor_mcore.config.yaml_file import read_yaml_file
from elastor_mcore.checkpoint.megatron_dir import ZarrSaveSettings
from elastor_mcore.integrations.megatron_lm.hooks import CKPT_FORMATS, ElastorOptions
from elastor_mcore.config.recipe import ModelConfig, Recipe, TrainingConfig

log = logging.getLogger(__name__)


def add_elastor_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Elastor's flags to Megatron-LM's parser (an ``extra_args_provider``)."""
    group = parser.add_argument_group("elastor", "Elastor: heterogeneous layouts and "
                                      "partition-agnostic zarr checkpoints")
    group.add_argument("--elastor-layout", default=None, metavar="SPEC",
                       help="layout YAML file or shorthand like dp2-tp2-pp2; builds "
                            "Elastor's process groups instead of Megatron's uniform grid")
    group.add_argument("--elastor-ckpt-format", default=None, choices=CKPT_FORMATS,
                       help="save checkpoints in the elastor zarr format (any layout "
                            "loads them); zarr and torch_dist checkpoints both load, "
                            "told apart by metadata.json")
    group.add_argument("--elastor-ckpt-keep", type=int, default=0, metavar="N",
                       help="keep only the N newest zarr checkpoints under --save "
                            "(default 0: keep all)")
    group.add_argument("--elastor-split-sizes", type=int, nargs="+", default=None,
                       metavar="TP",
                       help="TP degrees that later layouts may load the checkpoint with; "
                            "inner chunks are cut so each one reads whole chunks "
                            "(default: every TP degree the model allows)")
    _derive_from_layout_on_parse(parser)
    return parser


LAYOUT_FLAGS = {"tensor_model_parallel_size": "--tensor-model-parallel-size",
                "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
                "global_batch_size": "--global-batch-size"}
"""Megatron-LM's flags an ``--elastor-layout`` determines (destination -> flag)."""


def _derive_from_layout_on_parse(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` fill the layout's flags in as soon as it has parsed, i.e. before
    Megatron-LM validates them; a bad layout is a parser error on every rank, before
    torch.distributed starts."""
    original = parser.parse_known_args

    def parse_known_args(args: Sequence[str] | None = None, namespace=None):
        parsed, extras = original(args, namespace)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            check_checkpoint_flags(parsed)
            if parsed.elastor_layout:
                apply_layout_args(parsed, explicit_flags(argv),
                                  int(os.environ.get("WORLD_SIZE", "1")))
        except (ValueError, LayoutError) as exc:
            parser.error(str(exc))
        return parsed, extras

    parser.parse_known_args = parse_known_args


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


def _provisional_global_batch(args: argparse.Namespace, world_size: int) -> int:
    """The global batch the layout implies: a YAML layout's micro-batch counts, or for a
    shorthand (which has none) Megatron's default, one micro-batch per pipeline."""
    spec = args.elastor_layout
    if Path(spec).is_file():
        layout = layout_from_dict(read_yaml_file(spec, "layout file", LayoutError))
        return sum(p.micro_batches for p in layout.pipelines) * args.micro_batch_size
    args.global_batch_size = args.micro_batch_size * world_size  # any multiple of dp
    pipelines = len(load_layout(spec, recipe_from_args(args, 1)).pipelines)
    return args.micro_batch_size * pipelines


def is_heterogeneous(args: argparse.Namespace) -> bool:
    """Whether ``--elastor-layout`` names a layout Megatron-LM's own loop cannot train
    (its TP and PP arguments are then placeholders until ``adapt_args``)."""
    spec = getattr(args, "elastor_layout", None)
    return bool(spec) and not load_layout(spec, recipe_from_args(args, 1)).is_uniform


def apply_layout_args(args: argparse.Namespace, explicit: dict[str, str],
                      world_size: int) -> Layout:
    """Set TP, PP and the global batch of ``args`` from ``--elastor-layout`` (before
    Megatron-LM validates them); an explicit flag that disagrees, or a layout
    Megatron-LM's loop cannot train, is a ValueError naming both."""
    spec = args.elastor_layout
    if "global_batch_size" not in explicit:
        args.global_batch_size = _provisional_global_batch(args, world_size)
    layout = load_layout(spec, recipe_from_args(args, 1))
    if layout.is_uniform:
        stages = layout.pipelines[0].stages
        derived = {"tensor_model_parallel_size": stages[0].tp,
                   "pipeline_model_parallel_size": len(stages)}
    else:  # per-rank values come later (adapt_args); these only pass Megatron's checks
        derived = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    for dest, value in derived.items():
        if dest in explicit and layout.is_uniform and int(explicit[dest]) != value:
            raise ValueError(
                f"{LAYOUT_FLAGS[dest]} {explicit[dest]} conflicts with --elastor-layout "
                f"{spec} ({layout.describe()} has {value}); drop {LAYOUT_FLAGS[dest]}: "
                f"the layout sets it")
        if dest not in explicit:
            setattr(args, dest, value)
    reason = unsupported_layout_reason(layout, args, world_size)
    if reason:
        raise ValueError(f"--elastor-layout {spec}: {reason}")
    return layout


def unsupported_layout_reason(layout: Layout, args: argparse.Namespace,
                              world_size: int) -> str | None:
    """Why Megatron-LM's loop cannot train ``layout`` with ``args`` on ``world_size``
    ranks (None: it can); checked when the arguments are parsed, before any rank
    trains."""
    if layout.num_gpus != world_size:
        return (f"the layout uses {layout.num_gpus} ranks but {world_size} were started; "
                f"Megatron-LM needs work on every rank: start exactly {layout.num_gpus} "
                f"(torchrun --nproc-per-node ...)")
    if getattr(args, "virtual_pipeline_model_parallel_size", None) or getattr(
            args, "num_layers_per_virtual_pipeline_stage", None):
        return ("virtual pipeline stages are not supported; drop "
                "--num-layers-per-virtual-pipeline-stage / "
                "--virtual-pipeline-model-parallel-size")
    if layout.is_uniform:
        return None
    from elastor_mcore.integrations.megatron_lm import training

    return training.unsupported_reason(layout, args)


def extra_args_provider(base: Callable | None = None) -> Callable:
    """``extra_args_provider`` adding Elastor's flags after ``base``'s (e.g. ModelOpt's)."""
    def provider(parser):
        if base is not None:
            parser = base(parser)
        return add_elastor_args(parser)
    return provider


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


def recipe_from_args(args: argparse.Namespace, vocab_size: int | None = None) -> Recipe:
    """The model and batch shape Megatron-LM's arguments describe, as a Recipe, so the
    layout is validated like any Elastor layout.

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
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=vocab,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        rotary_base=int(args.rotary_base),
        norm_epsilon=args.layernorm_epsilon,
        init_method_std=args.init_method_std,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )
    training = TrainingConfig(global_batch_size=args.global_batch_size,
                              micro_batch_size=args.micro_batch_size, seed=args.seed,
                              params_dtype="bfloat16" if args.bf16 else "float32")
    return Recipe(name="megatron-lm", model=model, training=training)


def _tokenizer_vocab_size() -> int | None:
    """The unpadded vocabulary of Megatron-LM's tokenizer (built before the parallel
    state), or None before it exists."""
    from megatron.training import get_tokenizer

    try:
        return get_tokenizer().vocab_size
    except AssertionError:  # megatron.training.global_vars: "tokenizer is not initialized"
        return None


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


def options_from_args(args: argparse.Namespace, vocab_size: int | None = None) -> ElastorOptions:
    """Hook options from parsed Megatron-LM arguments (validates the layout)."""
    check_checkpoint_flags(args)
    recipe = recipe_from_args(args, vocab_size)
    layout = load_layout(args.elastor_layout, recipe) if args.elastor_layout else None
    split = tuple(args.elastor_split_sizes or recipe.model.valid_tp_sizes)
    differences = llama_differences(args)
    extra = {} if differences else {"model": recipe.to_dict()["model"]}
    if differences:
        log.info("not recording a model in zarr manifests: the Megatron-LM model is not "
                 "Llama-style (needs %s); `elastor convert --to hf` will need --recipe",
                 ", ".join(differences))
    if layout is not None:
        extra["layout"] = layout.to_dict()
    return ElastorOptions(
        layout=layout, ckpt_format=args.elastor_ckpt_format,
        save=ZarrSaveSettings(chunking=ChunkPolicy(split_sizes=split),
                              keep=args.elastor_ckpt_keep, manifest_extra=extra))


def adapt_args(args: argparse.Namespace, groups: RankGroups | None) -> None:
    """Rewrite this rank's Megatron arguments to its own stage of the layout."""
    if groups is None:
        raise RuntimeError(
            f"rank {args.rank} is idle in --elastor-layout: Megatron-LM needs work on "
            f"every rank; start exactly the ranks the layout uses "
            f"({hooks.options().layout.num_gpus})")
    layout = groups.layout
    pipeline = layout.pipelines[groups.position.pipeline]
    stage_layers = [s.layers for s in pipeline.stages]
    set_tensor_parallel_args(args, pipeline.stages[groups.position.stage].tp)
    args.pipeline_model_parallel_size = len(stage_layers)
    if args.data_parallel_size != len(groups.dp_ranks):  # the rank's exact replicas
        from megatron.core.num_microbatches_calculator import (
            reconfigure_num_microbatches_calculator)

        args.data_parallel_size = len(groups.dp_ranks)
        reconfigure_num_microbatches_calculator(
            args.rank, args.rampup_batch_size, args.global_batch_size,
            args.micro_batch_size, args.data_parallel_size,
            getattr(args, "decrease_batch_size_if_needed", False))
    if len(set(stage_layers)) > 1:
        args.pipeline_model_parallel_layout = mcore_pipeline_layout(stage_layers)
        args.decoder_first_pipeline_num_layers = None
        args.decoder_last_pipeline_num_layers = None
    args.padded_vocab_size = recipe_from_args(
        args, _tokenizer_vocab_size()).model.padded_vocab_size


def install_hooks() -> None:
    """The hook ``patches/`` call before ``pretrain``: options come from Megatron-LM's
    parsed arguments when first needed."""
    from megatron.training import get_args

    hooks.install(lambda: options_from_args(get_args(), _tokenizer_vocab_size()),
                           on_parallel_state=lambda groups: adapt_args(get_args(), groups))
