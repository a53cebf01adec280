#include "transport/cuda/staged_payload.h"

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <map>
#include <numeric>
#include <utility>

#include "base/env.h"
#include "base/status.h"
#include "transport/cuda/device_memory.h"
#include "transport/cuda/driver.h"
#include "transport/cuda/streams.h"

namespace fxm::cuda {
namespace {

constexpr uint64_t kDefaultChunk = 1ull << 20;  // H200: 1 MiB beat 4 and 16 MiB from 16 MiB ops (docs/gpu.md)
constexpr uint64_t kDefaultInflight = 64ull << 20;
constexpr uint64_t kDefaultKernelBytes = 64ull << 10;
constexpr uint64_t kDefaultLandingBuffers = 4;

// A whole number from the environment: `dflt` when unset, else one of [lo, hi] (else
// InvalidArgument "<name>=<text>: want <want>").
uint64_t number_from(const std::string& text, const char* name, uint64_t dflt, uint64_t lo, uint64_t hi,
                     const std::string& want) {
  if (text.empty()) return dflt;
  char* end = nullptr;
  unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (*end != '\0' || v < lo || v > hi) {
    fail(Code::kInvalidArgument, -1, 0, std::string(name) + "=" + text + ": want " + want);
  }
  return v;
}

// A byte count from the environment: `dflt` when unset, else a whole number >= lo.
uint64_t bytes_from(const std::string& text, const char* name, uint64_t dflt, uint64_t lo) {
  return number_from(text, name, dflt, lo, 1ull << 40, "a byte count of at least " + std::to_string(lo));
}

// staged_waits(): how many waits of each kind, and their microseconds.
struct WaitCount {
  std::atomic<uint64_t> n{0}, us{0};
  void add(uint64_t waited_us) {
    n.fetch_add(1, std::memory_order_relaxed);
    us.fetch_add(waited_us, std::memory_order_relaxed);
  }
};
WaitCount g_waits[4];  // by StagedWait

WaitCount& waits_of(StagedWait kind) { return g_waits[static_cast<int>(kind)]; }

struct Budget {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::pair<const void*, int>, uint64_t> held;  // by (outbox, peer)
  uint64_t peak = 0;
};
Budget& budget() {
  static Budget* b = new Budget();  // never destroyed: payloads may die during exit
  return *b;
}

std::string to_peer(int peer) { return "a staged put to peer " + std::to_string(peer); }

}  // namespace

uint64_t staged_chunk_bytes() {
  static const uint64_t v = [] {
    uint64_t c = bytes_from(staged_chunk_env(), "FLAGCX_MESH_STAGED_CHUNK_BYTES", kDefaultChunk, 64 << 10);
    if ((c & (c - 1)) != 0) {
      fail(Code::kInvalidArgument, -1, 0, "FLAGCX_MESH_STAGED_CHUNK_BYTES=" + std::to_string(c) +
                                              ": want a power of two (the staging pool's sizes)");
    }
    return c;
  }();
  return v;
}

uint64_t staged_kernel_bytes() {
  static const uint64_t v = [] {
    uint64_t b = bytes_from(staged_kernel_env(), "FLAGCX_MESH_STAGED_KERNEL_BYTES", kDefaultKernelBytes, 4096);
    if (b % 16 != 0 || b > (1u << 20)) {
      fail(Code::kInvalidArgument, -1, 0, "FLAGCX_MESH_STAGED_KERNEL_BYTES=" + std::to_string(b) +
                                              ": want a multiple of 16 of at most 1 MiB");
    }
    return b;
  }();
  return v;
}

uint64_t staged_landing_buffers() {
  static const uint64_t v = number_from(staged_landing_env(), "FLAGCX_MESH_STAGED_LANDING_BUFFERS",
                                        kDefaultLandingBuffers, 2, 64, "a number of buffers from 2 to 64");
  return v;
}

uint64_t staged_inflight_bytes() {
  static const uint64_t v =
      bytes_from(staged_inflight_env(), "FLAGCX_MESH_STAGED_INFLIGHT_BYTES", kDefaultInflight, staged_chunk_bytes());
  return v;
}

uint64_t staged_bytes_held(const void* outbox, int peer) {
  Budget& b = budget();
  std::lock_guard<std::mutex> lock(b.mu);
  auto it = b.held.find({outbox, peer});
  return it == b.held.end() ? 0 : it->second;
}

uint64_t staged_bytes_peak() {
  Budget& b = budget();
  std::lock_guard<std::mutex> lock(b.mu);
  return b.peak;
}

std::vector<std::pair<const char*, uint64_t>> staged_waits() {
  static const char* const kNames[4][2] = {{"slot_waits", "slot_us"}, {"gather_waits", "gather_us"},
                                           {"starved", "starved_us"}, {"landing_waits", "landing_us"}};
  std::vector<std::pair<const char*, uint64_t>> out;
  for (int k = 0; k < 4; ++k) {  // by StagedWait
    out.emplace_back(kNames[k][0], g_waits[k].n.load(std::memory_order_relaxed));
    out.emplace_back(kNames[k][1], g_waits[k].us.load(std::memory_order_relaxed));
  }
  return out;
}

StagedWaitTimer::~StagedWaitTimer() {
  if (!waits_) return;
  waits_of(kind_).add(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0_).count()));
}

