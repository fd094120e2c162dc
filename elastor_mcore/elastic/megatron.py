"""Megatron-LM's own ``pretrain_gpt.py`` as a supervised workload (``elastor launch
--megatron-lm PATH -- <Megatron-LM flags>``): the same detection, planning, relaunch,
lease and timeline as the project's trainer, with Megatron-LM's loop in the ranks.

* **The job** is read from the user's flags by Megatron-LM's own parser before
  anything starts (``integrations.megatron_lm.launch_flags``), refused there if no
  re-planned layout could run it, and written beside the run: ``megatron-job.json``
  (what the parser made of the flags) and ``megatron-recipe.yaml`` (the model and
  batch the planner plans for).
* **Every launch** runs, on each rank, ``elastic.rank.megatron``, which arms the
  parent-death signal, watches Megatron-LM's loop through its hooks
  (``integrations.megatron_lm.loop``: heartbeats, events, metrics, injected failures)
  and runs ``pretrain_gpt.py`` with the user's flags, TP and PP taken out, and
  ``--elastor-layout <launch>/layout.yaml --elastor-ckpt-format zarr --save ROOT --load
  ROOT --ckpt-step N`` (``megatron_argv``).
* **Checkpoints** are Megatron-LM's iteration directories in the zarr format
  (``checkpoint.megatron_dir``); a launch resumes from the latest committed one that
  loads (the supervisor skips one whose load failed). Before the root holds any, the
  first launch loads the user's ``--load`` (e.g. a converted checkpoint).
* **Layouts** must suit Megatron-LM's loop: heterogeneous ones pass
  ``training.unsupported_reason`` with the job's arguments (``refusal``), and the
  torchrun ranks increase along every pipeline, so the highest holds a last stage
  (Megatron-LM logs the loss there; ``rank_order``).
"""

from __future__ import annotations

import ast
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import yaml

from elastor_mcore.checkpoint.storage import Location, as_path
from elastor_mcore.config.launch import MegatronSettings, RoundSettings
from elastor_mcore.config.recipe import Recipe, recipe_from_dict
from elastor_mcore.elastic.job import Launch, RankCommand, Workload
from elastor_mcore.integrations.megatron_lm.launch_flags import (
    LAUNCHER_SET, MegatronJob, read_job, strip_flags)
from elastor_mcore.parallel.layout import Layout

log = logging.getLogger(__name__)

JOB_FILE = "megatron-job.json"
RECIPE_FILE = "megatron-recipe.yaml"



def script_core_imports(script: Path) -> tuple[str, ...]:
    """The Megatron-Core modules ``script`` imports at its top level, for the
    pre-imported worker to import once instead of every rank (Megatron-Core 0.16's
    tokenizers load ``transformers``: 1.2 CPU-s a rank, measured). Not
    ``megatron.training``: what it hooks at its import may depend on each run's
    environment. Empty if the script cannot be read (its ranks then say why)."""
    try:
        tree = ast.parse(script.read_text())
    except (OSError, SyntaxError, ValueError):
        return ()
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return tuple(dict.fromkeys(n for n in names if n.split(".")[:2] == ["megatron", "core"]))


LAZY_CORE_IMPORTS = ("megatron.core.tokenizers.text",)
"""Megatron-Core modules a Megatron-LM rank imports after its script's top level and
before its first step. Megatron-Core 0.19 builds the tokenizer through ``importlib``
from ``megatron.core.tokenizers.text``, whose Hugging Face wrapper imports
``transformers`` (2.2 CPU-s a rank, measured); 0.16's ``pretrain_gpt.py`` imports it
at its top level."""


def rank_core_imports(script: Path) -> tuple[str, ...]:
    """What the pre-imported worker imports for the ranks of ``script``: its top-level
    Megatron-Core imports (``script_core_imports``), then ``LAZY_CORE_IMPORTS``."""
    return tuple(dict.fromkeys(script_core_imports(script) + LAZY_CORE_IMPORTS))


