// The progress engine of one mesh: a thread that owns every TCP connection
// once the mesh is built. It writes queued frames (messages, puts, get
// requests and answers, acks) without blocking, reads every receive
// connection, lands incoming puts in the target windows and then applies
// their signals, answers gets, counts completions from acks, and files
// two-sided messages into per-(peer, context) mailboxes.
//
// Application threads enqueue (under mu_), write a frame themselves when its
// queue is empty (send_direct), and wake the thread through an eventfd;
// nothing they call blocks on a socket. A thread waiting here (wait_signal,
// flush, wait_counter) may read the lane-0 receive connections itself for the
// first kHelpSpin of its wait, holding the read role (progress_poll.cc). A
// connection that closes without a kBye marks its peer lost: waits on it fail
// with PeerLost. Acks of put_signals are lazy (wire::kPutLazyAck, send_acks).
#pragma once

#include <poll.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/log.h"
#include "core/mesh_builder.h"
#include "core/window.h"
#include "base/wire.h"

namespace fxm {

class Backoff;  // base/backoff.h

// An engine's words ("rank 0: ", "peer 0", " (ctx 0)", "closed its mesh") said of a 2-party pair
// whose peer 0 is `peer` ("agent b"): an agent's connection.
std::string said_of_pair(std::string msg, const std::string& peer);

// Logs at `level` through the engine's words (its message built only when the level is on).
#define FXM_ENGINE_LOG(level, msg)                  \
  do {                                              \
    if (::fxm::log_enabled(level)) log(level, msg); \
  } while (0)

class Engine : public Outbox {
 public:
  // max_unreceived: bytes of messages that may wait in one (peer, ctx)
  // mailbox; above it the engine stops reading that connection until recv()
  // drains it (acks and get answers on that connection wait too).
  // timeout_s (the mesh's) bounds each device copy of the progress thread.
  // words: how its log lines name itself and its peer 0 (an agent's connection: "agent a:
  // connection to agent b (...): ", "agent b"); empty: "[rank N]" and "peer N", the mesh's.
  // arrival: called (on the thread that read it, no lock of the engine held) each time a
  // message lands in a mailbox and when a peer says goodbye or is lost: what a waiter outside
  // the engine (an agent's notification inbox, agent/doorbell.h) is woken by instead of
  // polling recv_message. It must not block nor call into the engine.
  struct Words {
    std::string self;
    std::string peer0;
  };
  using ArrivalHook = std::function<void()>;
  Engine(int rank, int nranks, int ncontexts, Connections* conns, WindowTable* windows,
         uint64_t max_unreceived, double timeout_s, Words words = {}, ArrivalHook arrival = {});
  ~Engine() override;

  // One-sided ops over TCP (the caller validated every argument). The source
  // bytes must stay valid until the op completes (see completed()).
  void post_put(int peer, int ctx, const uint8_t* src, uint64_t len, uint32_t dst_win,
                uint64_t dst_off, const SignalSpec& sig, bool may_stripe = false) override;
  // Puts of at least this many bytes are striped over the lanes (when there are several).
  static constexpr uint64_t kStripeMinBytes = 1ull << 20;
  int lanes() const { return lanes_; }
  void post_get(int peer, int ctx, uint32_t src_win, uint64_t src_off, uint8_t* dst, uint64_t len,
                int dst_device = -1) override;
  void issued(int peer, int ctx, PathKind kind) override;
  void issued_n(int peer, int ctx, PathKind kind, uint64_t ops);
  void issued_probe(int peer, int ctx, PathKind kind, std::unique_ptr<CompletionProbe> probe, uint64_t ops) override;
  // Completes the probed ops that are done, in issue order per pair (cheap when there are none).
  bool poll_probes();  // true when some completed
  bool probe_done(CompletionProbe& p, std::string* error);
  struct ProbeEnd {
    int slot;
    std::string error;
    bool lost;
    uint64_t ops;
  };
  // Ops counted by issued() and not completed yet (queued on CUDA streams).
  int64_t stream_ops_pending() const { return stream_ops_.load(); }
  bool wait_stream_ops(const Deadline& deadline);  // false: some remain at the deadline
  void completed(int peer, int ctx, const std::string& error) override;
  void completed_n(int peer, int ctx, const std::string& error, uint64_t ops);
  // True while ops to (peer, ctx) are in flight on an asynchronous path
  // (*kind: which); a later op to that pair must then take that path too, or
  // wait_idle(), to stay FIFO. Throws PeerLost, naming `op`, when the peer
  // was lost or closed its mesh.
  bool in_flight(int peer, int ctx, const char* op, PathKind* kind) const;
  void wait_idle(int peer, int ctx, const Deadline& deadline) override;
  void post_put_staged(int peer, int ctx, std::shared_ptr<cuda::StagedPayload> payload, uint32_t dst_win,
                       uint64_t dst_off, const SignalSpec& sig) override;
  int stripes(uint64_t bytes) const override { return lanes_ > 1 && bytes >= kStripeMinBytes ? lanes_ : 1; }
  void post_put_blocks(int peer, int ctx, std::vector<std::shared_ptr<cuda::StagedPayload>> parts,
                       std::vector<wire::BlockEntry> blocks) override;
  void post_put_host_blocks(int peer, int ctx, std::vector<wire::BlockEntry> blocks, ScatterList sources) override;
  void post_get_blocks(int peer, int ctx, std::vector<wire::BlockEntry> blocks, std::shared_ptr<const ScatterList> into,
                       int device) override;

