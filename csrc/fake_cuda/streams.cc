// Streams and events. Each stream is a FIFO of operations served by a thread
// of its own; the legacy NULL stream is one more such stream, ordered with
// every blocking stream as the real one is. An operation's error becomes the
// stream's sticky error, returned by cuStreamSynchronize. cuStreamDestroy
// returns at once, as the driver's does: the thread finishes the queued work
// (a pending wait included) and then frees the stream.
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "fake_cuda.h"

namespace fakecuda {
namespace {

using Op = std::function<CUresult()>;

struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;   // records issued
  uint64_t completed = 0;  // the latest record the stream has reached
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
    CUresult r = op();
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

Op record_op(const EventPtr& ev, uint64_t seq) {
  return [ev, seq] {
    std::lock_guard<std::mutex> g(ev->mu);
    ev->completed = std::max(ev->completed, seq);
    ev->cv.notify_all();
    return kSuccess;
  };
}

Op wait_op(const EventPtr& ev, uint64_t target) {
  return [ev, target] {
    std::unique_lock<std::mutex> lk(ev->mu);
    ev->cv.wait(lk, [&] { return ev->completed >= target; });
    return kSuccess;
  };
}

// Makes `waiter` wait for the work queued so far on `on` (nothing when it is idle).
void order_after(Stream* waiter, Stream* on) {
  if (on == waiter || on->idle()) return;
  auto ev = std::make_shared<EventState>();
  ev->recorded = 1;
  on->push(record_op(ev, 1));
  waiter->push(wait_op(ev, 1));
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
      {
        std::shared_lock<std::shared_mutex> g(table_lock());
        std::vector<Span> spans;
        if (resolve(addr, 8, &spans) != kSuccess || spans.size() != 1) return kIllegalAddress;
        v = __atomic_load_n(reinterpret_cast<uint64_t*>(spans[0].p), __ATOMIC_ACQUIRE);
      }
      if (wait_condition(v, value, kind)) return kSuccess;
      usleep(20);
    }
  };
}

Op copy_op(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  return [dst, src, n] {
    std::shared_lock<std::shared_mutex> g(table_lock());
    std::vector<Span> d, s;
    if (resolve(dst, n, &d) != kSuccess || resolve(src, n, &s) != kSuccess) return kIllegalAddress;
    copy_spans(d, s);
    return kSuccess;
  };
}

}  // namespace

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
  {
    std::shared_lock<std::shared_mutex> g(table_lock());
    std::vector<Span> d, sp;
    if (resolve(dst, n, &d) != kSuccess || resolve(src, n, &sp) != kSuccess) return kInvalidValue;
  }
  if (n) enqueue(s, copy_op(dst, src, n));
  return kSuccess;
}

FAKE_API CUresult cuLaunchHostFunc(void* handle, void (*fn)(void*), void* data) {
  FAKE_ENTER("cuLaunchHostFunc");
  if (!fn) return kInvalidValue;
  FAKE_STREAM(s, handle);
  enqueue(s, [fn, data] {
    fn(data);
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
  uint64_t seq;
  {
    std::lock_guard<std::mutex> g(ev->mu);
    seq = ++ev->recorded;
  }
  enqueue(s, record_op(ev, seq));
  return kSuccess;
}

FAKE_API CUresult cuStreamWaitEvent(void* handle, void* event, unsigned flags) {
  FAKE_ENTER("cuStreamWaitEvent");
  EventPtr ev = find_event(event);
  if (!ev) return kInvalidHandle;
  if (flags != 0) return kInvalidValue;
  FAKE_STREAM(s, handle);
  uint64_t target;
  {
    std::lock_guard<std::mutex> g(ev->mu);
    target = ev->recorded;  // the latest record issued so far, not later ones
  }
  if (target) enqueue(s, wait_op(ev, target));
  return kSuccess;
}

FAKE_API CUresult cuEventQuery(void* event) {
  FAKE_ENTER("cuEventQuery");
  EventPtr ev = find_event(event);
  if (!ev) return kInvalidHandle;
  std::lock_guard<std::mutex> g(ev->mu);
  return ev->completed >= ev->recorded ? kSuccess : kNotReady;
}

FAKE_API CUresult cuEventSynchronize(void* event) {
  FAKE_ENTER("cuEventSynchronize");
  EventPtr ev = find_event(event);
  if (!ev) return kInvalidHandle;
  std::unique_lock<std::mutex> lk(ev->mu);
  uint64_t target = ev->recorded;
  ev->cv.wait(lk, [&] { return ev->completed >= target; });
  return kSuccess;
}
