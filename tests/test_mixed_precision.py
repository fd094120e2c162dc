"""Mixed precision as Megatron runs it, and the lr schedule across resumes.

The layout-training modules' shared world (``tests/train_world.py``) runs tiny-llama
with a warm-up + cosine schedule:

* fp32: an uninterrupted run, and a run saved under one layout and resumed under
  another: every step's lr equals the uninterrupted run's, losses within fp32's 1e-5;
* bf16 (``params_dtype: bfloat16``): two uniform layouts against each other (the
  noise floor of bf16 arithmetic under another reduction order) and three
  heterogeneous layouts against the uniform one, within ``BF16_TOLERANCE``;
* across precisions: the fp32 checkpoint resumed in bf16 and a bf16 checkpoint
  resumed in fp32, each under another layout; both load the fp32 state bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastor_mcore import checkpoint
from elastor_mcore.config.recipe import RecipeError, recipe_from_dict
from elastor_mcore.config.yaml_file import read_yaml_file
from elastor_mcore.runtime.optimizer import StageOptimizer
from tests.conftest import (
    TINY, case_metrics, global_state, layout_arg, max_relative_difference, write_tiny_recipe)
from tests.train_world import TIMEOUT, TrainWorldPart

SCHEDULE = {"lr_decay_style": "cosine", "lr_warmup_iters": 2, "lr_decay_iters": 8,
            "min_lr": 3.0e-5}
STEPS = 3
LR_STEPS, LR_RESUME_AT = 6, 3
BF16_UNIFORM = ("dp1-tp1-pp1", "dp2-tp2-pp1")
BF16_HETERO = ("tp4-tp2-tp1", "two-pipelines-crossed-splits", "unequal-micro-batches")
FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 5e-5
"""Relative, per step. Measured here (CPU, gloo) over 6 steps: the two uniform bf16
layouts differ by at most 4.8e-6 (the noise floor, printed by the test), the three
heterogeneous ones from the uniform by 6.1e-6 to 1.0e-5, bf16 from fp32 by 7.9e-6
(fp32 layouts agree to ~1e-8); the world now trains 3 (bf16 noise grows with steps).
5e-5 is ten times the floor; one step of training moves the loss by ~1e-3, so a lost
or doubled gradient contribution still fails."""


def write_recipe(path: Path, params_dtype: str) -> Path:
    return write_tiny_recipe(path, params_dtype=params_dtype, lr_schedule=SCHEDULE)


def train_world_part(out: Path) -> TrainWorldPart:
    ck = out / "checkpoints"
    fp32 = write_recipe(out / "fp32.yaml", "float32")
    bf16 = write_recipe(out / "bf16.yaml", "bfloat16")
    cases = [
        f"lr-reference=dp1-tp1-pp1:{LR_STEPS},recipe={fp32}",
        f"lr-first={layout_arg('two-pipelines-different-stages')}:{LR_RESUME_AT},"
        f"recipe={fp32},save={ck / 'fp32'}",
        f"lr-second={layout_arg('tp4-tp2-tp1')}:{LR_STEPS},recipe={fp32},load={ck / 'fp32'}",
    ]
    cases += [f"bf16-{n}={layout_arg(n)}:{STEPS},recipe={bf16}" for n in BF16_UNIFORM]
    cases += [f"bf16-{n}={layout_arg(n)}:{STEPS},recipe={bf16}"
              + (f",save={ck / 'bf16'}" if n == BF16_HETERO[0] else "") for n in BF16_HETERO]
    cases += [f"fp32-to-bf16={layout_arg('tp2-to-tp1')}:{LR_RESUME_AT + 2},recipe={bf16},"
              f"load={ck / 'fp32'},verify",
              f"bf16-to-fp32=dp1-tp2-pp1:{STEPS + 2},recipe={fp32},load={ck / 'bf16'},verify"]
    return TrainWorldPart(cases)


@pytest.fixture(scope="module")
def world(train_world) -> Path:
    return train_world[__name__]


@pytest.mark.timeout(TIMEOUT)
def test_lr_continues_exactly_across_a_resume_under_another_layout(world):
    reference = case_metrics(world, "lr-reference")
    resumed = case_metrics(world, "lr-first") + case_metrics(world, "lr-second")
    assert [m["step"] for m in resumed] == list(range(1, LR_STEPS + 1))
    assert [m["lr"] for m in resumed] == [m["lr"] for m in reference]
    assert reference[0]["lr"] == 0.0 and reference[2]["lr"] == 3e-4  # warm-up from 0
    assert reference[-1]["lr"] < reference[3]["lr"] < 3e-4             # cosine decay
    assert max_relative_difference([m["loss"] for m in resumed],
                                   [m["loss"] for m in reference]) <= FP32_TOLERANCE


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("name", BF16_HETERO)
def test_bf16_heterogeneous_layout_matches_uniform(world, name):
    uniform = [m["loss"] for m in case_metrics(world, f"bf16-{BF16_UNIFORM[0]}")]
    other = [m["loss"] for m in case_metrics(world, f"bf16-{BF16_UNIFORM[1]}")]
    losses = [m["loss"] for m in case_metrics(world, f"bf16-{name}")]
    floor = max_relative_difference(other, uniform)
    diff = max_relative_difference(losses, uniform)
    print(f"bf16 {name}: {diff:.2e} from uniform (noise floor {floor:.2e}, "
          f"tolerance {BF16_TOLERANCE:.0e})")
    assert len(losses) == STEPS
    assert floor <= BF16_TOLERANCE
    assert diff <= BF16_TOLERANCE
    fp32 = [m["loss"] for m in case_metrics(world, "lr-reference")][:STEPS]
    assert losses != fp32  # bf16 arithmetic really ran


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("case, saved", [("fp32-to-bf16", "fp32"), ("bf16-to-fp32", "bf16")])
def test_other_precision_resumes_the_fp32_state_bit_exact(world, case, saved):
    expected = global_state(sorted((world / "checkpoints" / f"{saved}.state").glob("rank*.pt")))
    loaded = global_state(sorted((world / case).glob("loaded.rank*.pt")))
    assert loaded.keys() == expected.keys()
    assert any(k.startswith("optimizer.exp_avg.") for k in expected)
    for key, tensor in expected.items():
        assert tensor.dtype == loaded[key].dtype == torch.float32, key
        assert torch.equal(loaded[key], tensor), key
    info = checkpoint.open(world / "checkpoints" / saved).manifest
    assert {t.dtype for t in info.tensors.values()} == {"float32"}


@pytest.mark.timeout(TIMEOUT)
def test_resumes_across_precisions_continue_the_run(world):
    reference = case_metrics(world, "lr-reference")
    fp32_to_bf16 = case_metrics(world, "fp32-to-bf16")
    assert [m["lr"] for m in fp32_to_bf16] == [m["lr"] for m in reference[LR_RESUME_AT:
                                                                            LR_RESUME_AT + 2]]
    assert max_relative_difference([m["loss"] for m in fp32_to_bf16],
                                   [m["loss"] for m in reference[LR_RESUME_AT:
                                                                 LR_RESUME_AT + 2]]) \
        <= BF16_TOLERANCE
    bf16_to_fp32 = case_metrics(world, "bf16-to-fp32")
    assert [m["step"] for m in bf16_to_fp32] == [STEPS + 1, STEPS + 2]
    assert [m["lr"] for m in bf16_to_fp32] == [m["lr"] for m in reference[STEPS:STEPS + 2]]


def test_bf16_accumulates_micro_batches_in_fp32_main_grad():
    """Megatron's DDP hook: each backward's bf16 gradient is added into an fp32
    ``main_grad``; AdamW updates the fp32 main copy, rounded back into the weight."""
    data = read_yaml_file(TINY, "recipe", RecipeError)
    data["training"]["params_dtype"] = "bfloat16"
    recipe = recipe_from_dict(data)
    model = torch.nn.Linear(8, 4, bias=False).to(torch.bfloat16)
    opt = StageOptimizer(model, recipe)
    weight = model.weight
    main = opt.main_param(weight)
    assert main.dtype == torch.float32 and torch.equal(main, weight.float())
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        model(x).float().sum().backward()
        assert weight.grad is None
        grads.append((torch.ones(3, 4, dtype=torch.bfloat16).t() @ x).float())
    assert weight.main_grad.dtype == torch.float32
    assert torch.equal(weight.main_grad, grads[0] + grads[1])
    assert opt.adamw.param_groups[0]["params"][0] is main and main.grad is weight.main_grad
    before = main.clone()
    opt.step()
    assert not torch.equal(main, before)
    assert torch.equal(weight.detach(), main.to(torch.bfloat16))
    opt.zero_grad()
    assert not weight.main_grad.any()