  // Two-sided messages. The message is written by the calling thread when nothing is queued
  // before it (send_direct), else copied into the queue; while more
  // than kMaxQueuedMessageBytes of messages wait on that (peer, ctx), the
  // call waits for the queue to drain, up to `deadline`.
  static constexpr uint64_t kMaxQueuedMessageBytes = 64ull << 20;
  void post_message(int peer, int ctx, const void* data, uint64_t len, const Deadline& deadline);
  std::vector<uint8_t> recv_message(int peer, int ctx, const Deadline& deadline);
  // Without waiting: true with the next message in *out; false when none is there (no error
  // made, as a drain of the mailbox ends every time); throws as recv_message does once nothing
  // more will come (PeerLost) or the engine was closed.
  bool try_recv_message(int peer, int ctx, std::vector<uint8_t>* out);
  bool pop_message(int peer, int ctx, std::vector<uint8_t>* out);  // (mu_ held)
  void fail_if_no_more_messages(int peer, int ctx);                 // (mu_ held)

  // Waiters that read (progress_poll.cc). help_read: when no other thread reads them now, reads
  // what the lane-0 receive connections hold (never blocking; never with mu_ held); true when
  // it read some. may_help: false once the engine stops. unpark: a waiter that stops reading and
  // sleeps hands lane 0 back. With a device window here a waiter stops at a frame whose bytes go
  // through staging buffers and device copies (progress_thread_frame) and leaves it, and that
  // connection, to the progress thread (left_to_progress_); it reads the others, and none while
  // the progress thread wants the role (role_wanted_).
  bool help_read();
  bool may_help() const;
  void unpark();
  static constexpr std::chrono::microseconds kHelpSpin{50};
  static constexpr size_t kHelpDirectReads = 2;  // help_read reads up to this many connections without a poll
  // The progress thread's parked polls so far, and those among them that ran out their timer
  // although a waiter had gone to sleep before that timer was due (a lost wake-up: the frames it
  // waited for waited for the timer instead; none is expected). mesh.stats() reports both.
  struct ParkCounts {
    uint64_t parks, late_wakes;
  };
  ParkCounts park_counts() const { return {parks_.load(), late_wakes_.load()}; }
  // Striped puts lane 0 admitted while earlier ones' stripes were still landing (early
  // admission), and the times a head of the same layout waited because kMaxAdmitted were.
  struct AdmitCounts {
    uint64_t early, limit_waits;
  };
  AdmitCounts admit_counts() const { return {early_admits_.load(), admit_limit_waits_.load()}; }
  // Memory the answers to gets hold (each streams through a ring of StagedPayload::kAnswerChunks
  // chunks, taken when it reaches the head of its queue): bytes now, and the most at once.
  struct AnswerCounts {
    uint64_t held, peak;
  };
  AnswerCounts answer_counts() const { return {answer_held_.load(), answer_peak_.load()}; }
  // Socket reads of lane 0 that got bytes, made by waiting threads themselves (help_read).
  uint64_t waiter_reads() const { return waiter_reads_.load(std::memory_order_relaxed); }

  // Completion counting: ops issued by this rank and completed at their target.
  void count_inline(int peer, uint64_t n);  // ops done synchronously (no lock unless a thread waits)
  uint64_t completed() const { return completed_all_.load(); }
  // Liveness: ping() asks the peer for an ack now (kAckReq on lane 0, which the peer's engine
  // answers even when it applied nothing new) and returns the acks heard from it so far;
  // acks_heard(peer) exceeds that value once the peer's engine answered. (What an agent asks of
  // a connection whose name another incarnation claims: is the agent at its end alive?)
  uint64_t ping(int peer);
  uint64_t acks_heard(int peer) const;
  void wait_counter(uint64_t value, const Deadline& deadline);
  // peer -1: every peer. Then raises what those peers refused since the last
  // report, unless `report_refused` is false (deregister keeps it for the user).
  void flush(int peer, const Deadline& deadline, bool report_refused = true);

