// Streams and events. Each stream is a FIFO of operations served by a thread
// of its own; the legacy NULL stream is one more such stream, ordered with
// every blocking stream as the real one is. An operation's error becomes the
// stream's sticky error, returned by cuStreamSynchronize. cuStreamDestroy
// returns at once, as the driver's does: the thread finishes the queued work
// (a pending wait included) and then frees the stream. An operation never
// touches memory freed after it was queued (it fails as an illegal address),
// and at process exit the stream threads stop (shutdown.cc).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "table.h"

namespace fakecuda {
namespace {

using Op = std::function<CUresult()>;

// One cuEventRecord: done once its stream has reached it. A wait queued
// behind a record waits for that record alone, never for a later one.
struct Record {
  bool done = false;
};
using RecordPtr = std::shared_ptr<Record>;

struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  RecordPtr latest;  // the most recent record issued (null: never recorded)
};
using EventPtr = std::shared_ptr<EventState>;

struct Event {  // what a CUevent points at
  EventPtr state = std::make_shared<EventState>();
};

struct Stream;
using StreamPtr = std::shared_ptr<Stream>;

struct Stream {
  explicit Stream(bool b) : blocking(b) {}
  static StreamPtr start(bool blocking);
  void serve();
  void push(Op op);
  bool idle();
  CUresult synchronize();
  void stop();

  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> queue;
  uint64_t pushed = 0, done = 0;
  bool stopping = false;
  CUresult sticky = kSuccess;
  const bool blocking;
  std::thread worker;
};

// The thread holds the stream until it has drained it after stop().
StreamPtr Stream::start(bool blocking) {
  StreamPtr s = std::make_shared<Stream>(blocking);
  watch_process_exit();
  s->worker = std::thread([s] { s->serve(); });
  return s;
}

void Stream::serve() {
  std::unique_lock<std::mutex> lk(mu);
  for (;;) {
    cv.wait(lk, [&] { return stopping || !queue.empty(); });
    if (queue.empty()) return;  // stopping, drained
    Op op = std::move(queue.front());
    queue.pop_front();
    lk.unlock();
    CUresult r = run_stream_op(op);
    op = nullptr;
    lk.lock();
    if (r != kSuccess && sticky == kSuccess) sticky = r;
    done++;
    cv.notify_all();
  }
}

void Stream::push(Op op) {
  std::lock_guard<std::mutex> g(mu);
  queue.push_back(std::move(op));
  pushed++;
  cv.notify_all();
}

bool Stream::idle() {
  std::lock_guard<std::mutex> g(mu);
  return done == pushed;
}

CUresult Stream::synchronize() {
  std::unique_lock<std::mutex> lk(mu);
  uint64_t target = pushed;
  cv.wait(lk, [&] { return done >= target; });
  return sticky;
}

void Stream::stop() {
  worker.detach();
  std::lock_guard<std::mutex> g(mu);
  stopping = true;
  cv.notify_all();
}

struct Registry {
  std::mutex mu;
  std::map<Stream*, StreamPtr> streams;  // by handle
  std::set<Event*> events;
  StreamPtr null_stream;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: stream threads may outlive exit()
  return *r;
}

bool is_null_stream(void* s) {  // 0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
  return s == nullptr || s == reinterpret_cast<void*>(1) || s == reinterpret_cast<void*>(2);
}

// The stream a CUstream names, or nullptr for an unknown handle.
StreamPtr find_stream(void* s) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> g(reg.mu);
  if (is_null_stream(s)) {
    if (!reg.null_stream) reg.null_stream = Stream::start(true);
    return reg.null_stream;
  }
  auto it = reg.streams.find(static_cast<Stream*>(s));
  return it == reg.streams.end() ? nullptr : it->second;
}

EventPtr find_event(void* e) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> g(reg.mu);
  Event* ev = static_cast<Event*>(e);
  return reg.events.count(ev) ? ev->state : nullptr;
}

Op record_op(const EventPtr& ev, const RecordPtr& rec) {
  return [ev, rec] {
    std::lock_guard<std::mutex> g(ev->mu);
    rec->done = true;
    ev->cv.notify_all();
    return kSuccess;
  };
}

// Waits on the host for `rec`; false when the process began to exit first.
bool wait_record(EventState& ev, const Record& rec) {
  std::unique_lock<std::mutex> lk(ev.mu);
  while (!rec.done) {
    if (process_exiting()) return false;
    ev.cv.wait_for(lk, std::chrono::milliseconds(5));
  }
  return true;
}

