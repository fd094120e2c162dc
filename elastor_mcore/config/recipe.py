"""Recipes: a model shape plus training settings, loaded from YAML.

A recipe never says how the model is partitioned; that is the layout's job
(``layout.py``). Field names follow Megatron-LM's flags (``--num-layers`` becomes
``num_layers``) so a recipe reads like the command line it stands for.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from functools import reduce
from pathlib import Path
from typing import Any

from elastor_mcore.config.shipped import find_input
from elastor_mcore.config.yaml_file import read_yaml_file


class RecipeError(ValueError):
    """A recipe file is missing, malformed, or names an impossible model."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, SwiGLU, RoPE, GQA, untied embeddings)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    max_position_embeddings: int | None = None
    rotary_base: int = 10000
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("norm_epsilon", "init_method_std", "max_position_embeddings"):
                continue
            if not isinstance(value, int) or value <= 0:
                raise RecipeError(f"model.{f.name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise RecipeError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise RecipeError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_query_groups={self.num_query_groups}")

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def valid_tp_sizes(self) -> list[int]:
        """Every TP degree that divides heads, query groups and FFN width."""
        common = math.gcd(self.num_attention_heads, self.num_query_groups, self.ffn_hidden_size)
        return [d for d in range(1, common + 1) if common % d == 0]

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded so that every valid TP degree splits it evenly.

        Padding to ``make_vocab_size_divisible_by`` x lcm(valid TP sizes) makes the
        padded size a property of the model alone, identical under every layout.
        """
        lcm = reduce(math.lcm, self.valid_tp_sizes, 1)
        multiple = self.make_vocab_size_divisible_by * lcm
        return -(-self.vocab_size // multiple) * multiple

    def parameter_count(self) -> int:
        """Parameters of the unpadded model (embedding and output layer untied)."""
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        kv = self.num_query_groups * self.kv_channels
        attention = h * h + 2 * h * kv + h * h
        mlp = 3 * h * f
        per_layer = attention + mlp + 2 * h
        return self.num_layers * per_layer + 2 * v * h + h


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyper-parameters (Megatron names); ``lr`` is the peak learning rate of
    ``training.lr_schedule``."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WEIGHT_DECAY_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRScheduleConfig:
    """Megatron's learning-rate and weight-decay schedule, with its flag names
    (``--lr-decay-style`` becomes ``lr_decay_style``), run by mcore's own
    ``OptimizerParamScheduler``. Lengths are in iterations or, like Megatron's
    ``--lr-*-samples``, in samples; never both. The peak is ``optimizer.lr``.

    One departure: Megatron ramps weight decay over ``--train-iters``, a property of
    the run, not of the recipe; here ``weight_decay_incr_iters`` (default
    ``lr_decay_iters``) says how long.
    """

    lr_decay_style: str = "constant"
    lr_warmup_init: float = 0.0
    lr_warmup_iters: int | None = None
    lr_warmup_samples: int | None = None
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    min_lr: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"
    weight_decay_incr_iters: int | None = None
    weight_decay_incr_samples: int | None = None

    def __post_init__(self) -> None:
        where = "training.lr_schedule"
        for name, allowed in (("lr_decay_style", LR_DECAY_STYLES),
                              ("lr_wsd_decay_style", WSD_DECAY_STYLES),
                              ("weight_decay_incr_style", WEIGHT_DECAY_INCR_STYLES)):
            if getattr(self, name) not in allowed:
                raise RecipeError(f"{where}.{name}={getattr(self, name)!r}: use one of "
                                  f"{list(allowed)}")
        for length in ("lr_warmup", "lr_decay", "lr_wsd_decay", "weight_decay_incr"):
            iters, samples = getattr(self, f"{length}_iters"), getattr(self, f"{length}_samples")
            if iters is not None and samples is not None:
                raise RecipeError(f"{where}: set {length}_iters or {length}_samples, not both")
            for name, value in ((f"{length}_iters", iters), (f"{length}_samples", samples)):
                if value is not None and (not isinstance(value, int) or value < 0):
                    raise RecipeError(f"{where}.{name} must be a non-negative integer, "
                                      f"got {value!r}")
        for name in ("lr_warmup_init", "min_lr", "start_weight_decay", "end_weight_decay"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or value < 0):
                raise RecipeError(f"{where}.{name} must be a non-negative number, got {value!r}")

    def scheduler_steps(self, global_batch_size: int) -> dict[str, int | None]:
        """Warm-up, decay, WSD-anneal and weight-decay lengths in samples, the unit
        Megatron-LM gives ``OptimizerParamScheduler`` (it steps by the global batch)."""
        def samples(length: str) -> int | None:
            iters = getattr(self, f"{length}_iters")
            return iters * global_batch_size if iters is not None \
                else getattr(self, f"{length}_samples")

        decay = samples("lr_decay")
        incr = samples("weight_decay_incr")
        return {"lr_warmup_steps": samples("lr_warmup") or 0, "lr_decay_steps": decay,
                "wsd_decay_steps": samples("lr_wsd_decay"),
                "wd_incr_steps": incr if incr is not None else decay}


@dataclass(frozen=True)
class TrainingConfig:
    """What does not depend on the layout: batch sizes, seed, optimizer, precision."""

    global_batch_size: int
    micro_batch_size: int = 1
    seed: int = 1234
    params_dtype: str = "float32"
    """``bfloat16``: bf16 weights and activations, fp32 gradients, fp32 main
    parameters under AdamW, as Megatron's ``--bf16``."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    distributed_optimizer: bool = False
    """ZeRO-1, as Megatron's ``--use-distributed-optimizer``: the fp32 main parameters
    and moments of each piece are sharded across the ranks holding it
    (``runtime/distributed_optimizer.py``); same losses, checkpoints either way."""
    sequence_parallel: bool = False
    """Megatron's ``--sequence-parallel``: in every stage of TP > 1, norms and residuals
    run on the TP rank's slice of the sequence (``model.seq_length`` must be divisible
    by every such TP); stage boundaries re-split the sequence (``runtime/p2p.py``)."""
    overlap_grad_reduce: bool = False
    """Megatron's ``--overlap-grad-reduce``: the gradient reduction across pipelines
    starts bucket by bucket during the last micro-batch's backward (Megatron-LM's loop,
    ``integrations/megatron_lm/overlap.py``); the planner hides it behind that backward."""
    overlap_param_gather: bool = False
    """Megatron's ``--overlap-param-gather`` (with ``distributed_optimizer`` and
    ``overlap_grad_reduce``): ZeRO-1's all-gather of the weights overlaps the next
    forward; the planner hides it behind the first micro-batch's forward."""
    recompute_granularity: str | None = None
    """Megatron's ``--recompute-granularity``: ``full`` (whole layers, with
    ``recompute_method`` and ``recompute_num_layers``) or ``selective`` (core
    attention); None keeps every activation. Same losses, less activation memory."""
    recompute_method: str | None = None
    """``uniform``: recompute chunks of ``recompute_num_layers`` layers (the number must
    divide every stage's layers); ``block``: the first ``recompute_num_layers`` layers of
    each stage."""
    recompute_num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.global_batch_size % self.micro_batch_size:
            raise RecipeError(
                f"training.global_batch_size={self.global_batch_size} is not a multiple of "
                f"training.micro_batch_size={self.micro_batch_size}")
        if self.params_dtype not in ("float32", "bfloat16"):
            raise RecipeError(
                f"training.params_dtype={self.params_dtype!r}: use 'float32' or 'bfloat16'")
        if not isinstance(self.distributed_optimizer, bool):
            raise RecipeError(f"training.distributed_optimizer={self.distributed_optimizer!r}: "
                              f"use true or false")
        for name in ("sequence_parallel", "overlap_grad_reduce", "overlap_param_gather"):
            if not isinstance(getattr(self, name), bool):
                raise RecipeError(f"training.{name}={getattr(self, name)!r}: use true or false")
        if self.overlap_param_gather and not (self.distributed_optimizer
                                              and self.overlap_grad_reduce):
            raise RecipeError("training.overlap_param_gather needs distributed_optimizer and "
                              "overlap_grad_reduce (as Megatron's --overlap-param-gather)")
        self._check_recompute()
        self._check_schedule()

    def _check_recompute(self) -> None:
        """What mcore's ``TransformerConfig`` asserts, as errors naming the field."""
        granularity, method, layers = (self.recompute_granularity, self.recompute_method,
                                       self.recompute_num_layers)
        where = "training.recompute"
        if granularity not in (None, "full", "selective"):
            raise RecipeError(f"{where}_granularity={granularity!r}: use 'full', 'selective' "
                              f"or leave it out")
        if granularity == "full":
            if method not in ("uniform", "block"):
                raise RecipeError(f"{where}_granularity='full' needs {where}_method "
                                  f"'uniform' or 'block', got {method!r}")
            if isinstance(layers, bool) or not isinstance(layers, int) or layers <= 0:
                raise RecipeError(f"{where}_granularity='full' needs {where}_num_layers, "
                                  f"a positive integer, got {layers!r}")
        elif method is not None or layers is not None:
            raise RecipeError(f"{where}_method and {where}_num_layers go with "
                              f"{where}_granularity='full' (got granularity {granularity!r}); "
                              f"drop them or set the granularity to 'full'")

    def _check_schedule(self) -> None:
        """What mcore's ``OptimizerParamScheduler`` asserts, as errors naming the field."""
        s, lr, where = self.lr_schedule, self.optimizer.lr, "training.lr_schedule"
        steps = s.scheduler_steps(self.global_batch_size)
        if s.min_lr > lr:
            raise RecipeError(f"{where}.min_lr={s.min_lr} exceeds the peak "
                              f"training.optimizer.lr={lr}; lower min_lr")
        if s.lr_warmup_init > lr:
            raise RecipeError(f"{where}.lr_warmup_init={s.lr_warmup_init} exceeds the peak "
                              f"training.optimizer.lr={lr}; lower lr_warmup_init")
        if s.lr_decay_style != "constant" and not steps["lr_decay_steps"]:
            raise RecipeError(f"{where}.lr_decay_style={s.lr_decay_style!r} needs "
                              f"{where}.lr_decay_iters (or lr_decay_samples) > 0")
        if steps["lr_decay_steps"] is not None and \
                steps["lr_warmup_steps"] >= steps["lr_decay_steps"]:
            raise RecipeError(f"{where}: the warm-up must end before the decay does; make "
                              f"lr_warmup_iters smaller than lr_decay_iters")
        if s.lr_decay_style == "WSD" and not (
                steps["wsd_decay_steps"] and steps["wsd_decay_steps"] <= steps["lr_decay_steps"]):
            raise RecipeError(f"{where}.lr_decay_style='WSD' needs {where}.lr_wsd_decay_iters "
                              f"(or _samples) > 0 and at most lr_decay_iters")
        start, end = self.weight_decay_range
        if end < start:
            raise RecipeError(f"{where}.end_weight_decay={end} is below start_weight_decay="
                              f"{start}; Megatron only increases weight decay")
        if s.weight_decay_incr_style == "constant" and start != end:
            raise RecipeError(f"{where}: start_weight_decay={start} and end_weight_decay={end} "
                              f"differ; set weight_decay_incr_style to 'linear' or 'cosine'")
        if s.weight_decay_incr_style != "constant" and not steps["wd_incr_steps"]:
            raise RecipeError(f"{where}.weight_decay_incr_style={s.weight_decay_incr_style!r} "
                              f"needs weight_decay_incr_iters (or lr_decay_iters) > 0")

    @property
    def weight_decay_range(self) -> tuple[float, float]:
        """(start, end) weight decay; each defaults to ``optimizer.weight_decay``, as
        Megatron's ``--start/--end-weight-decay`` default to ``--weight-decay``."""
        s, wd = self.lr_schedule, self.optimizer.weight_decay
        return (wd if s.start_weight_decay is None else s.start_weight_decay,
                wd if s.end_weight_decay is None else s.end_weight_decay)

    @property
    def total_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


