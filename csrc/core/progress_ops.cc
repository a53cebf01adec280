// One-sided frames of the progress engine: puts landed (or refused) and
// their signals, get requests answered with a snapshot, get answers landed,
// acks and refusals counted.
#include <algorithm>
#include <cstring>

#include "base/log.h"
#include "base/status.h"
#include "core/progress_items.h"
#include "transport/cuda/device_scratch.h"
#include "transport/cuda/staged_payload.h"
#include "transport/cuda/staging.h"
#include "transport/cuda/streams.h"
#include "transport/signal_ops.h"

namespace fxm {

using wire::FrameType;

void Engine::on_put_header(int s, InConn& in, uint64_t payload) {
  std::memcpy(&in.put, in.buf, sizeof(in.put));
  if (payload == 0) return;  // signal only: no data window involved
  Window* w = windows_->find(in.put.dst_win);
  std::string what = "a put of " + std::to_string(payload) + " bytes to window #" + std::to_string(in.put.dst_win);
  if (!w) {
    in.refused = what + ": not registered here";
  } else if (!w->enter(true)) {
    in.refused = what + ": it was deregistered here";
  } else {
    in.entered = w;
    if (w->kind == WindowKind::kSignal) {  // slots change only through signals (notify, last signaller)
      in.refused = what + ": a signal window (data goes to a data window; use signal())";
    } else if (in.put.dst_off > w->size || payload > w->size - in.put.dst_off) {
      in.refused = what + " at offset " + std::to_string(in.put.dst_off) + ": out of range (" +
                   std::to_string(w->size) + " bytes here)";
    } else if (w->kind == WindowKind::kDevice) {
      stage_put(in, *w, payload, what);
    } else {
      in.dst = w->base + in.put.dst_off;
    }
  }
  if (!in.refused.empty()) FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, "refused " + in.refused + " from peer " + std::to_string(peer_of(s)));
}

// A put to a device window lands in a ring of staging buffers; where they
// cannot be had the put is refused.
void Engine::stage_put(InConn& in, Window& w, uint64_t payload, const std::string& what) {
  std::string failed = take_landing_ring(in, payload, w.base + in.put.dst_off, w.device);
  if (!failed.empty()) in.refused = what + ": " + failed;
}

// Pinned host memory of staged_chunk_bytes() a buffer, at most staged_landing_buffers()
// of them, reused as the payload's bytes arrive.
std::string Engine::take_landing_ring(InConn& in, uint64_t n, uint8_t* at, int device) {
  try {
    uint64_t chunk = std::min(n, cuda::staged_chunk_bytes());
    uint64_t count = std::min<uint64_t>(cuda::staged_landing_buffers(), (n + chunk - 1) / chunk);
    bool bounce = cuda::staged_bounce();
    for (uint64_t k = 0; k < count; ++k) {
      in.stage.push_back({cuda::staging_buffer(chunk, device), nullptr, nullptr,
                          bounce ? cuda::device_scratch(chunk, device) : nullptr});
    }
    in.staged = chunk;
  } catch (const Error& e) {
    in.release_stage();
    return e.what();
  } catch (const std::bad_alloc&) {
    in.release_stage();
    return "allocating its staging buffers failed (out of memory)";
  }
  in.dst = in.stage[0].buf.get();
  in.device_at = at;
  in.device = device;
  return "";
}

void Engine::on_get_answer(int s, InConn& in, uint64_t payload) {
  std::memcpy(&in.req_id, in.buf, 8);
  std::string bad;
  PendingGet get{};
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = gets_.find(in.req_id);
    if (it == gets_.end() || slot(it->second.peer, it->second.ctx) != s) {
      bad = "an answer to get #" + std::to_string(in.req_id) + ", which was not asked of it on this context";
    } else if (it->second.len != payload) {
      bad = "a " + std::to_string(payload) + "-byte answer to a get of " + std::to_string(it->second.len) + " bytes";
    } else {
      get = it->second;
    }
  }
  if (bad.empty() && get.device >= 0 && payload > 0) {  // into device memory: through the landing ring
    std::string failed = take_landing_ring(in, payload, get.dst, get.device);
    if (!failed.empty()) in.refused = "a get of " + std::to_string(payload) + " bytes: " + failed;
    in.scatter = get.scatter;  // a batch of reads: each buffer scattered into its blocks
  }
  if (bad.empty()) return;  // landing_spot() finds the buffer, as long as the get is pending
  lose(s / ncontexts_, "protocol error: " + bad);
  in.closed = true;
}

