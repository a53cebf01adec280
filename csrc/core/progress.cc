#include "core/progress.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/env.h"
#include "base/log.h"
#include "base/thread_name.h"
#include "core/progress_items.h"
#include "transport/byte_ranges.h"
#include "transport/cuda/streams.h"
#include "transport/signal_ops.h"
#include "base/status.h"

namespace fxm {

using wire::FrameType;

namespace {

void replace_all(std::string* s, const std::string& from, const std::string& to) {
  for (size_t at = s->find(from); at != std::string::npos; at = s->find(from, at + to.size())) {
    s->replace(at, from.size(), to);
  }
}

}  // namespace

std::string said_of_pair(std::string msg, const std::string& peer) {
  if (msg.rfind("rank 0: ", 0) == 0) msg.erase(0, 8);
  replace_all(&msg, " (ctx 0)", "");
  replace_all(&msg, "peer 0 closed its mesh", peer + " closed the connection");
  replace_all(&msg, "closed its mesh", "closed the connection");
  replace_all(&msg, "peer 0", peer);
  return msg;
}

void Engine::log(LogLevel level, const std::string& msg) const {
  if (words_.self.empty()) return log_line(level, rank_, msg);
  log_line(level, -1, words_.self + said_of_pair(msg, words_.peer0));
}

Engine::Engine(int rank, int nranks, int ncontexts, Connections* conns, WindowTable* windows,
               uint64_t max_unreceived, double timeout_s, Words words, ArrivalHook arrival)
    : words_(std::move(words)), arrival_(std::move(arrival)), rank_(rank), nranks_(nranks), ncontexts_(ncontexts), total_(nranks * ncontexts),
      lanes_(std::max<int>(1, static_cast<int>(conns->send.size()) / std::max(1, nranks * ncontexts))),
      stripe_seq_(total_), stripes_admitted_(total_), lane_landed_(total_ * lanes_), lane_seq_(total_ * lanes_),
      last_stripe_(total_ * lanes_), stripe_moved_(total_ * lanes_), range_waits_(total_), held_puts_(total_), striped_blocks_(total_),
      lane0_held_(total_), left_to_progress_(total_), stripe_refused_(total_), conns_(conns), windows_(windows), open_answers_(total_),
      out_(nranks * ncontexts * lanes_), mailbox_(nranks * ncontexts), mailbox_bytes_(nranks * ncontexts),
      max_unreceived_(max_unreceived), timeout_s_(timeout_s), outstanding_(nranks * ncontexts), acks_due_(nranks * ncontexts),
      in_flight_kind_(nranks * ncontexts, PathKind::kTcp), probes_(nranks * ncontexts), refused_(nranks), refused_lost_(nranks),
      queued_msg_(nranks * ncontexts), get_bytes_(nranks * ncontexts), answer_bytes_(nranks * ncontexts),
      applied_(nranks * ncontexts), acked_out_(nranks * ncontexts), acked_in_(nranks * ncontexts),
      lazy_unreq_(nranks * ncontexts), ack_now_(nranks * ncontexts), lazy_since_(nranks * ncontexts),
      acks_heard_(nranks), lost_(nranks), bye_conn_(nranks * ncontexts * lanes_), bye_count_(nranks), bye_(nranks), issued_(nranks),
      done_(nranks) {
  for (int s = 0; s < total_ * lanes_; ++s) {
    in_.push_back(std::make_unique<InConn>());
    write_mu_.push_back(std::make_unique<std::mutex>());
  }
  if (lanes_ > 1) lane_spin_ns_ = int64_t{tcp_lane_spin_us_env()} * 1000;  // before any thread starts
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) fail(Code::kSystem, -1, errno, who() + "eventfd for the progress thread");
  try {
    start_lane_workers();
    thread_ = std::thread([this] {
      name_this_thread("fxm-progress");
      run();
    });
  } catch (...) {
    stopping_ = true;
    join_lane_workers();
    ::close(wake_fd_);
    throw;
  }
}

Engine::~Engine() {
  stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Engine::wake() {
  uint64_t one = 1;
  ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  (void)n;
}

void Engine::enqueue(int s, OutItem&& item, Count counted) {
  bool idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    int peer = s / ncontexts_;
    if (counted != Count::kNone) {  // before any byte leaves: the ack may come back at once
      ++outstanding_[s];
      in_flight_kind_[s] = PathKind::kTcp;
      if (counted == Count::kPut || counted == Count::kLazyPut) ++acks_due_[s];
      if (counted == Count::kLazyPut) ++lazy_unreq_[s];
      issued_[peer].fetch_add(1);
    }
    idle = out_[s].empty();
    if (!idle) out_[s].push_back(std::move(item));
  }
  if (idle && send_direct(s, item)) return;
  // The progress thread queues only from poll_once(), whose write_pending() sends it before the next
  // poll: waking itself through the eventfd would cost a write and an extra pass for nothing.
  if (!owns_conn(s)) wake_conn(s);
}

