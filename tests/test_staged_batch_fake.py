"""A call's staged writes (reads) as one op (transport/cuda/staged_batch.h, core/progress_blocks.cc)
on the fake CUDA driver: write_blocks over staged (FLAGCX_MESH_CUDA_PATH=staged) gathers each
chunk of the batch with one launch of the copy kernel, sends one frame and the target scatters
each chunk with one launch (read_blocks: one request, the target gathers, this side scatters);
1 block, blocks straddling the chunks, mixed sizes and 100,000 blocks land byte for byte, with
the kernel, with the driver's copies and with batching off; a block crossing the region's end is
refused naming the op, a batch to (from) a region the target deregistered is refused there
naming the block and the peer, nothing written either time; a forged frame naming a block past
the region's end is refused whole by the target, nothing landed; a target killed mid-batch fails
the call with PeerLost. Each role is a process of tests/agent_device_prog.py (blocks, blocks-lost); the same
roles run with CUDA tensors on a real GPU from scripts/test-gpu.sh."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from meshutil import finish_prog, spawn_prog, wait_stopped
from test_agent_device_fake import HERE, PROG, ROLE_TIMEOUT, fake_env, finish, pair, spawn

pytestmark = pytest.mark.timeout(180)


def staged_env(**extra):
    return fake_env(FLAGCX_MESH_CUDA_PATH="staged", FLAGCX_MESH_STAGED_CHUNK_BYTES="65536", **extra)


def reap(*procs) -> None:
    """Kills (continued first, if stopped) and waits for each process still running."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.communicate()


def role_timeout(copies: str) -> float:
    """The blocks role's limit: batches off, its 100,000 reads are as many staged gets (in flight
    together, answered one after another by the target through the fake driver's copies: the
    role took 17-20 s alone on the 2-core VM, up to 4x that beside three other test workers).
    Within the module's 180 s."""
    return 160 if copies == "off" else ROLE_TIMEOUT


@pytest.mark.parametrize("copies", ["auto", "driver", "off", "bounce"])
def test_a_batch_of_staged_writes_lands_every_byte_and_bad_blocks_write_nothing(tmp_path, copies):
    """bounce: FLAGCX_MESH_STAGED_BOUNCE=on, the kernel's gathers and scatters through device
    scratch, each chunk crossing in one copy (counted on both sides by the blocks role)."""
    env = staged_env(FLAGCX_MESH_CUDA_BATCH_COPY="auto" if copies == "bounce" else copies,
                     FLAGCX_MESH_STAGED_BOUNCE="on" if copies == "bounce" else "off")
    server = spawn("serve", tmp_path, "owner", env=env)
    try:
        got = finish(spawn("blocks", tmp_path, "owner", env=env), "blocks", role_timeout(copies))
    finally:
        finish(server, "serve")
    if copies != "off":  # off: each op a staged put (get) of its own, refused as one
        assert "block 0 of a batch of 10 staged writes" in got, got


@pytest.mark.parametrize("lanes,copies", [(3, "auto"), (4, "auto"), (4, "off"), (4, "bounce"), (4, "landing2")])
def test_a_batch_of_1_mib_is_striped_over_the_tcp_lanes_and_lands_every_byte(tmp_path, lanes, copies):
    """With several tcp lanes a batch of 1 MiB or more goes over all of them (each lane's thread
    sends a part staged by the caller, the parts taking turns; at the target each part lands
    through a ring of its own), and so does a call's one staged write of 1 MiB: the blocks
    role's batches, every byte checked, and each lane's socket carried its part. (Batches off:
    a staged put an op, each on lane 0, every byte checked; the GPU host has 4 lanes by default.
    landing2: FLAGCX_MESH_STAGED_LANDING_BUFFERS=2, each part landing through a ring of 2 buffers,
    every byte still in place: a check of the smaller ring, not of its size, which the refusal
    test below shows is read.)"""
    env = staged_env(FLAGCX_MESH_TCP_LANES=str(lanes),
                     FLAGCX_MESH_CUDA_BATCH_COPY="off" if copies == "off" else "auto",
                     FLAGCX_MESH_STAGED_BOUNCE="on" if copies == "bounce" else "off",
                     FLAGCX_MESH_STAGED_LANDING_BUFFERS="2" if copies == "landing2" else "4")
    server = spawn("serve", tmp_path, "owner", env=env)
    try:
        got = finish(spawn("blocks", tmp_path, "owner", env=env), "blocks", role_timeout(copies))
    finally:
        finish(server, "serve")
    for n in (300, 1):
        want = f"{n} write(s) not striped: batches off" if copies == "off" else f"{n} write(s) striped over {lanes} lanes:"
        assert want in got, got


