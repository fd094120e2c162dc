"""A user's ``pretrain_gpt.py`` flags as ``elastor launch --megatron-lm`` takes them,
before any rank starts: what Megatron-LM's own parser makes of them, what the
launcher sets in their place, and what it refuses.

* **Read by Megatron-LM.** The flags are parsed by Megatron-LM's ``parse_args`` with
  Elastor's extra arguments (``args.extra_args_provider``), in a short subprocess with
  the checkout on its path (``read_job``; ``python -m`` of this module), so they mean
  exactly what they mean to ``pretrain_gpt.py``; the vocabulary is that of Megatron-LM's
  tokenizer. The job (``MegatronJob``) is the model and batch as a recipe
  (``translate.recipe_from_args``, the translation ``--elastor-layout`` is validated
  with), the iterations, the save interval and the arguments themselves.
* **Set by the plan and the launcher.** TP, PP and the layers per stage come from each
  launch's layout, the checkpoint flags from the run: they are taken out of the user's
  flags (``strip_flags`` of ``LAUNCHER_SET``), and the launcher adds
  ``--elastor-layout``, ``--elastor-ckpt-format zarr``, ``--save``, ``--load`` and
  ``--ckpt-step`` itself. ``--global-batch-size`` stays: the planner
  plans for it, and the parser checks it against every layout.
* **Refused** (``refusal``), naming the flag: what the launcher sets itself, what a
  relaunch could not resume exactly, what no re-planned layout could run (virtual
  pipeline stages, context or expert parallelism) and whatever Megatron-LM's loop cannot
  train on a heterogeneous layout (``training.unsupported_reason``, asked about a
  heterogeneous layout of this model: any relaunch may need one).

A leaf of the integration on the launcher's side: the launcher imports neither
Megatron-LM nor torch through it; the subprocess does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

LAUNCHER_SET = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                "--pipeline-model-parallel-layout", "--save", "--load",
                "--elastor-ckpt-format")
"""The user's flags (each with one value) that a launch sets itself: TP, PP and the
layers per stage from its layout, the checkpoint flags from the run (the user's
``--save`` and ``--load`` still say where: ``MegatronJob.save``, ``.load``)."""

LAUNCHER_FLAGS = {
    "elastor_layout": "--elastor-layout: elastor launch plans every launch's layout",
    "ckpt_step": "--ckpt-step: elastor launch picks the iteration every launch resumes from",
    "finetune": "--finetune: a relaunch must resume the whole state (iteration, optimizer, "
                "RNG) from the run's own checkpoints",
    "no_load_optim": "--no-load-optim: a relaunch must resume the optimizer state",
    "no_load_rng": "--no-load-rng: a relaunch must resume the RNG state",
    "use_checkpoint_args": "--use-checkpoint-args: the parallel sizes come from each "
                           "launch's layout, not from a checkpoint",
    "train_samples": "--train-samples: elastor launch counts iterations; use --train-iters",
}
"""Arguments (destination -> why) the user may not set under the launcher."""

NOT_REPLANNED = (
    ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage",
     (None,)),
    ("--num-virtual-stages-per-pipeline-rank", "num_virtual_stages_per_pipeline_rank",
     (None,)),
    ("--virtual-pipeline-model-parallel-size", "virtual_pipeline_model_parallel_size",
     (None,)),
    ("--context-parallel-size", "context_parallel_size", (None, 1)),
    ("--expert-model-parallel-size", "expert_model_parallel_size", (None, 1)),
    ("--expert-tensor-parallel-size", "expert_tensor_parallel_size", (None, 1)),
)
"""Parallelisms the planner does not lay out: (flag, destination, the values that mean
none of it)."""


@dataclass(frozen=True)
class MegatronJob:
    """What Megatron-LM's parser made of the user's flags."""

    recipe: dict[str, Any]
    """``translate.recipe_from_args`` (``Recipe.to_dict``): the planner's job."""
    train_iters: int
    save_interval: int
    save: str | None
    load: str | None
    arguments: dict[str, Any]
    """Megatron-LM's parsed arguments that JSON holds (``unsupported_reason`` reads
    them for every layout a launch would run)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "MegatronJob":
        return cls(**json.loads(text))

    def namespace(self) -> argparse.Namespace:
        return argparse.Namespace(**self.arguments)


def strip_flags(argv: Sequence[str], flags: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` without ``flags`` (each with one value; Megatron-LM's parser takes no
    abbreviations), and what was taken out."""
    kept, removed = [], []
    tokens = iter(argv)
    for token in tokens:
        if token in flags:
            removed.append(f"{token} {next(tokens, '')}".strip())
        elif token.split("=", 1)[0] in flags and "=" in token:
            removed.append(token)
        else:
            kept.append(token)
    return kept, removed


