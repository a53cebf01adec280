// Get answers through a StagedPayload (staged_payload.h): a ring of kAnswerChunks
// chunks, filled by the engine's writer as the socket drains, so a reader that
// stops reading holds at most that ring of the target's memory, whatever it
// asked for. From device memory each chunk is a copy down on the landing stream
// (published by poll_copies() once complete); from host memory a memcpy.
#include <algorithm>
#include <cstring>

#include "base/status.h"
#include "transport/cuda/driver.h"
#include "transport/cuda/staged_payload.h"
#include "transport/cuda/streams.h"

namespace fxm::cuda {

void StagedPayload::answer_from(int ordinal, const uint8_t* src, const Deadline& deadline) {
  std::lock_guard<std::mutex> lock(mu_);
  copies_on_ = ordinal;
  src_ = src;
  copy_timeout_s_ = std::max(1.0, deadline.seconds_left());  // each copy's (copies start as the socket drains)
}

void StagedPayload::answer_gathered(int ordinal, ChunkCopy gather, const Deadline& deadline) {
  answer_from(ordinal, nullptr, deadline);
  std::lock_guard<std::mutex> lock(mu_);
  gather_ = std::move(gather);
}

// Pinned for a device's copies down, plain heap memory for host bytes.
HostBuffer StagedPayload::answer_buffer(uint64_t n) {
  HostBuffer b = copies_on_ >= 0 ? staging_buffer(n, copies_on_) : HostBuffer(new uint8_t[n], std::default_delete<uint8_t[]>());
  counted_ += n;
  if (count_held_ != nullptr) {
    uint64_t now = count_held_->fetch_add(n) + n;
    uint64_t peak = count_peak_->load();
    while (now > peak && !count_peak_->compare_exchange_weak(peak, now)) {
    }
  }
  return b;
}

void StagedPayload::give_up_locked(const std::string& why) {
  failure_ = why;
  failed_.store(true, std::memory_order_release);
  if (waker_) waker_();
}

// One chunk out of the source, inside the source's guard (a closed source gives the answer up).
bool StagedPayload::copy_chunk(uint64_t i, uint8_t* dst) {
  if (source_begin_ && !source_begin_()) {
    give_up_locked("its window was deregistered before the answer was copied out of it");
    return false;
  }
  try {
    if (gather_) {
      copies_by_ = Deadline::after_seconds(copy_timeout_s_);
      std::unique_ptr<CopyList> list;
      try {
        events_.push_back(gather_(i, dst, &list));
      } catch (...) {
        if (list) list.release();  // a launch may read it: never reused
        throw;
      }
      lists_.push_back(std::move(list));
    } else if (copies_on_ < 0) {
      std::memcpy(dst, src_ + i * chunk_, chunk_len(i));
    } else {
      copies_by_ = Deadline::after_seconds(copy_timeout_s_);
      events_.push_back(copy_async(copies_on_, dst, src_ + i * chunk_, chunk_len(i),
                                   "staging a get's answer from the device to the host"));
    }
  } catch (const Error& e) {
    if (source_end_) source_end_();
    give_up_locked(std::string("its copy from the device could not be queued: ") + e.what());
    return false;
  }
  if (source_end_) source_end_();
  return true;
}

void StagedPayload::release_source_locked() {
  if (!release_source_) return;
  release_source_();
  release_source_ = nullptr;
}

void StagedPayload::copy_ahead() {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t slots = ring_.size(), n = chunks(), before = next_;
  while (answer_ && !failed() && next_ < n && (next_ < slots || sent_ >= (next_ - slots + 1) * chunk_)) {
    HostBuffer& slot = ring_[next_ % slots];
    try {
      if (!slot) slot = answer_buffer(n <= 1 ? std::max<uint64_t>(len_, 1) : chunk_);
    } catch (const Error& e) {
      give_up_locked(std::string("no buffer for its answer: ") + e.what());
      break;
    }
    if (!copy_chunk(next_, slot.get())) break;
    ++next_;
  }
  if (next_ == before || copies_on_ >= 0) return;
  ready_.store(std::min(len_, next_ * chunk_), std::memory_order_release);  // host bytes are there now
  if (next_ == n) release_source_locked();
}

void StagedPayload::snapshot_rest() {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = chunks(), from = next_;
  if (!answer_ || failed() || from >= n) return;
  own_.resize(n);
  for (uint64_t i = from; i < n; ++i) {
    try {
      own_[i] = answer_buffer(chunk_len(i));
    } catch (const Error& e) {
      give_up_locked(std::string("no buffer for its answer: ") + e.what());
      return;
    }
    if (!copy_chunk(i, own_[i].get())) return;
    next_ = i + 1;
  }
  snap_from_.store(from, std::memory_order_release);
  if (copies_on_ >= 0) return;
  ready_.store(len_, std::memory_order_release);
  release_source_locked();
  if (waker_) waker_();
}

bool StagedPayload::all_copied() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_ >= chunks() || failed();
}

bool StagedPayload::copies_pending() const {
  if (failed()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return events_done_ < events_.size();
}

bool StagedPayload::poll_copies() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t before = events_done_;
  if (events_done_ < events_.size()) use_device(copies_on_);
  while (events_done_ < events_.size() && !failed()) {
    CUresult r = driver()->cuEventQuery(events_[events_done_].get());
    if (r == kErrNotReady) {
      if (copies_by_.expired()) give_up_locked("its copy from the device did not complete before the deadline");
      break;
    }
    if (r != kSuccess) {
      give_up_locked("its copy from the device failed: " + result_text(r));
      break;
    }
    if (events_done_ < lists_.size()) lists_[events_done_].reset();  // the kernel read it
    ++events_done_;
  }
  if (events_done_ == before) return false;
  ready_.store(std::min(len_, events_done_ * chunk_), std::memory_order_release);
  if (next_ == chunks() && events_done_ == events_.size()) release_source_locked();
  return true;
}

}  // namespace fxm::cuda