bool Engine::send_direct(int s, OutItem& item) {
  std::unique_lock<std::mutex> writer(*write_mu_[s], std::try_to_lock);
  if (!writer.owns_lock() || owns_conn(s)) {
    std::lock_guard<std::mutex> lock(mu_);
    out_[s].push_back(std::move(item));
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!out_[s].empty()) {  // someone queued meanwhile: keep the order
      out_[s].push_back(std::move(item));
      return false;
    }
  }
  ssize_t n = send_item(s, item);
  if (n >= 0 && item.sent == item.total()) return true;
  if (n < 0) {  // the connection failed (the peer is lost): the item is not queued, so a filler
    // waiting for its ring slots learns it here, not at its deadline
    if (item.staged) item.staged->cancel("its connection is gone: " + lost_reason(peer_of(s)));
    return false;
  }
  std::lock_guard<std::mutex> lock(mu_);
  out_[s].push_front(std::move(item));  // started on the wire: it goes first
  return false;
}

namespace {

// The iovecs of a staged payload's ready bytes from offset `off`, after the n already in iov.
int staged_iov(const cuda::StagedPayload& p, uint64_t off, iovec* iov, int n, int max) {
  while (n < max && off < p.len()) {
    uint64_t got = 0;
    const uint8_t* at = p.bytes_at(off, &got);
    if (got == 0) break;
    iov[n++] = {const_cast<uint8_t*>(at), got};
    off += got;
  }
  return n;
}

// The pieces of a gathered payload (OutItem::gather) from piece `at`, byte `off` of it on, after
// the n already in iov.
int gather_iov(const ScatterList& pieces, size_t at, uint64_t off, iovec* iov, int n, int max) {
  for (size_t k = at; n < max && k < pieces.size(); ++k, off = 0) {
    if (pieces[k].second > off) iov[n++] = {pieces[k].first + off, pieces[k].second - off};
  }
  return n;
}

}  // namespace

ssize_t Engine::send_item(int s, OutItem& it) {
  if (!it.gather.empty()) return send_gather_item(s, it);
  constexpr int kMaxIov = 8;
  iovec iov[kMaxIov];
  int n = 0;
  uint64_t hs = it.head.size();
  if (it.sent < hs) iov[n++] = {it.head.data() + it.sent, hs - it.sent};
  uint64_t off = it.sent > hs ? it.sent - hs : 0;
  if (it.staged) {
    it.staged->copy_ahead();  // a get answer's next chunks, into the ring slots sent already
    if (it.sent == 0 && it.staged->failed()) return 0;  // not started: write_some() refuses it instead
    if (it.staged->copies_pending() && it.staged->poll_copies()) {  // a get answer's chunks coming down
      answer_copies_done_.fetch_add(1, std::memory_order_relaxed);
    }
    n = staged_iov(*it.staged, off, iov, n, kMaxIov);
  } else if (it.len > 0) {
    iov[n++] = {const_cast<uint8_t*>(it.data) + off, it.len - off};
  }
  if (n == 0) return 0;  // staged bytes not copied yet
  ssize_t w = send_iov(s, iov, n);
  if (w > 0) {
    it.sent += static_cast<uint64_t>(w);
    if (it.staged && it.sent >= hs) it.staged->sent_to(it.sent - hs);  // frees ring slots for the filler
  }
  return w;
}

// One non-blocking sendmsg of iov[0..n) on slot s: the bytes sent, 0 when the socket is full,
// -1 when the connection failed (the peer is then lost).
ssize_t Engine::send_iov(int s, iovec* iov, int n) {
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = n;
  while (true) {
    ssize_t w = ::sendmsg(conns_->send[s].get(), &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w >= 0) return w;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    lose(peer_of(s), "writing to its connection" + conn_name(s) + " failed: " + errno_text(errno));
    return -1;
  }
}

// A batch of host writes: its headers and list, then its blocks' bytes straight out of their
// places, kGatherIov pieces a system call at most.
ssize_t Engine::send_gather_item(int s, OutItem& it) {
  iovec iov[kGatherIov];
  int n = 0;
  uint64_t hs = it.head.size();
  if (it.sent < hs) iov[n++] = {it.head.data() + it.sent, hs - it.sent};
  n = gather_iov(it.gather, it.gather_at, it.gather_off, iov, n, kGatherIov);
  ssize_t w = send_iov(s, iov, n);
  if (w > 0) {
    uint64_t head_part = it.sent < hs ? std::min<uint64_t>(hs - it.sent, static_cast<uint64_t>(w)) : 0;
    advance_pieces(it.gather, &it.gather_at, &it.gather_off, static_cast<uint64_t>(w) - head_part);
    it.sent += static_cast<uint64_t>(w);
  }
  return w;
}