  // "" when the peer is fine, else why it is lost.
  std::string lost_reason(int peer) const;
  // True once the peer said goodbye on every connection (it closed its side).
  bool peer_closed(int peer) const {
    std::lock_guard<std::mutex> lock(mu_);
    return bye_[peer];
  }
  // lost_reason(peer) is not "" or peer_closed(peer): one lock, no text.
  bool peer_ended(int peer) const {
    std::lock_guard<std::mutex> lock(mu_);
    return !lost_[peer].empty() || bye_[peer];
  }
  int first_lost_peer() const;
  // Sends kBye on every connection, drains queues (bounded), stops the thread.
  void stop();
  // The copies up of the gets into device memory landing now end, and those gets are dropped
  // (stop() does it before its waiters learn of the close; a caller that tells them first, too).
  void settle_device_gets();
  bool stopped() const { return stopping_.load(); }
  // Largest two-sided message a peer may announce; a bigger frame is a protocol error.
  static constexpr uint64_t kMaxMessageBytes = 1ull << 32;
  // Bytes of get answers one (peer, context) may have in flight (see get_bytes_).
  static constexpr uint64_t kMaxGetBytesInFlight = 64ull << 20;

 private:
  struct OutItem;
  struct InConn;
  struct Inbound;
  int slot(int peer, int ctx) const { return peer * ncontexts_ + ctx; }
  // Connection c: lane c / total_ of slot c % total_ (c == slot on lane 0).
  int base_slot(int c) const { return c % total_; }
  int peer_of(int c) const { return base_slot(c) / ncontexts_; }
  int lane_of(int c) const { return c / total_; }
  std::string conn_name(int c) const;  // "" on lane 0, else " (tcp lane k)"
  // Lanes (progress_lanes.cc). A put of kStripeMinBytes or more to a host window is split
  // over every lane: its first part, with its signal, on lane 0 (kPut + kPutStriped) and one
  // kStripe part on each other lane, all queued at once so parts and puts keep one order.
  void post_striped(int peer, int ctx, const uint8_t* src, uint64_t len, uint32_t dst_win, uint64_t dst_off,
                    const SignalSpec& sig);
  // A batch of host writes of kStripeMinBytes or more (wire::kBlocksStriped): the list and the
  // first part on lane 0, a kStripe (kStripeOfBlocks) of the blocks' bytes on each other lane.
  // attach(item, k, at, n): gives lane k's item (k = 0: the head) its payload, bytes [at, at + n) of the blocks'.
  using AttachPart = std::function<void(OutItem* item, int k, uint64_t at, uint64_t n)>;
  void post_striped_blocks(int peer, int ctx, const std::vector<wire::BlockEntry>& blocks, uint64_t bytes,
                           const AttachPart& attach);
  static bool lands_disjoint(const std::vector<wire::BlockEntry>& blocks);  // no two land on the same bytes
  // Queues a striped op: `head` on lane 0, stripe(k, number) on lane k, in one critical section.
  template <typename Stripe>
  void queue_striped(int peer, int ctx, OutItem head, const Stripe& stripe);
  // Target (progress_admit.cc). A lane-0 striped put admits its stripes (a stripe waits, its
  // lane not read, until the lane-0 part of its put was read). While stripes are still landing,
  // lane 0 reads on only into the head of a striped put of the same layout (admits_early); any
  // other frame stops it after its op header until the held puts are applied, in order.
  struct HeldPut {  // a striped put whose lane-0 part landed, waiting for its stripes
    wire::PutHeader put;
    uint64_t length = 0;  // its lane-0 frame's length (the layout, with put.dst_win, dst_off, pad)
    uint64_t number = 0;  // its stripes' number
    bool data = false;    // its lane-0 part carried bytes
    Window* entered = nullptr;  // left exactly once: when it is applied or dropped
    std::string refused;
    std::vector<Window*> windows;  // a striped batch of writes: the windows it entered (left likewise)
    bool blocks = false;           // a striped batch of writes (never admitted early: progress_admit.cc)
    void leave_windows() {
      if (entered) entered->leave();
      for (Window* w : windows) w->leave();
      entered = nullptr;
      windows.clear();
    }
  };
  // A striped batch of writes as lane 0 checked it, for its stripes (taken by their threads).
  struct StripedBlocks {
    uint64_t number = 0;  // its stripes' number
    uint64_t first = 0;   // the bytes of lane 0's part
    uint64_t part = 0;    // the bytes of each other lane's stripe
    std::shared_ptr<const ScatterList> places;          // each block's place here
    std::shared_ptr<const std::vector<Window*>> block_windows;  // each block's window
    std::vector<Window*> windows;  // the distinct windows (each stripe enters them too)
    std::string refused;           // lane 0 refused the batch: every stripe's bytes are dropped
    int device = -1;               // staged writes: the device of its windows (else host memory)
  };
  static constexpr size_t kMaxAdmitted = 4;  // per slot: striped puts admitted and not applied (held + read)
  bool on_striped_header(int s, InConn& in);  // false: protocol error (the peer was lost)
  bool admits_early(int s, const InConn& in);  // lane 0 may act on this frame now
  bool hold_striped(int s, InConn& in);  // lane 0's part landed: true when held (in reset)
  void finish_held(int s);               // applies the held puts whose stripes all landed, in order
  bool applies_now(int s, uint64_t number, std::string* refused);  // (hold_striped, hold_striped_blocks)
  void hold(int s, HeldPut h);           // held until its stripes land (finish_held)
  void take_stripe_refusal(int s, uint64_t number, std::string* refused);
  uint64_t landed_all(int s) const;      // the last striped put of slot s every lane landed its stripe of
  void on_stripe_header(int c, InConn& in, uint64_t payload);
  // A striped batch of writes (progress_admit.cc): lane 0 admits its stripes once its list was
  // checked; a stripe takes the list then, at its first byte, and lands its bytes through it.
  void admit_striped_blocks(int s, InConn& in);
  // Lane 0's part landed (`refused`: why not, else ""): true when held (in reset).
  bool hold_striped_blocks(int s, InConn& in, std::string* refused);
  uint8_t* stripe_blocks_spot(int c, InConn& in, size_t* want);
  void forget_striped_blocks(int s);
  void on_stripe_done(int c, InConn& in);
  bool stripe_waits(int c) const;        // lane c's stripe is not read past its header now
  void finish_landed_stripes();  // progress thread: applies the held puts whose stripes all landed
  void apply_put(int s, const wire::PutHeader& put, std::string refused, bool data);  // signal, ack
  bool lane_readable(int c) const;  // with mu_ held, by c's thread: polled for reading now
  // A lane whose stripe waits for lane 0 is polled for its peer's close only: when the rest of
  // that stripe is not in its buffer, it can never complete, and the peer is lost now.
  void on_waiting_close(int c);
  // Lane workers: with lanes_ > 1, worker k - 1 is the only thread that writes and reads the
  // connections of lane k (of every slot), so the kernel copies of the lanes run side by side;
  // the progress thread keeps lane 0 and applies striped puts (their signal, their ack).
  struct LaneWorker;
  std::vector<std::unique_ptr<LaneWorker>> lane_workers_;
  void start_lane_workers();  // before the progress thread starts; throws, with none left running
  void join_lane_workers();   // stopping_ is set
  void run_lane(LaneWorker& w);
  void poll_lane(LaneWorker& w);
  void wake_lane(int lane);  // lane 0: the progress thread
  void wake_lanes();         // every lane worker (not the progress thread)
  void wake_conn(int c) { wake_lane(lane_of(c)); }
  bool owns_conn(int c) const;  // the calling thread is connection c's thread
  uint8_t* discard_for(int c, size_t* size);  // the sink for dropped payload bytes of connection c's thread
  // The window one read of a put's payload lands in, counted in its io while the read runs
  // (progress_recv.cc); enter() is false, and the put refused, once it was deregistered.
  struct WindowIo {
    Window* w = nullptr;
    bool enter(InConn& in, Window* into);
    ~WindowIo() {
      if (w) w->end_io();
    }
  };
  // What an item counts as: puts are acked (a lazy one when asked, see wire::kPutLazyAck), gets answered.
  enum class Count { kNone, kPut, kLazyPut, kGet };
  void enqueue(int s, OutItem&& item, Count counted);
  // Writes an item straight from the calling thread when its queue is empty
  // (saves a hand-off to the progress thread); false: it must be queued.
  bool send_direct(int s, OutItem& item);
  // One non-blocking sendmsg of what is left of `item`; -1 on a fatal error.
  ssize_t send_item(int s, OutItem& item);
  ssize_t send_gather_item(int s, OutItem& item);  // a batch of host writes (OutItem::gather)
  // A kPutBlocks frame's head carrying `carried` of the blocks' `bytes` (flags: wire::kBlocksStriped...).
  OutItem blocks_item(const std::vector<wire::BlockEntry>& blocks, uint64_t bytes, uint64_t carried, uint32_t flags = 0);
  ssize_t send_iov(int s, iovec* iov, int n);  // one non-blocking sendmsg (progress.cc)
  // Frames queued behind the front one go with it in one sendmsg (progress.cc), up to these.
  static constexpr int kGatherIov = 64;
  static constexpr uint64_t kGatherBytes = 1ull << 20;
  void gather_behind(int s, std::vector<OutItem*>* items);  // with mu_ held
  ssize_t send_gathered(int s, const std::vector<OutItem*>& items);
  bool pop_sent(int s);
  // With mu_ held: the front item of slot s waits for staged bytes not copied yet (no POLLOUT then).
  bool waiting_for_staging(int s) const;
  // A staged put whose copy out of device memory failed mid-frame: the frame cannot be
  // completed, so the connection is shut and the peer lost (it sees the frame cut short).
  void give_up_frame(int s, const OutItem& item);
  void refuse_unsent_answer(int s);  // with write_mu_[s]: its front item, a failed answer, becomes a refusal
  void drop_queues();  // stop(): the items never sent go (their payloads release what they hold)
  static OutItem refusal(uint64_t number, const std::string& why);  // a kRefused frame
  void wake();
  void run();
  void poll_once();
  void read_phase(const std::vector<pollfd>& fds, const std::vector<int>& owner, const std::vector<int>& ahead);
  // With mu_ held and the read role: lane-0 receive connections to read now (owner: tag + slot).
  void readable_fds(std::vector<pollfd>* fds, std::vector<int>* owner, int tag, std::vector<int>* ahead,
                    bool waiter) const;
  // The read role (progress_poll.cc): held by whoever reads lane-0 receive connections.
  std::mutex read_mu_;
  std::vector<pollfd> help_fds_;            // under read_mu_: help_read's poll set
  std::vector<int> help_owner_, help_ahead_;
  std::atomic<uint64_t> helped_{0};         // waiters' reads so far
  std::atomic<uint64_t> waiter_reads_{0};   // of them, the socket reads that got bytes
  uint64_t helped_seen_ = 0;                // progress thread: helped_ at its last pass
  std::atomic<uint64_t> sleeps_{0};         // waiters that went to sleep (unpark) so far
  uint64_t sleeps_seen_ = 0;                // progress thread: sleeps_ at its last pass
  void decide_park();
  bool park_beside_reader(uint64_t sleeps_before);
  std::atomic<uint64_t> parks_{0}, late_wakes_{0};  // see park_counts()
  std::atomic<uint64_t> early_admits_{0}, admit_limit_waits_{0};  // see admit_counts()
  std::atomic<int64_t> last_sleep_ns_{0};   // steady_ns() of the last unpark (the late-wake count's clock)
  bool woke_late(uint64_t sleeps_before, int64_t poll_from_ns, int timeout_ms) const;
  std::atomic<bool> parked_{false};         // the progress thread leaves lane 0 to waiters (<= 1 ms)
  uint64_t frames_read_ = 0;                // under read_mu_ (lane 0): socket reads that got bytes
  bool write_some(int s);
  void write_pending();  // writes what it can of every non-empty queue
  int copies_timeout_ms(bool copies);  // the poll's timeout while get answers wait for copies (or not)
  std::chrono::steady_clock::time_point copies_since_{};  // progress thread: when that wait began
  uint64_t copies_seen_ = 0;                   // progress thread: answer_copies_done_ at that time
  std::atomic<uint64_t> answer_copies_done_{0};  // get answers' copies down seen complete (send_item)
  void read_some(int s);
  bool read_socket(int s, InConn& in, uint8_t* where, size_t want, size_t* done, uint8_t* then = nullptr,
                   size_t then_want = 0);
  bool advance(int s, InConn& in, const uint8_t* data, size_t n, size_t* used);
  void on_header(int s, InConn& in);
  void on_op_header(int s, InConn& in);
  void on_payload_done(int s, InConn& in);
  void on_get_request(int s, const wire::GetHeader& g);
  void on_get_answer(int s, InConn& in, uint64_t payload);
  bool on_ack(int s, const uint8_t* buf);
  void on_put_header(int s, InConn& in, uint64_t payload);
  void on_put_done(int s, InConn& in);  // lands a staged put's last bytes, then apply_put
  std::string land_rest(InConn& in);     // "" or why the put is refused (its staged bytes landed first)
  void stage_put(InConn& in, Window& w, uint64_t payload, const std::string& what);
  // The ring a payload of n bytes to device memory at `at` lands through: "" or why it cannot be had.
  std::string take_landing_ring(InConn& in, uint64_t n, uint8_t* at, int device);
  // Queues the copy up of the n bytes in the buffer being filled and makes the
  // next buffer ready (waiting for its earlier copy): "" or why they did not land.
  std::string land_on_device(InConn& in, uint64_t n);
  // Waits until every copy up of the payload is done: "" or why not.
  std::string wait_landed(InConn& in);
  static std::string landing_what(const InConn& in);  // what its copies up are, for errors
  static std::string op_words(const InConn& in);      // "a put of N bytes", for errors
  // A batch of staged writes (kPutBlocks, progress_blocks.cc): its list lands first; then every
  // block is checked against its window (nothing lands unless all pass) and its bytes land
  // through the staging ring, each full buffer scattered by one launch; one ack for the frame.
  void on_blocks_header(int s, InConn& in, uint64_t payload);
  uint8_t* blocks_spot(int s, InConn& in, size_t* want);
  uint8_t* host_blocks_spot(InConn& in, uint64_t received, size_t* want);
  uint8_t* ring_blocks_spot(InConn& in, uint64_t received, size_t* want);  // staged: through the ring
  std::string land_blocks_rest(InConn& in, uint64_t carried);  // "" or why its bytes did not land
  // "" or why the batch is refused; `land`: a batch of writes, whose landing ring it takes.
  std::string check_blocks(InConn& in, bool land);
  // A batch of staged reads (kGetBlocks): its list lands, then it is answered like a get, its
  // chunks gathered out of the windows by one launch each (or refused naming the bad block).
  void on_get_blocks_header(int s, InConn& in, uint64_t payload);
  void on_get_blocks_request(int s, InConn& in);
  void answer_blocks(int s, const wire::GetBlocksHeader& h, std::vector<Window*> windows,
                     std::shared_ptr<const ScatterList> places, std::shared_ptr<std::vector<uint64_t>> starts,
                     int device);
  // Queues a streamed answer (answer_streamed, answer_blocks) once its payload is set up.
  void queue_answer(int s, std::shared_ptr<cuda::StagedPayload> p, uint64_t req_id, uint64_t size);
  // Queues the scatter of the n bytes in the buffer being filled: one launch (or the driver's copies).
  cuda::SharedEvent scatter_blocks(InConn& in, uint64_t n);
  void on_blocks_done(int s, InConn& in);
  bool get_pending(uint64_t req_id) const;  // takes mu_
  void land_get_answer(int s, InConn& in);
  uint8_t* staging_spot(InConn& in, size_t* want);  // landing_spot() of a staged put
  // Tells the initiator its op `number` (0: applied_[s], a put) was refused.
  void refuse(int s, const std::string& why, uint64_t number = 0);
  void answer_get(int s, Window& w, const wire::GetHeader& g);
  // A get answer streamed out of w through a ring of chunks (StagedPayload, staged_answer.cc).
  void answer_streamed(int s, Window& w, const wire::GetHeader& g, const std::string& what);
  // Before a frame of slot s that changes memory or tells the application something (a put, a
  // message) is acted on, the answers to that slot not copied yet are copied whole.
  void snapshot_answers(int s);
  void on_refused(int s, InConn& in);
  // With mu_ held: throws InvalidArgument naming what a peer in [lo, hi) refused (and forgets it).
  void fail_if_refused(int lo, int hi, const char* doing);
  // Where the next payload bytes go (nullptr: discard), at most *want of them.
  uint8_t* landing_spot(int c, InConn& in, size_t* want);  // (c: its connection)
  // Commits memory for a message as its bytes arrive (a header alone commits
  // little); false when that allocation failed (in.refused says so).
  bool grow_message(InConn& in);
  void on_message_done(int s, InConn& in);
  void on_bye(int s, int peer);
  // Reads and handles frames of slot s; what throws fails that peer only.
  void read_guarded(int s);
  void write_guarded(int s);
  void complete(int peer, int ctx, uint64_t n);
  // Lazy acks. The target (its reader) acks at the end of a pass what a kAckReq or a put that
  // is not lazy asked for, and lazy puts applied kLazyAckNs ago or more; every pending one
  // once the mesh closes. The initiator asks (kAckReq) before it waits for lazy puts.
  static constexpr int64_t kLazyAckNs = 1000000;
  void send_acks();
  void note_applied(int s, bool lazy);  // the reader: an op of slot s was applied
  void request_acks(int lo, int hi);    // peers [lo, hi): kAckReq where lazy puts are unacked
  bool lazy_unrequested(int lo, int hi) const;  // with mu_ held: some slot of them needs a kAckReq
  // With mu_ held (lock): sends the kAckReqs peers [lo, hi) need, false when none (lock kept held).
  bool ask_for_acks(std::unique_lock<std::mutex>& lock, int lo, int hi);
  void flush_acks_before_bye();         // stop(): the reader sends every pending ack first
  void lose(int peer, const std::string& why);
  void drain_landings(int peer);  // the copies up of its (-1: every) gets into device memory ended
  void wait_landing_streams(const std::vector<int>& devices);  // bounded by timeout_s_, failures logged
  // With mu_ held: throws PeerLost, prefixed by `what`, when the peer is lost or closed.
  void fail_if_gone(int peer, const std::string& what) const;
  [[noreturn]] void fail_wait(int peer, const char* doing, const Deadline& deadline) const;
  std::string who() const { return "rank " + std::to_string(rank_) + ": "; }
  // One log line of this engine, in its words_ when it has them.
  void log(LogLevel level, const std::string& msg) const;
  Words words_;
  ArrivalHook arrival_;  // may be empty (a mesh's engine)
  void arrived() const {
    if (arrival_) arrival_();
  }