Op wait_op(const EventPtr& ev, const RecordPtr& rec) {
  return [ev, rec] { return wait_record(*ev, *rec) ? kSuccess : kDeinitialized; };
}

// Makes `waiter` wait for the work queued so far on `on` (nothing when it is idle).
void order_after(Stream* waiter, Stream* on) {
  if (on == waiter || on->idle()) return;
  auto ev = std::make_shared<EventState>();
  auto rec = std::make_shared<Record>();
  on->push(record_op(ev, rec));
  waiter->push(wait_op(ev, rec));
}

// Queues op on s, after what the legacy NULL stream semantics put before it.
void enqueue(Stream* s, Op op) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> g(reg.mu);
  if (s == reg.null_stream.get()) {
    for (auto& b : reg.streams)
      if (b.second->blocking) order_after(s, b.second.get());
  } else if (s->blocking && reg.null_stream) {
    order_after(s, reg.null_stream.get());
  }
  s->push(std::move(op));
}

bool wait_condition(uint64_t v, uint64_t value, unsigned kind) {
  switch (kind) {
    case 0: return static_cast<int64_t>(v - value) >= 0;  // GEQ: cyclic, as the driver's
    case 1: return v == value;                            // EQ
    case 2: return (v & value) != 0;                      // AND
    default: return ~(v | ~value) != 0;                   // NOR
  }
}

Op wait_value_op(CUdeviceptr addr, uint64_t value, unsigned kind) {
  return [addr, value, kind] {
    for (;;) {
      uint64_t v = 0;
      {  // the slot must still be device or registered memory: never read freed pages
        std::shared_lock<std::shared_mutex> g(table_lock());
        std::vector<Span> spans;
        if (!device_visible(addr, 8) || resolve(addr, 8, &spans) != kSuccess || spans.size() != 1)
          return kIllegalAddress;
        v = __atomic_load_n(reinterpret_cast<uint64_t*>(spans[0].p), __ATOMIC_ACQUIRE);
      }
      if (wait_condition(v, value, kind)) return kSuccess;
      if (process_exiting()) return kDeinitialized;
      usleep(20);
    }
  };
}

// What one end of a copy was when the copy was queued. Call with table_lock() held.
enum class End { kPageable, kRegisteredHost, kDevice };
End end_of(CUdeviceptr addr, size_t n) {
  if (find_range(addr)) return End::kDevice;
  return find_host(static_cast<uintptr_t>(addr), n) ? End::kRegisteredHost : End::kPageable;
}

// An end queued as device or registered memory that is no longer so was freed
// meanwhile: its pages may be unmapped. (An address reused by a new allocation
// of the same kind is not told apart.)
bool end_still_there(CUdeviceptr addr, size_t n, End was) {
  return was == End::kPageable || end_of(addr, n) == was;
}

Op copy_op(CUdeviceptr dst, End dst_was, CUdeviceptr src, End src_was, size_t n) {
  long delay_ms = (dst_was == End::kDevice ? copy_to_device_delay_ms() : 0) +
                  (src_was == End::kDevice ? copy_from_device_delay_ms() : 0);
  return [=] {
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    std::shared_lock<std::shared_mutex> g(table_lock());
    std::vector<Span> d, s;
    if (!end_still_there(dst, n, dst_was) || !end_still_there(src, n, src_was)) return kIllegalAddress;
    if (resolve(dst, n, &d) != kSuccess || resolve(src, n, &s) != kSuccess) return kIllegalAddress;
    copy_spans(d, s);
    return kSuccess;
  };
}

}  // namespace

struct HostFunctions {
  std::mutex mu;
  std::condition_variable cv;
  int running = 0;  // queued or running
};
HostFunctions& host_functions() {
  static HostFunctions* h = new HostFunctions();  // never destroyed: stream threads use it at exit
  return *h;
}
thread_local bool in_host_function = false;

void host_function_queued() {
  HostFunctions& h = host_functions();
  std::lock_guard<std::mutex> g(h.mu);
  ++h.running;
}

void run_host_function(void (*fn)(void*), void* data) {
  HostFunctions& h = host_functions();
  in_host_function = true;
  fn(data);
  in_host_function = false;
  std::lock_guard<std::mutex> g(h.mu);
  if (--h.running == 0) h.cv.notify_all();
}

void wait_host_functions_idle() {
  if (in_host_function) return;
  HostFunctions& h = host_functions();
  std::unique_lock<std::mutex> g(h.mu);
  // Bounded, unlike the driver's: a host function dropped at process exit must not hang it.
  h.cv.wait_for(g, std::chrono::seconds(60), [&] { return h.running == 0; });
}

