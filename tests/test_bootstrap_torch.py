"""Bootstraps over torch.distributed: from_store (HashStore, TCPStore, FileStore), from_env
(default process group, torchrun, plain RANK/WORLD_SIZE/MASTER_* environment) and the errors
a user sees when MASTER_PORT is taken.

Skipped without torch, unless FXM_REQUIRE_TORCH=1 (scripts/test.sh sets it): then a missing
torch fails the run.
"""
import datetime
import os
import threading
import time

import pytest

if os.environ.get("FXM_REQUIRE_TORCH") != "1":
    pytest.importorskip("torch.distributed", reason="torch is not installed (pip install torch==2.13.0)")
import torch.distributed as dist  # noqa: E402

import flagcx_mesh  # noqa: E402
from flagcx_mesh import Mesh, bootstrap  # noqa: E402

from bootstrap_helpers import (JOB, PY, clean_env, finish, free_port, ok_lines, run, start,  # noqa: E402
                               unrelated_listener)
from forkserver import ForkServer  # noqa: E402

pytestmark = pytest.mark.timeout(180)
T = 30.0


@pytest.fixture(scope="module")
def torch_fork():
    """The programs that import torch are forked from one process that imported it (~3 s of
    CPU each on 2 cores otherwise); tests/forkserver.py runs each as a fresh interpreter would."""
    server = ForkServer(["torch.distributed"], env=clean_env())
    yield server
    server.close()


def check(mesh, nranks):
    """Every rank agrees on the mesh id; every (peer) connection carries data."""
    assert mesh.nranks == nranks
    ids = set(mesh.allgather(mesh.mesh_id.encode(), timeout=T))
    assert len(ids) == 1
    for peer in range(nranks):
        mesh.send(peer, f"{mesh.rank}->{peer}".encode(), timeout=T)
    for peer in range(nranks):
        assert mesh.recv(peer, timeout=T) == f"{peer}->{mesh.rank}".encode()
    return mesh.mesh_id


def run_threads(nranks, body):
    """Runs body(rank) on nranks threads; returns results by rank, re-raising the first error."""
    results, errs = [None] * nranks, []

    def one(r):
        try:
            results[r] = body(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(nranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    if errs:
        raise errs[0]
    return results


def builds_twice(make_store, nranks, prefix="t"):
    """Each rank builds two meshes through (possibly new) store objects: ids agree, differ."""
    def body(r):
        ids = []
        for _ in range(2):
            with Mesh.from_store(make_store(r), r, nranks, prefix=prefix, timeout=T) as m:
                assert m.rank == r
                ids.append(check(m, nranks))
        return ids

    per_rank = run_threads(nranks, body)
    first, second = {ids[0] for ids in per_rank}, {ids[1] for ids in per_rank}
    assert len(first) == 1 and len(second) == 1 and first != second, per_rank


# ----------------------------------------------------------------------------- from_store

def test_from_store_hashstore_threads():
    store = dist.HashStore()
    builds_twice(lambda r: store, 4)


def test_from_store_two_prefixes_on_one_store_at_once():
    store = dist.HashStore()
    run_threads(2, lambda k: builds_twice(lambda r: store, 3, prefix=f"mesh{k}"))


def test_from_store_tcpstore_new_client_per_call():
    """A new client object per call must still find this call's id, not the previous one."""
    master = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=T),
                           wait_for_workers=False)
    port = master.port

    def client(r):
        return dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=T))

    builds_twice(client, 3)


def test_from_store_filestore_processes(tmp_path, torch_fork):
    path = str(tmp_path / "store")
    procs = [start([PY, JOB, "file", path, str(r), "3"], clean_env(), torch_fork) for r in range(3)]
    results = finish(procs, 120)
    for res in results:
        assert res.rc == 0 and not res.timed_out, res
    assert len(ok_lines("".join(r.out for r in results), "file")) == 3


