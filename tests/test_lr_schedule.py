"""Learning-rate and weight-decay schedules: Megatron's semantics, checked against
mcore's own ``OptimizerParamScheduler`` driven the way Megatron-LM's loop drives it,
and against the published Llama 2 schedule worked out by hand."""

from __future__ import annotations

import math
import random
from dataclasses import asdict

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from elastor_mcore.checkpoint import CheckpointError, Manifest
from elastor_mcore.config.recipe import RecipeError, load_recipe, recipe_from_dict
from elastor_mcore.config.yaml_file import read_yaml_file
from elastor_mcore.runtime.optimizer import StageOptimizer
from elastor_mcore.runtime.state import check_lr_schedule, restore_non_tensor_state
from tests.conftest import TINY

GBS = 16


def recipe_with(schedule: dict, optimizer: dict | None = None, **training):
    data = read_yaml_file(TINY, "recipe", RecipeError)
    data["training"].update(training)
    data["training"]["optimizer"].update(optimizer or {})
    data["training"]["lr_schedule"] = schedule
    return recipe_from_dict(data)


def random_settings(rng: random.Random) -> tuple[dict, dict]:
    """A random valid (optimizer, lr_schedule) pair, lengths in iterations or samples."""
    style = rng.choice(["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    lr = rng.uniform(1e-5, 1e-2)
    decay = rng.randint(5, 60)
    schedule = {"lr_decay_style": style, "min_lr": lr * rng.uniform(0, 0.5),
                "lr_warmup_init": lr * rng.choice([0.0, rng.uniform(0, 0.5)])}
    warmup = rng.randint(0, decay - 1)
    unit = rng.choice(["iters", "samples"])
    scale = 1 if unit == "iters" else GBS
    schedule[f"lr_warmup_{unit}"] = warmup * scale
    schedule[f"lr_decay_{unit}"] = decay * scale
    if style == "WSD":
        schedule["lr_wsd_decay_style"] = rng.choice(["linear", "cosine", "exponential",
                                                     "minus_sqrt"])
        schedule[f"lr_wsd_decay_{unit}"] = rng.randint(1, decay) * scale
    wd_style = rng.choice(["constant", "linear", "cosine"])
    start = rng.uniform(0, 0.1)
    end = start if wd_style == "constant" else start + rng.uniform(0, 0.2)
    schedule.update(weight_decay_incr_style=wd_style, start_weight_decay=start,
                    end_weight_decay=end)
    if wd_style != "constant" and rng.random() < 0.5:
        schedule["weight_decay_incr_iters"] = rng.randint(1, 80)
    return {"lr": lr}, schedule


def megatron_reference(optimizer: dict, schedule: dict, gbs: int = GBS) -> OptimizerParamScheduler:
    """What Megatron-LM's ``get_optimizer_param_scheduler`` builds from the same flags
    (iteration lengths times the global batch; weight decay over the decay length,
    our stand-in for --train-iters)."""
    def samples(name: str) -> int | None:
        if schedule.get(f"{name}_iters") is not None:
            return schedule[f"{name}_iters"] * gbs
        return schedule.get(f"{name}_samples")

    decay = samples("lr_decay")
    incr = samples("weight_decay_incr")
    dummy = torch.optim.SGD([torch.zeros(1)], lr=0.0)
    return OptimizerParamScheduler(
        dummy, init_lr=schedule["lr_warmup_init"], max_lr=optimizer["lr"],
        min_lr=schedule["min_lr"], lr_warmup_steps=samples("lr_warmup"), lr_decay_steps=decay,
        lr_decay_style=schedule["lr_decay_style"], start_wd=schedule["start_weight_decay"],
        end_wd=schedule["end_weight_decay"], wd_incr_steps=incr if incr is not None else decay,
        wd_incr_style=schedule["weight_decay_incr_style"],
        wsd_decay_steps=samples("lr_wsd_decay"),
        lr_wsd_decay_style=schedule.get("lr_wsd_decay_style"))


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    """Stands in for a stage: one matrix (decayed) and one norm-like vector (not)."""
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.randn(4, 3))
    model.bias = torch.nn.Parameter(torch.randn(3))
    return model


@pytest.mark.parametrize("seed", range(40))
def test_lr_and_weight_decay_match_mcore_at_every_step(seed, tiny_model):
    optimizer, schedule = random_settings(random.Random(seed))
    recipe = recipe_with(schedule, optimizer)
    ours = StageOptimizer(tiny_model, recipe)
    reference = megatron_reference(optimizer, schedule)
    for step in range(80):
        decayed, not_decayed = ours.param_groups
        assert ours.lr == pytest.approx(reference.get_lr({}), abs=1e-12, rel=0), step
        assert decayed["lr"] == not_decayed["lr"] == ours.lr
        assert decayed["weight_decay"] == pytest.approx(reference.get_wd(), abs=1e-12, rel=0)
        assert not_decayed["weight_decay"] == 0.0
        ours.scheduler.step(increment=GBS)  # what StageOptimizer.step does after AdamW
        reference.step(GBS)


def test_stage_optimizer_step_applies_the_scheduled_lr(tiny_model):
    recipe = recipe_with({"lr_decay_style": "linear", "lr_warmup_iters": 2,
                          "lr_decay_iters": 6}, {"lr": 1e-2})
    ours = StageOptimizer(tiny_model, recipe)
    seen = []
    for _ in range(8):
        seen.append(ours.lr)
        for p in tiny_model.parameters():
            p.grad = torch.ones_like(p)
        ours.step()
    assert seen == pytest.approx([0.0, 5e-3, 1e-2, 7.5e-3, 5e-3, 2.5e-3, 0.0, 0.0], abs=1e-15)


@pytest.mark.parametrize("name", ["llama2-7b", "llama2-13b"])
def test_llama2_published_schedule(name):
    """Touvron et al. 2023, section 2.2: cosine, 2000 warm-up steps, down to 10% of the
    peak (3e-4, Table 1)."""
    recipe = load_recipe(f"recipes/{name}.yaml")
    s = recipe.training.lr_schedule
    assert (s.lr_decay_style, s.lr_warmup_iters, s.min_lr) == ("cosine", 2000, 3e-5)
    gbs, decay = recipe.training.global_batch_size, s.lr_decay_iters
    sched = megatron_reference(asdict(recipe.training.optimizer),
                               {**asdict(s), "start_weight_decay": 0.1, "end_weight_decay": 0.1},
                               gbs)

    def lr_at(step: int) -> float:
        sched.num_steps = 0
        sched.step(step * gbs)
        return sched.get_lr({})

    half = 2000 + (decay - 2000) / 2
    assert lr_at(0) == 0.0 and lr_at(1000) == pytest.approx(1.5e-4)
    assert lr_at(2000) == pytest.approx(3e-4)
    assert lr_at(int(half)) == pytest.approx(3e-5 + 0.5 * 2.7e-4, rel=1e-4)
    assert lr_at(decay) == pytest.approx(3e-5) and lr_at(decay + 10) == 3e-5
    assert 0.5 * (math.cos(math.pi * 0.5) + 1) == pytest.approx(0.5)


@pytest.mark.parametrize("name,peak", [("llama3-8b", 3e-4), ("llama3-70b", 1.5e-4)])
def test_llama3_schedule(name, peak):
    """The Llama 3 Herd of Models, Table 3 (peak lr) and section 3.4.1 (8000 warm-up
    steps, cosine to 1% of the peak)."""
    recipe = load_recipe(f"recipes/{name}.yaml")
    s = recipe.training.lr_schedule
    assert recipe.training.optimizer.lr == peak
    assert (s.lr_decay_style, s.lr_warmup_iters) == ("cosine", 8000)
    assert s.min_lr == pytest.approx(peak / 100)


@pytest.mark.parametrize("schedule,field", [
    ({"lr_decay_style": "cosine"}, "lr_decay_iters"),
    ({"lr_decay_style": "cosin", "lr_decay_iters": 10}, "training.lr_schedule.lr_decay_style"),
    ({"lr_decay_iters": 10, "lr_decay_samples": 160}, "lr_decay_iters or lr_decay_samples"),
    ({"lr_decay_style": "linear", "lr_warmup_iters": 10, "lr_decay_iters": 10},
     "lr_warmup_iters smaller than lr_decay_iters"),
    ({"min_lr": 1.0}, "training.lr_schedule.min_lr"),
    ({"lr_warmup_init": 1.0}, "training.lr_schedule.lr_warmup_init"),
    ({"lr_warmup_iters": -1}, "training.lr_schedule.lr_warmup_iters"),
    ({"lr_decay_style": "WSD", "lr_decay_iters": 10}, "lr_wsd_decay_iters"),
    ({"start_weight_decay": 0.0, "end_weight_decay": 0.1}, "weight_decay_incr_style"),
    ({"start_weight_decay": 0.2, "end_weight_decay": 0.1, "weight_decay_incr_style": "linear",
      "lr_decay_iters": 10}, "end_weight_decay"),
    ({"weight_decay_incr_style": "cosine", "start_weight_decay": 0.0}, "weight_decay_incr_iters"),
    ({"warmup": 10}, "training.lr_schedule: unknown field"),
])
def test_bad_schedule_names_the_field(schedule, field):
    with pytest.raises(RecipeError, match=field.replace("(", r"\(").replace(".", r"\.")):
        recipe_with(schedule)


def test_default_schedule_is_the_constant_lr_of_before(tiny_model):
    recipe = load_recipe(TINY)
    ours = StageOptimizer(tiny_model, recipe)
    for _ in range(5):
        assert ours.lr == recipe.training.optimizer.lr
        assert [g["weight_decay"] for g in ours.param_groups] == [
            recipe.training.optimizer.weight_decay, 0.0]
        ours.scheduler.step(increment=GBS)


def test_resume_restores_the_schedule_position(tiny_model):
    schedule = {"lr_decay_style": "cosine", "lr_warmup_iters": 3, "lr_decay_iters": 20}
    saved = StageOptimizer(tiny_model, recipe_with(schedule))
    for _ in range(7):
        saved.scheduler.step(increment=GBS)
    manifest = Manifest(step=7, tensors={}, optimizer={"step": 7},
                        extra={"lr_schedule": saved.scheduler.state_dict()})
    resumed = StageOptimizer(tiny_model, recipe_with(schedule))
    check_lr_schedule(manifest, resumed)
    restore_non_tensor_state(manifest, resumed)
    assert resumed.lr == saved.lr and resumed.scheduler.num_steps == 7 * GBS


def test_resume_with_another_schedule_names_what_differs(tiny_model):
    saved = StageOptimizer(tiny_model, recipe_with({"lr_decay_style": "cosine",
                                                    "lr_decay_iters": 20}))
    manifest = Manifest(step=2, tensors={}, extra={"lr_schedule": saved.scheduler.state_dict()})
    other = StageOptimizer(tiny_model, recipe_with({"lr_decay_style": "cosine",
                                                    "lr_decay_iters": 30}))
    with pytest.raises(CheckpointError, match="lr_decay_steps=320 .* this run has 480"):
        check_lr_schedule(manifest, other)
