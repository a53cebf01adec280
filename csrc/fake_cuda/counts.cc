// How often each entry point was called in this process, for tests that
// count what one operation costs in driver calls (fakecuda_call_count).
#include <map>
#include <mutex>
#include <string>

#include "fake_cuda.h"

namespace fakecuda {
namespace {

struct Counts {
  std::mutex mu;
  std::map<std::string, unsigned long long> calls;  // by base name (no _v2)
};

Counts& counts() {
  static Counts* c = new Counts;  // never destroyed: stream threads may call at exit
  return *c;
}

}  // namespace

// The calling thread's own calls, by base name (fakecuda_thread_call_count); never destroyed (a
// thread may call during its exit, after its thread_local objects are gone).
thread_local std::map<std::string, unsigned long long>* t_calls = nullptr;

unsigned long long count_call(const char* name) {
  if (t_calls == nullptr) t_calls = new std::map<std::string, unsigned long long>();
  ++(*t_calls)[name];
  Counts& c = counts();
  std::lock_guard<std::mutex> g(c.mu);
  return ++c.calls[name];
}

}  // namespace fakecuda

// Calls of the entry point `name` made by the calling thread so far (a test's check that device
// work stays on the library's own threads: a waiter's thread lands no staged bytes itself).
FAKE_API unsigned long long fakecuda_thread_call_count(const char* name) {
  if (fakecuda::t_calls == nullptr) return 0;
  auto it = fakecuda::t_calls->find(name ? name : "");
  return it == fakecuda::t_calls->end() ? 0 : it->second;
}

// Calls of the entry point `name` (e.g. "cuEventRecord") so far, failed ones included.
FAKE_API unsigned long long fakecuda_call_count(const char* name) {
  fakecuda::Counts& c = fakecuda::counts();
  std::lock_guard<std::mutex> g(c.mu);
  auto it = c.calls.find(name ? name : "");
  return it == c.calls.end() ? 0 : it->second;
}
