#include "transport/cuda/streams.h"

#include <map>
#include <thread>

#include "base/backoff.h"
#include "base/log.h"
#include "base/status.h"
#include "transport/cuda/device_memory.h"
#include "transport/signal_ops.h"

namespace fxm::cuda {

namespace {

struct EventPool {
  std::mutex mu;
  std::map<int, std::vector<CUevent>> free;  // by device
};
EventPool& event_pool() {
  static EventPool* p = new EventPool();  // never destroyed: events may be returned at exit
  return *p;
}

}  // namespace

SharedEvent pooled_event(int ordinal) {
  EventPool& pool = event_pool();
  CUevent e = nullptr;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    std::vector<CUevent>& v = pool.free[ordinal];
    if (!v.empty()) {
      e = v.back();
      v.pop_back();
    }
  }
  if (e == nullptr) check(driver()->cuEventCreate(&e, kEventDisableTiming), "cuEventCreate");
  return SharedEvent(e, [ordinal](void* ev) {
    EventPool& p = event_pool();
    std::lock_guard<std::mutex> lock(p.mu);
    p.free[ordinal].push_back(ev);
  });
}

SharedEvent record_event(int ordinal, CUstream s) {
  SharedEvent e = pooled_event(ordinal);
  check(driver()->cuEventRecord(e.get(), s), "cuEventRecord");
  return e;
}

bool event_done(const SharedEvent& e) {
  const Driver* d = driver();
  return d == nullptr || d->cuEventQuery(e.get()) != kErrNotReady;
}

void wait_for_stream(int ordinal, CUstream s, const Deadline& deadline, const std::string& doing) {
  use_device(ordinal);
  wait_event(ordinal, record_event(ordinal, s), deadline, doing);
}

void wait_event(int ordinal, const SharedEvent& e, const Deadline& deadline, const std::string& doing) {
  use_device(ordinal);
  for (Backoff pace;; pace.pause()) {
    CUresult r = driver()->cuEventQuery(e.get());
    if (r == kSuccess) return;
    if (r != kErrNotReady) check(r, doing);
    if (deadline.expired()) {
      fail(Code::kTimeout, -1, 0, doing + ": the stream did not get there before the deadline "
                                          "(is its earlier work waiting for something that never comes?)");
    }
  }
}

StreamFence::~StreamFence() {
  const Driver* d = driver();
  if (d == nullptr) return;
  for (const auto& [ordinal, s] : owned_) d->cuStreamDestroy(s);  // their queued work still runs
}

CUstream StreamFence::other_own_stream(int ordinal) {
  CUstream s = nullptr;
  for (const auto& [o, made] : owned_) {
    if (o == ordinal) s = made;
  }
  if (s == nullptr) {
    use_device(ordinal);
    check(driver()->cuStreamCreate(&s, kStreamNonBlocking), "cuStreamCreate for a pair's ops");
    owned_.emplace_back(ordinal, s);
  }
  own_ = s;
  own_ordinal_ = ordinal;
  return s;
}

void StreamFence::before(CUstream s) {
  if (!event_ || last_ == s) return;
  check(driver()->cuStreamWaitEvent(s, event_.get(), 0), "cuStreamWaitEvent (ordering after the pair's previous op)");
}

void StreamFence::forget() {
  event_.reset();
  last_ = nullptr;
}

void StreamFence::after(CUstream s, SharedEvent recorded) {
  last_ = s;
  event_ = std::move(recorded);
}

namespace {

class EventProbe : public CompletionProbe {
 public:
  EventProbe(int ordinal, SharedEvent e) : ordinal_(ordinal), event_(std::move(e)) {}
  bool done() override {
    use_device(ordinal_);
    CUresult r = driver()->cuEventQuery(event_.get());
    if (r == kErrNotReady) return false;
    if (r != kSuccess) error_ = "a device copy failed on its stream: " + result_text(r);
    return true;
  }
  std::string error() const override { return error_; }

 private:
  int ordinal_;
  SharedEvent event_;
  std::string error_;
};

}  // namespace

std::unique_ptr<CompletionProbe> event_probe(int ordinal, SharedEvent recorded) {
  return std::make_unique<EventProbe>(ordinal, std::move(recorded));
}

