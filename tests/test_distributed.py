"""kivi_jax.distributed: generate and the engine across 2 processes of 2 host devices each
(one group of processes, tests/distributed_worker.py, on loopback), against this process's
one-device run; then a process killed while the engine serves ends the other."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import distributed_worker
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed_worker import CASES, LENGTHS, NEW, PROMPTS
from tiny_model import tiny_params, write_hf_dir

import kivi_jax
from kivi_jax import distributed, sharding
from kivi_jax.generate import RowSampling, Sampling
from kivi_jax.serving import plan
from kivi_jax.serving.plan import Op

TESTS = Path(__file__).parent
STARTUP_S = 300  # both processes through every case (about 100 s on 2 shared CPU cores)
LOST_S = 60  # a dead process ends the others within this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """Two worker processes; every wait bounded, both killed when the module ends."""

    def __init__(self, tmp: Path, engines: list[str]):
        write_hf_dir(str(tmp / "hf"), tiny_params())
        kivi_jax.save_model(kivi_jax.load_model(tmp / "hf", dtype=jnp.float32), tmp / "saved")
        port = free_port()
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        env["JAX_COORDINATOR_BIND_ADDRESS"] = f"127.0.0.1:{port}"  # JAX's default is [::]
        self.tmp, self.logs, self.procs = tmp, [tmp / "log_0", tmp / "log_1"], []
        self.engines = engines
        for pid, log in enumerate(self.logs):
            cmd = [sys.executable, str(TESTS / "distributed_worker.py"), str(pid), "2", str(port)]
            cmd += [str(tmp), str(tmp / "saved"), ",".join(engines), "--loop"]
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen(cmd, cwd=TESTS, env=env, stdout=f, stderr=f))

    def log(self, pid: int) -> str:
        return self.logs[pid].read_text()

    def wait_for(self, pid: int, line: str) -> None:
        """Until process `pid` prints `line` (fails if a process exits or time runs out)."""
        deadline = time.monotonic() + STARTUP_S
        while line not in self.log(pid):
            exited = [p.poll() for p in self.procs]
            if any(rc is not None for rc in exited) or time.monotonic() > deadline:
                pytest.fail(f"exits {exited}, waiting for {line!r}:\n{self.log(0)[-4000:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


@pytest.fixture(scope="module")
def group(tmp_path_factory, request):
    """The module's group; the engine on (data=2, model=2) only where its test runs (`-m slow`:
    35-40 s of the workers' time on the shared 2-core CPU)."""
    slow = "slow" in request.config.getoption("markexpr")
    ids = [item.nodeid for item in request.session.items]
    grid = slow and any("[engine_data2_model2]" in i for i in ids)
    engines = ["engine_model4", *(["engine_data2_model2"] if grid else [])]
    g = Group(tmp_path_factory.mktemp("distributed"), engines)
    try:
        yield g
    finally:
        g.kill()


@pytest.mark.parametrize("name", CASES)
def test_generate_across_processes_equals_one_process(group, name):
    """Each process passes the whole batch and reads every row's tokens back: the greedy
    tokens of ("model",) over 4 devices and of ("data", "model") 2 x 2, through generate, a
    TokenStream and a saved model restored into its shards, equal one device's."""
    _, kv, _ = CASES[name]
    want = kivi_jax.generate(tiny_params(), PROMPTS, lengths=LENGTHS, kv=kv, max_new_tokens=NEW)
    group.wait_for(1, "cases done")
    group.wait_for(0, "cases done")
    for pid in (0, 1):
        got = np.load(group.tmp / f"tokens_{pid}.npz")[name]
        np.testing.assert_array_equal(got, np.asarray(want), err_msg=f"process {pid}")