@pytest.mark.parametrize("lanes", [1, 4])
def test_a_batch_of_staged_writes_into_a_host_region_is_one_frame_landed_in_place(tmp_path, lanes):
    """Device memory here, the target's region in host memory (a CPU tier of the KV cache):
    write_blocks gathers and sends one frame as into device memory (striped over the lanes), the
    target lands the blocks in place, every byte checked (blocks-host role)."""
    env = staged_env(FLAGCX_MESH_TCP_LANES=str(lanes))
    server = spawn("serve", tmp_path, "owner", env=env)
    try:
        got = finish(spawn("blocks-host", tmp_path, "owner", env=env), "blocks-host")
    finally:
        finish(server, "serve")
    want = "300 write(s) striped over 4 lanes:" if lanes == 4 else "blocks-host ok"
    assert want in got, got


@pytest.mark.parametrize("value", ["1", "65", "four"])
def test_a_bad_number_of_landing_buffers_refuses_the_batch_at_the_target_naming_it(tmp_path, value):
    """FLAGCX_MESH_STAGED_LANDING_BUFFERS is read at the target's first staged landing: a value
    it does not take (2 to 64) refuses the batch there, the initiator told why, the peer kept."""
    env = staged_env(FLAGCX_MESH_TCP_LANES="1")
    server = spawn("serve", tmp_path, "owner", env=dict(env, FLAGCX_MESH_STAGED_LANDING_BUFFERS=value))
    try:
        got = finish(spawn("blocks-refused", tmp_path, "owner", env=env), "blocks-refused")
    finally:
        served = finish(server, "serve")
    assert f"FLAGCX_MESH_STAGED_LANDING_BUFFERS={value}" in got, got
    assert "want a number of buffers" in served + got, served


@pytest.mark.parametrize("var,value", [("FLAGCX_MESH_STAGED_BOUNCE", "maybe"),
                                       ("FLAGCX_MESH_STAGED_KERNEL_BYTES", "1000")])
def test_a_bad_setting_of_how_chunks_cross_the_bus_fails_the_batch_naming_it(tmp_path, var, value):
    """A value the variable does not take fails the staged batch with InvalidArgument naming it
    (read once, at the first batch), no byte written in its place."""
    env = staged_env(**{var: value})
    server = spawn("serve", tmp_path, "owner", env=env)
    try:
        out, err = finish_prog(spawn("blocks", tmp_path, "owner", env=env), rc=1, timeout=90, what="blocks")
    finally:
        server.kill()
        server.communicate()
    assert f"{var}={value}" in out + err and "InvalidArgument" in out + err, out + err


def test_a_forged_batch_with_a_block_past_the_region_end_is_refused_whole_by_the_target(tmp_path):
    """The initiator never sends such a block (it checks ranges first): a frame written on the
    connection's socket by hand shows the target's own check, before any byte lands."""
    env = staged_env(FLAGCX_MESH_TCP_LANES="1")
    server = spawn("serve", tmp_path, "owner", env=env)
    try:
        finish(spawn("blocks-forged", tmp_path, "owner", env=env), "blocks-forged")
    finally:
        served = finish(server, "serve")
    assert "refused block 1 of a batch of 2 staged writes (16 bytes to window #" in served, served
    assert f"at offset {(1 << 20) - 8}): out of range (1048576 bytes here)" in served, served


