"""Run Megatron-LM's real ``pretrain_gpt.py`` (patched with Elastor's hooks) under torchrun
on CPU/gloo, and read its per-iteration losses from its own log lines.

The checkout named by ``MEGATRON_LM_DIR`` is never modified: ``patched_checkout``
copies it (a few MB of Python) and applies ``tools/apply_megatron_patch.sh`` to the
copy. ``tests/megatron_lm_cpu`` goes first on the workers' ``PYTHONPATH``; its
``sitecustomize`` shims the places where Megatron-LM's training code needs CUDA.

The ranks are forked from a pre-imported worker (``elastic.prestart``, as ``elastor
launch --megatron-lm`` starts its ranks), whose interpreter holds torch and
Megatron-Core and loaded the shims: a cold rank spends seconds of CPU importing them,
and the suite runs dozens of 4-6 rank runs. ``cold=True`` runs the ranks as a user's
``torchrun pretrain_gpt.py`` does.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.elastic import prestart
from elastor_mcore.elastic.megatron import rank_core_imports
from tests.conftest import PRE_IMPORTED

REPO = Path(__file__).resolve().parents[1]
CPU_SHIMS = REPO / "tests" / "megatron_lm_cpu"
APPLY_PATCH = REPO / "tools" / "apply_megatron_patch.sh"
TINY = REPO / "recipes" / "tiny-llama.yaml"

_LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([-+0-9.eE]+) \|")
_SKIPPED = re.compile(r"number of skipped iterations:\s+(\d+)")
_patched: dict[Path, Path] = {}
RUN_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # Megatron's check for TP > 1 (pre-Blackwell)


def tiny_model_args(recipe_path: Path = TINY) -> list[str]:
    """Megatron-LM flags for the recipe's model and optimizer: Llama-style (RMSNorm,
    SwiGLU, RoPE, GQA, no biases, untied embeddings), the local transformer (no TE,
    no fused kernels: none is compiled on a CPU rank), constant lr, no dropout."""
    recipe = load_recipe(recipe_path)
    m, t = recipe.model, recipe.training
    o = t.optimizer
    return [
        "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
        "--num-attention-heads", str(m.num_attention_heads),
        "--group-query-attention", "--num-query-groups", str(m.num_query_groups),
        "--ffn-hidden-size", str(m.ffn_hidden_size), "--seq-length", str(m.seq_length),
        "--max-position-embeddings", str(m.max_position_embeddings or m.seq_length),
        "--normalization", "RMSNorm", "--norm-epsilon", str(m.norm_epsilon), "--swiglu",
        "--position-embedding-type", "rope", "--rotary-base", str(m.rotary_base),
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--init-method-std", str(m.init_method_std),
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
        "--no-persist-layer-norm", "--no-bias-dropout-fusion",
        "--micro-batch-size", str(t.micro_batch_size), "--seed", str(t.seed),
        "--lr", str(o.lr), "--min-lr", str(o.lr), "--lr-decay-style", "constant",
        "--weight-decay", str(o.weight_decay), "--adam-beta1", str(o.adam_beta1),
        "--adam-beta2", str(o.adam_beta2), "--adam-eps", str(o.adam_eps),
        "--clip-grad", str(o.clip_grad),
    ]


def data_args(vocab_size: int) -> list[str]:
    """Deterministic data and a tokenizer without files: Megatron's mock GPT dataset
    and ``NullTokenizer``; no evaluation, no data-loader worker processes."""
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(vocab_size), "--eval-iters", "0", "--eval-interval", "1000000",
            "--log-interval", "1", "--distributed-backend", "gloo", "--num-workers", "0"]


def default_args(tied_embeddings: bool = False) -> list[str]:
    """The tiny model on mock data: everything but layout, batch and iteration flags
    (``tied_embeddings``: without ``--untie-embeddings-and-output-weights``)."""
    args = tiny_model_args() + data_args(load_recipe(TINY).model.vocab_size)
    return [a for a in args if a != "--untie-embeddings-and-output-weights"] \
        if tied_embeddings else args


def checkout_release(megatron_lm_dir: Path) -> tuple[int, int] | None:
    """The (major, minor) Megatron-Core release a Megatron-LM checkout belongs to: that
    of the patch in ``patches/`` whose dry run fits its ``pretrain_gpt.py`` (the
    archives carry no ``megatron/core`` to ask); None if none fits."""
    for patch in sorted((REPO / "patches").glob("*.patch")):
        with patch.open() as stdin:
            fits = subprocess.run(["patch", "--dry-run", "--forward", "--silent", "-p1",
                                   "-d", str(megatron_lm_dir)], stdin=stdin,
                                  capture_output=True).returncode == 0
        header = re.search(r"^Applies to: .* core_[rv](\d+)\.(\d+)", patch.read_text(), re.M)
        if fits and header:
            return int(header.group(1)), int(header.group(2))
    return None


def patched_checkout(megatron_lm_dir: Path) -> Path:
    """A patched copy of ``megatron_lm_dir`` (made once per process)."""
    source = Path(megatron_lm_dir).resolve()
    if source not in _patched:
        copy = Path(tempfile.mkdtemp(prefix="megatron-lm-patched-")) / source.name
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
        result = subprocess.run([str(APPLY_PATCH), str(copy)], capture_output=True,
                                text=True)
        if result.returncode:
            raise RuntimeError(f"{APPLY_PATCH} {copy} failed:\n{result.stdout}{result.stderr}")
        _patched[source] = copy
    return _patched[source]


@dataclass
class PretrainRun:
    """One ``pretrain_gpt.py`` run: its exit status, losses and output."""

    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    logged: dict[int, float] = field(default_factory=dict)
    """Iteration -> ``lm loss`` as Megatron-LM's log line prints it (``--log-interval 1``)."""
    losses: dict[int, float] = field(default_factory=dict)
    """Iteration -> that iteration's own loss (``iteration_losses``)."""
    skipped: list[int] = field(default_factory=list)
    """Megatron-LM's "number of skipped iterations" of each logged iteration."""

    def tail(self, chars: int = 6000) -> str:
        """The end of both streams, for assertion messages."""
        return (f"$ {' '.join(self.command)}\nexit {self.returncode}\n"
                f"--- stdout ---\n{self.stdout[-chars:]}\n--- stderr ---\n"
                f"{self.stderr[-chars:]}")


