"""Agents with device memory on the fake CUDA driver (no GPU needed): every device path
(cuda-self, cuda-ipc, cuda-vmm, staged) writes and reads device->device, host->device and
device->host with the bytes checked, cuMem fds are exported only when a peer fetches them,
writes and reads on a stream wait for its earlier work, bad input is refused with nothing
written, a deregistered device region is refused, and a target killed with device writes
pending fails their handles with PeerLost. Every role is a process of tests/agent_device_prog.py (a process that ever
loaded no driver keeps that answer: nothing here loads the fake into the pytest process).
The same roles run with CUDA tensors on a real GPU from scripts/test-gpu.sh.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import fakecuda
import gpujobs
from meshutil import finish_prog, spawn_prog

pytestmark = pytest.mark.timeout(180)

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "agent_device_prog.py")
ROLE_TIMEOUT = 90


def fake_env(**extra):
    return gpujobs.job_env(fakecuda.env(granularity=64 << 10),
                           ("FLAGCX_MESH_CUDA_PATH", "FLAGCX_MESH_TRANSPORT", "FXM_FAKECUDA_FAIL"), **extra)


def spawn(role, *args, env, stdin=None):
    return spawn_prog(PROG, role, *args, "--timeout", 20, env=env, stdin=stdin, cwd=HERE)


def finish(p, role, timeout=ROLE_TIMEOUT):
    out, err = finish_prog(p, timeout=timeout, what=role, ok=f"{role} ok")
    return out + err


def pair(tmp_path, role, env, *args):
    server = spawn("serve", tmp_path, "owner", env=env)
    try:
        got = finish(spawn(role, tmp_path, "owner", *args, env=env), role)
    finally:
        served = finish(server, "serve")
    return got, served


# What each (local, remote) pair takes: remote "ipc" is a cudaMalloc buffer, "vmm" a cuMem one
# with a POSIX fd handle, "host" host memory; local "dev" is a cudaMalloc buffer.
EXPECT = {
    "auto": {"ipc": "cuda-ipc", "vmm": "cuda-vmm"},
    "cuda-ipc": {"ipc": "cuda-ipc", "vmm": "staged"},  # cuMem memory has no legacy IPC handle
    "cuda-vmm": {"ipc": "staged", "vmm": "cuda-vmm"},  # a cudaMalloc buffer has no cuMem fd
    "staged": {"ipc": "staged", "vmm": "staged"},
}


@pytest.mark.parametrize("forced", sorted(EXPECT))
def test_every_device_path_writes_and_reads_the_right_bytes_both_ways(tmp_path, forced):
    """Writes with the target checking every byte, reads back checked, from host and device
    memory into device regions and from device memory into a host region (staged: another
    process's host memory is reached through host memory)."""
    e = EXPECT[forced]
    expect = {f"{lk}:{rk}": p for rk, p in e.items() for lk in ("host", "dev")}
    expect["dev:host"] = "staged"
    env = fake_env() if forced == "auto" else fake_env(FLAGCX_MESH_CUDA_PATH=forced)
    got, served = pair(tmp_path, "client", env, "--expect", ",".join(f"{k}={v}" for k, v in expect.items()))
    taken = [line.split()[1:] for line in got.splitlines() if line.startswith("paths ")]
    assert taken and sorted(taken[0]) == sorted(f"{k}={v}" for k, v in expect.items()), got
    assert "served 5" in served


@pytest.mark.parametrize("forced, fetched", [("auto", 1), ("cuda-vmm", 1), ("staged", 0), ("cuda-ipc", 0)])
def test_a_cuMem_region_exports_its_fds_only_when_a_peer_fetches_them(tmp_path, forced, fetched):
    """Registration exports no cuMem fd; a peer taking cuda-vmm makes the one mapping's fd once
    (its reads and writes from host and device memory share it); a peer that never takes
    cuda-vmm makes none."""
    env = fake_env() if forced == "auto" else fake_env(FLAGCX_MESH_CUDA_PATH=forced)
    _, served = pair(tmp_path, "client", env)
    assert "exports after registration: 0" in served, served
    assert f"exports at the end: {fetched}" in served, served


@pytest.mark.parametrize("forced", ["auto", "staged"])
def test_writes_and_reads_on_a_busy_stream_wait_for_its_earlier_work(tmp_path, forced):
    """The stream sleeps, then fills the write's source (or clears the read's destination):
    a write not ordered on it copies zeros, a read not ordered on it is wiped. auto: cuda-ipc,
    cuda-vmm and staged (to a host region); staged: every region."""
    env = fake_env() if forced == "auto" else fake_env(FLAGCX_MESH_CUDA_PATH=forced)
    got, served = pair(tmp_path, "stream", env)
    want = {"auto": "dev:ipc=cuda-ipc dev:vmm=cuda-vmm dev:host=staged",
            "staged": "dev:ipc=staged dev:vmm=staged dev:host=staged"}[forced]
    assert "paths " + want in got, got
    assert "served 3" in served


@pytest.mark.parametrize("forced", ["auto", "staged"])
def test_a_waiter_reads_its_notifications_itself_with_device_regions_registered(tmp_path, forced):
    """The target waits in wait_notification with device regions registered: its thread reads the
    connection itself (before, only the progress thread read it there: a wake-up per
    notification); each write into its device region, its notification riding behind it, has
    landed when the notification is read, and each small read is answered, with no lost wake-up
    of the progress thread and no device call made by the waiting thread (staged: the waiter
    leaves a get at its op header, and a write the progress thread began in its payload, to the
    progress thread; chunks of 64 KiB: a landing every 64 KiB of a write, which a waiter reading
    on in its payload would make itself)."""
    env = fake_env() if forced == "auto" else fake_env(FLAGCX_MESH_CUDA_PATH=forced, FLAGCX_MESH_STAGED_CHUNK_BYTES="65536")
    server = spawn("serve", tmp_path, "owner", "--waits", env=env)
    try:
        got = finish(spawn("waits", tmp_path, "owner", env=env), "waits")
    finally:
        finish(server, "serve")
    assert "60 reads and 180 writes over " + {"auto": "cuda-ipc", "staged": "staged"}[forced] + " checked" in got, got


def test_a_fallback_says_why_the_better_path_was_refused(tmp_path):
    got, _ = pair(tmp_path, "client", fake_env(FLAGCX_MESH_CUDA_PATH="cuda-vmm", FLAGCX_MESH_LOG="info"),
                  "--expect", "dev:ipc=staged")
    assert "over staged (" in got and "cuda-vmm refused: not a cuMem allocation with a POSIX fd handle" in got, got


def test_two_agents_in_one_process_copy_directly_and_a_deregistered_region_is_refused():
    p = spawn("self", env=fake_env())
    got = finish(p, "self")
    assert "host:ipc=cuda-self host:vmm=cuda-self dev:ipc=cuda-self dev:vmm=cuda-self dev:host=cuda-self" in got


@pytest.mark.parametrize("forced", ["auto", "staged"])
def test_bad_input_and_a_deregistered_device_region_are_refused_with_nothing_written(tmp_path, forced):
    env = fake_env() if forced == "auto" else fake_env(FLAGCX_MESH_CUDA_PATH=forced)
    got, _ = pair(tmp_path, "bad", env)
    assert "was deregistered" in got, got


def test_device_writes_pending_to_a_killed_target_fail_with_peer_lost(tmp_path):
    env = fake_env(FLAGCX_MESH_CUDA_PATH="staged")
    server = spawn("serve", tmp_path, "owner", env=env)
    client = spawn("pending", tmp_path, "owner", env=env, stdin=subprocess.PIPE)
    try:
        assert client.stdout.readline().strip() == "ready"
        server.send_signal(signal.SIGSTOP)  # it reads nothing more: 64 MiB cannot all be acknowledged
        client.stdin.write("go\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "issued"
        server.send_signal(signal.SIGKILL)
        server.communicate(timeout=30)
        client.stdin.write("wait\n")
        client.stdin.flush()
        finish(client, "pending")
    finally:
        for p in (server, client):
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_the_c_abi_registers_device_memory(tmp_path):
    """flagcx_mesh_agent_register_device gives a device region's descriptor; host memory is refused."""
    code = f"""
import ctypes, sys
sys.path.insert(0, {HERE!r})
import fakecuda, flagcx_mesh
from flagcx_mesh import agent
lib = ctypes.CDLL(flagcx_mesh.get_library())
p, u64 = ctypes.c_void_p, ctypes.c_uint64
lib.flagcx_mesh_agent_create.argtypes = [ctypes.POINTER(p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_double]
lib.flagcx_mesh_agent_register_device.argtypes = [p, p, u64, p, ctypes.POINTER(ctypes.c_size_t)]
lib.flagcx_mesh_agent_destroy.argtypes = [p]
cu = fakecuda.FakeCuda.get()
ptr = cu.alloc(1 << 16)
a = p()
assert lib.flagcx_mesh_agent_create(ctypes.byref(a), b"c", b"secret", 5.0) == 0
desc = ctypes.create_string_buffer(4096)
n = ctypes.c_size_t(4096)
assert lib.flagcx_mesh_agent_register_device(a, ptr, 1 << 16, desc, ctypes.byref(n)) == 0
info = agent.region_info(desc.raw[:n.value])
assert info["kind"] == "device" and info["size"] == 1 << 16, info
host = ctypes.create_string_buffer(64)
n = ctypes.c_size_t(4096)
assert lib.flagcx_mesh_agent_register_device(a, ctypes.addressof(host), 64, desc, ctypes.byref(n)) != 0
lib.flagcx_mesh_agent_destroy(a)
print("capi ok")
"""
    p = subprocess.run([sys.executable, "-c", code], env=fake_env(), cwd=HERE, capture_output=True, text=True,
                       timeout=ROLE_TIMEOUT)
    assert p.returncode == 0 and "capi ok" in p.stdout, p.stdout + p.stderr


def test_a_region_deregistered_while_a_staged_read_copies_from_it_waits_for_those_copies(tmp_path):
    # The answer's copies down are queued at once and slowed to 1 s each; the owner deregisters and
    # frees the memory as soon as they are queued. Before the fix the window was left when the get
    # was queued, deregister returned at once, and the copies read freed memory: wrong bytes arrived.
    env = fake_env(FLAGCX_MESH_CUDA_PATH="staged", FXM_FAKECUDA_COPY_FROM_DEVICE_DELAY_MS="1000")
    owner = spawn("dereg-owner", tmp_path, "owner", env=env)
    try:
        finish(spawn("dereg-reader", tmp_path, "owner", env=env), "dereg-reader")
    finally:
        finish(owner, "dereg-owner")