def test_from_store_rank0_absent_times_out():
    store = dist.HashStore()
    t0 = time.monotonic()
    with pytest.raises(flagcx_mesh.MeshTimeout) as e:
        Mesh.from_store(store, 1, 2, prefix="lonely", timeout=1.0)
    assert time.monotonic() - t0 < 10
    text = str(e.value)
    assert "rank 1" in text and "rank 0" in text and "lonely/1/unique_id" in text, text


def test_from_store_bad_arguments():
    store = dist.HashStore()
    with pytest.raises(flagcx_mesh.InvalidArgument, match="rank 2 is not in"):
        Mesh.from_store(store, 2, 2)
    with pytest.raises(flagcx_mesh.InvalidArgument, match="timeout"):
        Mesh.from_store(store, 1, 2, timeout=-1)


def test_from_store_world_size_mismatch_is_named():
    store = dist.HashStore()
    store.add("w/rank0/calls", 1)
    store.set("w/1/unique_id", bootstrap._pack(2, bytes(256)))  # rank 0 said: 2 ranks
    with pytest.raises(flagcx_mesh.InvalidArgument, match="rank 0 builds a mesh of 2 ranks, this rank was told 3"):
        Mesh.from_store(store, 1, 3, prefix="w", timeout=5)


def test_from_store_rank0_failure_reaches_every_rank(tmp_path, torch_fork):
    """Rank 0 cannot make an id (no such interface): rank 1 learns why, without waiting."""
    path = str(tmp_path / "store")
    code = ("import sys; from torch.distributed import FileStore; from flagcx_mesh import Mesh\n"
            "r = int(sys.argv[1])\n"
            "Mesh.from_store(FileStore(sys.argv[2], 2), r, 2, timeout=60)\n")
    p0 = start([PY, "-c", code, "0", path], clean_env(FLAGCX_MESH_IFNAME="nosuchif0"), torch_fork)
    p1 = start([PY, "-c", code, "1", path], clean_env(), torch_fork)
    r0, r1 = finish([p0, p1], 60)
    assert r0.rc != 0 and "nosuchif0" in r0.err, r0
    assert r1.rc != 0 and not r1.timed_out, r1
    assert "rank 1: rank 0 could not make the unique id" in r1.err and "nosuchif0" in r1.err, r1


# ----------------------------------------------------------------------------- from_env

def test_from_env_without_a_launcher_says_what_it_looked_for():
    res = run([PY, "-c", "from flagcx_mesh import Mesh; Mesh.from_env()"], 60)
    assert res.rc != 0 and "no launcher found in the environment" in res.err, res


def test_from_env_plain_environment_processes(torch_fork):
    """RANK/WORLD_SIZE/MASTER_*: rank 0 hosts the store on MASTER_PORT, the others join."""
    port = free_port()
    procs = [start([PY, JOB, "env"], clean_env(RANK=r, WORLD_SIZE=3, MASTER_ADDR="127.0.0.1",
                                               MASTER_PORT=port), torch_fork) for r in range(3)]
    results = finish(procs, 120)
    for res in results:
        assert res.rc == 0 and not res.timed_out, res
    assert len(ok_lines("".join(r.out for r in results), "env")) == 3


def test_from_env_reuses_the_default_process_group_store(torch_fork):
    port = free_port()
    procs = [start([PY, JOB, "pg"], clean_env(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                                              MASTER_PORT=port), torch_fork) for r in range(2)]
    results = finish(procs, 120)
    for res in results:
        assert res.rc == 0 and not res.timed_out, res
    assert len(ok_lines("".join(r.out for r in results), "pg")) == 2