uint8_t* Engine::landing_spot(int c, InConn& in, size_t* want) {
  uint64_t at = in.total - in.remaining;
  if (in.f.type == FrameType::kStripe && (in.put.flags & wire::kStripeOfBlocks)) return stripe_blocks_spot(c, in, want);
  if (in.f.type == FrameType::kMessage) {
    if (!in.refused.empty() || (at == in.msg.size() && !grow_message(in))) return nullptr;
    *want = static_cast<size_t>(std::min<uint64_t>(*want, in.msg.size() - at));
    return in.msg.data() + at;
  }
  if (in.f.type == FrameType::kPutBlocks || in.f.type == FrameType::kGetBlocks) return blocks_spot(c, in, want);
  if (in.device_at != nullptr) return staging_spot(in, want);
  if (in.f.type != FrameType::kGetResp) return in.dst ? in.dst + at : nullptr;
  if (!in.refused.empty()) return nullptr;  // its landing ring could not be had: discarded
  std::lock_guard<std::mutex> lock(mu_);
  auto it = gets_.find(in.req_id);  // gone once its peer was lost: discard
  return it == gets_.end() ? nullptr : it->second.dst + at;
}

// A full staging buffer is copied up while the next one takes the bytes that
// follow; a copy that fails refuses the put (the rest is discarded).
uint8_t* Engine::staging_spot(InConn& in, size_t* want) {
  uint64_t filled = in.total - in.remaining - in.landed;
  if (filled == in.staged && in.f.type == FrameType::kGetResp && !get_pending(in.req_id)) {
    in.device_at = nullptr;  // the get failed meanwhile (its peer lost): nothing more lands
    in.dst = nullptr;
    return nullptr;
  }
  if (filled == in.staged) {
    std::string failed = land_on_device(in, filled);
    if (!failed.empty()) {
      in.refused = failed;
      in.device_at = nullptr;
      in.dst = nullptr;
      return nullptr;
    }
    filled = 0;
  }
  *want = static_cast<size_t>(std::min<uint64_t>(*want, in.staged - filled));
  return in.stage[in.filling].buf.get() + filled;
}

// A message's buffer doubles as its bytes arrive, from 64 KiB up to its
// announced size: a header alone commits 64 KiB, whatever it announces.
bool Engine::grow_message(InConn& in) {
  constexpr uint64_t kFirstBytes = 64 << 10;
  uint64_t next = std::min<uint64_t>(in.total, std::max<uint64_t>(kFirstBytes, in.msg.size() * 2));
  try {
    in.msg.reserve(next);  // exactly `next`: resize alone may take up to twice that
    in.msg.resize(next);
    return true;
  } catch (const std::bad_alloc&) {
    in.refused = "a " + std::to_string(in.total) + "-byte message: allocating " + std::to_string(next) +
                 " bytes for it failed (out of memory)";
    std::vector<uint8_t>().swap(in.msg);  // the rest is discarded
    return false;
  }
}