// The plain frames queued behind the front item of slot s (with mu_ held): sent with it in one
// sendmsg (a batch of small puts costs a system call per kGatherIov / 2 frames, not per frame).
void Engine::gather_behind(int s, std::vector<OutItem*>* items) {
  const std::deque<OutItem>& q = out_[s];
  if (q.size() < 2 || !q.front().plain()) return;
  uint64_t bytes = q.front().total() - q.front().sent;
  items->push_back(&out_[s].front());
  for (size_t k = 1; k < q.size() && 2 * items->size() + 2 <= kGatherIov && bytes < kGatherBytes; ++k) {
    if (!q[k].plain()) break;
    bytes += q[k].total();
    items->push_back(&out_[s][k]);
  }
  if (items->size() == 1) items->clear();
}

// One sendmsg of what is left of items[0] and the items after it (plain ones, none started).
ssize_t Engine::send_gathered(int s, const std::vector<OutItem*>& items) {
  iovec iov[kGatherIov];
  int n = 0;
  for (OutItem* it : items) {
    uint64_t hs = it->head.size();
    if (it->sent < hs) iov[n++] = {it->head.data() + it->sent, hs - it->sent};
    uint64_t off = it->sent > hs ? it->sent - hs : 0;
    if (it->len > off) iov[n++] = {const_cast<uint8_t*>(it->data) + off, it->len - off};
  }
  ssize_t w = send_iov(s, iov, n);
  if (w <= 0) return w;
  uint64_t left = static_cast<uint64_t>(w);
  for (OutItem* it : items) {  // the bytes sent, item by item
    uint64_t step = std::min(left, it->total() - it->sent);
    it->sent += step;
    left -= step;
  }
  return w;
}

void Engine::post_put(int peer, int ctx, const uint8_t* src, uint64_t len, uint32_t dst_win,
                      uint64_t dst_off, const SignalSpec& sig, bool may_stripe) {
  if (may_stripe && lanes_ > 1 && len >= kStripeMinBytes) return post_striped(peer, ctx, src, len, dst_win, dst_off, sig);
  wire::PutHeader h = put_header(dst_win, dst_off, sig);
  if (sig.on) h.flags |= wire::kPutLazyAck;  // its target learns of it through the signal
  OutItem it{frame(FrameType::kPut, &h, len), src, len, 0, 0};
  enqueue(slot(peer, ctx), std::move(it), sig.on ? Count::kLazyPut : Count::kPut);
}

void Engine::post_put_staged(int peer, int ctx, std::shared_ptr<cuda::StagedPayload> payload, uint32_t dst_win,
                             uint64_t dst_off, const SignalSpec& sig) {
  wire::PutHeader h = put_header(dst_win, dst_off, sig);
  uint64_t len = payload->len();
  OutItem it{frame(FrameType::kPut, &h, len), nullptr, len, 0, 0};
  payload->set_waker([this] { wake(); });  // each chunk copied: the progress thread sends it
  it.staged = std::move(payload);           // sent from its ring, freed with the item
  enqueue(slot(peer, ctx), std::move(it), Count::kPut);
}

// Whether no two blocks land on each other's bytes (one sort: a request's KV never does). A batch
// whose blocks do keeps to lane 0, where they land in list order and the later one wins.
bool Engine::lands_disjoint(const std::vector<wire::BlockEntry>& blocks) {
  std::vector<ByteSpan> spans;
  spans.reserve(blocks.size());
  for (const wire::BlockEntry& b : blocks) {
    uint64_t at = window_key(b.win, b.off);
    spans.push_back({at, at + b.len, true});
  }
  return !any_conflict(spans);
}

// A kPutBlocks frame's item: its headers and block list (the list goes with the headers, before
// `carried` of the blocks' `bytes`, which the caller attaches as its payload: all of them, or
// lane 0's part of a batch striped over the lanes, `flags` saying so).
Engine::OutItem Engine::blocks_item(const std::vector<wire::BlockEntry>& blocks, uint64_t bytes, uint64_t carried,
                                    uint32_t flags) {
  wire::BlocksHeader h;
  h.count = static_cast<uint32_t>(blocks.size());
  h.flags = flags;
  h.bytes = bytes;
  uint64_t list = blocks.size() * sizeof(wire::BlockEntry);
  OutItem it{frame(FrameType::kPutBlocks, &h, list + carried), nullptr, carried, 0, 0};
  const uint8_t* raw = reinterpret_cast<const uint8_t*>(blocks.data());
  it.head.insert(it.head.end(), raw, raw + list);
  return it;
}