void wait_event_counted(StagedWait kind, int ordinal, const SharedEvent& e, const Deadline& deadline,
                        const std::string& doing) {
  StagedWaitTimer timed(kind, !event_done(e));  // (a failed copy's event is "done": wait_event raises)
  wait_event(ordinal, e, deadline, doing);
}

namespace {

// The budget of (outbox, peer): waits until `want` more bytes fit (or none is held), then takes them.
void take_budget(const void* outbox, int peer, uint64_t want, const Deadline& deadline) {
  uint64_t limit = staged_inflight_bytes();
  Budget& b = budget();
  std::unique_lock<std::mutex> lock(b.mu);
  uint64_t& held = b.held[{outbox, peer}];
  while (held > 0 && held + want > limit) {
    if (deadline.expired()) {
      fail(Code::kTimeout, peer, 0, to_peer(peer) + ": timed out waiting for " + std::to_string(held) +
                                        " bytes of earlier staged puts to be sent (is the peer receiving?)");
    }
    b.cv.wait_until(lock, deadline.min(Deadline::after_seconds(0.1)).at());
  }
  held += want;
  b.peak = std::max(b.peak, held);
}

}  // namespace

// A ring of slots chunks (one chunk, or a buffer of len when it fits one): its bytes.
uint64_t StagedPayload::ring_bytes(uint64_t len, int share, uint64_t* slots) {
  uint64_t chunk = staged_chunk_bytes(), chunks = (len + chunk - 1) / chunk;
  *slots = std::max<uint64_t>(1, std::min(chunks, staged_inflight_bytes() / chunk / static_cast<uint64_t>(share)));
  return chunks <= 1 ? std::max<uint64_t>(len, 1) : *slots * chunk;
}

std::vector<std::shared_ptr<StagedPayload>> StagedPayload::parts(const void* outbox, int peer,
                                                                 const std::vector<uint64_t>& lens, int ordinal,
                                                                 const Deadline& deadline) {
  int share = static_cast<int>(lens.size());
  uint64_t want = 0, slots = 0;
  for (uint64_t len : lens) want += ring_bytes(len, share, &slots);
  take_budget(outbox, peer, want, deadline);  // at once: two callers never each hold part of what they wait for
  std::vector<std::shared_ptr<StagedPayload>> out;
  out.reserve(lens.size());
  try {
    for (uint64_t len : lens) {
      // Its share is its own once it was made: given back when it goes.
      std::unique_ptr<StagedPayload> p(new StagedPayload(outbox, peer, len, ordinal, deadline, true, share, true));
      want -= p->held_;
      p->frame_len_ = std::accumulate(lens.begin(), lens.end(), uint64_t{0});
      out.push_back(std::shared_ptr<StagedPayload>(std::move(p)));
    }
  } catch (...) {
    Budget& b = budget();
    std::lock_guard<std::mutex> lock(b.mu);
    b.held[{outbox, peer}] -= want;  // the parts not made
    b.cv.notify_all();
    throw;
  }
  return out;
}

StagedPayload::StagedPayload(const void* outbox, int peer, uint64_t len, int ordinal, const Deadline& deadline,
                             bool bounded, int share, bool prepaid)
    : outbox_(outbox), peer_(peer), len_(len), chunk_(staged_chunk_bytes()) {
  uint64_t slots = 0;
  uint64_t want = ring_bytes(len, share, &slots);
  bool one = chunks() <= 1;  // the whole op fits one chunk: a buffer of its size
  if (!bounded) slots = std::max<uint64_t>(1, std::min(chunks(), kAnswerChunks));
  if (bounded && !prepaid) take_budget(outbox_, peer_, want, deadline);
  Budget& b = budget();
  held_ = bounded ? want : 0;
  answer_ = !bounded;
  if (answer_) {  // taken as its chunks are copied (answer_buffer)
    ring_.resize(slots);
    return;
  }
  try {
    for (uint64_t k = 0; k < slots; ++k) ring_.push_back(staging_buffer(one ? want : chunk_, ordinal));
  } catch (...) {
    ring_.clear();
    if (prepaid) throw;  // the budget is still the caller's (parts())
    std::lock_guard<std::mutex> lock(b.mu);
    b.held[{outbox_, peer_}] -= held_;
    b.cv.notify_all();
    throw;
  }
}