@pytest.mark.parametrize(
    "name",
    ["engine_model4", pytest.param("engine_data2_model2", marks=pytest.mark.slow)],
)
def test_the_engine_across_processes_serves_as_one_process(group, name):
    """6 requests arriving two at a time, submitted to process 0's engine while process 1
    follows its plans, some prefilled in chunks, some preempted to host memory and back: each
    request's greedy tokens on ("model",) over 4 devices and on ("data", "model") 2 x 2 equal
    the one-process engine's. (data=2, model=2) under `-m slow`."""
    if name not in group.engines:
        pytest.skip("the engine on (data=2, model=2): run with `pytest -m slow`")
    one = distributed_worker.engine()
    want = distributed_worker.serve(one)
    assert one.stats().preemptions > 0
    group.wait_for(0, "engine cases done")
    got = json.loads((group.tmp / "engine.json").read_text())[name]
    assert got["tokens"] == want and got["preemptions"] > 0


def test_a_killed_process_ends_the_other_naming_it(group):
    """Process 1 killed while process 0's engine serves and it follows: process 0 exits
    non-zero within LOST_S seconds (the heartbeat timeout, 30 s), its log naming task 1 as
    the one that stopped."""
    assert distributed.HEARTBEAT_TIMEOUT_S <= 30
    group.wait_for(0, "served")
    group.procs[1].kill()
    t0 = time.monotonic()
    try:
        rc = group.procs[0].wait(timeout=LOST_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"process 0 still running {LOST_S} s after process 1 died")
    assert rc != 0
    assert time.monotonic() - t0 < LOST_S
    assert re.search(r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\b", group.log(0))


def test_one_process_global_mesh_and_conversions():
    """In one process: the mesh of its device, and to_global / to_host a round trip."""
    mesh = distributed.global_mesh()
    assert mesh.axis_names == ("model",) and mesh.devices.size == 1
    with pytest.raises(ValueError, match="does not divide"):
        distributed.global_mesh(2)
    x = np.arange(12).reshape(4, 3)
    placed = distributed.to_global(x, mesh, sharding.rows_spec(mesh))
    np.testing.assert_array_equal(distributed.to_host(placed), x)


def test_a_plan_comes_back_as_it_was_sent(monkeypatch):
    """The engine's plan as int32 words and back: ints, None, arrays of each dtype (floats
    and seeds bit for bit), page tables as the rows that changed since the last one sent;
    a plan longer than a buffer goes out in several and comes back whole."""
    table = np.full((4, 3), -1, np.int32)
    rows = jax.tree.leaves(RowSampling.of([Sampling(temperature=0.7, top_p=0.9, seed=2**32 - 1)]))
    ops = [
        (Op.RESET, 2),
        (Op.CHUNK, np.arange(8, dtype=np.int32).reshape(2, 4), 32, np.int32([4, 4]), None),
        (Op.INSERT, table, -1, 1, np.int32([5, 6]), np.int32([9]), table[:1], 1, *rows),
    ]
    grown = table.copy()
    grown[1, :2] = [7, 3]
    later = [(Op.DECODE, grown, 0, 1, 8), (Op.PREFILL, np.ones((1, plan.PLAN_WORDS), np.int32),
                                          np.array([plan.PLAN_WORDS], np.int32))]  # fmt: skip
    sent, received = plan.Codec(table.shape), plan.Codec(table.shape)
    buffers = []
    monkeypatch.setattr(plan.multihost_utils, "broadcast_one_to_all", lambda b: buffers.append(b))
    for batch in (ops, later):
        words = sent.encode(batch)
        if batch is later:  # the decode's table: its one changed row (after 2 words of op)
            assert words[2:4] == [3, 1] and words[4:8] == [1, 7, 3, -1]
        plan.send(words)
        monkeypatch.setattr(plan.multihost_utils, "broadcast_one_to_all",
                            lambda _: buffers.pop(0))  # fmt: skip
        if batch is later:
            assert len(buffers) == 2  # PLAN_WORDS prompt tokens: two buffers
        got = received.decode(plan.receive())
        monkeypatch.setattr(plan.multihost_utils, "broadcast_one_to_all",
                            lambda b: buffers.append(b))  # fmt: skip
        assert len(got) == len(batch)
        for g, b in zip(got, batch, strict=True):
            assert g[0] == b[0] and len(g) == len(b)
            for x, y in zip(g[1:], b[1:], strict=True):
                if isinstance(y, np.ndarray):
                    assert x.dtype == y.dtype and x.shape == y.shape
                    np.testing.assert_array_equal(x, y)
                else:
                    assert x == y