def shimmed_env() -> dict[str, str]:
    """This process's environment with the CPU shims and the repository first on
    ``PYTHONPATH``, and ``RUN_ENV``."""
    path = os.pathsep.join([str(CPU_SHIMS), str(REPO), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, **RUN_ENV)


@functools.cache
def zygote_env(script: Path) -> dict[str, str]:
    """The environment pointing keepers to this pytest process's pre-imported worker for
    the Megatron-LM ranks of ``script``, started at its first warm run; it holds the
    script's Megatron-Core imports too, as ``elastor launch --megatron-lm``'s does
    (``MegatronLM.zygote_imports``). The suite's other worlds have their own, without
    the shims: ``conftest.zygote_env``."""
    return PRE_IMPORTED.enter_context(prestart.prestarted(
        True, env=shimmed_env(), imports=rank_core_imports(script)))


def run_pretrain_gpt(megatron_lm_dir: Path, nproc: int, args: list[str], workdir: Path,
                     timeout: float = 300, env: dict[str, str] | None = None,
                     tied_embeddings: bool = False, cold: bool = False) -> PretrainRun:
    """Run the patched ``pretrain_gpt.py`` of ``megatron_lm_dir`` on ``nproc`` CPU ranks
    (``torchrun --standalone``) with ``args`` after ``default_args(tied_embeddings)``, in
    ``workdir``; its ranks forked from the pre-imported worker unless ``cold``.

    The run is stopped (SIGTERM, then SIGKILL to its process group) after ``timeout``
    seconds; it then returns with returncode -9 and what it printed so far."""
    script = patched_checkout(megatron_lm_dir) / "pretrain_gpt.py"
    rank = [str(script)] if cold else ["-m", prestart.KEEPER, "tests.workers.run_script",
                                       str(script)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", *rank, *default_args(tied_embeddings), *args]
    run_env = shimmed_env() if cold else dict(shimmed_env(), **zygote_env(script))
    run_env.update(env or {})
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(command, cwd=workdir, env=run_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        stderr += f"\n[run_pretrain_gpt: stopped after {timeout:.0f} s]"
    run = PretrainRun(command, proc.returncode, stdout, stderr)
    for line in stdout.splitlines():
        if m := _LOG_LINE.search(line):
            run.logged[int(m.group(1))] = float(m.group(2))
            if s := _SKIPPED.search(line):
                run.skipped.append(int(s.group(1)))
    run.losses = iteration_losses(run.logged)
    return run


def iteration_losses(logged: dict[int, float]) -> dict[int, float]:
    """Each iteration's own loss from the losses one process logged at
    ``--log-interval 1``.

    Megatron-LM's ``training_log`` prints a process's first iteration without resetting
    its loss sums (``is_first_iteration``, training.py:1797 at core_v0.16.1, :2594 at
    core_v0.19.0), so the second line of every process, fresh or resumed, prints the
    mean of its first two iterations; every later line is its own iteration's. The
    second iteration's own loss is therefore ``2 * printed - first``: exact up to the
    print's 7 significant digits (a few 1e-7 relative)."""
    losses = dict(logged)
    if len(logged) >= 2:
        first, second = sorted(logged)[:2]
        losses[second] = 2 * logged[second] - logged[first]
    return losses