// A message goes to its mailbox; one dropped here leaves its place to an
// error that recv() raises, and the sender is told (its next flush fails).
void Engine::on_message_done(int s, InConn& in) {
  int peer = s / ncontexts_;
  if (!in.refused.empty()) {
    FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, "dropped " + in.refused + " from peer " + std::to_string(peer));
    refuse(s, in.refused);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool below = mailbox_bytes_[s] < max_unreceived_;
    mailbox_bytes_[s] += in.msg.size();
    if (below && mailbox_bytes_[s] >= max_unreceived_) {  // log the transition only
      FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, std::to_string(mailbox_bytes_[s]) + " bytes of messages from peer " +
                                                 std::to_string(peer) + " (ctx " + std::to_string(s % ncontexts_) +
                                                 ") wait for recv(); reading that connection pauses until they are received");
    }
    mailbox_[s].push_back({std::move(in.msg), in.refused});
    cv_.notify_all();
  }
  arrived();  // after the lock: the hook's waiter drains the mailbox through recv_message
}

bool Engine::on_ack(int s, const uint8_t* buf) {
  uint64_t v;
  std::memcpy(&v, buf, 8);
  uint64_t delta = v - acked_in_[s];
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (v < acked_in_[s] || delta > acks_due_[s]) delta = UINT64_MAX;
    else acks_due_[s] -= delta;
    ++acks_heard_[s / ncontexts_];
  }
  if (delta == UINT64_MAX) {
    lose(s / ncontexts_, "protocol error: an ack for puts that were never issued");
    in_[s]->closed = true;
    return false;
  }
  acked_in_[s] = v;
  if (delta) complete(s / ncontexts_, s % ncontexts_, delta);
  return true;
}

void Engine::on_payload_done(int s, InConn& in) {
  int peer = s / ncontexts_;
  if (in.f.type == FrameType::kMessage) {
    on_message_done(s, in);
  } else if (in.f.type == FrameType::kPutBlocks) {
    on_blocks_done(s, in);  // (a striped batch is held until its stripes land)
  } else if (in.f.type == FrameType::kGetBlocks) {
    on_get_blocks_request(s, in);
  } else if (in.f.type == FrameType::kStripe) {
    return on_stripe_done(s, in);  // resets it
  } else if (in.f.type == FrameType::kPut) {
    if ((in.put.flags & wire::kPutStriped) && hold_striped(s, in)) return;  // applied once its stripes land
    on_put_done(s, in);
  } else if (in.f.type == FrameType::kGetResp) {
    if (in.device_at != nullptr || !in.refused.empty()) land_get_answer(s, in);
    bool pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = gets_.find(in.req_id);  // gone: its peer was lost meanwhile (already failed)
      pending = it != gets_.end();
      if (pending) drop_get(&it);
    }
    if (pending) complete(peer, s % ncontexts_, 1);
  } else if (in.f.type == FrameType::kRefused) {
    on_refused(s, in);
  }
  in.reset();
}

// The data landed (or was refused); the signal follows only a landed put.
void Engine::on_put_done(int s, InConn& in) { apply_put(s, in.put, land_rest(in), in.f.length > in.need); }

// Why the put was refused, else what landing its last staged bytes on the device said: the
// data is on the device before its signal and its ack.
std::string Engine::land_rest(InConn& in) {
  std::string refused = in.refused;
  if (refused.empty() && in.device_at != nullptr) {
    refused = land_on_device(in, in.total - in.landed);
    if (refused.empty()) refused = wait_landed(in);
  }
  return refused;
}

// data: the put carried bytes (a refused signal says they landed).
void Engine::apply_put(int s, const wire::PutHeader& put, std::string refused, bool data) {
  int peer = s / ncontexts_;
  if (refused.empty() && (put.flags & wire::kPutHasSignal)) {
    Window* w = windows_->find(put.sig_win);
    if (w && w->kind == WindowKind::kSignal && put.sig_slot < w->nslots() && w->enter(true)) {
      apply_signal(reinterpret_cast<uint64_t*>(w->base), w->last_src, w->notify, put.sig_slot, put.sig_val,
                   (put.flags & wire::kPutSignalSet) != 0, peer);
      w->leave();
    } else {
      refused = "a signal to window #" + std::to_string(put.sig_win) + " slot " + std::to_string(put.sig_slot) +
                ": not a signal slot here" + (data ? " (its data landed)" : "");
      FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, "refused " + refused + " from peer " + std::to_string(peer));
    }
  } else if (!refused.empty() && (put.flags & wire::kPutHasSignal)) {
    refused += "; its signal (window #" + std::to_string(put.sig_win) + " slot " + std::to_string(put.sig_slot) +
               ") was not applied";
  }
  note_applied(s, (put.flags & wire::kPutLazyAck) != 0);
  if (!refused.empty()) refuse(s, refused);
}