  int rank_, nranks_, ncontexts_;
  int total_;  // slots: nranks_ * ncontexts_
  int lanes_;  // connections per slot (Connections holds lanes_ * total_ of each kind)
  std::vector<uint64_t> stripe_seq_;      // per slot (initiator, under mu_): striped puts queued
  // Per slot (target): striped puts whose lane-0 part was read (the progress thread adds, lane
  // workers read: a stripe numbered above it waits). Per connection: the number of the last
  // stripe it landed (its worker stores, the progress thread reads: put n is whole once every
  // lane landed n).
  std::vector<std::atomic<uint64_t>> stripes_admitted_, lane_landed_;
  std::vector<uint64_t> lane_seq_;        // per connection (target, its thread): the last stripe read on it
  struct StripeRange {
    uint32_t win = 0;
    uint64_t off = 0, len = 0;
    bool operator==(const StripeRange& o) const { return win == o.win && off == o.off && len == o.len; }
  };
  std::vector<StripeRange> last_stripe_;  // per connection (its thread): the bytes of its last stripe
  // Per connection (its thread): its stripe covers other bytes than the one before it on that
  // lane; it then waits until every lane landed its stripe of the put before.
  std::vector<uint8_t> stripe_moved_;
  mutable std::vector<std::atomic<bool>> range_waits_;  // per slot: such a stripe waits (wake the lanes)
  std::vector<std::deque<HeldPut>> held_puts_;  // per slot (target, the reader), oldest first
  // Per slot (target, under mu_): the striped batch of writes admitted last (lane 0 sets it
  // before it admits the stripes; at most one is admitted and not applied: admits_early).
  std::vector<std::shared_ptr<const StripedBlocks>> striped_blocks_;
  std::vector<bool> lane0_held_;          // per slot (the reader): lane 0 stopped at a frame's op header
  // Per slot (the reader): lane 0's frame is the progress thread's (progress_poll.cc): a waiter
  // stopped at its op header (kLeftAtHeader: the progress thread acts on it next) or in its
  // payload, which the progress thread began (kLeftMidFrame: it reads it to its end).
  // left_count_: how many slots are so (waiters skip them, and the progress thread does not park
  // and waits for the read role meanwhile, saying so in role_wanted_, which keeps waiters from
  // taking it again); left_at_header_: those of the first kind.
  enum : uint8_t { kNotLeft = 0, kLeftAtHeader = 1, kLeftMidFrame = 2 };
  std::vector<uint8_t> left_to_progress_;
  std::atomic<int> left_count_{0}, left_at_header_{0};
  std::atomic<int64_t> left_since_ns_{0};  // when a frame left at its op header was last handed over
  std::atomic<bool> role_wanted_{false};
  uint64_t left_marks_ = 0;                 // (the reader) frames left so far
  bool left_frame_waited(int64_t poll_from_ns, int timeout_ms) const;
  bool device_payload(const InConn& in) const;
  bool progress_thread_frame(int s, const InConn& in);
  void mark_left(int s, uint8_t how);
  void clear_left(int s);
  bool leave_to_progress(int s, InConn& in);
  bool waiter_stops(int s, const InConn& in);
  bool take_back_left(int s, InConn& in);
  bool mailbox_full(int s) const;
  void forget_closed_left();
  std::vector<int> held_;                 // the reader: the slots with held puts
  // Striped traffic hands each put over between threads twice at the target (lane 0 admits its
  // stripes, the last stripe releases lane 0): for lane_spin_ns_ after each hand-off the threads
  // involved poll without sleeping, so the next one is seen in microseconds, not at a wake-up
  // (FLAGCX_MESH_TCP_LANE_SPIN_US; 0: off).
  int64_t lane_spin_ns_ = 0;
  std::atomic<int64_t> lane0_spin_until_ns_{0};  // the progress thread's (set by whoever holds the read role)
  bool lane_spinning(int64_t until_ns) const;
  // Per slot (target, under mu_): why a stripe was dropped, by its put's number (the first one).
  std::vector<std::map<uint64_t, std::string>> stripe_refused_;
  Connections* conns_;
  WindowTable* windows_;
  int wake_fd_ = -1;
  std::thread thread_;
  std::atomic<std::thread::id> progress_tid_{};  // the progress thread, once it runs
  std::atomic<bool> stopping_{false};

