// A rank's connection to the rendezvous root: join, allgather, barrier,
// point-to-point messages relayed by the root, and the failure notices the
// root pushes (another rank failed or was lost).
// Thread-safety: any thread may call anything. Reads from the root
// (allgather, barrier, recv) are serialised by mu_; writes (including send)
// by wmu_, so one thread may send while another waits in recv. Relayed
// messages that arrive while a thread waits for something else are kept in
// an inbox keyed by (source rank, tag).
#pragma once

#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "bootstrap/proto.h"
#include "bootstrap/unique_id.h"

namespace fxm::bootstrap {

using Parts = std::vector<std::vector<uint8_t>>;

class Client {
 public:
  // Connects (retrying until `deadline`), proves the key of `epoch` (the
  // unique id's when negative) and checks the root's proof, then sends JOIN,
  // which tells the root the build timeout and how much of it is left.
  // Throws Error (kProtocol when the root cannot prove the key).
  Client(const UniqueId& id, int rank, int nranks, const Deadline& deadline, int64_t epoch = -1);
  ~Client();

  // Every rank's contribution, indexed by rank. Throws Error naming the
  // failed or lost rank, or kTimeout. A part above max_allgather_part(nranks)
  // is refused without being sent: every rank fails with kInvalidArgument
  // naming the limit and the rank, and the next collective works. `call` says
  // what this collective is; when another rank's differs, every rank fails
  // with kInvalidArgument naming both calls, and the next collective works.
  Parts allgather(const std::vector<uint8_t>& mine, const Deadline& deadline, const Call& call = {});
  void barrier(const Deadline& deadline, CallKind kind = CallKind::kBarrier) {
    allgather({}, deadline, Call{kind, 0});
  }

  // Relays `size` bytes (at most kMaxRelayPayload) to rank `peer` under `tag`
  // (self included); returns once the root has them. Throws kInvalidArgument
  // for a bad peer or size.
  void send(int peer, uint32_t tag, const void* data, size_t size, const Deadline& deadline);
  // The oldest message from (peer, tag); waits for it until `deadline`
  // (kTimeout, nothing lost) and fails like allgather when the root reports
  // a failed or lost rank.
  std::vector<uint8_t> recv(int peer, uint32_t tag, const Deadline& deadline);

  // For poll(): readable outside a collective means the root reported a
  // failure (or went away); raise_pending() then throws it. Only for a client
  // that takes no relayed messages (a Mesh's): a delivery is reported as an
  // unexpected message.
  int fd() const { return fd_.get(); }
  [[noreturn]] void raise_pending(const Deadline& deadline);

  // Tells the root this rank failed (best effort), then disconnects.
  void abort(Code code, const std::string& reason);
  // Clean disconnect (best effort). Idempotent.
  void bye();
  // Wakes a collective blocked in another thread (it then fails); used by
  // close() before bye().
  void interrupt();
  // At process exit (bootstrap/exit_wait.h): bye() when no other thread is
  // using the client, else interrupt(). Never blocks on the client's locks.
  void leave_at_exit();

 private:
  void connect_root(const Deadline& deadline);
  // Raises when `err` says the id was used or its root is gone (see client.cc).
  void check_refused(int err, Clock::time_point* refused_since);
  std::string oversized_part(size_t size) const;
  // One attempt of the join handshake on a fresh connection; false when the
  // root closed it before proving itself (a root crowded by strangers drops
  // connections that did not prove the key yet): the caller retries.
  bool try_join(const UniqueId& id, uint32_t epoch, const Deadline& deadline);
  bool admitted(const std::string& doing, const Deadline& deadline);
  // Next message from the root other than a relayed one (which is stashed);
  // on an I/O failure raises naming `doing`. Caller holds mu_.
  Msg next_msg(const std::string& doing, const Deadline& deadline);
  // Writes one whole message under wmu_; raises naming `doing`.
  void write_msg(const Msg& m, const std::string& doing, const Deadline& deadline);
  void stash(Msg& m);  // throws kProtocol beyond kMaxInboxBytes
  bool take(int peer, uint32_t tag, std::vector<uint8_t>* out);
  void check_open(const std::string& doing);
  [[noreturn]] void raise(const Msg& m, const std::string& doing);
  [[noreturn]] void raise_io(const tcp::IoResult& r, const std::string& doing);

  std::mutex mu_;
  std::mutex wmu_;
  tcp::Fd fd_;
  tcp::SockAddr root_;
  int rank_;
  int nranks_;
  uint32_t seq_ = 0;
  std::string broken_;  // set when a collective timed out: why later ones are refused
  std::map<std::pair<int, uint32_t>, std::deque<std::vector<uint8_t>>> inbox_;  // under mu_
  uint64_t inbox_bytes_ = 0;  // under mu_
};

}  // namespace fxm::bootstrap
