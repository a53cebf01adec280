// Stream ordering of device ops: the pair's fence (FIFO across streams), the
// library's own stream per device (ops without a stream), completion and
// signals reported from the stream (cuLaunchHostFunc: there is no stream
// "add"), and stream waits on host-shared signal slots (cuStreamWaitValue64).
//
// The library launches no kernel of its own, so no lazy module load can sit
// behind a pending stream wait in its own calls.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>
#include <mutex>
#include <string>

#include "base/clock.h"
#include "transport/cuda/driver.h"
#include "transport/path.h"

namespace fxm::cuda {

// A CUDA event from a per-device pool, back in the pool when the last holder lets go.
using SharedEvent = std::shared_ptr<void>;
SharedEvent pooled_event(int ordinal);
// Records a pooled event on `s` (after the work queued so far).
SharedEvent record_event(int ordinal, CUstream s);

// True once the work before the event's record is done (or failed).
bool event_done(const SharedEvent& e);

// Waits on the host until `s` has done the work queued so far, at most until
// `deadline` (then Error(kTimeout) "<doing>: ..."): no unbounded synchronize.
void wait_for_stream(int ordinal, CUstream s, const Deadline& deadline, const std::string& doing);

// Orders device ops of one (peer, context) across streams: an op on another
// stream than the previous one waits for it on the device. Guarded by the
// caller's per-pair lock. Ops without a stream of their own go on the pair's
// stream (own_stream), so a user's stream that holds them holds only this pair.
class StreamFence {
 public:
  ~StreamFence();
  void before(CUstream s);  // s waits for the previous op when that was on another stream
  void after(CUstream s, SharedEvent recorded);  // the latest op was queued on s; `recorded` follows it
  // Every earlier op of the pair has completed: the next op, on any stream, waits for nothing.
  void forget();
  // Whether the next op may wait for an earlier one (forget() would change something).
  bool holds() const { return event_ != nullptr; }
  // The pair's stream on device `ordinal`: one per device, made on first use and kept until the
  // fence goes, so a stream handed out stays valid (copies queued on one device's are issued on
  // it after another device's was asked for). (Inline: asked once per device copy.)
  CUstream own_stream(int ordinal) { return own_ != nullptr && own_ordinal_ == ordinal ? own_ : other_own_stream(ordinal); }

 private:
  CUstream other_own_stream(int ordinal);
  SharedEvent event_;
  CUstream last_ = nullptr;
  CUstream own_ = nullptr;  // the one asked for last (of own_ordinal_), of those in owned_
  int own_ordinal_ = -1;
  std::vector<std::pair<int, CUstream>> owned_;  // (device, its stream) of each made
};

// The completion of the work queued on a stream up to an event.
std::unique_ptr<CompletionProbe> event_probe(int ordinal, SharedEvent recorded);

// The library's stream on `ordinal`, for the engine's copies (staged bytes
// landing, get answers) and staging: never ordered after a user's stream.
CUstream library_stream(int ordinal);

// Copies n bytes between any two addresses the driver knows (device, host) on
// the library's stream and waits until they landed, at most until `deadline`
// (then Error(kTimeout) "<doing>: ..."; the copy may still run: the caller
// keeps both buffers alive).
void copy_and_wait(int ordinal, void* dst, const void* src, uint64_t n, const Deadline& deadline,
                   const std::string& doing);

// The library's stream on `ordinal` for copies up of staged bytes (copy_async), beside library_stream.
CUstream landing_stream(int ordinal);

// Queues a copy of n bytes on landing_stream() and returns an event
// recorded after it (the caller keeps both buffers alive until it is done).
SharedEvent copy_async(int ordinal, void* dst, const void* src, uint64_t n, const std::string& doing);
// Waits on the host until the work before `e` is done, at most until
// `deadline` (then Error(kTimeout) "<doing>: ..."); a failed copy throws its error.
void wait_event(int ordinal, const SharedEvent& e, const Deadline& deadline, const std::string& doing);

// After the work queued on `s` so far: applies `sig` to `slots` (when given)
// and reports the op to (peer, ctx) completed through `outbox`. The op must
// have been counted with outbox->issued() before.
void complete_on_stream(CUstream s, Outbox* outbox, int peer, int ctx, const SignalSpec* sig,
                        const SignalSlots& slots, int src_rank);

// Host memory (a signal window's slots) registered for the device, so a
// stream can wait on it. Unregistered on destruction.
class HostRegistration {
 public:
  HostRegistration(void* base, uint64_t bytes);
  ~HostRegistration();
  CUdeviceptr device_address(const void* p) const;

 private:
  void* base_;
  CUdeviceptr dev_base_ = 0;
};

// Queues on `s` a wait until *slot >= expected. False when the driver has no
// stream memory operations (then *why says so and nothing was queued).
bool stream_wait_geq(CUstream s, CUdeviceptr slot, uint64_t expected, std::string* why);

}  // namespace fxm::cuda