void Engine::post_put_blocks(int peer, int ctx, std::vector<std::shared_ptr<cuda::StagedPayload>> parts,
                             std::vector<wire::BlockEntry> blocks) {
  uint64_t bytes = 0;
  for (const auto& p : parts) bytes += p->len();
  if (parts.size() > 1) {  // each part sent by its lane's thread, which its filler wakes
    bool fits = stripes(bytes) == static_cast<int>(parts.size());
    for (size_t k = 0; fits && k < parts.size(); ++k) {
      fits = parts[k]->len() == (k == 0 ? wire::stripe_first(bytes, lanes_) : wire::stripe_part(bytes, lanes_));
    }
    if (!fits) {  // (checked before anything is queued)
      fail(Code::kInternal, peer, 0, who() + "a striped batch of staged writes cut in " + std::to_string(parts.size()) +
                                         " parts of other sizes than its " + std::to_string(lanes_) + " lanes take");
    }
    return post_striped_blocks(peer, ctx, blocks, bytes, [&](OutItem* item, int k, uint64_t, uint64_t) {
      parts[k]->set_waker([this, k] { wake_lane(k); });
      item->staged = parts[k];
    });
  }
  OutItem it = blocks_item(blocks, bytes, bytes);
  parts.at(0)->set_waker([this] { wake(); });
  it.staged = std::move(parts[0]);
  enqueue(slot(peer, ctx), std::move(it), Count::kPut);
}

void Engine::post_put_host_blocks(int peer, int ctx, std::vector<wire::BlockEntry> blocks, ScatterList sources) {
  uint64_t bytes = 0;
  for (const wire::BlockEntry& b : blocks) bytes += b.len;
  if (stripes(bytes) > 1 && lands_disjoint(blocks)) {  // its parts land at once: no block may land on another's bytes
    return post_striped_blocks(peer, ctx, blocks, bytes, [&](OutItem* item, int, uint64_t at, uint64_t n) {
      item->gather = slice_pieces(sources, at, n);
    });
  }
  OutItem it = blocks_item(blocks, bytes, bytes);
  it.gather = std::move(sources);
  enqueue(slot(peer, ctx), std::move(it), Count::kPut);
}

void Engine::post_get_blocks(int peer, int ctx, std::vector<wire::BlockEntry> blocks,
                             std::shared_ptr<const ScatterList> into, int device) {
  wire::GetBlocksHeader h;
  h.count = static_cast<uint32_t>(blocks.size());
  for (const wire::BlockEntry& b : blocks) h.bytes += b.len;
  int s = slot(peer, ctx);
  {
    std::unique_lock<std::mutex> lock(mu_);
    wait_get_credit(lock, peer, s, h.bytes);
    get_bytes_[s] += h.bytes;
    h.req_id = next_req_++;
    gets_[h.req_id] = {peer, ctx, into->front().first, h.bytes, device, std::move(into)};
  }
  uint64_t list = blocks.size() * sizeof(wire::BlockEntry);
  OutItem it{frame(FrameType::kGetBlocks, &h, list), nullptr, 0, 0, 0};
  const uint8_t* raw = reinterpret_cast<const uint8_t*>(blocks.data());
  it.head.insert(it.head.end(), raw, raw + list);
  enqueue(s, std::move(it), Count::kGet);
}

bool Engine::waiting_for_staging(int s) const {
  if (out_[s].empty() || !out_[s].front().staged) return false;
  return out_[s].front().staged->waiting_for_bytes();
}

// An answer whose chunks could not be staged before any byte of it went: a refusal of its get
// takes its place in the queue (the pair stays usable; the initiator's flush names why).
void Engine::refuse_unsent_answer(int s) {
  OutItem failed;  // dies after mu_ is released (its payload's buffers go back to the pool)
  std::lock_guard<std::mutex> lock(mu_);
  OutItem& front = out_[s].front();
  std::string why = "a get of " + std::to_string(front.answer_bytes) + " bytes: staging its answer failed: " +
                    front.staged->failure();
  FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, "refused " + why + " from peer " + std::to_string(peer_of(s)));
  answer_bytes_[s] -= front.answer_bytes;  // the credit taken for it
  failed = std::move(front);
  front = refusal(wire::kRefusedGet | failed.answer_id, why);
}

void Engine::give_up_frame(int s, const OutItem& item) {
  int peer = peer_of(s);  // (s: any lane's connection; a striped batch's parts are staged on every lane)
  lose(peer, std::string(item.answer_bytes > 0 ? "the answer to a get" : "a staged put") + " of " +
                 std::to_string(item.len) + " bytes could not be copied out of its window (" + item.staged->failure() +
                 ") after its frame started: the connection was shut");
  ::shutdown(conns_->send[s].get(), SHUT_WR);  // the peer sees the frame cut short, never a partial put applied
}