  // Get answers' buffers (streamed, see answer_streamed): bytes held now and the most at once.
  // Declared before the queues: the payloads in them count down when they go.
  std::atomic<uint64_t> answer_held_{0}, answer_peak_{0};
  mutable std::mutex mu_;  // queues, mailboxes, pending gets, lost_, open_answers_
  // Per slot: the answers queued to it that may still read their window (snapshot_answers).
  std::vector<std::vector<std::weak_ptr<cuda::StagedPayload>>> open_answers_;
  std::vector<std::unique_ptr<std::mutex>> write_mu_;  // per slot: one writer on a socket at a time
  std::condition_variable cv_;
  std::vector<std::deque<OutItem>> out_;
  std::vector<std::unique_ptr<InConn>> in_;
  std::vector<std::deque<Inbound>> mailbox_;
  std::vector<uint64_t> mailbox_bytes_;  // per slot: bytes waiting for recv()
  uint64_t max_unreceived_;
  double timeout_s_;
  struct PendingGet {
    int peer, ctx;
    uint8_t* dst;
    uint64_t len;
    int device;  // >= 0: dst is device memory, landed through the staging ring
    std::shared_ptr<const ScatterList> scatter;  // a batch of reads: where each block lands (dst: the first)
  };
  std::map<uint64_t, PendingGet> gets_;
  // Get credits, per (peer, ctx). A target copies each answer when it reads the request, so
  // answers in flight cost it memory: an initiator posts a get only while no get to that pair
  // is in flight or their bytes plus this one fit kMaxGetBytesInFlight, and a target queues
  // answers within the same bound (a peer that breaks it is lost: protocol error).
  std::vector<uint64_t> get_bytes_;     // per slot (initiator): bytes of gets not yet answered
  std::vector<uint64_t> answer_bytes_;  // per slot (target): bytes of answers queued to send
  void drop_get(std::map<uint64_t, PendingGet>::iterator* it);  // with mu_ held: erase, return credit
  // With mu_ held (lock): waits until a get of len bytes to slot s fits its credit, or fails.
  void wait_get_credit(std::unique_lock<std::mutex>& lock, int peer, int s, uint64_t len);
  bool take_answer_credit(int s, uint64_t size);  // target: false when the peer exceeds it
  // Held by the progress thread while it lands a get answer in the user's
  // buffer; lose() takes it, so once a get failed with PeerLost nothing lands.
  std::mutex landing_mu_;
  std::vector<uint8_t> discard_ = std::vector<uint8_t>(1 << 16);  // sink for dropped payloads (never read)
  uint64_t next_req_ = 1;
  std::vector<uint64_t> outstanding_;  // per slot: ops on an asynchronous path not yet complete
  std::vector<PathKind> in_flight_kind_;  // per slot: the path they are on (one at a time)
  std::vector<uint64_t> acks_due_;     // per slot: puts not yet acknowledged (gets are answered)
  std::vector<std::string> refused_;   // per peer: ops refused or failed that nobody was told of yet
  std::vector<uint8_t> refused_lost_;  // per peer: the first of those failed with the peer's loss (PeerLost)
  std::vector<uint64_t> queued_msg_;   // per slot: message bytes waiting to be written
  std::vector<uint64_t> applied_;      // per slot: ops from that peer applied here
  std::vector<uint64_t> acked_out_;    // per slot: applied count last acked
  std::vector<uint64_t> acked_in_;     // per slot: ack received from that peer
  std::vector<uint64_t> lazy_unreq_;   // per slot (initiator, under mu_): lazy puts queued since its last kAckReq
  std::vector<uint8_t> ack_now_;       // per slot (target, its reader): an ack is due (kAckDue) or asked for (kAckAsked)
  static constexpr uint8_t kAckDue = 1;    // sent when something new was applied
  static constexpr uint8_t kAckAsked = 2;  // a kAckReq: sent even when nothing new was (the peer pings)
  std::vector<int64_t> lazy_since_;    // per slot (target, its reader): when its oldest unacked lazy put was applied (0: none)
  std::vector<uint64_t> acks_heard_;   // per peer (initiator, under mu_): kAck frames read from it
  std::atomic<int> lazy_pending_{0};   // (target, its reader): slots with lazy_since_ set
  std::atomic<bool> closing_{false};   // stop() began: every pending ack goes at once
  bool acks_flushed_ = false;          // under mu_: the reader sent them, after closing_ was set
  std::vector<std::string> lost_;      // per peer
  std::vector<bool> bye_conn_;         // per slot: kBye arrived on that connection
  std::vector<int> bye_count_;         // per peer: connections that said goodbye
  std::vector<bool> bye_;              // per peer: goodbye on every connection (all
                                       // its earlier frames have been processed)
  std::vector<std::atomic<uint64_t>> issued_, done_;  // per peer
  std::atomic<uint64_t> completed_all_{0};
  std::atomic<int64_t> stream_ops_{0};
  std::mutex probe_mu_;  // after mu_, never while holding it
  struct Probed {
    std::unique_ptr<CompletionProbe> probe;
    uint64_t ops;  // completing together
  };
  std::vector<std::deque<Probed>> probes_;  // per slot
  std::atomic<int64_t> probes_pending_{0};
  // One step of a waiter: polls probes, yields or sleeps, paced by `pace` (one per wait).
  void wait_or_poll(std::unique_lock<std::mutex>& lock, const Deadline& deadline, const Backoff& pace);
  bool settle_probes(std::unique_lock<std::mutex>& lock);
  // Threads in flush / wait_counter: while none, count_inline neither locks
  // mu_ nor notifies (each waiter counts itself before testing the counters).
  std::atomic<int> count_waiters_{0};
};

}  // namespace fxm