@dataclass(frozen=True)
class Recipe:
    name: str
    model: ModelConfig
    training: TrainingConfig
    source: str | None = None
    """Where the model shape comes from (a citation), for real-model recipes."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other top-level sections (e.g. a default layout, a Megatron-LM command line)."""

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "model": asdict(self.model), "training": asdict(self.training)}
        if self.source:
            out["source"] = self.source
        out.update(self.extra)
        return out


def _build(cls, section: dict[str, Any], where: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise RecipeError(f"{where}: unknown field(s) {unknown}; known fields are {sorted(known)}")
    try:
        return cls(**section)
    except TypeError as exc:
        raise RecipeError(f"{where}: {exc}") from None


def recipe_from_dict(data: dict[str, Any], name: str = "recipe") -> Recipe:
    if not isinstance(data, dict) or "model" not in data or "training" not in data:
        raise RecipeError(f"{name}: a recipe needs a 'model' and a 'training' section")
    training = dict(data["training"])
    optimizer = _build(OptimizerConfig, training.pop("optimizer", {}) or {}, "training.optimizer")
    schedule = _build(LRScheduleConfig, training.pop("lr_schedule", {}) or {},
                      "training.lr_schedule")
    extra = {k: v for k, v in data.items() if k not in ("name", "model", "training", "source")}
    return Recipe(
        name=data.get("name", name),
        model=_build(ModelConfig, dict(data["model"]), "model"),
        training=_build(TrainingConfig,
                        {**training, "optimizer": optimizer, "lr_schedule": schedule}, "training"),
        source=data.get("source"),
        extra=extra,
    )


def load_recipe(path: str | Path) -> Recipe:
    """Read a recipe YAML file, or the shipped recipe of that name (``llama3-8b``);
    errors name the file and the field."""
    path = find_input(path, "recipe")
    data = read_yaml_file(path, "recipe file", RecipeError, shipped_kind="recipe")
    return recipe_from_dict(data, name=path.stem)
