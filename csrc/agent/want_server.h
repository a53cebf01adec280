// Wants served by the core (docs/agent.md, "Wants served by the core"): a KV connector's prefill
// side offers the blocks it holds for a request and gives, per connection and part, the tables
// that turn a decode's want (agent/want.h) into ops; the agent's inbox hands the puller's thread
// (block_pull.h) each want as it is drained, the thread makes its push here (push_for), issues
// it and watches it as it does reads, and posts served events for the connector. No Python is on
// the way of a want the core can serve; one it cannot goes back to the inbox, untouched, for the
// connector's own reader (which has every check and refusal).
//
// This is the serving side's bookkeeping; it is guarded by the puller's lock (every call here is
// made with it held) and has no thread of its own.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "agent/agent.h"
#include "agent/block_rows.h"
#include "agent/want.h"

namespace fxm::agent {

struct PullJob;

constexpr int kServedStarted = 1;  // the push was issued (its answer with it, or once its bytes landed)
constexpr int kServedEnded = 2;    // it is over: its error "" once the bytes landed and the answer went
constexpr int kServedLate = 3;     // still in flight past its offer's timeout (once a push)

struct ServedEvent {
  uint64_t token = 0;  // the offer's
  uint64_t push = 0;   // the push's number (from 1, per puller)
  int kind = 0;        // kServedStarted, kServedEnded, kServedLate
  std::string peer;    // the wanter
  Incarnation incarnation{};
  uint32_t readers = 0;  // the want's readers, or its sn when 0
  uint64_t ops = 0, bytes = 0;
  std::string error;  // (ended)
  double at_s = 0;    // seconds of the steady clock (Python's time.monotonic())
};

// A want the inbox's claim took, with the connection it came on.
struct ClaimedWant {
  std::shared_ptr<Connection> conn;
  Notification n;
};

class WantServer {
 public:
  using Regions = std::vector<std::shared_ptr<const RegionDesc>>;
  using GroupTables = std::vector<std::vector<std::shared_ptr<const BlockRows>>>;

  // The blocks held for request `req` (ids per KV cache group) that its wants are served from; a
  // push not over within timeout_s (<= 0: the agent's timeout) is reported late. Replaces an
  // earlier offer of `req` and one of `token`.
  void offer(uint64_t token, std::string req, std::vector<std::vector<int64_t>> groups, double timeout_s);
  // Takes the offer of `token` out (its later wants are handed back); the pushes of it in flight.
  uint64_t withdraw(uint64_t token);
  uint64_t in_flight(uint64_t token) const;
  // The tables (per group: one per shape of layers, none for a group without layers) and regions
  // wants of `part` arriving on `conn` with as many groups are served with; replaces earlier ones
  // of that key. Those of connections gone are dropped here.
  void serve_layout(const std::shared_ptr<Connection>& conn, const std::array<uint32_t, 4>& part, Regions locals,
                    Regions remotes, GroupTables group_tables);
  // Drops the tables of every part served on `conn` (its peer sent another layout).
  void forget_layouts(const Connection* conn);
  // The push that serves `w`, arrived on `conn`: a write of the last counts[g] ids held of each
  // group into the group's slice of w.dst, its answer sent behind the data; "" and *job
  // made, else why the core cannot serve it.
  std::string push_for(const Want& w, const std::shared_ptr<Connection>& conn, PullJob* job);
  // A push of the offer of `token` about to be issued: numbered and counted in flight (before its
  // answer can go), until its ended event is recorded, or end() (its write was refused).
  uint64_t begin(uint64_t token);
  void end(uint64_t token);
  // Records an event for take() (an ended one is no longer counted in flight).
  void record(ServedEvent e);
  std::vector<ServedEvent> take();

 private:
  struct Offer {
    uint64_t token = 0;
    std::vector<std::vector<int64_t>> held;
    double timeout_s = 0;
  };
  struct Layout {
    std::weak_ptr<Connection> conn;
    Regions locals, remotes;
    GroupTables tables;
  };
  using LayoutKey = std::tuple<const Connection*, std::array<uint32_t, 4>, size_t>;
  const Layout* layout(const std::shared_ptr<Connection>& conn, const LayoutKey& key);

  std::unordered_map<std::string, Offer> offers_;      // by request
  std::unordered_map<uint64_t, std::string> req_of_;   // offers' requests by token
  std::unordered_map<uint64_t, uint64_t> in_flight_;   // pushes started and not ended, by token
  std::map<LayoutKey, Layout> layouts_;
  std::vector<ServedEvent> events_;
  uint64_t pushes_ = 0;
};

}  // namespace fxm::agent