void synchronize_all_streams() {
  std::vector<StreamPtr> all;
  {
    Registry& reg = registry();
    std::lock_guard<std::mutex> g(reg.mu);
    for (auto& s : reg.streams) all.push_back(s.second);
    if (reg.null_stream) all.push_back(reg.null_stream);
  }
  for (StreamPtr& s : all) s->synchronize();
}

}  // namespace fakecuda

using namespace fakecuda;

// A stream argument: unknown handles are invalid, the NULL stream needs a current context.
#define FAKE_STREAM(var, handle)                                          \
  if (is_null_stream(handle)) FAKE_NEED_CONTEXT();                        \
  StreamPtr var##_ptr = find_stream(handle);                              \
  Stream* var = var##_ptr.get();                                          \
  if (!var) return kInvalidHandle

FAKE_API CUresult cuStreamCreate(void** out, unsigned flags) {
  FAKE_ENTER("cuStreamCreate");
  FAKE_NEED_CONTEXT();
  if (!out || (flags & ~1u)) return kInvalidValue;
  StreamPtr s = Stream::start((flags & 1u) == 0);  // CU_STREAM_NON_BLOCKING = 1
  Registry& reg = registry();
  std::lock_guard<std::mutex> g(reg.mu);
  reg.streams[s.get()] = s;
  *out = s.get();
  return kSuccess;
}

FAKE_API CUresult cuStreamDestroy_v2(void* handle) {
  FAKE_ENTER("cuStreamDestroy");
  StreamPtr s;
  {
    Registry& reg = registry();
    std::lock_guard<std::mutex> g(reg.mu);
    auto it = reg.streams.find(static_cast<Stream*>(handle));
    if (is_null_stream(handle) || it == reg.streams.end()) return kInvalidHandle;
    s = it->second;
    reg.streams.erase(it);
  }
  s->stop();  // its thread drains it, then lets it go
  return kSuccess;
}

FAKE_API CUresult cuStreamSynchronize(void* handle) {
  FAKE_ENTER("cuStreamSynchronize");
  FAKE_STREAM(s, handle);
  return s->synchronize();
}

FAKE_API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void* handle) {
  FAKE_ENTER("cuMemcpyAsync");
  FAKE_STREAM(s, handle);
  End dst_was, src_was;
  {
    std::shared_lock<std::shared_mutex> g(table_lock());
    std::vector<Span> d, sp;
    if (resolve(dst, n, &d) != kSuccess || resolve(src, n, &sp) != kSuccess) return kInvalidValue;
    dst_was = end_of(dst, n);
    src_was = end_of(src, n);
  }
  if (n) enqueue(s, copy_op(dst, dst_was, src, src_was, n));
  return kSuccess;
}

// CUDA 13.0's cuMemcpyBatchAsync. The driver does not order the copies of one
// call: the fake runs them last to first, so a caller that relies on their
// order gets the wrong bytes. Attributes as the driver checks them: at least
// one, the first from copy 0, a valid source access order; no legacy stream.
struct FakeMemcpyAttributes {
  int src_access_order;
  int src_hint[2];
  int dst_hint[2];
  unsigned flags;
};

FAKE_API CUresult cuMemcpyBatchAsync_v2(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
                                        FakeMemcpyAttributes* attrs, size_t* attr_idxs, size_t num_attrs,
                                        void* handle) {
  FAKE_ENTER("cuMemcpyBatchAsync");
  if (!dsts || !srcs || !sizes || count == 0 || !attrs || !attr_idxs || num_attrs == 0 || attr_idxs[0] != 0) {
    return kInvalidValue;
  }
  for (size_t a = 0; a < num_attrs; ++a) {
    if (attrs[a].src_access_order < 1 || attrs[a].src_access_order > 3) return kInvalidValue;
  }
  if (is_null_stream(handle)) return kInvalidValue;
  FAKE_STREAM(s, handle);
  std::vector<Op> ops;
  {
    std::shared_lock<std::shared_mutex> g(table_lock());
    for (size_t i = count; i-- > 0;) {
      std::vector<Span> d, sp;
      if (resolve(dsts[i], sizes[i], &d) != kSuccess || resolve(srcs[i], sizes[i], &sp) != kSuccess) return kInvalidValue;
      if (sizes[i]) ops.push_back(copy_op(dsts[i], end_of(dsts[i], sizes[i]), srcs[i], end_of(srcs[i], sizes[i]), sizes[i]));
    }
  }
  for (Op& op : ops) enqueue(s, std::move(op));
  return kSuccess;
}

