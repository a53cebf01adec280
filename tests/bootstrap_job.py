"""One rank of a bootstrap test job, started by mpiexec, torchrun or a test (not collected).

    python tests/bootstrap_job.py MODE [ARGS]

Modes:
    mpi                   under mpiexec: from_mpi on COMM_WORLD (twice), on a split
                          sub-communicator, on a Dup; then from_env
    mpi-timeout           under mpiexec -n 2: rank 1 calls from_mpi alone and must time out
    env                   from_env twice (torchrun, or a plain RANK/WORLD_SIZE/MASTER_* env);
                          checks that no process but a plain-env rank 0 listens on MASTER_PORT
    pg                    init_process_group(gloo, env://), then from_env uses its store
    file PATH RANK WORLD  from_store over a FileStore at PATH, twice

Each rank prints "OK <mode> rank R of N" on success and exits 0; a failure exits 1
with the reason on stderr.
"""
import os
import sys
import traceback

import flagcx_mesh
from flagcx_mesh import Mesh
from meshutil import listening_ports  # this script's folder (tests/) is on sys.path

TIMEOUT = 30.0


def check(mesh, nranks, tag):
    """The mesh has nranks ranks, every (peer) connection carries data, ids agree."""
    assert mesh.nranks == nranks, (mesh.nranks, nranks)
    ids = set(mesh.allgather(mesh.mesh_id.encode(), timeout=TIMEOUT))
    assert len(ids) == 1, f"{tag}: ranks disagree on the mesh id: {ids}"
    ranks = [int(b) for b in mesh.allgather(str(mesh.rank).encode(), timeout=TIMEOUT)]
    assert ranks == list(range(nranks)), f"{tag}: allgather gave {ranks}"
    for peer in range(nranks):
        mesh.send(peer, f"{tag}:{mesh.rank}->{peer}".encode(), timeout=TIMEOUT)
    for peer in range(nranks):
        got = mesh.recv(peer, timeout=TIMEOUT)
        assert got == f"{tag}:{peer}->{mesh.rank}".encode(), f"{tag}: from {peer} got {got!r}"
    return mesh.mesh_id


def two_meshes(build, nranks, tag):
    """Builds twice with the same bootstrap: two different, working meshes."""
    with build() as a:
        first = check(a, nranks, tag + "/1")
    with build() as b:
        second = check(b, nranks, tag + "/2")
    assert first != second, f"{tag}: the second build reused the first mesh id {first}"


def mode_mpi():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    assert "mpi4py" in sys.modules
    two_meshes(lambda: Mesh.from_mpi(timeout=TIMEOUT), size, "world")
    color = rank % 2
    sub = world.Split(color, rank)
    with Mesh.from_mpi(sub, contexts=2, timeout=TIMEOUT) as m:
        assert m.rank == sub.Get_rank() and m.nranks == sub.Get_size()
        check(m, sub.Get_size(), f"split{color}")
        members = [int(b) for b in m.allgather(str(rank).encode(), timeout=TIMEOUT)]
        assert members == [r for r in range(size) if r % 2 == color], members
    sub.Free()
    dup = world.Dup()
    with Mesh.from_mpi(comm=dup, timeout=TIMEOUT) as m:
        check(m, size, "dup")
    dup.Free()
    two_meshes(lambda: Mesh.from_env(timeout=TIMEOUT), size, "from_env")
    return rank, size


def mode_mpi_timeout():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    dup = world.Dup()
    if rank == 1:
        try:
            Mesh.from_mpi(dup, timeout=1.0)
        except flagcx_mesh.MeshTimeout as e:
            assert "rank 1" in str(e) and "did not complete within 1 s" in str(e), str(e)
            print(f"timed out as expected: {e}", flush=True)
        else:
            raise AssertionError("from_mpi without rank 0 did not time out")
    world.Barrier()
    if rank == 0:  # complete the broadcast rank 1 left pending, so MPI can finalize cleanly
        dup.Ibcast([bytearray(1024), MPI.BYTE], root=0).Wait()
    world.Barrier()
    return rank, size


def mode_env():
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    two_meshes(lambda: Mesh.from_env(timeout=TIMEOUT), size, "env")
    held = [hp for hp in listening_ports() if hp[1] == port]
    torchrun = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if torchrun or rank != 0:
        assert not held, f"rank {rank} listens on MASTER_PORT {port} itself"
    assert "mpi4py" not in sys.modules, "mpi4py was imported without MPI in the environment"
    return rank, size


def mode_pg():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    two_meshes(lambda: Mesh.from_env(timeout=TIMEOUT), size, "pg")
    dist.barrier()
    dist.destroy_process_group()
    return rank, size


def mode_file(path, rank, world):
    from torch.distributed import FileStore

    rank, world = int(rank), int(world)
    store = FileStore(path, world)
    two_meshes(lambda: Mesh.from_store(store, rank, world, prefix="job", timeout=TIMEOUT), world, "file")
    return rank, world


MODES = {"mpi": mode_mpi, "mpi-timeout": mode_mpi_timeout, "env": mode_env, "pg": mode_pg,
         "file": mode_file}


def main():
    mode = sys.argv[1]
    try:
        rank, size = MODES[mode](*sys.argv[2:])
    except Exception:  # noqa: BLE001 - reported, exit 1
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    os.write(1, f"OK {mode} rank {rank} of {size}\n".encode())  # one write: one line
    return 0


if __name__ == "__main__":
    sys.exit(main())