StagedPayload::~StagedPayload() {
  bool copying = false;
  for (size_t k = events_done_; k < events_.size(); ++k) {
    if (!event_done(events_[k])) {
      new HostBuffer(buffer_of(k));  // deliberately kept: a copy down may still write it
      if (k < lists_.size() && lists_[k]) new std::shared_ptr<CopyList>(lists_[k]);  // and its list be read
      copying = true;
    }
  }
  if (release_source_ && !copying) release_source_();  // else its source stays held: a copy may still read it
  events_.clear();
  ring_.clear();  // back to the pool (the caller holds no engine lock: see Engine::write_some)
  own_.clear();
  if (count_held_ != nullptr) count_held_->fetch_sub(counted_);
  Budget& b = budget();
  std::lock_guard<std::mutex> lock(b.mu);
  b.held[{outbox_, peer_}] -= held_;
  b.cv.notify_all();
}

uint8_t* StagedPayload::slot_for(uint64_t i, const Deadline& deadline) {
  uint64_t slots = ring_.size();
  uint64_t free_at = i >= slots ? (i - slots + 1) * chunk_ : 0;  // the chunk before it in its slot was sent
  std::unique_lock<std::mutex> lock(mu_);
  StagedWaitTimer timed(StagedWait::kSlot, sent_ < free_at);  // a wait for the slot: the lanes are behind
  while (sent_ < free_at) {
    if (!canceled_.empty()) fail(Code::kPeerLost, peer_, 0, to_peer(peer_) + ": " + canceled_);
    if (deadline.expired()) {
      std::string part = frame_len_ > len_ ? " of its tcp lane's part (a frame of " + std::to_string(frame_len_) +
                                                 " bytes striped over the lanes)" : "";
      fail(Code::kTimeout, peer_, 0, to_peer(peer_) + ": timed out with " + std::to_string(sent_) + " of " +
                                         std::to_string(len_) + " bytes" + part + " sent (is the peer receiving?)");
    }
    cv_.wait_until(lock, deadline.min(Deadline::after_seconds(0.1)).at());
  }
  if (!canceled_.empty()) fail(Code::kPeerLost, peer_, 0, to_peer(peer_) + ": " + canceled_);
  return ring_[i % slots].get();
}

void StagedPayload::fill(int ordinal, const uint8_t* src, const Deadline& deadline,
                         const std::function<void()>& posted) {
  bool started = !posted;
  for (uint64_t i = 0; i < chunks(); ++i) {
    uint64_t at = i * chunk_;
    uint8_t* dst = nullptr;
    try {
      dst = slot_for(i, deadline);
      copy_and_wait(ordinal, dst, src + at, chunk_len(i), deadline, "staging bytes from the device to the host");
    } catch (const Error& e) {
      if (dst != nullptr && e.code() == Code::kTimeout) keep_slot(i);  // the copy may still write it
      if (started) give_up(e.what());
      throw;
    }
    publish(at + chunk_len(i));
    if (!started) {
      posted();
      started = true;
    }
  }
}

namespace {

struct ChunkInFlight {
  size_t part;
  uint64_t i;
  SharedEvent done;
  std::unique_ptr<CopyList> list;
};

}  // namespace

void StagedPayload::fill_queued(int ordinal, const Deadline& deadline, const std::function<void()>& posted,
                                const ChunkCopy& copy) {
  fill_parts({this}, ordinal, deadline, posted,
             [&](size_t, uint64_t i, uint8_t* dst, std::unique_ptr<CopyList>* list) { return copy(i, dst, list); });
}