def probe_layout(num_layers: int, micro_batches: int):
    """A heterogeneous layout of the model (a one-stage pipeline beside a two-stage
    one, highest rank a last stage), to ask ``unsupported_reason`` what no
    heterogeneous layout could run; None if the model or batch is too small for one."""
    from elastor_mcore.parallel.layout import layout_from_dict

    if num_layers < 2 or micro_batches < 3:
        return None
    return layout_from_dict({"pipelines": [
        {"micro_batches": micro_batches - micro_batches // 2,
         "stages": [{"tp": 1, "layers": num_layers - 1, "ranks": [0]},
                    {"tp": 1, "layers": 1, "ranks": [1]}]},
        {"micro_batches": micro_batches // 2,
         "stages": [{"tp": 1, "layers": num_layers, "ranks": [2]}]}]})


def refusal(args: argparse.Namespace) -> str | None:
    """Why the launcher cannot run Megatron-LM with ``args`` (None: it can)."""
    from elastor_mcore.integrations.megatron_lm.training import unsupported_reason

    for dest, why in LAUNCHER_FLAGS.items():
        if getattr(args, dest, None):
            return f"{why}; drop it"
    if not getattr(args, "train_iters", None):
        return "--train-iters is required: elastor launch counts the run in iterations"
    if not getattr(args, "save_interval", None):
        return ("--save-interval is required: a relaunch resumes from the latest saved "
                "iteration, and a failure redoes at most that many")
    if getattr(args, "global_batch_size", None) is None:
        return ("--global-batch-size is required: Megatron-LM's default (micro-batch size "
                "x data-parallel size) changes with the layout, and a relaunch must keep "
                "the global batch")
    for flag, dest, neutral in NOT_REPLANNED:
        value = getattr(args, dest, None)
        if value not in neutral:
            return (f"{flag} {value}: the planner re-plans tensor, pipeline and data "
                    f"parallelism only, one model chunk per pipeline stage; drop {flag}")
    micro_batches = args.global_batch_size // args.micro_batch_size
    layout = probe_layout(args.num_layers, micro_batches)
    reason = None if layout is None else unsupported_reason(layout, args)
    if reason:
        return f"a relaunch may need a heterogeneous layout, and {reason}"
    return None


def job_from_args(args: argparse.Namespace, vocab_size: int) -> MegatronJob:
    """The job ``args`` describe (``refusal`` first)."""
    from elastor_mcore.integrations.megatron_lm.translate import recipe_from_args

    arguments = {}
    for name, value in vars(args).items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        arguments[name] = value
    return MegatronJob(recipe_from_args(args, vocab_size).to_dict(), args.train_iters,
                       args.save_interval, args.save, args.load, arguments)


def _vocab_size(args: argparse.Namespace) -> int:
    """The unpadded vocabulary of Megatron-LM's tokenizer, as every rank builds it."""
    from megatron.training.global_vars import rebuild_tokenizer

    try:
        return rebuild_tokenizer(args).vocab_size
    except Exception as exc:  # any tokenizer's failure, reported with the flags' fix
        raise ValueError(f"Megatron-LM's tokenizer ({args.tokenizer_type}) could not be "
                         f"built from these flags: {exc}") from exc


class FlagError(ValueError):
    """The flags cannot run under the launcher; the message names the flag and the fix."""


def read_job(script: str | os.PathLike, argv: Sequence[str],
             env: dict[str, str] | None = None, timeout_s: float = 300) -> MegatronJob:
    """Parse ``argv`` (the user's flags) with the Megatron-LM checkout of ``script``;
    raise ``FlagError`` for what it refuses."""
    result = subprocess.run(
        [sys.executable, "-m", __name__, str(Path(script).resolve().parent)],
        input=json.dumps(list(argv)), capture_output=True, text=True, timeout=timeout_s,
        env={**os.environ, **(env or {}), "WORLD_SIZE": "1", "RANK": "0"})
    lines = result.stdout.strip().splitlines()
    if result.returncode == 0 and lines:
        return MegatronJob.from_json(lines[-1])
    error = result.stderr.strip().splitlines()
    detail = next((line for line in reversed(error) if "error:" in line), None) or \
        "\n".join(error[-15:])
    raise FlagError(f"{script}'s flags: {detail.split('error: ', 1)[-1]}")


def main(checkout: str) -> int:
    """The subprocess: the flags (JSON list on stdin) through Megatron-LM's parser; the
    job on stdout, or the parser's error (``pretrain_gpt.py: error: ...``) on stderr."""
    sys.path.insert(0, checkout)
    from megatron.training.arguments import parse_args

    from elastor_mcore.integrations.megatron_lm.args import extra_args_provider

    sys.argv = ["pretrain_gpt.py", *json.loads(sys.stdin.read())]
    stdout = sys.stdout
    sys.stdout = sys.stderr  # Megatron-LM's prints; the job alone goes to stdout
    args = parse_args(extra_args_provider())
    reason = refusal(args)
    if reason:
        print(f"pretrain_gpt.py: error: {reason}", file=sys.stderr)
        return 2
    try:
        job = job_from_args(args, _vocab_size(args))
    except ValueError as exc:
        print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr)
        return 2
    print(job.to_json().replace("\n", ""), file=stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