void Engine::post_get(int peer, int ctx, uint32_t src_win, uint64_t src_off, uint8_t* dst,
                      uint64_t len, int dst_device) {
  wire::GetHeader g;
  g.src_win = src_win;
  g.src_off = src_off;
  g.size = len;
  int s = slot(peer, ctx);
  {
    std::unique_lock<std::mutex> lock(mu_);
    wait_get_credit(lock, peer, s, len);
    get_bytes_[s] += len;
    g.req_id = next_req_++;
    gets_[g.req_id] = {peer, ctx, dst, len, dst_device, nullptr};
  }
  enqueue(s, {frame(FrameType::kGetReq, &g, 0), nullptr, 0, 0, 0}, Count::kGet);
}

void Engine::wait_get_credit(std::unique_lock<std::mutex>& lock, int peer, int s, uint64_t len) {
  Deadline deadline = Deadline::after_seconds(env_config().timeout_s);
  while (get_bytes_[s] > 0 && get_bytes_[s] + len > kMaxGetBytesInFlight) {
    std::string what = who() + "get of " + std::to_string(len) + " bytes from peer " + std::to_string(peer);
    if (stopping_) fail(Code::kClosed, peer, 0, what + ": the mesh was closed");
    fail_if_gone(peer, what + ": ");
    if (deadline.expired()) {
      fail(Code::kTimeout, peer, 0, what + ": timed out waiting for " + std::to_string(get_bytes_[s]) +
                                        " bytes of earlier gets to be answered (is the peer progressing?)");
    }
    cv_.wait_until(lock, deadline.min(Deadline::after_seconds(0.1)).at());
  }
}

void Engine::drop_get(std::map<uint64_t, PendingGet>::iterator* it) {
  get_bytes_[slot((*it)->second.peer, (*it)->second.ctx)] -= (*it)->second.len;
  *it = gets_.erase(*it);
  cv_.notify_all();
}


void Engine::post_message(int peer, int ctx, const void* data, uint64_t len, const Deadline& deadline) {
  int s = slot(peer, ctx);
  if (len > kMaxMessageBytes) {
    fail(Code::kInvalidArgument, peer, 0, who() + "send to peer " + std::to_string(peer) + ": " +
                                              std::to_string(len) + " bytes exceed the message limit of " +
                                              std::to_string(kMaxMessageBytes) + " (use a window and put)");
  }
  OutItem it{frame<wire::PutHeader>(FrameType::kMessage, nullptr, len), nullptr, 0, 0, len};
  const uint8_t* p = static_cast<const uint8_t*>(data);
  it.head.insert(it.head.end(), p, p + len);
  std::unique_lock<std::mutex> lock(mu_);
  auto what = [&] {  // (words made only for an error: a notification's hot path)
    return who() + "send to peer " + std::to_string(peer) + " (ctx " + std::to_string(ctx) + ")";
  };
  while (queued_msg_[s] > 0 && queued_msg_[s] + len > kMaxQueuedMessageBytes) {
    if (!lost_[peer].empty() || bye_[peer] || stopping_) break;
    if (deadline.expired()) {
      fail(Code::kTimeout, peer, 0, what() + ": timed out waiting for " + std::to_string(queued_msg_[s]) +
                                        " queued bytes to drain (is the peer receiving?)");
    }
    cv_.wait_until(lock, deadline.min(Deadline::after_seconds(0.1)).at());
  }
  if (stopping_) fail(Code::kClosed, peer, 0, what() + ": the mesh was closed");
  if (!lost_[peer].empty() || bye_[peer]) fail_if_gone(peer, what() + ": ");
  queued_msg_[s] += len;
  bool idle = out_[s].empty();
  if (!idle) out_[s].push_back(std::move(it));
  lock.unlock();
  if (idle && send_direct(s, it)) {  // written by this thread, as a put's frame is: no wake-up on the way
    std::lock_guard<std::mutex> sent(mu_);
    queued_msg_[s] -= len;
    cv_.notify_all();
    return;
  }
  wake();
}

std::vector<uint8_t> Engine::recv_message(int peer, int ctx, const Deadline& deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  auto& box = mailbox_[slot(peer, ctx)];
  while (box.empty()) {
    if (stopping_) fail(Code::kClosed, peer, 0, who() + "recv: the mesh was closed");
    if (!lost_[peer].empty() || bye_conn_[slot(peer, ctx)]) break;  // nothing more will come
    if (deadline.expired()) break;
    unpark();
    cv_.wait_until(lock, deadline.min(Deadline::after_seconds(0.1)).at());
  }
  std::vector<uint8_t> m;
  if (pop_message(peer, ctx, &m)) return m;
  fail_if_no_more_messages(peer, ctx);
  fail(Code::kTimeout, peer, 0, who() + "recv from peer " + std::to_string(peer) + " (ctx " + std::to_string(ctx) +
                                    "): timed out");
}

bool Engine::try_recv_message(int peer, int ctx, std::vector<uint8_t>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pop_message(peer, ctx, out)) return true;
  if (stopping_) fail(Code::kClosed, peer, 0, who() + "recv: the mesh was closed");
  fail_if_no_more_messages(peer, ctx);
  return false;
}

