// A rank's connection to the rendezvous root: join, allgather, barrier, and
// the failure notices the root pushes (another rank failed or was lost).
// Collectives are serialised by an internal mutex; any thread may call them.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "bootstrap/proto.h"
#include "bootstrap/unique_id.h"

namespace fxm::bootstrap {

using Parts = std::vector<std::vector<uint8_t>>;

class Client {
 public:
  // Connects (retrying until `deadline`) and sends JOIN, which tells the root
  // the build timeout and how much of it is left. Throws Error.
  Client(const UniqueId& id, int rank, int nranks, const Deadline& deadline);
  ~Client();

  // Every rank's contribution, indexed by rank. Throws Error naming the
  // failed or lost rank, or kTimeout.
  Parts allgather(const std::vector<uint8_t>& mine, const Deadline& deadline);
  void barrier(const Deadline& deadline) { allgather({}, deadline); }

  // For poll(): readable outside a collective means the root reported a
  // failure (or went away); raise_pending() then throws it.
  int fd() const { return fd_.get(); }
  [[noreturn]] void raise_pending(const Deadline& deadline);

  // Tells the root this rank failed (best effort), then disconnects.
  void abort(Code code, const std::string& reason);
  // Clean disconnect (best effort). Idempotent.
  void bye();
  // Wakes a collective blocked in another thread (it then fails); used by
  // close() before bye().
  void interrupt();

 private:
  void connect_root(const Deadline& deadline);
  [[noreturn]] void raise(const Msg& m, const std::string& doing);
  [[noreturn]] void raise_io(const tcp::IoResult& r, const std::string& doing);

  std::mutex mu_;
  tcp::Fd fd_;
  tcp::SockAddr root_;
  int rank_;
  int nranks_;
  uint32_t seq_ = 0;
  std::string broken_;  // set when a collective timed out: why later ones are refused
};

}  // namespace fxm::bootstrap
