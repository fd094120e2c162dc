"""Shared fixtures: the repository root, recipes, and a runner for torchrun worlds."""

import ast
import contextlib
import functools
import json
import os
import time
from pathlib import Path

import pytest
import torch

from elastor_mcore.elastic import prestart
from elastor_mcore.elastic.torchrun import run_torchrun
from tests import train_world as shared_world

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-llama.yaml"
THIRD_PARTY = REPO.parent / "shared" / "third_party"
"""Unmodified Megatron-LM archives (see its README.md); absent outside this workspace."""
MEGATRON_LM_ENV = "MEGATRON_LM_DIR"


SHARED_WORLDS = ("train_world", "mcore_world", "single_process_reference")
"""Session fixtures whose world several test modules share."""


def pytest_configure(config):
    """Draw ``test_random_layouts``' base seed once, in the controlling process: every
    pytest-xdist worker collects the suite itself and inherits this environment, and
    the workers must agree on the test ids the seed is part of. With
    ``--record-unit-seconds`` it also times the work units there (``UnitSeconds``)."""
    if not hasattr(config, "workerinput"):
        os.environ.setdefault("ELASTOR_LAYOUT_SEED", str(time.time_ns() % 1_000_000))
        if config.getoption("--record-unit-seconds"):
            config.pluginmanager.register(UnitSeconds(config), "unit-seconds")


@functools.cache
def shared_world_of(module_path: Path) -> str | None:
    """The first of ``SHARED_WORLDS`` that a test module's functions (tests, fixtures)
    take, read from its source: xdist's controller schedules by node id, without
    collecting."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(module_path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
            names.update(a.arg for a in (*node.args.args, *node.args.kwonlyargs))
    return next((world for world in SHARED_WORLDS if world in names), None)


def work_unit(config, nodeid: str) -> str:
    """What one xdist worker runs whole: a test module, or the modules that share one
    session world (named after it)."""
    module = nodeid.split("::", 1)[0]
    return shared_world_of(config.rootpath / module) or module


UNIT_SECONDS = Path(__file__).with_name("unit_seconds.json")
"""Each work unit's seconds in a recorded run (``pytest --record-unit-seconds``): the
scheduler hands out the longest first, so that the run does not end on one worker
with a long module still to go. A unit it does not list counts 0 s (it goes last)."""


def recorded_unit_seconds() -> dict[str, float]:
    """``UNIT_SECONDS``'s units and seconds (none before the first recording)."""
    return json.loads(UNIT_SECONDS.read_text()) if UNIT_SECONDS.exists() else {}


def pytest_addoption(parser):
    parser.addoption("--record-unit-seconds", action="store_true",
                     help=f"write each work unit's seconds (setup, call and teardown of "
                          f"its tests) into {UNIT_SECONDS.name}, keeping the units this "
                          f"run did not run")