def test_from_env_master_port_taken_fails_at_once_on_rank0(torch_fork):
    """Plain env, MASTER_PORT held by an unrelated program: EADDRINUSE, the port, what to do."""
    with unrelated_listener() as port:
        env = clean_env(RANK=0, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        t0 = time.monotonic()
        res = run([PY, "-m", "flagcx_mesh.selftest", "--timeout", "60"], 60, env, torch_fork)
        took = time.monotonic() - t0
        code = ("import errno\nfrom flagcx_mesh import Mesh, SystemCallError\n"
                "try:\n    Mesh.from_env(timeout=60)\n"
                "except SystemCallError as e:\n    assert e.errno == errno.EADDRINUSE, e.errno\n"
                "    print('errno ok')\n")
        res2 = run([PY, "-c", code], 60, env, torch_fork)
    assert res.rc == 1 and took < 30, (took, res)
    err = res.err
    assert f"MASTER_PORT={port} is already in use" in err and "EADDRINUSE" in err, err
    assert "Pick a free port" in err and "torchrun" in err, err
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    assert res2.rc == 0 and "errno ok" in res2.out, res2


@pytest.mark.parametrize("behaviour, says", [
    ("silent", "did not answer as a torch.distributed store"),
    ("close", "it is not a torch.distributed store"),
])
def test_from_env_master_port_taken_other_ranks_say_so(behaviour, says, torch_fork):
    with unrelated_listener(behaviour=behaviour) as port:
        env = clean_env(RANK=1, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        t0 = time.monotonic()
        res = run([PY, "-m", "flagcx_mesh.selftest", "--timeout", "3"], 60, env, torch_fork)
        took = time.monotonic() - t0
    assert res.rc == 1 and not res.timed_out and took < 30, (took, res)
    said = [ln for ln in res.err.splitlines() if "rank 1" in ln]  # the rank's own words, not torch's trace
    assert says in res.err and f"127.0.0.1:{port}" in res.err and "free MASTER_PORT" in res.err, said or res


def test_from_env_nobody_listening_times_out_clearly(torch_fork):
    port = free_port()
    env = clean_env(RANK=1, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    res = run([PY, "-m", "flagcx_mesh.selftest", "--timeout", "2"], 60, env, torch_fork)
    assert res.rc == 1 and not res.timed_out, res
    assert f"127.0.0.1:{port}: nothing accepted a connection there within 2 s" in res.err, res


# ----------------------------------------------------------------------------- torchrun

TORCHRUN = [PY, "-m", "torch.distributed.run"]  # the `torchrun` entry point, this interpreter
# (the agent forked from torch_fork; the ranks it starts are processes of their own)


def test_torchrun_selftest_4_ranks_while_29500_is_held(torch_fork):
    """`torchrun --nproc_per_node=4 -m flagcx_mesh.selftest` while another job holds 29500."""
    with unrelated_listener(29500, taken_is_fine=True):
        res = run(TORCHRUN + ["--nproc_per_node=4", "-m", "flagcx_mesh.selftest",
                              "--iterations", "3", "--timeout", "30"], 240, server=torch_fork)
    assert res.rc == 0 and not res.timed_out, res
    assert "launcher: torchrun (rank 0 joined the launcher's store" in res.out, res
    assert "PASS: 3 mesh(es) built" in res.out, res
    assert "EADDRINUSE" not in res.out + res.err, res


def test_torchrun_job_builds_twice_and_never_listens_on_master_port(torch_fork):
    res = run(TORCHRUN + ["--nproc_per_node=2", JOB, "env"], 240, server=torch_fork)
    assert res.rc == 0 and not res.timed_out, res
    assert len(ok_lines(res.out, "env")) == 2, res


def test_torchrun_without_the_agent_store(torch_fork):
    """TORCHELASTIC_USE_AGENT_STORE=False: rank 0 hosts, as torch's own env:// does."""
    env = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    res = run(TORCHRUN + ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--nproc_per_node=2",
                          "-m", "flagcx_mesh.selftest", "--timeout", "30"], 240, env, torch_fork)
    assert res.rc == 0 and not res.timed_out, res
    assert "launcher: torchrun (rank 0 hosts the store" in res.out, res