CUresult fakecuda::enqueue_on(void* handle, std::function<CUresult()> op) {
  FAKE_STREAM(s, handle);
  enqueue(s, std::move(op));
  return kSuccess;
}

FAKE_API CUresult cuLaunchHostFunc(void* handle, void (*fn)(void*), void* data) {
  FAKE_ENTER("cuLaunchHostFunc");
  if (!fn) return kInvalidValue;
  FAKE_STREAM(s, handle);
  host_function_queued();
  enqueue(s, [fn, data] {
    run_host_function(fn, data);
    return kSuccess;
  });
  return kSuccess;
}

FAKE_API CUresult cuStreamWaitValue64_v2(void* handle, CUdeviceptr addr, uint64_t value, unsigned flags) {
  FAKE_ENTER("cuStreamWaitValue64");
  if (stream_memops_disabled()) return kNotSupported;
  constexpr unsigned kFlush = 1u << 30;
  if ((flags & ~(kFlush | 3u)) || addr % 8 != 0) return kInvalidValue;
  FAKE_STREAM(s, handle);
  {
    std::shared_lock<std::shared_mutex> g(table_lock());
    if (!device_visible(addr, 8)) return kInvalidValue;  // pageable host memory
  }
  enqueue(s, wait_value_op(addr, value, flags & 3u));
  return kSuccess;
}

FAKE_API CUresult cuEventCreate(void** out, unsigned flags) {
  FAKE_ENTER("cuEventCreate");
  FAKE_NEED_CONTEXT();
  if (!out || (flags & ~0xfu)) return kInvalidValue;
  Event* e = new Event;
  Registry& reg = registry();
  std::lock_guard<std::mutex> g(reg.mu);
  reg.events.insert(e);
  *out = e;
  return kSuccess;
}

FAKE_API CUresult cuEventDestroy_v2(void* handle) {
  FAKE_ENTER("cuEventDestroy");
  Event* e = static_cast<Event*>(handle);
  {
    Registry& reg = registry();
    std::lock_guard<std::mutex> g(reg.mu);
    if (reg.events.erase(e) == 0) return kInvalidHandle;
  }
  delete e;  // queued operations keep the state
  return kSuccess;
}

FAKE_API CUresult cuEventRecord(void* event, void* handle) {
  FAKE_ENTER("cuEventRecord");
  EventPtr ev = find_event(event);
  if (!ev) return kInvalidHandle;
  FAKE_STREAM(s, handle);
  auto rec = std::make_shared<Record>();
  std::lock_guard<std::mutex> g(ev->mu);  // records of one event are queued in the order they become latest
  ev->latest = rec;
  enqueue(s, record_op(ev, rec));
  return kSuccess;
}

// Waits for the record that is the latest when the wait is queued; a later
// record of the same event, on any stream, does not release it.
FAKE_API CUresult cuStreamWaitEvent(void* handle, void* event, unsigned flags) {
  FAKE_ENTER("cuStreamWaitEvent");
  EventPtr ev = find_event(event);
  if (!ev) return kInvalidHandle;
  if (flags != 0) return kInvalidValue;
  FAKE_STREAM(s, handle);
  RecordPtr rec;
  {
    std::lock_guard<std::mutex> g(ev->mu);
    rec = ev->latest;
  }
  if (rec) enqueue(s, wait_op(ev, rec));  // never recorded: nothing to wait for
  return kSuccess;
}

// Query and synchronize refer to the latest record at the time of the call.
FAKE_API CUresult cuEventQuery(void* event) {
  FAKE_ENTER("cuEventQuery");
  EventPtr ev = find_event(event);
  if (!ev) return kInvalidHandle;
  {
    std::lock_guard<std::mutex> g(ev->mu);
    if (!ev->latest || ev->latest->done) return kSuccess;
  }
  // A slow poll of pending work: the answer is the state at the call, given after the delay.
  if (long us = not_ready_query_delay_us()) std::this_thread::sleep_for(std::chrono::microseconds(us));
  return kNotReady;
}

FAKE_API CUresult cuEventSynchronize(void* event) {
  FAKE_ENTER("cuEventSynchronize");
  EventPtr ev = find_event(event);
  if (!ev) return kInvalidHandle;
  RecordPtr rec;
  {
    std::lock_guard<std::mutex> g(ev->mu);
    rec = ev->latest;
  }
  if (!rec) return kSuccess;
  return wait_record(*ev, *rec) ? kSuccess : kDeinitialized;
}