namespace {

// One non-blocking stream per device in `streams`, made at first use.
CUstream stream_of(std::map<int, CUstream>& streams, std::mutex& mu, int ordinal) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams.find(ordinal);
  if (it != streams.end()) return it->second;
  use_device(ordinal);
  CUstream s = nullptr;
  // Non-blocking: it never waits for the legacy default stream's work (a user's pending
  // stream wait there must not hold up the progress thread's staged copies).
  check(driver()->cuStreamCreate(&s, kStreamNonBlocking), "cuStreamCreate on device " + std::to_string(ordinal));
  streams.emplace(ordinal, s);
  return s;
}

}  // namespace

CUstream library_stream(int ordinal) {
  static std::mutex mu;
  static std::map<int, CUstream> streams;
  return stream_of(streams, mu, ordinal);
}

// Copies up run beside the staging copies down of library_stream (another copy engine on a GPU).
CUstream landing_stream(int ordinal) {
  static std::mutex mu;
  static std::map<int, CUstream> streams;
  return stream_of(streams, mu, ordinal);
}

void copy_and_wait(int ordinal, void* dst, const void* src, uint64_t n, const Deadline& deadline,
                   const std::string& doing) {
  const Driver& d = need_driver(doing);
  use_device(ordinal);
  CUstream s = library_stream(ordinal);
  check(d.cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src), n, s), doing);
  wait_for_stream(ordinal, s, deadline, doing + " (waiting for the copy)");
}

SharedEvent copy_async(int ordinal, void* dst, const void* src, uint64_t n, const std::string& doing) {
  const Driver& d = need_driver(doing);
  use_device(ordinal);
  CUstream s = landing_stream(ordinal);
  check(d.cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src), n, s), doing);
  return record_event(ordinal, s);
}

namespace {

struct StreamDone {
  Outbox* outbox;
  int peer, ctx;
  bool has_signal;
  SignalSpec sig;
  SignalSlots slots;
  int src_rank;
};

// Runs on the driver's thread once the stream reached it: no CUDA call here.
void on_stream_done(void* p) {
  StreamDone* done = static_cast<StreamDone*>(p);
  if (done->has_signal) {
    apply_signal(done->slots.values, done->slots.last_src, done->slots.notify, done->sig.slot, done->sig.value,
                 done->sig.set, done->src_rank);
  }
  done->outbox->completed(done->peer, done->ctx, "");
  delete done;
}

}  // namespace

void complete_on_stream(CUstream s, Outbox* outbox, int peer, int ctx, const SignalSpec* sig,
                        const SignalSlots& slots, int src_rank) {
  bool has_signal = sig != nullptr && sig->on && slots.values != nullptr;
  auto* done = new StreamDone{outbox, peer, ctx, has_signal, has_signal ? *sig : SignalSpec{}, slots, src_rank};
  CUresult r = driver()->cuLaunchHostFunc(s, on_stream_done, done);
  if (r != kSuccess) {
    delete done;
    outbox->completed(peer, ctx, "cuLaunchHostFunc: " + result_text(r));
  }
}

HostRegistration::HostRegistration(void* base, uint64_t bytes) : base_(base) {
  const Driver& d = need_driver("registering signal slots for stream waits");
  check(d.cuMemHostRegister(base, bytes, kHostRegisterPortable | kHostRegisterDeviceMap),
        "cuMemHostRegister of a signal window (" + std::to_string(bytes) + " bytes)");
  CUresult r = d.cuMemHostGetDevicePointer(&dev_base_, base, 0);
  if (r != kSuccess) {
    d.cuMemHostUnregister(base);
    check(r, "cuMemHostGetDevicePointer of a signal window");
  }
}

HostRegistration::~HostRegistration() {
  const Driver* d = driver();
  if (d != nullptr) d->cuMemHostUnregister(base_);
}

CUdeviceptr HostRegistration::device_address(const void* p) const {
  return dev_base_ + (static_cast<const uint8_t*>(p) - static_cast<const uint8_t*>(base_));
}

bool stream_wait_geq(CUstream s, CUdeviceptr slot, uint64_t expected, std::string* why) {
  CUresult r = driver()->cuStreamWaitValue64(s, slot, expected, kWaitGeq);
  if (r == kSuccess) return true;
  if (r != kErrNotSupported) check(r, "cuStreamWaitValue64");
  *why = "cuStreamWaitValue64: " + result_text(r);
  return false;
}

}  // namespace fxm::cuda