def test_a_striped_batch_whose_scatter_fails_on_a_lane_is_refused_and_the_connection_serves_on(tmp_path):
    """The target's copies up fail for a while (its first 12 cuMemcpyAsync: scatters through the
    driver's copies, FLAGCX_MESH_CUDA_BATCH_COPY=off there): each striped batch that meets one is
    refused (a lane's part: its landing ring's copy failed on that lane's thread), the peer is not
    lost, nothing waits for the failed part, and a later batch lands whole."""
    env = staged_env(FLAGCX_MESH_TCP_LANES="4")
    target_env = dict(env, FLAGCX_MESH_CUDA_BATCH_COPY="off", FXM_FAKECUDA_FAIL="cuMemcpyAsync=999@1:12")
    server = spawn("serve", tmp_path, "owner", env=target_env)
    try:
        got = finish(spawn("blocks-scatter", tmp_path, "owner", env=env), "blocks-scatter")
    finally:
        served = finish(server, "serve")
    assert "refused " in got and "a batch of 300 staged writes" in got, got
    assert "landing a part of a striped batch of staged writes" in served, served  # a lane k >= 1's part failed


def test_a_striped_batch_that_times_out_mid_frame_gives_up_every_lanes_part_and_loses_the_peer(tmp_path):
    """A target that stops reading: a striped batch's filler waits for ring slots (a part's ring
    smaller than its part) past its deadline, after the frame's parts were posted; every part is
    given up, each by its own lane's thread (which loses the peer and shuts its connection), and
    the call fails at its deadline. (A lane's give-up once named a peer index past the end.) The
    filler's wait for its ring slots is counted in flagcx_mesh.cuda.staged_waits() (it lasted
    until the 3 s deadline)."""
    env = staged_env(FLAGCX_MESH_TCP_LANES="4", FLAGCX_MESH_STAGED_INFLIGHT_BYTES=str(256 << 10))
    server = spawn("serve", tmp_path, "owner", env=env)
    client = spawn_prog(PROG, "blocks-lost", tmp_path, "owner", "--expect", "timeout", "--timeout", 3, env=env,
                        stdin=subprocess.PIPE, cwd=HERE)
    try:
        assert client.stdout.readline().strip() == "ready"
        server.send_signal(signal.SIGSTOP)
        client.stdin.write("go\n")
        client.stdin.flush()
        got = finish(client, "blocks-lost")
        assert "timed out:" in got and "gone:" in got, got
        waits = json.loads(got.split("staged waits ", 1)[1].splitlines()[0])
        assert set(waits) == {"slot_waits", "slot_us", "gather_waits", "gather_us", "starved", "starved_us",
                              "landing_waits", "landing_us"}, waits
        assert waits["slot_waits"] >= 1 and waits["slot_us"] >= 500_000, waits
    finally:
        reap(server, client)


