"""The real-model recipes: published shapes and sizes, default layouts, Megatron-LM commands."""

from __future__ import annotations

import shlex

import pytest

from elastor_mcore.parallel.layout import load_layout
from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.planner import load_hardware
from elastor_mcore.planner.baselines import best_uniform

PUBLISHED = {  # parameters, from each recipe's cited source
    "llama2-7b": 6.74e9,
    "llama2-13b": 13.02e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.55e9,
    "llama3-405b": 405e9,
}
SEQ = {"llama2-7b": 4096, "llama2-13b": 4096, "llama3-8b": 8192, "llama3-70b": 8192,
       "llama3-405b": 8192}


@pytest.fixture(params=sorted(PUBLISHED))
def recipe(request):
    return load_recipe(f"recipes/{request.param}.yaml")


def test_parameter_count_matches_published(recipe):
    assert recipe.model.parameter_count() == pytest.approx(PUBLISHED[recipe.name], rel=0.005)


def test_llama2_7b_parameter_count_is_exact():
    # 32 x (4 x 4096^2 attention + 3 x 4096 x 11008 MLP + 2 x 4096 norms)
    # + 2 x 32000 x 4096 (untied embedding and output layer) + 4096 (final norm)
    assert load_recipe("recipes/llama2-7b.yaml").model.parameter_count() == 6_738_415_616


def test_training_settings(recipe):
    assert recipe.source and "config.json" in recipe.source
    assert recipe.training.params_dtype == "bfloat16"
    assert recipe.training.micro_batch_size == 1
    assert recipe.training.global_batch_size in (512, 1024, 2048)
    assert recipe.model.seq_length == SEQ[recipe.name]


def test_recipes_use_the_distributed_optimizer(recipe):
    """As Megatron-LM's own Llama example (examples/llama/train_llama3_8b_h100_fp8.sh
    at core_v0.16.1 and core_v0.19.0 passes --use-distributed-optimizer): the planner
    then counts the optimizer state split over the pipelines."""
    assert recipe.training.distributed_optimizer is True
    assert "--use-distributed-optimizer" in _flags(recipe.extra["megatron_lm_command"])


def test_default_layout_is_the_fastest_uniform_one(recipe):
    """What the recipes' comment says: the fastest uniform layout on its cluster under
    the planner's cost model (A100-80GB), with the recipe's ZeRO-1."""
    default = recipe.extra["default_layout"]
    fastest = best_uniform(recipe, load_hardware("recipes/hardware/a100-80gb.yaml"),
                           range(default["nodes"] * default["gpus_per_node"]))
    layout = load_layout(default["layout"], recipe)
    assert [[(s.tp, s.layers) for s in p.stages] for p in fastest.layout.pipelines] == \
        [[(s.tp, s.layers) for s in p.stages] for p in layout.pipelines]


def test_default_layout_fills_its_cluster(recipe):
    default = recipe.extra["default_layout"]
    layout = load_layout(default["layout"], recipe)  # validates against the recipe
    assert layout.num_gpus == default["nodes"] * default["gpus_per_node"]
    assert all(s.tp <= default["gpus_per_node"] for _, _, s in layout.iter_stages())


def _flags(command: str) -> dict[str, str | None]:
    words = shlex.split(command)
    out: dict[str, str | None] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") \
                else None
            out[word] = value
    return out


def test_megatron_command_matches_recipe(recipe):
    flags = _flags(recipe.extra["megatron_lm_command"])
    assert "pretrain_gpt.py" in recipe.extra["megatron_lm_command"]
    m, t = recipe.model, recipe.training
    expected = {
        "--num-layers": m.num_layers, "--hidden-size": m.hidden_size,
        "--num-attention-heads": m.num_attention_heads, "--ffn-hidden-size": m.ffn_hidden_size,
        "--seq-length": m.seq_length, "--max-position-embeddings": m.max_position_embeddings,
        "--rotary-base": m.rotary_base, "--micro-batch-size": t.micro_batch_size,
        "--global-batch-size": t.global_batch_size,
        "--lr-decay-style": t.lr_schedule.lr_decay_style,
        "--lr-warmup-iters": t.lr_schedule.lr_warmup_iters,
        "--lr-decay-iters": t.lr_schedule.lr_decay_iters,
    }
    for flag, value in expected.items():
        assert flags.get(flag) == str(value), flag
    if m.num_query_groups != m.num_attention_heads:
        assert "--group-query-attention" in flags
        assert flags["--num-query-groups"] == str(m.num_query_groups)
    for flag in ("--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                 "--bf16"):
        assert flag in flags, flag
    assert float(flags["--min-lr"]) == t.lr_schedule.min_lr
    assert float(flags["--lr"]) == t.optimizer.lr
    assert flags["--normalization"] == "RMSNorm"
    assert flags["--position-embedding-type"] == "rope"
    layout = load_layout(recipe.extra["default_layout"]["layout"], recipe)
    first = layout.pipelines[0]
    assert flags["--tensor-model-parallel-size"] == str(first.stages[0].tp)
    assert flags["--pipeline-model-parallel-size"] == str(len(first.stages))
