// Invariant 8, in one place: a path opens only what the peer at the other end
// of THIS connection registered.
//
// A window description (path.h, WindowDesc) is a claim made by whoever handed
// it over: a mesh rank through the bootstrap, an agent's application through
// any channel of its own. Everything in it that a path would open (a pid and
// an address for cma, a /dev/shm segment, a legacy IPC handle, a cuMem fd
// server) is bound here, once per (description, connection), before any path
// factory maps or reads anything:
//
//   process  the pid must be the process that holds the peer's end of this
//            rank's (agent's) authenticated connection to the peer (the kernel's
//            socket table, cma/peer_process.h), on this host, in this PID namespace
//            (an agent's connection keeps the verdict per pid and start time);
//   seal     the owner keeps, at the description's cookie address, a seal of the
//            registration (window_seal(): the window index and the canonical
//            encoding of the whole description); read back from that process it must equal the seal of
//            the description as presented, so a changed address, size, index,
//            segment name or export is refused, and a closed window (seal 0) too;
//   segment  shm: the segment opened by name must be the very file (device and
//            inode) that process maps at the described address, shared and
//            writable ("rw?s"), over the whole window (/proc/<pid>/maps, whole lines);
//   exports  cuda-vmm: the fd server must be that process (SO_PEERCRED);
//            cuda-ipc: a legacy handle is opened for one peer process only (by pid
//            and start time: the first that presented it and had it opened here,
//            while it lives: claim_export), and the mesh keeps its
//            "first publisher" rule (core/onesided_device.cc).
//
// Whatever fails refuses the path naming the peer and the field (describe(),
// agent errors); the caller takes tcp / staged, where the target checks every
// frame against its own table, or (agents, a description whose seal does not
// match a proven peer process) refuses the op.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace fxm {

struct WindowDesc;
struct PathRequest;

// The verdict of bind_to_peer() for one description on one connection.
struct Binding {
  std::string process;   // "" : the pid is the peer's process here, else why not
  std::string sealed;    // "" : the seal read back matches, else why not
  bool seal_unreadable = false;  // the seal could not be read (ptrace rules): not a mismatch
  // The description contradicts what the proven peer process registered
  // (seal mismatch): a tampered or stale description, not a missing capability.
  bool mismatch = false;
  bool host_ok() const { return process.empty(); }
  // "" when paths that read the peer's memory through its pid (cma) may be taken.
  std::string for_cma() const { return !process.empty() ? process : sealed; }
  // "" when a path that maps what the description names may be taken (shm, device):
  // the process is proven, and the seal matches or could not be read at all.
  std::string for_mapping() const { return !process.empty() ? process : (seal_unreadable ? "" : sealed); }
};

// The seal of a description for window `index` (never 0: 0 is a closed window): a hash of the
// index and the description's canonical encoding, so no two descriptions share it.
uint64_t window_seal(const WindowDesc& d, uint32_t index);

// Proves the description's process and reads its seal (the one place: choose_path calls it).
Binding bind_to_peer(const PathRequest& req, const WindowDesc& d);

// "" when process `pid` maps the file (st_dev, st_ino) at `addr` from offset 0
// over at least `bytes`, else why not (shm: the segment is the peer's).
std::string maps_file_at(pid_t pid, uint64_t addr, uint64_t bytes, uint64_t st_dev, uint64_t st_ino);

// cuda-ipc, for agents ("first presenter"): an export is opened for one peer process only, the
// first that presented it and had it opened here, keyed by its proven pid and start time (a
// name is what a peer says; another holder of the secret may connect under it). The claim lasts
// while that process lives: it is not released with the path, or a peer that supersedes the
// owner's connection under its name would take it over once the old connection closed.
// export_holder: "" when process `pid` may open `key`, else who holds it (checked before opening).
// claim_export: the same, and records `pid` as the holder (called once the open succeeded).
std::string export_holder(const std::string& key, pid_t pid);
std::string claim_export(const std::string& key, pid_t pid, const std::string& words);

// /proc/<pid>/stat field 22 (its start time in clock ticks after boot), 0 when unknown.
uint64_t process_start_time(pid_t pid);

// "rank 3" or "the peer agent", for refusals.
std::string peer_words(const PathRequest& req);

// The first field in which two descriptions differ ("" when none), for errors.
std::string first_difference(const WindowDesc& a, const WindowDesc& b);

}  // namespace fxm
