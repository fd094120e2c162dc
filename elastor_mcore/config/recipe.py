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
    """AdamW hyper-parameters (Megatron names); a constant learning rate."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass(frozen=True)
class TrainingConfig:
    """What does not depend on the layout: batch sizes, seed, optimizer, precision."""

    global_batch_size: int
    micro_batch_size: int = 1
    seed: int = 1234
    params_dtype: str = "float32"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    def __post_init__(self) -> None:
        if self.global_batch_size % self.micro_batch_size:
            raise RecipeError(
                f"training.global_batch_size={self.global_batch_size} is not a multiple of "
                f"training.micro_batch_size={self.micro_batch_size}")
        if self.params_dtype not in ("float32", "bfloat16"):
            raise RecipeError(
                f"training.params_dtype={self.params_dtype!r}: use 'float32' or 'bfloat16'")

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
    extra = {k: v for k, v in data.items() if k not in ("name", "model", "training", "source")}
    return Recipe(
        name=data.get("name", name),
        model=_build(ModelConfig, dict(data["model"]), "model"),
        training=_build(TrainingConfig, {**training, "optimizer": optimizer}, "training"),
        source=data.get("source"),
        extra=extra,
    )


def load_recipe(path: str | Path) -> Recipe:
    """Read a recipe YAML file; errors name the file and the field."""
    data = read_yaml_file(path, "recipe file", RecipeError)
    return recipe_from_dict(data, name=Path(path).stem)