@dataclass(frozen=True)
class MegatronLM(Workload):
    """``pretrain_gpt.py`` under the launcher (see the module docstring)."""

    settings: MegatronSettings
    """The script, the job file and the failure plan."""
    argv: tuple[str, ...]
    """The user's Megatron-LM flags without ``LAUNCHER_SET``."""
    job: MegatronJob
    recipe_path: str
    """The job's recipe file (``megatron-recipe.yaml``)."""
    module = "elastor_mcore.elastic.rank.megatron"
    prestarted = True
    """Its ranks fork from the zygote, which holds torch, Megatron-Core and the script's
    Megatron-Core imports (``zygote_imports``, ``rank_core_imports``); each imports
    ``megatron.training`` and runs ``pretrain_gpt.py`` as a cold rank does."""

    @property
    def zygote_imports(self) -> tuple[str, ...]:
        return rank_core_imports(Path(self.settings.script))

    @property
    def steps(self) -> int:
        return self.job.train_iters

    @property
    def save_interval(self) -> int:
        return self.job.save_interval

    @property
    def failure_plan(self) -> str | None:
        return self.settings.failure_plan

    @property
    def recipe_file(self) -> str:
        return self.recipe_path

    @property
    def recipe(self) -> Recipe:
        return recipe_from_dict(self.job.recipe, "Megatron-LM's flags")

    def megatron_argv(self, layout: str, checkpoint_dir: str, load_step: int | None
                      ) -> list[str]:
        """``pretrain_gpt.py``'s flags for one launch on ``layout``, saving into
        ``checkpoint_dir`` and resuming its iteration ``load_step``; None: the user's
        ``--load`` if they gave one, else ``checkpoint_dir`` (nothing there yet:
        Megatron-LM starts from scratch)."""
        argv = [*self.argv, "--elastor-layout", layout, "--elastor-ckpt-format", "zarr",
                "--save", checkpoint_dir]
        if load_step is not None:
            return [*argv, "--load", checkpoint_dir, "--ckpt-step", str(load_step)]
        return [*argv, "--load", self.job.load or checkpoint_dir]

    def launch_command(self, launch: Launch) -> RankCommand:
        rank = replace(self.settings, elastic_dir=launch.directory,
                       metrics_out=launch.metrics_out, rank_slots=launch.slots)
        return RankCommand(self.module, [
            *rank.to_argv("megatron-worker"), "--",
            *self.megatron_argv(launch.layout, launch.checkpoint_dir, launch.load_step)])

    def round_command(self, node: RoundSettings, checkpoint_dir: str, hardware: str,
                      node_dir: str) -> RankCommand:
        rank = replace(self.settings, elastic_dir=node_dir, checkpoint_dir=checkpoint_dir,
                       hardware=hardware)
        return RankCommand(self.module, [*rank.to_argv("megatron-worker"),
                                         *node.to_argv("node-worker"), "--", *self.argv])

    def committed_steps(self, root: Location) -> list[int]:
        from elastor_mcore.checkpoint.megatron_dir import committed_iterations

        return committed_iterations(root)

    def refusal(self, layout: Layout) -> str | None:
        """What Megatron-LM's parser would refuse of a heterogeneous ``layout`` (a
        uniform one runs Megatron-LM's own loop)."""
        if layout.is_uniform:
            return None
        from elastor_mcore.integrations.megatron_lm.training import unsupported_reason

        return unsupported_reason(layout, self.job.namespace())

    def rank_order(self, layout: Layout) -> tuple[int, ...]:
        """Pipeline by pipeline, stage by stage, so torchrun ranks increase along every
        pipeline: Megatron-Core takes a rank's stage from its place in its pipeline
        group, which torch orders by rank (a last stage holding rank 0 built the output
        layer on a middle stage). The last rank then holds a last stage, where
        Megatron-LM logs the loss."""
        return tuple(s for pipe in layout.pipelines for stage in pipe.stages
                     for s in stage.ranks)


def prepare(script: str, argv: Sequence[str], run_dir: Path, failure_plan: str | None,
            on_message=log.info) -> MegatronLM:
    """Read the job from the user's flags with Megatron-LM's parser (raises
    ``launch_flags.FlagError`` for what it refuses), write its files into ``run_dir``
    and return the workload."""
    if not Path(script).is_file():
        raise ValueError(f"--megatron-lm {script}: no such file; pass Megatron-LM's "
                         f"pretrain_gpt.py, patched by tools/apply_megatron_patch.sh")
    job = read_job(script, argv)
    kept, removed = strip_flags(argv, LAUNCHER_SET)
    if removed:
        on_message(f"taken out of the Megatron-LM flags (each launch sets them): "
                   f"{', '.join(removed)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    job_file, recipe_file = run_dir / JOB_FILE, run_dir / RECIPE_FILE
    job_file.write_text(job.to_json() + "\n")
    recipe = recipe_from_dict(job.recipe, "Megatron-LM's flags")
    recipe_file.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    settings = MegatronSettings(script=str(Path(script).resolve()), job=str(job_file),
                                failure_plan=failure_plan)
    return MegatronLM(settings, tuple(kept), job, str(recipe_file))


def from_settings(settings: MegatronSettings, argv: Sequence[str]) -> MegatronLM:
    """The workload again, on a rank (a round plans and builds its own launch)."""
    job = MegatronJob.from_json(Path(settings.job).read_text())
    return MegatronLM(settings, tuple(argv), job,
                      str(Path(settings.job).with_name(RECIPE_FILE)))


def checkpoint_root(job: MegatronJob, given: str | None) -> str | None:
    """The run's checkpoint root: ``--checkpoint-dir`` or the user's ``--save`` (both
    must agree when given); None: the launcher's default."""
    if given and job.save and as_path(given) != as_path(job.save):
        raise ValueError(f"--checkpoint-dir {given} and the Megatron-LM flag --save "
                         f"{job.save} name different roots; give one of them")
    return given or job.save