// The bytes of a staged put (or get answer), copied from host memory into
// device memory on the landing stream; all of them are done before its signal
// is applied and before it is acknowledged (or the get completes): wait_landed.
std::string Engine::land_on_device(InConn& in, uint64_t n) {
  try {
    if (n > 0) {
      InConn::Landing& full = in.stage[in.filling];
      WindowIo io;  // a put's copy up is queued only while its window is registered (window.h)
      if (in.entered && !io.enter(in, in.entered)) return in.refused;
      full.copied = in.scatter
                        ? scatter_blocks(in, n)
                        : cuda::copy_async(in.device, in.device_at + in.landed, full.buf.get(), n, landing_what(in));
      in.landed += n;
      in.filling = (in.filling + 1) % in.stage.size();
    }
    InConn::Landing& next = in.stage[in.filling];
    if (next.copied) {  // its earlier copy up still reads it
      cuda::wait_event_counted(cuda::StagedWait::kLanding, in.device, next.copied,
                               Deadline::after_seconds(timeout_s_), landing_what(in));
      next.copied.reset();
    }
    return "";
  } catch (const Error& e) {  // a copy still pending keeps its buffer (InConn::release_stage)
    FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, e.what());
    return op_words(in) + ": " + e.what();
  }
}

std::string Engine::wait_landed(InConn& in) {
  Deadline deadline = Deadline::after_seconds(timeout_s_);
  try {
    for (size_t k = 1; k <= in.stage.size(); ++k) {  // oldest first
      InConn::Landing& l = in.stage[(in.filling + k) % in.stage.size()];
      if (!l.copied) continue;
      cuda::wait_event(in.device, l.copied, deadline, landing_what(in));
      l.copied.reset();
    }
    return "";
  } catch (const Error& e) {
    FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, e.what());
    return op_words(in) + ": " + e.what();
  }
}

std::string Engine::op_words(const InConn& in) {
  if (in.f.type == FrameType::kStripe && (in.put.flags & wire::kStripeOfBlocks)) {
    return "a part of a striped batch of " + std::string(in.device >= 0 ? "staged writes (" : "writes (") +
           std::to_string(in.total) + " bytes on this lane)";
  }
  if (in.f.type == FrameType::kPutBlocks) {
    return "a batch of " + std::to_string(in.blocks.size()) + (in.device >= 0 ? " staged writes (" : " writes (") +
           std::to_string(in.blocks_head.bytes) + " bytes)";
  }
  return "a " + std::string(in.f.type == FrameType::kPut ? "put" : "get") + " of " + std::to_string(in.total) +
         " bytes";
}

std::string Engine::landing_what(const InConn& in) {
  if (in.f.type == FrameType::kPutBlocks || in.f.type == FrameType::kStripe) {
    return "landing " + op_words(in) + " on device " + std::to_string(in.device);
  }
  if (in.f.type == FrameType::kPut) {
    return "landing a staged put in device window #" + std::to_string(in.put.dst_win);
  }
  return "landing a staged get's answer on device " + std::to_string(in.device);
}

bool Engine::get_pending(uint64_t req_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return gets_.count(req_id) != 0;
}

