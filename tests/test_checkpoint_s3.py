"""Checkpoints on S3, against a real S3 server (moto, on 127.0.0.1, started here).

The server runs with request authentication on and counts the bytes it serves, so
the tests see what every process (each rank of a torchrun world) fetched. Cases:

* the 4-rank library world of ``test_checkpoint_world`` with an ``s3://`` root (its
  assertions rerun on it; not its sub-group save, whose uneven split makes a thousand
  tiny objects), and a resharded load measured at the server;
* ``elastor train --save s3://`` (asynchronous saves, 2 ranks) with rank 0 SIGKILLed
  while a save is being written: the previous step loads; the resume on another
  layout (``--load s3://``) removes the partial step and trains on;
* a corrupted object (the error names the tensor), a missing bucket and wrong
  credentials (``elastor train`` and ``elastor launch`` refuse them before training), ``elastor inspect`` and ``elastor convert``
  (zarr on S3 <-> hf and <-> torch_dist) on an ``s3://`` URL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from elastor_mcore import checkpoint as ck
from elastor_mcore.checkpoint.storage.object_store import ObjectPath
from elastor_mcore.cli import main as cli_main
from elastor_mcore.convert.torch_dist import is_torch_dist
from tests.checkpoint_checks import MAX_READ_AMPLIFICATION, amplification
from tests.conftest import REPO, TINY, run_world
from tests.s3_server import s3_environment
from tests.test_checkpoint_crash import assert_loads, kill_when
from tests.test_checkpoint_world import (  # rerun on the S3 world below  # noqa: F401
    job_read_amplification, test_each_cell_written_once_and_spread,
    test_resharded_load_is_bit_exact)
from tests.workers.checkpoint_world import load_boxes, mismatches

BUCKET = "elastor-test"
CPU_SLOTS = REPO / "recipes" / "hardware" / "cpu-slots.yaml"


@pytest.fixture(scope="module")
def s3():
    """The server, reachable from every process the tests start while the module runs."""
    with s3_environment(BUCKET, REPO) as server:
        yield server


@pytest.fixture(scope="module")
def world(s3, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_world_s3")
    before = s3.counters()
    run_world(4, "tests.workers.checkpoint_world",
              ["--out", str(out), "--root", f"s3://{BUCKET}", "--no-subgroup"],
              timeout=240)
    result = json.loads((out / "result.json").read_text())
    result["server"] = {k: v - before[k] for k, v in s3.counters().items()
                        if k != "max_puts_in_flight"}
    result["server"]["max_puts_in_flight"] = s3.counters()["max_puts_in_flight"]
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["halves", "whole"])
def test_replicas_read_once_per_job(world, layout):
    """On object storage, where no page cache is shared, replicas on one host share
    reads too: the job fetches each byte about once."""
    assert job_read_amplification(world, "one host", layout) <= MAX_READ_AMPLIFICATION


@pytest.mark.timeout(300)
def test_saves_put_concurrently(world):
    assert world["server"]["max_puts_in_flight"] > 1, world["server"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank", [0, 3])
def test_resharded_load_fetches_what_it_needs_from_the_server(world, s3, rank):
    """One process loads rank ``rank``'s halves of the TP-4 save (another layout); the
    server's served bytes (chunks, file indices, the manifest and ``latest``) stay
    within ``MAX_READ_AMPLIFICATION`` of the target bytes."""
    targets = load_boxes(rank, "halves")
    needed = sum(t.data.numel() * t.data.element_size() for t in targets)
    before = s3.counters()["get_body_bytes"]
    ck.load(f"s3://{BUCKET}/world", targets)
    served = s3.counters()["get_body_bytes"] - before
    assert mismatches(targets) == []
    print(f"rank {rank} halves: served {served} bytes for {needed} needed "
          f"({served / needed:.3f}x)")
    assert amplification(served, needed) <= MAX_READ_AMPLIFICATION


@pytest.mark.timeout(120)
def test_corrupted_object_names_the_tensor(s3):
    root = f"s3://{BUCKET}/corrupt"
    key = "decoder.layers.0.mlp.linear_fc1.weight_w"
    data = torch.arange(192 * 64, dtype=torch.float32).view(192, 64)
    ck.save(root, 1, [ck.LocalShard(key, (192, 64), (0, 0), data)])
    chunk = next(p for p in (ObjectPath(root) / "step_00000001" / key).keys()
                 if p.startswith("c/"))
    obj = ObjectPath(root) / "step_00000001" / key / chunk
    raw = bytearray(obj.read_bytes())
    raw[100] ^= 0x40
    obj.write_bytes(bytes(raw))
    with pytest.raises(ck.CheckpointError, match=f"tensor {key}.*checksum mismatch"):
        ck.open(root).read(key)


def elastor(*args: str, env: dict[str, str] | None = None, timeout: float = 600):
    return subprocess.run([sys.executable, "-m", "elastor_mcore.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["missing bucket", "wrong credentials"])
def test_bad_storage_is_refused_before_training(s3, case, tmp_path):
    url = "s3://no-such-bucket/run" if case == "missing bucket" else f"s3://{BUCKET}/run"
    env = {"AWS_SECRET_ACCESS_KEY": "wrong"} if case == "wrong credentials" else {}
    want = ("the bucket does not exist" if case == "missing bucket"
            else "the credentials were refused")
    launch = ("launch", "--recipe", str(TINY), "--hardware", str(CPU_SLOTS), "--slots", "1",
              "--steps", "1", "--save-interval", "1", "--run-dir", str(tmp_path),
              "--devices", "cpu", "--checkpoint-dir", url)
    train = ("train", "--recipe", str(TINY), "--layout", "dp1-tp1-pp1", "--steps", "1")
    for command in ((*train, "--save", url), (*train, "--load", url), launch):
        run = elastor(*command, env=env, timeout=240)
        print(f"{case}, elastor {command[0]} {command[-2]}: "
              f"{run.stderr.strip().splitlines()[-1]}")
        assert run.returncode == 2, run.stdout + run.stderr
        assert want in run.stderr and url.split("/run")[0] in run.stderr
        assert "step     1" not in run.stdout and "step    1/1" not in run.stdout


@pytest.fixture(scope="module")
def trained(s3, tmp_path_factory):
    """Run 1 saves every 2 steps (asynchronously) and is SIGKILLed in rank 0, the
    committer, once step 4's objects are being written; run 2 resumes under another
    layout (TP2 instead of DP2) and saves at its end, step 5."""
    logs = tmp_path_factory.mktemp("train_s3")
    root = ObjectPath(f"s3://{BUCKET}/train")
    step4 = root / "step_00000004"

    def step4_in_progress() -> bool:
        time.sleep(0.05)  # each poll is two requests to the server
        return bool(step4.keys()) and not (step4 / "manifest.json").is_file()

    kill_when(["--recipe", str(TINY), "--layout", "dp2-tp1-pp1", "--steps", "4",
               "--save", str(root), "--save-interval", "2"], logs / "run1.log",
              moment=step4_in_progress, victim=0)
    after_kill = dict(committed=ck.committed_steps(root), partial=bool(step4.keys()))
    assert_loads(root, after_kill["committed"][-1])
    run2 = elastor("train", "--recipe", str(TINY), "--layout", "dp1-tp2-pp1", "--steps", "5",
                   "--load", str(root), "--save", str(root))
    assert run2.returncode == 0, run2.stdout[-3000:] + run2.stderr[-3000:]
    return dict(root=root, after_kill=after_kill, run2=run2.stdout)


@pytest.mark.timeout(900)
def test_killed_save_leaves_the_previous_step(trained):
    after = trained["after_kill"]
    if after["committed"] == [2, 4]:  # the commit won the race against the kill
        pytest.skip("step 4 committed before the kill landed; nothing partial to check")
    assert after["committed"] == [2] and after["partial"], after


@pytest.mark.timeout(900)
def test_resume_on_another_layout_cleans_the_partial_step(trained):
    root = trained["root"]
    assert "step     5" in trained["run2"]
    assert ck.committed_steps(root) == [*trained["after_kill"]["committed"], 5]
    assert ck.latest_step(root) == 5
    names = {p.name for p in root.iterdir()}
    assert {f"step_{s:08d}" for s in ck.committed_steps(root)} | {"latest"} == names, names
    assert_loads(root, 5)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """``elastor ARGS`` run in this process (the CLI's own ``main``): its exit code,
    stdout and stderr. Not for wrong credentials: a process keeps its bucket's
    kvstore (``checkpoint.storage.object_store``), so those tests start a new interpreter."""
    capsys.readouterr()
    code = cli_main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.timeout(900)
def test_inspect_and_convert_on_s3_urls(trained, tmp_path, capsys):
    root = str(trained["root"])
    code, shown, _ = cli(capsys, "inspect", root)
    assert code == 0
    assert f"checkpoint: {root}/step_00000005" in shown
    assert "step: 5" in shown and "objects" in shown

    hf, from_hf = tmp_path / "hf", f"s3://{BUCKET}/from-hf"
    assert cli(capsys, "convert", root, str(hf), "--to", "hf")[0] == 0
    assert cli(capsys, "convert", str(hf), from_hf, "--to", "zarr", "--recipe", str(TINY))[0] == 0
    original, converted = ck.open(root), ck.open(from_hf)
    weights = [i.name for i in original.tensors() if not i.name.startswith("optimizer.")]
    assert sorted(weights) == sorted(i.name for i in converted.tensors())
    vocab = original.manifest.model["vocab_size"]  # hf cuts the padded rows; import zeroes them
    for name in weights:
        saved, back = original.read(name), converted.read(name)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert not back[vocab:].any(), name
            saved, back = saved[:vocab], back[:vocab]
        assert torch.equal(saved.to(back.dtype), back), name

    # zarr on S3 -> a local torch_dist directory (Megatron-LM's stacked layer keys) ->
    # zarr on S3 again: every tensor comes back bit for bit.
    td, again_url = tmp_path / "td", f"s3://{BUCKET}/from-torch-dist"
    assert cli(capsys, "convert", from_hf, str(td), "--to", "torch_dist")[0] == 0
    assert is_torch_dist(td)
    assert cli(capsys, "convert", str(td), again_url, "--to", "zarr", "--recipe",
               str(TINY))[0] == 0
    again = ck.open(again_url)
    assert again.manifest.step == converted.manifest.step
    assert sorted(i.name for i in again.tensors()) == sorted(weights)
    for name in weights:
        assert torch.equal(converted.read(name), again.read(name)), name

    code, _, refused = cli(capsys, "convert", root, f"s3://{BUCKET}/td", "--to", "torch_dist")
    print(f"torch_dist to S3: {refused.strip()}")
    assert code == 2
    assert "--to torch_dist writes a local directory" in refused