void StagedPayload::fill_parts(const std::vector<StagedPayload*>& parts, int ordinal, const Deadline& deadline,
                               const std::function<void()>& posted, const PartCopy& copy) {
  std::deque<ChunkInFlight> flying;
  bool started = !posted;
  uint64_t rounds = 0;
  for (StagedPayload* p : parts) rounds = std::max(rounds, p->chunks());
  // At most half a part's ring is being gathered: the chunk a slot waits for was handed to the
  // lanes well before (older than every gather in flight), so the filler waits only for the lanes'
  // sends. (With every slot in flight, each part's slot waited for the chunk published just
  // before it, lane after lane: the lanes took turns instead of sending together.)
  auto most_in_flight = [](const StagedPayload* p) {
    return std::max<size_t>(1, std::min<size_t>(kFillAhead, p->ring_.size() / 2));
  };
  std::vector<size_t> in_flight(parts.size(), 0);
  auto finish_oldest = [&] {
    ChunkInFlight& f = flying.front();
    StagedPayload* p = parts[f.part];
    // (a wait for the gather: the device is behind)
    wait_event_counted(StagedWait::kGather, ordinal, f.done, deadline,
                       "gathering a staged batch from the device to the host");
    p->publish(f.i * p->chunk_ + p->chunk_len(f.i));
    --in_flight[f.part];
    flying.pop_front();
    if (!started) {
      posted();
      started = true;
    }
  };
  try {
    for (uint64_t i = 0; i < rounds; ++i) {  // chunk i of every part, then chunk i + 1: the lanes take turns
      for (size_t k = 0; k < parts.size(); ++k) {
        if (i >= parts[k]->chunks()) continue;
        while (!flying.empty() && event_done(flying.front().done)) finish_oldest();  // gathered: to the lanes now
        while (in_flight[k] >= most_in_flight(parts[k])) finish_oldest();
        uint8_t* dst = parts[k]->slot_for(i, deadline);
        ChunkInFlight f{k, i, nullptr, nullptr};
        try {
          f.done = copy(k, i, dst, &f.list);
        } catch (const Error&) {
          parts[k]->keep_slot(i);  // copies queued before the one refused may still write it
          if (f.list) f.list.release();
          throw;
        }
        flying.push_back(std::move(f));
        ++in_flight[k];
      }
    }
    while (!flying.empty()) finish_oldest();
  } catch (const Error& e) {
    for (ChunkInFlight& f : flying) {  // copies that may still write their slot or read their list
      if (event_done(f.done)) continue;
      parts[f.part]->keep_slot(f.i);
      f.list.release();
    }
    if (started) {
      for (StagedPayload* p : parts) p->give_up(e.what());
    }
    throw;
  }
}

void StagedPayload::publish(uint64_t ready) {
  ready_.store(ready, std::memory_order_release);
  int64_t since = starved_since_ns_.exchange(0, std::memory_order_acq_rel);
  if (since != 0) {
    waits_of(StagedWait::kStarved).add(static_cast<uint64_t>(std::max<int64_t>(0, steady_ns() - since) / 1000));
  }
  if (waker_) waker_();
}

void StagedPayload::give_up(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = why;
  }
  failed_.store(true, std::memory_order_release);
  if (waker_) waker_();
}

std::string StagedPayload::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void StagedPayload::keep_slot(uint64_t i) {
  new HostBuffer(buffer_of(i));  // deliberately kept: a copy may still write it
}

// A chunk's buffer: its ring slot, or (an answer's chunk copied by snapshot_rest) its own.
// The writer reads ready() before it asks: snap_from_ was stored before ready() covered it.
const HostBuffer& StagedPayload::buffer_of(uint64_t i) const {
  if (i >= snap_from_.load(std::memory_order_acquire)) return own_[i];
  return ring_[i % ring_.size()];
}

const uint8_t* StagedPayload::bytes_at(uint64_t off, uint64_t* n) const {
  uint64_t ready = this->ready();
  if (off >= ready) {
    *n = 0;
    return nullptr;
  }
  uint64_t in_chunk = off % chunk_;
  *n = std::min(chunk_ - in_chunk, ready - off);
  return buffer_of(off / chunk_).get() + in_chunk;
}

void StagedPayload::sent_to(uint64_t off) {
  std::lock_guard<std::mutex> lock(mu_);
  bool freed = off / chunk_ != sent_ / chunk_;  // a chunk boundary passed: its slot is free
  sent_ = off;
  head_sent_ = true;
  if (freed) cv_.notify_all();
}

bool StagedPayload::waiting_for_bytes() const {
  uint64_t ready = this->ready();
  if (failed() || ready >= len_) return false;
  std::lock_guard<std::mutex> lock(mu_);
  // An answer with no copy down in flight waits for none: copy_ahead() copies on at the next write.
  if (answer_ && events_done_ == events_.size()) return false;
  bool starved = head_sent_ && sent_ >= ready;
  int64_t none = 0, began = steady_ns();
  if (starved && !answer_ && starved_since_ns_.compare_exchange_strong(none, began, std::memory_order_acq_rel) &&
      this->ready() > sent_) {  // published meanwhile (its publish() found no wait to close): none began
    starved_since_ns_.compare_exchange_strong(began, 0, std::memory_order_acq_rel);
  }
  return starved;
}

void StagedPayload::cancel(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  canceled_ = why;
  cv_.notify_all();
}

}  // namespace fxm::cuda