// The last bytes of a get answer into device memory go up, and all its copies
// complete, before the get does; a landing that failed fails the get (its
// initiator's flush names it). The last copy is queued only while the get is
// pending (lose() takes landing_mu_): once a get failed, nothing more is queued.
void Engine::land_get_answer(int s, InConn& in) {
  std::string failed;
  if (in.device_at != nullptr) {
    {
      LandingLock landing(landing_mu_);  // the reader: read_some released it
      landing.lock();
      if (!get_pending(in.req_id)) return;
      failed = land_on_device(in, in.total - in.landed);
    }
    if (failed.empty()) failed = wait_landed(in);
  }
  if (failed.empty() && in.refused.empty()) return;
  // The get fails: its copies up queued before end first (no write into its memory after that).
  if (in.device >= 0 && !in.stage.empty()) wait_landing_streams({in.device});
  std::string why = who() + (failed.empty() ? in.refused : failed);
  std::lock_guard<std::mutex> lock(mu_);
  int peer = s / ncontexts_;
  if (refused_[peer].empty()) refused_[peer] = why;
  else if (refused_[peer].find(" (and more)") == std::string::npos) refused_[peer] += " (and more)";
}

Engine::OutItem Engine::refusal(uint64_t number, const std::string& why) {
  std::string text = why.substr(0, wire::kMaxRefusedText);
  OutItem it{frame(FrameType::kRefused, &number, text.size()), nullptr, 0, 0, 0};
  it.head.insert(it.head.end(), text.begin(), text.end());
  return it;
}

void Engine::refuse(int s, const std::string& why, uint64_t number) {
  // before the ack that counts the op: the initiator knows first
  enqueue(s, refusal(number != 0 ? number : applied_[s], why), Count::kNone);
}

void Engine::on_refused(int s, InConn& in) {
  int peer = s / ncontexts_;
  std::string why(in.msg.begin(), in.msg.end());
  uint64_t n;
  std::memcpy(&n, in.buf, 8);
  bool get_done = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (refused_[peer].empty()) {
      refused_[peer] = "peer " + std::to_string(peer) + " refused " + why;
    } else if (refused_[peer].find(" (and more)") == std::string::npos) {
      refused_[peer] += " (and more)";
    }
    auto it = (n & wire::kRefusedGet) ? gets_.find(n & ~wire::kRefusedGet) : gets_.end();
    if (it != gets_.end() && slot(it->second.peer, it->second.ctx) == s) {  // no answer follows
      drop_get(&it);
      get_done = true;
    }
  }
  if (get_done) complete(peer, s % ncontexts_, 1);
}

void Engine::fail_if_refused(int lo, int hi, const char* doing) {
  for (int p = lo; p < hi; ++p) {
    if (refused_[p].empty()) continue;
    std::string why = std::move(refused_[p]);
    refused_[p].clear();
    Code code = refused_lost_[p] ? Code::kPeerLost : Code::kInvalidArgument;
    refused_lost_[p] = 0;
    fail(code, p, 0, who() + doing + ": " + why);
  }
}

// The initiator keeps its gets in flight within kMaxGetBytesInFlight (or one
// at a time): a request beyond that is a peer breaking the protocol.
bool Engine::take_answer_credit(int s, uint64_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  if (answer_bytes_[s] > 0 && answer_bytes_[s] + size > kMaxGetBytesInFlight) return false;
  answer_bytes_[s] += size;
  return true;
}

// The answer is the window's bytes as of the request's place in the pair's FIFO. It is
// streamed (answer_streamed): its chunks are copied out of the window as the socket drains,
// and snapshot_answers() copies the rest before any later put or message of that pair is acted
// on. Where its buffers cannot be had, a refusal of the request completes the get.
void Engine::answer_get(int s, Window& w, const wire::GetHeader& g) {
  std::string what = "a get of " + std::to_string(g.size) + " bytes from window #" + std::to_string(g.src_win);
  if (g.size > 0) {
    answer_streamed(s, w, g, what);
    return;
  }
  uint64_t id = g.req_id;
  enqueue(s, {frame(FrameType::kGetResp, &id, 0), nullptr, 0, 0, 0}, Count::kNone);
}