// (mu_ held) The next message of (peer, ctx) into *out, if one is there.
bool Engine::pop_message(int peer, int ctx, std::vector<uint8_t>* out) {
  auto& box = mailbox_[slot(peer, ctx)];
  if (box.empty()) return false;
  Inbound m = std::move(box.front());
  box.pop_front();
  uint64_t& queued = mailbox_bytes_[slot(peer, ctx)];
  bool was_paused = queued >= max_unreceived_;
  queued -= m.bytes.size();
  if (was_paused && queued < max_unreceived_) wake();  // resume reading that connection
  if (!m.dropped.empty()) {
    fail(Code::kSystem, peer, ENOMEM, who() + "recv from peer " + std::to_string(peer) + ": it sent " + m.dropped +
                                          "; the message was dropped here");
  }
  *out = std::move(m.bytes);
  return true;
}

// (mu_ held, the mailbox empty) PeerLost when nothing more will come from (peer, ctx).
void Engine::fail_if_no_more_messages(int peer, int ctx) {
  if (lost_[peer].empty() && !bye_conn_[slot(peer, ctx)]) return;
  std::string what = who() + "recv from peer " + std::to_string(peer) + " (ctx " + std::to_string(ctx) + ")";
  if (!lost_[peer].empty()) fail(Code::kPeerLost, peer, 0, what + ": " + lost_[peer]);
  fail(Code::kPeerLost, peer, 0, what + ": peer " + std::to_string(peer) + " closed its mesh");
}


std::string Engine::lost_reason(int peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_[peer];
}

int Engine::first_lost_peer() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (int p = 0; p < nranks_; ++p) {
    if (!lost_[p].empty()) return p;
  }
  return -1;
}


void Engine::lose(int peer, const std::string& why) {
  if (peer < 0 || peer >= nranks_) {  // (a connection's index taken for a peer's: never written past the end;
    // said, not thrown: lose() runs in handlers that must not throw)
    FXM_ENGINE_LOG(::fxm::LogLevel::kError, "internal error: losing peer " + std::to_string(peer) + " of " +
                                               std::to_string(nranks_) + " (ignored): " + why);
    return;
  }
  {
    // No get answer is landing once this returns (the reader lands under
    // landing_mu_ and, between reads, finds the get gone).
    std::unique_lock<std::mutex> landing(landing_mu_, std::defer_lock);
    if (!t_landing) landing.lock();  // else this thread lands: it read the close mid-answer
    drain_landings(peer);
    std::lock_guard<std::mutex> lock(mu_);
    if (!lost_[peer].empty() || bye_[peer]) return;
    lost_[peer] = why;  // its queues are dropped by write_some(), which owns them
    for (auto it = gets_.begin(); it != gets_.end();) {
      if (it->second.peer == peer) drop_get(&it);
      else ++it;
    }
  }
  if (!stopping_) FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, "peer " + std::to_string(peer) + " lost: " + why);
  cv_.notify_all();
  arrived();
  if (lanes_ > 1) {
    // One lane's failure is seen here only: the peer's other lanes may wait for this rank's
    // lane 0 (a stripe for its first part, or the reverse), which sends nothing more now. Its
    // reads of every connection from this rank then end (its frames sent so far first), and it
    // loses this rank in turn rather than waiting out its timeout.
    for (int c = base_slot(slot(peer, 0)); c < total_ * lanes_; c += total_) {
      for (int ctx = 0; ctx < ncontexts_; ++ctx) ::shutdown(conns_->send[c + ctx].get(), SHUT_WR);
    }
  }
  wake_lanes();  // their queues to that peer are dropped (write_some)
}

// A get into device memory returns before its answer landed (StagedPath::get): its wait learns of
// a loss (lost_) or the close (stopping_), so the copies up its answer's chunks queued must end
// first, or one would write into memory its caller took back on the error. Called with
// landing_mu_ held (no copy is queued meanwhile); waits for the landing streams (shared by the
// process: other connections' copies on them too), all within the engine's timeout, a failure
// logged (the loss is what to report).
void Engine::drain_landings(int peer) {
  std::vector<int> devices;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (peer >= 0 && (!lost_[peer].empty() || bye_[peer])) return;
    for (const auto& [id, g] : gets_) {
      if ((peer < 0 || g.peer == peer) && g.device >= 0 &&
          std::find(devices.begin(), devices.end(), g.device) == devices.end()) {
        devices.push_back(g.device);
      }
    }
  }
  wait_landing_streams(devices);
}

void Engine::wait_landing_streams(const std::vector<int>& devices) {
  Deadline deadline = Deadline::after_seconds(timeout_s_);
  for (int d : devices) {
    try {
      cuda::wait_for_stream(d, cuda::landing_stream(d), deadline, "the copies up of gets failed or closed");
    } catch (const Error& e) {
      FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, e.what());
    }
  }
}