class UnitSeconds:
    """Adds up, in the controlling process, the seconds of every test report per work
    unit, and writes them at the end of the session."""

    def __init__(self, config) -> None:
        self.config = config
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        unit = work_unit(self.config, report.nodeid)
        self.seconds[unit] = self.seconds.get(unit, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        recorded = recorded_unit_seconds()
        recorded.update({unit: round(s, 1) for unit, s in self.seconds.items()})
        UNIT_SECONDS.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``-n 2``; pytest.ini) each test module runs whole on one
    worker, so that its module-scoped worlds run once, and the modules that share a
    session world run on the same worker, so that it runs once. The suite mostly
    waits on torchrun worlds starting, supervisors polling and timeouts running out:
    two workers overlap that. Units go out longest first (``UNIT_SECONDS``)."""
    from xdist.scheduler import LoadScopeScheduling

    seconds = recorded_unit_seconds()

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(config, nodeid)

        def _assign_work_unit(self, node) -> None:
            longest = max(self.workqueue, key=lambda unit: seconds.get(unit, 0.0))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


PRE_IMPORTED = contextlib.ExitStack()
"""Holds the zygote (``elastic.rank.zygote``) whose forks are ``run_world``'s ranks until
this pytest process ends."""


@functools.cache
def zygote_env() -> dict[str, str]:
    """The environment pointing keepers to the zygote, started at the first world."""
    return PRE_IMPORTED.enter_context(prestart.prestarted(True))


def pytest_unconfigure(config):
    PRE_IMPORTED.close()


def run_world(nproc: int, module: str, args: list[str], timeout: float = 240):
    """Run a torchrun world from the repo root; fail the test with its output.

    Its ranks are forked from this pytest process's zygote, under keepers, as
    ``elastor launch`` starts them: each rank of a cold world pays seconds of CPU
    importing torch and Megatron-Core, and the suite runs dozens of worlds. What a
    user's command starts (``elastor train``, ``pretrain_gpt.py``) the tests run cold."""
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           **zygote_env()}
    result = run_torchrun(nproc, prestart.KEEPER, [module, *args], timeout=timeout,
                          capture=True, env=env)
    if result.returncode:
        pytest.fail(f"torchrun {module} exited {result.returncode}\n"
                    f"--- stdout ---\n{result.stdout[-6000:]}\n"
                    f"--- stderr ---\n{result.stderr[-6000:]}")
    return result


def load_losses(path: Path) -> list[float]:
    return [m["loss"] for m in json.loads(path.read_text())]


def assemble_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """Full global tensors from every rank's saved shards (see train_matrix.py)."""
    parts: dict[str, list] = {}
    for f in sorted(run_dir.glob("rank*.pt")):
        for key, (offset, tensor) in torch.load(f).items():
            parts.setdefault(key, []).append((offset, tensor))
    full = {}
    for key, pieces in parts.items():
        shape = [max(o[d] + t.shape[d] for o, t in pieces) for d in range(pieces[0][1].dim())]
        out = torch.full(shape, float("nan"), dtype=pieces[0][1].dtype)
        for offset, tensor in pieces:
            out[tuple(slice(o, o + n) for o, n in zip(offset, tensor.shape))] = tensor
        full[key] = out
    return full


def case_metrics(world: Path, name: str) -> list[dict]:
    """The per-step metrics of one ``train_matrix`` case (``<world>/<name>/metrics.json``)."""
    return json.loads((world / name / "metrics.json").read_text())


def global_state(files: list[Path]) -> dict[str, torch.Tensor]:
    """Global tensors rebuilt from shard dumps (``train_matrix.dump_shards``); every
    element must be covered."""
    full: dict[str, torch.Tensor] = {}
    for f in files:
        for key, shape, offset, tensor in torch.load(f):
            full.setdefault(key, torch.full(shape, float("nan"), dtype=tensor.dtype))
            full[key][tuple(slice(o, o + n) for o, n in zip(offset, tensor.shape))] = tensor
    for key, tensor in full.items():
        assert not tensor.isnan().any(), f"{key}: not every element was dumped"
    return full


LAYOUTS = REPO / "tests" / "layouts"


def layout_arg(name: str) -> str:
    """A test layout by name: ``tests/layouts/<name>.yaml`` if it exists, else a
    shorthand such as ``dp2-tp2-pp2``."""
    path = LAYOUTS / f"{name}.yaml"
    return str(path) if path.exists() else name


def write_tiny_recipe(path: Path, optimizer: dict | None = None, **training) -> Path:
    """The tiny recipe with ``training`` (and ``training.optimizer``) settings
    replaced, validated, written to ``path``."""
    import yaml

    from elastor_mcore.config.recipe import RecipeError, recipe_from_dict
    from elastor_mcore.config.yaml_file import read_yaml_file

    data = read_yaml_file(TINY, "recipe", RecipeError)
    data["training"].update(training)
    data["training"]["optimizer"].update(optimizer or {})
    recipe_from_dict(data)
    path.write_text(yaml.safe_dump(data))
    return path


