// Reads of a request's blocks run off the caller's thread (a KV connector's decode side reading
// what a prefill holds). A read is submitted with its block ids and the tables that turn them into
// ops (BlockRows); a thread of its own makes the ops, issues the read on the connection, watches
// it land, sends the peer the notification the outcome calls for (its ack once the bytes landed, a
// release when the read failed) and posts the outcome for the caller to take. None of it needs the
// caller's thread or an interpreter lock: the read goes on however busy the thread that asked is.
//
// The same for a push the caller asked a peer for (await_answer): the peer's notification that
// the bytes landed (its answer) is matched in the agent's inbox as it arrives, the thread sends the
// ack and posts the outcome, with no thread of the caller's on the way.
//
// And on the side that holds the blocks, a peer's want (agent/want.h) of blocks offered here
// (serve_wants, offer, serve_layout): the agent's inbox hands each want to this thread as it
// arrives, which makes its push (want_server.h), issues and watches it as a read, sends the
// peer the want's answer (with the write where the socket orders it behind the data, else once
// the bytes landed) and posts served events (take_served); a want it cannot serve goes back to
// the inbox, untouched, for notifications().
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "agent/agent.h"
#include "agent/block_rows.h"
#include "agent/want_server.h"

namespace fxm::agent {

class Connection;

// One request's read: per KV cache group its tables (one per shape of layers) and its block ids
// (here, then the peer's: a table's src side is this agent's memory, read into from the peer's).
struct PullGroup {
  std::vector<std::shared_ptr<const BlockRows>> tables;
  std::vector<int64_t> local_ids, remote_ids;
};

struct PullJob {
  uint64_t token = 0;  // the caller's name for it, in its outcome
  std::shared_ptr<Connection> conn;
  std::vector<std::shared_ptr<const RegionDesc>> locals, remotes;  // the regions a table's indices name
  std::vector<PullGroup> groups;
  std::vector<uint8_t> on_landed, on_failed;  // notifications to the peer (empty: none)
  // A served push (want_server.h): a write of the blocks here into the peer's, on_landed its
  // answer; served events are posted for it, not an outcome.
  bool write = false;
  uint64_t push = 0;     // its number, once started
  uint32_t readers = 0;  // (its events)
  double late_s = 0;     // reported late after this long in flight (<= 0: the agent's timeout)
};

// A push's answer awaited: the peer's notification of exactly `answer` on `conn`.
struct AnswerJob {
  uint64_t token = 0;
  std::shared_ptr<Connection> conn;
  std::vector<uint8_t> answer;
  std::vector<uint8_t> on_landed;  // sent to the peer once the answer came, unless cancelled (empty: none)
  double timeout_s = 0;            // then the outcome fails (0: the agent's timeout)
};

struct PullOutcome {
  uint64_t token = 0;
  std::string error;  // "" when the bytes landed and the ack went
  uint64_t ops = 0, bytes = 0;  // of the read (0 when it was refused before any op)
  bool cancelled = false;  // cancel() came before its outcome was known (no ack was sent)
  double at_s = 0;  // when it was known: seconds of the steady clock (CLOCK_MONOTONIC, Python's time.monotonic())
};

class BlockPuller {
 public:
  // Its reads are on connections of `agent`, which it keeps alive (a connection's calls use its
  // agent) until it is destroyed.
  explicit BlockPuller(std::shared_ptr<Agent> agent);
  ~BlockPuller();  // close()
  BlockPuller(const BlockPuller&) = delete;
  BlockPuller& operator=(const BlockPuller&) = delete;

  // Queues a read; Closed after close(), InvalidArgument for a connection of another agent.
  void submit(PullJob job);
  // Awaits a push's answer (AnswerJob): its outcome is posted when the answer came (after the
  // ack, sent if the connection still can), or fails when the connection ends before it came, at
  // its timeout, or at close(); ops and bytes 0.
  // Closed after close(), InvalidArgument for a connection of another agent.
  void await_answer(AnswerJob job);
  // Stops awaiting the answer of `token` (the caller took another word of the peer for it, as a
  // refusal): no outcome is posted, no ack sent. No effect on a read, nor once the outcome was posted.
  void forget(uint64_t token);
  // The read of `token` (or the answer awaited) sends no ack when it lands (its outcome says
  // cancelled); a release still goes when a read fails. No effect once its outcome was posted.
  void cancel(uint64_t token);
  // The outcomes posted since the last take, in the order they were known (reads of several
  // connections may end in another order than they were submitted).
  std::vector<PullOutcome> take();
  // A count that moves on each outcome posted and each wake(): wait(seen, ...) returns at once
  // when it moved since `seen` was read, so a wake between a caller's look and its wait is not lost.
  uint64_t seq() const;
  // Until an outcome is there or seq() moved past `seen`, for up to timeout_s (at most a day).
  void wait(uint64_t seen, double timeout_s) const;
  void wake();
  // Reads queued fail ("closed"); reads in flight are not waited for (their outcome says so).
  // Served pushes in flight end with an error (an ended event each, no answer sent), wants taken
  // and not issued yet go back to the inbox, the claim of wants is taken out. The thread is joined.
  void close();