// Before the close is told to the gets' waiters: the copies up of the answers landing now end
// and those gets are dropped (the reader, if it reads on, finds them gone and lands nothing).
void Engine::settle_device_gets() {
  std::unique_lock<std::mutex> landing(landing_mu_);
  drain_landings(-1);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = gets_.begin(); it != gets_.end();) {
    if (it->second.device >= 0) drop_get(&it);
    else ++it;
  }
}

// The thread never ends before stop(): what a peer's frames throw fails that
// peer (read_guarded, write_guarded); anything else is logged and retried.
void Engine::run() {
  LogSpeaker speaker(words_.self);  // an agent connection's engine: its agent speaks ("" for a mesh)
  progress_tid_.store(std::this_thread::get_id());
  while (!stopping_) {
    try {
      poll_once();
    } catch (const std::exception& e) {  // never std::terminate the application
      FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, std::string("progress thread: ") + e.what() + " (retrying)");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

void Engine::read_guarded(int s) {
  try {
    read_some(s);
  } catch (const std::exception& e) {
    in_[s]->closed = true;  // its frame is half read: nothing more can be read from it
    lose(peer_of(s), std::string("handling its frames") + conn_name(s) + " failed: " + e.what());
  }
}

void Engine::write_guarded(int s) {
  try {
    write_some(s);
  } catch (const std::exception& e) {
    lose(peer_of(s), std::string("writing its frames") + conn_name(s) + " failed: " + e.what());
  }
}

void Engine::write_pending() {
  int total = total_;  // lane 0
  for (int s = 0; s < total; ++s) {
    bool pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending = !out_[s].empty();
    }
    if (pending) write_guarded(s);
  }
}

// Items leave the queue under mu_ but die after it is released: an owned
// payload's deleter may call the CUDA driver (a staging buffer unregistered),
// which can wait for a host function that needs mu_ (Engine::completed).
bool Engine::write_some(int s) {
  std::lock_guard<std::mutex> writer(*write_mu_[s]);
  while (true) {
    OutItem* it = nullptr;
    std::vector<OutItem*> gathered;  // it and the frames sent with it (gather_behind)
    std::deque<OutItem> dropped;  // declared before the lock: destroyed after it is released
    std::string gone_why;
    {
      std::lock_guard<std::mutex> lock(mu_);
      int peer = peer_of(s);
      if (!lost_[peer].empty() || bye_[peer]) {  // nothing more goes to a lost/closed peer
        dropped.swap(out_[s]);
        if (s < total_) queued_msg_[s] = answer_bytes_[s] = 0;
        gone_why = lost_[peer].empty() ? "it closed its mesh" : lost_[peer];
        cv_.notify_all();
      }
      if (!out_[s].empty()) it = &out_[s].front();
      if (it != nullptr) gather_behind(s, &gathered);
    }
    for (OutItem& gone : dropped) {  // a filler waiting for ring slots fails now, naming the peer
      if (gone.staged) gone.staged->cancel("its connection is gone: " + gone_why);
    }
    if (it == nullptr) return true;
    if (it->staged && it->staged->failed() && it->sent == 0 && it->answer_bytes > 0) {
      refuse_unsent_answer(s);
      continue;
    }
    if (it->staged && it->staged->failed()) {
      give_up_frame(s, *it);
      continue;  // the next pass drops the queue
    }
    if (!gathered.empty()) {
      if (send_gathered(s, gathered) < 0) return false;
      if (!pop_sent(s)) return true;  // the socket is full
      continue;
    }
    ssize_t w = send_item(s, *it);
    if (w < 0) return false;
    // A streamed answer that sent every byte it had copied copies on (its ring slots are free)
    // while the socket takes more; else the socket is full: wait for POLLOUT.
    if (it->sent < it->total() && w > 0 && it->answer_bytes > 0 && !it->staged->waiting_for_bytes()) continue;
    if (it->sent < it->total()) return true;
    OutItem done;
    std::lock_guard<std::mutex> lock(mu_);
    queued_msg_[base_slot(s)] -= it->msg_bytes;  // lanes > 0 carry neither
    answer_bytes_[base_slot(s)] -= it->answer_bytes;
    bool notify = stopping_ || it->msg_bytes > 0 || out_[s].size() == 1;
    done = std::move(out_[s].front());
    out_[s].pop_front();
    if (notify) cv_.notify_all();
  }
}


// After send_gathered: the items sent whole leave the queue; true when all of those gathered did.
bool Engine::pop_sent(int s) {
  std::deque<OutItem> done;  // destroyed after mu_ is released (see write_some)
  std::lock_guard<std::mutex> lock(mu_);
  while (!out_[s].empty() && !out_[s].front().staged && out_[s].front().sent == out_[s].front().total()) {
    OutItem& it = out_[s].front();
    queued_msg_[base_slot(s)] -= it.msg_bytes;
    answer_bytes_[base_slot(s)] -= it.answer_bytes;
    done.push_back(std::move(it));
    out_[s].pop_front();
  }
  bool whole = out_[s].empty() || out_[s].front().sent == 0;
  if (stopping_ || out_[s].empty() || std::any_of(done.begin(), done.end(), [](const OutItem& d) { return d.msg_bytes > 0; })) {
    cv_.notify_all();
  }
  return whole && !done.empty();
}

void Engine::note_applied(int s, bool lazy) {
  ++applied_[s];
  if (!lazy) {
    ack_now_[s] = std::max(ack_now_[s], kAckDue);
  } else if (lazy_since_[s] == 0) {
    lazy_since_[s] = steady_ns();
    ++lazy_pending_;
    if (!owns_conn(s)) wake();  // the progress thread's poll then runs the timer
  }
}

void Engine::send_acks() {
  bool all = closing_.load();
  int64_t now = lazy_pending_ > 0 ? steady_ns() : 0;
  for (int s = 0; s < total_; ++s) {
    bool timed = lazy_since_[s] != 0 && now - lazy_since_[s] >= kLazyAckNs;
    if (!all && !ack_now_[s] && !timed) continue;
    bool pinged = ack_now_[s] == kAckAsked;
    ack_now_[s] = 0;
    if (lazy_since_[s] != 0) --lazy_pending_;
    lazy_since_[s] = 0;
    if (applied_[s] == acked_out_[s] && !pinged) continue;  // every op is acked already
    acked_out_[s] = applied_[s];
    uint64_t v = applied_[s];
    enqueue(s, {frame(FrameType::kAck, &v, 0), nullptr, 0, 0, 0}, Count::kNone);
  }
  if (!all) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (!acks_flushed_) cv_.notify_all();
  acks_flushed_ = true;
}

bool Engine::lazy_unrequested(int lo, int hi) const {
  for (int s = lo * ncontexts_; s < hi * ncontexts_; ++s) {
    if (lazy_unreq_[s] != 0) return true;
  }
  return false;
}

uint64_t Engine::ping(int peer) {
  uint64_t heard;
  {
    std::lock_guard<std::mutex> lock(mu_);
    heard = acks_heard_[peer];
    if (!lost_[peer].empty() || bye_[peer]) return heard;  // no answer will come
  }
  enqueue(slot(peer, 0), {frame<wire::PutHeader>(FrameType::kAckReq, nullptr, 0), nullptr, 0, 0, 0}, Count::kNone);
  return heard;
}

uint64_t Engine::acks_heard(int peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return acks_heard_[peer];
}

void Engine::request_acks(int lo, int hi) {
  for (int s = lo * ncontexts_; s < hi * ncontexts_; ++s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      int peer = s / ncontexts_;
      if (lazy_unreq_[s] == 0 || !lost_[peer].empty() || bye_[peer]) continue;
      lazy_unreq_[s] = 0;
    }
    enqueue(s, {frame<wire::PutHeader>(FrameType::kAckReq, nullptr, 0), nullptr, 0, 0, 0}, Count::kNone);
  }
}