def max_relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="session")
def train_world(request, tmp_path_factory) -> dict[str, Path]:
    """One torchrun world for the cases of every collected module that defines
    ``train_world_part`` (``tests/train_world.py``); each module's directory by its
    ``__name__``."""
    modules = {item.module.__name__: item.module for item in request.session.items
               if hasattr(item.module, "train_world_part")}
    root = tmp_path_factory.mktemp("train-world")
    dirs = {name: root / shared_world.module_dir_name(name) for name in sorted(modules)}
    for directory in dirs.values():
        directory.mkdir()
    parts = {name: modules[name].train_world_part(dirs[name]) for name in dirs}
    run_world(shared_world.WORLD_SIZE, shared_world.WORKER,
              ["--recipe", str(TINY), *shared_world.world_args(root, parts)],
              timeout=shared_world.TIMEOUT)
    return dirs


@pytest.fixture(scope="session")
def single_process_reference(tmp_path_factory) -> Path:
    """The recovery tests' uninterrupted run (``tests/single_process_reference.py``,
    which imports this module's ``run_world``)."""
    from tests.single_process_reference import run_reference

    return run_reference(tmp_path_factory.mktemp("single-process-reference"))


@pytest.fixture(scope="session")
def mcore_world(tmp_path_factory) -> Path:
    """One 4-rank world for ``test_parallel_state`` (first, on fresh ``parallel_state``)
    and ``test_checkpoint_mcore`` (``tests/workers/checkpoint_mcore.py``): each rank's
    start-up is most of either job's cost. Their ``result.json`` files, under
    ``parallel_state/`` and at the top."""
    out = tmp_path_factory.mktemp("mcore-world")
    run_world(4, "tests.workers.checkpoint_mcore",
              ["--out", str(out), "--parallel-state-recipe", str(TINY)], timeout=300)
    return out


@pytest.fixture(scope="session")
def tiny_recipe_path() -> Path:
    return TINY


@pytest.fixture(scope="session")
def megatron_lm_dir() -> Path:
    """The Megatron-LM checkout named by $MEGATRON_LM_DIR (of the installed megatron-core's
    release; ``.ci/run`` extracts one); the test is skipped without one."""
    value = os.environ.get(MEGATRON_LM_ENV)
    if not value:
        pytest.skip(f"needs a Megatron-LM checkout: set {MEGATRON_LM_ENV} (.ci/run extracts "
                    f"one from {THIRD_PARTY})")
    path = Path(value).resolve()
    for need in ("pretrain_gpt.py", "megatron/training/checkpointing.py"):
        if not (path / need).is_file():
            pytest.fail(f"{MEGATRON_LM_ENV}={value} is not a Megatron-LM checkout: no {need}")
    return path


@pytest.fixture(scope="session")
def patched_megatron_lm(megatron_lm_dir) -> Path:
    """A patched copy of $MEGATRON_LM_DIR (the checkout stays unmodified), for running the
    real ``pretrain_gpt.py`` (``tests/pretrain_gpt_run.py``); skipped unless the
    checkout's release is the installed megatron-core's and megatron.training imports."""
    import importlib.util

    from elastor_mcore.compat.mcore import mcore_version
    from tests.pretrain_gpt_run import checkout_release, patched_checkout

    release, installed = checkout_release(megatron_lm_dir), mcore_version()[:2]
    if release != installed:
        pytest.skip(f"{MEGATRON_LM_ENV}={megatron_lm_dir} is Megatron-LM "
                    f"{'.'.join(map(str, release)) if release else 'of an unknown release'}"
                    f", the installed megatron-core is {'.'.join(map(str, installed))}: "
                    f"point it at the matching release (.ci/run extracts it)")
    for module in ("six", "triton"):  # imported by megatron.training on every path
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"importing megatron.training needs {module}: pip install {module}")
    return patched_checkout(megatron_lm_dir)