  // Wants served here (want_server.h). serve_wants(true) claims the agent's notifications that
  // start with kWantPrefix (false gives them back to notifications(); wants claimed before are
  // still served). One puller of an agent serves its wants: InvalidArgument while another does.
  // Closed after close().
  void serve_wants(bool on);
  // See WantServer::offer / withdraw / in_flight (withdraw posts nothing: the pushes in flight
  // post their ended event as they end).
  void offer(uint64_t token, std::string req, std::vector<std::vector<int64_t>> groups, double timeout_s);
  uint64_t withdraw(uint64_t token);
  uint64_t in_flight(uint64_t token) const;
  // See WantServer::serve_layout. InvalidArgument for a connection of another agent (a table row
  // naming a region beyond locals / remotes is found when a want is served: it is handed back).
  void serve_layout(std::shared_ptr<Connection> conn, std::array<uint32_t, 4> part,
                    std::vector<std::shared_ptr<const RegionDesc>> locals,
                    std::vector<std::shared_ptr<const RegionDesc>> remotes,
                    std::vector<std::vector<std::shared_ptr<const BlockRows>>> group_tables);
  // A want that arrived on conn and was handed back (no offer yet, say), served again as if the
  // claim had just taken it: its blocks are now offered. Handed back again when still not served.
  // InvalidArgument for a connection of another agent, kClosed after close(); false (nothing
  // done) while wants are not served (serve_wants(false)).
  bool resubmit(const std::shared_ptr<Connection>& conn, std::vector<uint8_t> bytes);
  // See WantServer::forget_layouts: the wants arriving on conn are handed back until serve_layout.
  void forget_layouts(const std::shared_ptr<Connection>& conn);
  // The served events posted since the last take, in order. A push is counted by in_flight()
  // from before its write is issued, so before the peer's ack of it can come; its started event
  // is posted once the write was issued (it may follow that ack).
  std::vector<ServedEvent> take_served();

 private:
  struct InFlight {
    InFlight(PullJob j, Handle h) : job(std::move(j)), op(std::move(h)) {}
    PullJob job;
    Handle op;         // its read, or its write (a push)
    Deadline late_at;  // a push: reported late past it
    bool late = false;
    bool answered = false;  // a push: its answer went with the write (the socket orders it behind the data)
  };
  struct Awaited {  // an answer awaited, until the thread takes its arrival (or forget())
    std::shared_ptr<Connection> conn;
    std::vector<uint8_t> on_landed;
    std::shared_ptr<WaitState> watch;
  };
  struct Answered {
    uint64_t token;
    std::string error;
  };
  void run();
  bool news() const;  // work for the thread (mu_ held)
  void answered(uint64_t token, const std::string& error);  // the watch's release (the inbox's lock held)
  void finish_answers(std::vector<Answered> done);
  void close_answers();
  void start(PullJob& job);  // makes the ops and issues the read: in flight_, or its outcome posted
  std::string issue(PullJob& job);  // "" (in flight_, or finished), else why nothing was issued (nothing moved)
  bool polled(InFlight& f);  // its op is over: finished (its outcome or ended event posted)
  void finish(InFlight& f, const std::string& error);
  void finish_push(InFlight& f, std::string error);
  bool claimed(const std::shared_ptr<Connection>& conn, Notification& n);  // the claim (the inbox's lock held)
  void serve(ClaimedWant& c);  // its push issued, else the want handed back
  void hand_back(ClaimedWant& c, const std::string& why);
  void uncount_push(const PullJob& job);  // its write was refused: no longer in flight (no event)
  void post_served(InFlight& f, int kind, const std::string& error);
  void post(PullOutcome o);
  bool cancelled(uint64_t token);  // taken out of cancelled_ (its outcome is being made)

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;  // jobs queued, closing (the thread); outcomes, wakes (wait())
  std::vector<PullJob> queued_;
  std::unordered_map<uint64_t, Awaited> awaited_;
  std::vector<Answered> answered_;
  std::unordered_set<uint64_t> live_;       // tokens submitted whose outcome is not posted yet
  std::unordered_set<uint64_t> cancelled_;  // of those, the ones cancel() named
  std::vector<PullOutcome> outcomes_;
  std::vector<ClaimedWant> claimed_;  // wants the claim took, for the thread
  WantServer served_;
  bool serving_ = false;  // the claim takes wants
  uint64_t seq_ = 0;
  bool closing_ = false;
  std::mutex claim_mu_;  // serve_wants and close: the claim is never installed after close took it out
  std::deque<InFlight> flight_;  // the thread's alone
  std::shared_ptr<Agent> agent_;
  std::thread thread_;
};

}  // namespace fxm::agent