// The acks of ops applied here go before the goodbye: an initiator still waiting for lazy ones
// (its flush) completes rather than fails with "closed its mesh".
void Engine::flush_acks_before_bye() {
  closing_ = true;
  if (owns_conn(0)) return send_acks();
  wake();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::seconds(1), [&] { return acks_flushed_; });
}

void Engine::stop() {
  if (!thread_.joinable()) return;
  flush_acks_before_bye();
  int total = total_ * lanes_;  // a goodbye on every lane too: its close is then clean
  for (int s = 0; s < total; ++s) {
    enqueue(s, {frame<wire::PutHeader>(FrameType::kBye, nullptr, 0), nullptr, 0, 0, 0}, Count::kNone);
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(1), [&] {
      for (int s = 0; s < total; ++s) {
        if (!out_[s].empty() && lost_[peer_of(s)].empty() && !bye_[peer_of(s)]) return false;
      }
      return true;
    });
  }
  settle_device_gets();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake();
  thread_.join();
  join_lane_workers();
  cv_.notify_all();
  drop_queues();
}

// What was never sent goes now, not with the engine (which a handle may keep past its owner):
// an answer leaves the window it reads while that window's table still exists. Destroyed
// outside mu_ (a payload's buffers may go back to the driver).
void Engine::drop_queues() {
  std::vector<std::deque<OutItem>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& q : out_) left.push_back(std::move(q));
    for (auto& q : out_) q.clear();
  }
  for (auto& q : left) {
    for (OutItem& it : q) {
      if (it.staged) it.staged->cancel("the connection was closed");  // a filler waiting for its ring fails
    }
  }
}

}  // namespace fxm