// Host memory is copied with memcpy, device memory by copies down on the stream that lands
// staged puts (after those landed before it); each chunk is sent once it is there. The window
// stays entered (it cannot be deregistered unawares) until the last chunk was copied out.
void Engine::answer_streamed(int s, Window& w, const wire::GetHeader& g, const std::string& what) {
  std::shared_ptr<cuda::StagedPayload> p;
  int ordinal = w.kind == WindowKind::kDevice ? w.device : -1;
  try {
    Deadline deadline = Deadline::after_seconds(timeout_s_);
    p = std::make_shared<cuda::StagedPayload>(this, s / ncontexts_, g.size, ordinal, deadline, false);
    if (!w.enter(true)) fail(Code::kInvalidArgument, -1, 0, "it was deregistered here");
    Window* source = &w;  // windows live as long as their table (window.h)
    p->hold_source([source] { source->leave(); });
    p->guard_source(
        [source] {
          if (source->begin_io()) return true;
          source->cut_off.fetch_add(1);  // the payload gives up: asked once
          return false;
        },
        [source] { source->end_io(); });
    p->count_in(&answer_held_, &answer_peak_);
    p->answer_from(ordinal, w.base + g.src_off, deadline);
  } catch (const std::exception& e) {  // Error or bad_alloc: nothing was sent
    p.reset();
    {
      std::lock_guard<std::mutex> lock(mu_);
      answer_bytes_[s] -= g.size;  // the credit taken for it
    }
    std::string why = what + ": staging its answer failed: " + e.what();
    FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, "refused " + why + " from peer " + std::to_string(s / ncontexts_));
    refuse(s, why, wire::kRefusedGet | g.req_id);
    return;
  }
  queue_answer(s, std::move(p), g.req_id, g.size);
}

void Engine::queue_answer(int s, std::shared_ptr<cuda::StagedPayload> p, uint64_t req_id, uint64_t size) {
  uint64_t id = req_id;
  OutItem it{frame(FrameType::kGetResp, &id, size), nullptr, size, 0, 0};
  it.answer_bytes = size;
  it.answer_id = req_id;
  p->set_waker([this] { wake(); });
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& list = open_answers_[s];  // those sent already go
    list.erase(std::remove_if(list.begin(), list.end(), [](const auto& a) { return a.expired(); }), list.end());
    list.push_back(p);
  }
  it.staged = std::move(p);
  enqueue(s, std::move(it), Count::kNone);
}

void Engine::snapshot_answers(int s) {
  std::vector<std::shared_ptr<cuda::StagedPayload>> open;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::weak_ptr<cuda::StagedPayload>>& list = open_answers_[s];
    if (list.empty()) return;
    for (auto& weak : list) {
      if (auto p = weak.lock()) open.push_back(std::move(p));
    }
    list.clear();
  }
  for (auto& p : open) p->snapshot_rest();  // copies the rest (the reader: one at a time)
}

void Engine::on_get_request(int s, const wire::GetHeader& g) {
  Window* w = windows_->find(g.src_win);
  if (w && !w->enter(true)) {  // closed here since the peer looked it up: refused, not a protocol error
    refuse(s, "a get of " + std::to_string(g.size) + " bytes from window #" + std::to_string(g.src_win) +
                  ": it was deregistered here", wire::kRefusedGet | g.req_id);
    return;
  }
  if (!w) {
    lose(s / ncontexts_, "protocol error: a get request for window #" + std::to_string(g.src_win) +
                             ", which is not registered here");
    return;
  }
  bool fits = g.src_off <= w->size && g.size <= w->size - g.src_off;
  if (fits && !take_answer_credit(s, g.size)) {
    w->leave();
    lose(s / ncontexts_, "protocol error: get requests for more than " +
                             std::to_string(kMaxGetBytesInFlight >> 20) + " MiB of answers at once");
    return;
  }
  if (fits) {
    answer_get(s, *w, g);
    w->leave();
    return;
  }
  w->leave();
  lose(s / ncontexts_, "protocol error: a get request for window #" + std::to_string(g.src_win) +
                           " out of range here");
}

}  // namespace fxm