@pytest.mark.parametrize("op,lanes", [("write", 1), ("read", 1), ("write", 4)])
def test_a_target_killed_mid_batch_fails_the_call_with_peer_lost(tmp_path, op, lanes):
    """(4 lanes: the batch's frames are striped, each part's filler waiting for its lane.)"""
    env = staged_env(FLAGCX_MESH_TCP_LANES=str(lanes))
    server = spawn("serve", tmp_path, "owner", env=env)
    client = spawn("blocks-lost", tmp_path, "owner", "--expect", op, env=env, stdin=subprocess.PIPE)
    try:
        assert client.stdout.readline().strip() == "ready"
        server.send_signal(signal.SIGSTOP)  # it reads nothing more: 64 MiB cannot all be sent
        client.stdin.write("go\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "issuing"
        server.send_signal(signal.SIGKILL)
        server.communicate(timeout=30)
        got = finish(client, "blocks-lost")
        assert "lost:" in got, got
    finally:
        reap(server, client)


def test_the_staged_reads_figures_role_reads_every_byte(tmp_path):
    """reads-timed (scripts/test-gpu.sh's figures of staged reads one at a time and in flight
    together) on the fake driver: its reads' bytes right, its figures printed (not judged)."""
    env = staged_env()
    got, _ = pair(tmp_path, "reads-timed", env)
    assert "in flight" in got, got


def test_staged_reads_into_device_memory_are_in_flight_together(tmp_path):
    """2000 staged reads of 8 B into device memory, one call each, issued while the target is
    stopped: each call returns at once, none done; the target continued, all complete and every
    byte is right (tests/agent_device_prog.py reads). Until 2026-12-07 each call waited for its
    bytes, so the first one waited out its deadline here."""
    env = staged_env()
    server = spawn("serve", tmp_path, "owner", env=env)
    client = spawn("reads", tmp_path, "owner", env=env, stdin=subprocess.PIPE)
    try:
        assert client.stdout.readline().strip() == "ready"
        server.send_signal(signal.SIGSTOP)
        client.stdin.write("go\n")
        client.stdin.flush()
        line = client.stdout.readline()
        assert "none done" in line, line + finish(client, "reads")
        assert client.stdout.readline().strip() == "issued"
        server.send_signal(signal.SIGCONT)
        client.stdin.write("go\n")
        client.stdin.flush()
        finish(client, "reads")
        finish(server, "serve")
    finally:
        reap(server, client)


@pytest.mark.parametrize("how", ["killed", "close", "superseded", "superseded-in"])
def test_a_staged_read_that_fails_mid_answer_writes_nothing_after_it_failed(tmp_path, how):
    """The target's copies down take 100 ms each, this side's copies up 400 ms: once the read's
    first chunk landed (more chunks' copies up queued), the target is killed, or this side closes
    the connection, or the target hangs (stopped) and a new incarnation of its name appears,
    which this side connects to (superseded) or which connects here (superseded-in): the hung
    one's connection is retired (copies up of 1.5 s there, so that some are still queued once the
    2 s name probe gave the old one up). The handle shows done when polled, its wait fails with
    PeerLost naming the peer, and the copies up already queued ended before (nothing lands in the
    destination afterwards). A staged read is only posted since 2026-12-07, so its caller learns
    of the failure from the engine, not from its own call; until later that day a retired
    connection did not wait for them."""
    superseded = how.startswith("superseded")
    server = spawn("serve", tmp_path, "owner", env=staged_env(FXM_FAKECUDA_COPY_FROM_DEVICE_DELAY_MS="100"))
    client = spawn("read-lost", tmp_path, "owner", "--expect", how,
                   env=staged_env(FXM_FAKECUDA_COPY_TO_DEVICE_DELAY_MS="1500" if superseded else "400"))
    second = None  # the new incarnation, started beside the old one (it appears once that one is stopped)
    if how == "superseded":
        (tmp_path / "second").mkdir()
        second = spawn("serve", tmp_path / "second", "owner", env=staged_env())
    elif how == "superseded-in":
        second = spawn("dial", tmp_path, "owner", env=staged_env(), stdin=subprocess.PIPE)
    try:
        if how == "superseded-in":
            assert second.stdout.readline().strip() == "ready"
        line = client.stdout.readline()
        if line.strip() != "landing":
            finish(client, "read-lost")  # fails naming what the role said
        if how == "killed":
            server.send_signal(signal.SIGKILL)
            server.communicate(timeout=30)
        elif superseded:
            server.send_signal(signal.SIGSTOP)
            wait_stopped(server.pid, "the first target")
            if how == "superseded-in":
                second.stdin.write("go\n")
                second.stdin.flush()
        got = finish(client, "read-lost")
        lost = [ln for ln in got.splitlines() if ln.startswith("lost:")]
        assert lost, got
        if superseded:
            assert "was superseded by incarnation" in lost[0], got
    finally:
        reap(*[p for p in (server, second, client) if p is not None])
