"""Shared-memory window names: random, not derived from the mesh id, and a name another
local user created first never stops a registration.

Regression: names were ``/fxm-<12 hex of the mesh id>-<rank>-<index>``; a local user who
saw one in /dev/shm pre-created the next ones and every rank's next ``alloc_window`` failed
with ``File exists`` (and the names leaked 48 bits of the mesh id)."""

import os
import threading
import time

import pytest

import flagcx_mesh
from flagcx_mesh import Mesh, _core

from meshutil import run_threads

pytestmark = pytest.mark.timeout(90)

SHM = "/dev/shm"


def fxm_names():
    return {n for n in os.listdir(SHM) if n.startswith("fxm-")}


def squat(names):
    made = []
    for n in names:
        path = os.path.join(SHM, n)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            continue
        os.close(fd)
        made.append(path)
    return made


def two_meshes():
    uid = flagcx_mesh.get_unique_id()
    meshes = run_threads(2, lambda r: Mesh(2, uid, r, timeout=30), timeout=45)
    return uid, meshes


@pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm")
def test_squatted_old_style_names_do_not_stop_alloc_window():
    """Every name the old scheme would use for the next windows exists (made by 'another
    user'), plus a flood of random fxm- names: alloc_window and signal_window still work on
    every rank, over shared memory."""
    uid, meshes = two_meshes()
    tag = _core._unique_id_info(uid)["mesh_id"][:12]
    old = [f"fxm-{tag}-{r}-{i}" for r in range(2) for i in range(16)]
    flood = [f"fxm-{os.urandom(16).hex()}" for _ in range(500)]
    made = squat(old + flood)
    try:
        def body(r):
            m = meshes[r]
            wins = [m.alloc_window(4096) for _ in range(3)] + [m.signal_window(4)]
            assert [w.index for w in wins] == [0, 1, 2, 3]
            m.barrier(timeout=20)
            assert wins[0].mode == "shm", wins[0].describe()
            m.put(1 - r, wins[0], 0, wins[1], 8, 64)
            m.signal(1 - r, 0)
            m.wait_signal(0, 1, timeout=20, window=wins[3])
            return True

        assert run_threads(2, body, timeout=60) == [True, True]
    finally:
        for p in made:
            os.unlink(p)
        for m in meshes:
            m.close()


@pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm")
def test_names_hold_no_part_of_the_mesh_id():
    """The names a registration creates (seen in /dev/shm while rank 1 is late) are
    /fxm-<32 random hex> and share no 6-digit run with the mesh id's hex."""
    uid, meshes = two_meshes()
    mesh_hex = _core._unique_id_info(uid)["mesh_id"]
    before = fxm_names()
    seen = set()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.update(fxm_names() - before)
            time.sleep(0.005)

    def body(r):
        if r == 1:
            time.sleep(0.5)  # rank 0's segments exist meanwhile
        return [meshes[r].alloc_window(64), meshes[r].signal_window(2)]

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run_threads(2, body, timeout=60)
    finally:
        stop.set()
        watcher.join(5)
        for m in meshes:
            m.close()
    assert seen, "no segment seen in /dev/shm while rank 1 was late"
    for name in seen:
        digits = name[len("fxm-"):]
        assert len(digits) == 32 and all(c in "0123456789abcdef" for c in digits), name
        runs = {mesh_hex[i:i + 6] for i in range(len(mesh_hex) - 5)}
        assert not any(run in digits for run in runs), (name, mesh_hex)
    assert not (fxm_names() - before), "a window's name is still in /dev/shm after registration"
