"""The Llama recipe on two nodes, simulated on one machine (docs/multi-node.md).

Two ``torchrun --nnodes 2 --nproc-per-node 2`` launches meet at a c10d rendezvous on
localhost, each with its own ``FSDP2_NODE``: four ranks, two per node, that read each other's
memory only inside a node (``fsdp2/comm/cpu/_cma.py``). The recipe runs HSDP with the shard
axis inside a node and the replicate axis across (``--dp-replicate 2 --dp-shard 2``), under
``FSDP2_CPU_COLLECTIVES=read``, which makes every shard group read (the small test model would
otherwise take the flat collectives) and a group that cannot read an error: the run succeeding
says each shard group stayed inside a node. It trains; its losses, learning rates and
gradient norms equal the same run's on one node (``train()`` on four ranks of the test world,
where every rank can read every other) bit for bit, since the maths is the same: the shard
groups read in both, the replicate all-reduce and the gradient norm go over gloo in both. It
resumes from its step-3 checkpoint on the two nodes again, simulated in the test world
(``FSDP2_NODE`` set per rank as the two launches set it, one torchrun pair is enough), and
repeats the steps after it exactly. That a shard group across the nodes is refused under
``read`` is tests/comm/test_nodes.py's ``test_reads_demanded_across_nodes_are_an_error``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from fsdp2.comm.cpu._cma import NODE_ENV
from tests._dist import _free_port, environ, run_on_ranks
from tests.tools.test_recipe import RUN_ARGS_2D, TRAIN, _assert_loss_falls, _records, _train_on_ranks

REPO = Path(__file__).resolve().parents[2]
HSDP = ["--dp-replicate", "2", "--dp-shard", "2"]  # the replicate axis across the nodes, shard inside
# The run's arguments: no loss curve to draw (tests/tools/test_recipe.py checks it; here it is
# matplotlib's start on rank 0 at the end of each run, for nothing checked).
ARGS = [*RUN_ARGS_2D, *HSDP, "--metrics.plot=false"]
KEYS = ("loss", "lr", "grad_norm")


def _two_nodes(args: list[str], run_id: str) -> list[subprocess.Popen]:
    """``recipes/train.py args`` launched twice, with ``FSDP2_NODE=0`` and ``FSDP2_NODE=1``,
    meeting at a c10d rendezvous on a free local port (which numbers the launches itself: torchrun
    ignores ``--node-rank`` with it); started, not waited for (``_wait``)."""
    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
               "--rdzv-id", run_id, str(TRAIN), *args]
        env = {**os.environ, NODE_ENV: str(node), CPU_COLLECTIVES_ENV: "read"}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                      env=env))
    return procs


def _wait(procs: list[subprocess.Popen], timeout: float = 300.0) -> list[subprocess.CompletedProcess]:
    """Each launch's result; one still running after ``timeout`` (or when waiting fails) is killed."""
    done = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def _succeeded(done: list[subprocess.CompletedProcess]) -> str:
    """Rank 0's output (one launch prints it, whichever the rendezvous made node 0)."""
    for proc in done:
        assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return "".join(proc.stdout for proc in done)


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    """HSDP on two simulated nodes (6 steps, checkpoints at 3 and 6, per-step metrics in a.jsonl)
    and the same run on one node in the test world (one.jsonl), which runs while the two launches
    start (a torchrun agent's start keeps one core of two busy) and meet."""
    root = tmp_path_factory.mktemp("nodes")
    launches = _two_nodes([*ARGS, "--checkpoint-dir", str(root / "ckpt"), "--metrics-file", str(root / "a.jsonl")],
                          "nodes-train")
    try:
        run_on_ranks(_train_reading, 4, [*ARGS, "--metrics-file", str(root / "one.jsonl")], timeout=240.0)
    except BaseException:
        for proc in launches:
            proc.kill()
            proc.communicate()
        raise
    return root, _succeeded(_wait(launches))


def _train_reading(argv: list[str]) -> int:
    with environ(CPU_COLLECTIVES_ENV, "read"):
        return _train_on_ranks(argv)


@pytest.mark.slow  # two torchrun launches: about 30 s on 2 cores
def test_recipe_trains_on_two_nodes_as_on_one(two_node_run):
    root, stdout = two_node_run
    assert "world 4 (cpu, gloo), mesh {'dp_replicate': 2, 'dp_shard': 2}" in stdout
    records = _records(root / "a.jsonl")
    _assert_loss_falls(records, 6, drop=0.5)
    assert records[1]["tokens"] == 4 * 32 * 4  # batch x seq x dp ranks
    one_node = _records(root / "one.jsonl")  # train() on four ranks of the test world
    assert {s: [r[k] for k in KEYS] for s, r in records.items()} == \
        {s: [r[k] for k in KEYS] for s, r in one_node.items()}


def _train_on_two_nodes(argv: list[str]) -> int:
    """``train()`` with this rank's ``FSDP2_NODE`` as the two launches set it (ranks 0-1: node 0)."""
    with environ(NODE_ENV, str(dist.get_rank() // 2)):
        return _train_reading(argv)


@pytest.mark.slow  # two_node_run: two torchrun launches
def test_recipe_resumes_on_two_nodes(two_node_run):
    root, _ = two_node_run
    resumed = root / "resumed"
    shutil.copytree(root / "ckpt" / "step-00000003", resumed / "step-00000003")
    shutil.copy(root / "a.jsonl", root / "b.jsonl")  # the interrupted run's: steps after 3 are dropped
    starts = run_on_ranks(_train_on_two_nodes, 4, [*ARGS, "--checkpoint-dir", str(resumed),
                                                   "--metrics-file", str(root / "b.jsonl")], timeout=240.0)
    assert starts == [3] * 4, "the run must resume from the checkpoint, not start over"
    assert [json.loads(line)["step"] for line in (root / "b.jsonl").read_text().splitlines()] == list(range(1, 7))
    uninterrupted, after_resume = _records(root / "a.jsonl"), _records(root / "b.jsonl")
    assert {s: [after_resume[s][k] for k in KEYS] for s in (4, 5, 6)} == \
        {s: [uninterrupted[s][k] for k in KEYS] for s in (4, 5, 6)}
