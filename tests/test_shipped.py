"""Shipped recipes, hardware profiles and layouts, found by name (what a user of the
wheel types), and files of one's own, which win over a shipped name. The installed
wheel itself is exercised by stage 3 of ``.ci/run``."""

from __future__ import annotations

import pytest
import yaml

from elastor_mcore.config.recipe import RecipeError, load_recipe
from elastor_mcore.config.shipped import shipped, shipped_root
from elastor_mcore.parallel.layout import LayoutError, load_layout
from elastor_mcore.planner import HardwareError, load_hardware


def test_every_shipped_recipe_and_profile_loads_by_name():
    recipes, profiles = shipped("recipe"), shipped("hardware profile")
    assert {"tiny-llama", "llama3-8b", "llama3-70b"} <= set(recipes)
    assert {"cpu-slots", "h100-80gb"} <= set(profiles)
    for name in recipes:
        assert load_recipe(name).name == name
        assert load_recipe(f"{name}.yaml").name == name
    for name in profiles:
        assert load_hardware(name).name == name


def test_shipped_layout_by_name():
    recipe = load_recipe("tiny-llama")
    assert load_layout("tiny-hetero-4", recipe) == load_layout(
        shipped_root() / "layouts" / "tiny-hetero-4.yaml", recipe)


@pytest.mark.parametrize("load,error,kind", [
    (load_recipe, RecipeError, "recipe"),
    (load_hardware, HardwareError, "hardware profile"),
])
def test_unknown_name_lists_the_shipped_ones(load, error, kind):
    with pytest.raises(error) as err:
        load("llama9-1t")
    message = str(err.value)
    assert "llama9-1t does not exist" in message and f"shipped {kind}" in message
    assert all(name in message for name in shipped(kind))


def test_unknown_layout_name_lists_the_shipped_ones():
    with pytest.raises(LayoutError, match="tiny-hetero-4"):
        load_layout("no-such-layout", load_recipe("tiny-llama"))


def test_a_file_of_ones_own_wins_over_a_shipped_name(tmp_path, monkeypatch):
    data = yaml.safe_load((shipped_root() / "tiny-llama.yaml").read_text())
    data["model"]["num_layers"] = 4
    (tmp_path / "tiny-llama").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    assert load_recipe("tiny-llama").model.num_layers == 4
    assert load_recipe("tiny-llama.yaml").model.num_layers == 8  # no such file here
