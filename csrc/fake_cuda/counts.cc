// How often each entry point was called in this process, for tests that
// count what one operation costs in driver calls (fakecuda_call_count).
//
// FXM_FAKECUDA_LIBRARY_THREADS=PREFIX (the library names its threads "fxm-..."): a call
// from a thread whose name does not start with PREFIX is counted as "foreign:NAME" too, so
// that a test tells a copy made on the application's thread (a waiter that landed bytes)
// from one made on the library's own threads.
#include <pthread.h>

#include <cstdlib>
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

// True when FXM_FAKECUDA_LIBRARY_THREADS is set and the calling thread's name does not start
// with it (read once: the tests set it in the process's environment before it starts).
bool foreign_thread() {
  static const std::string prefix = [] {
    const char* v = std::getenv("FXM_FAKECUDA_LIBRARY_THREADS");
    return std::string(v ? v : "");
  }();
  if (prefix.empty()) return false;
  char name[16] = {0};
  if (pthread_getname_np(pthread_self(), name, sizeof(name)) != 0) return false;
  return std::string(name).compare(0, prefix.size(), prefix) != 0;
}

}  // namespace

unsigned long long count_call(const char* name) {
  bool foreign = foreign_thread();
  Counts& c = counts();
  std::lock_guard<std::mutex> g(c.mu);
  if (foreign) ++c.calls[std::string("foreign:") + name];
  return ++c.calls[name];
}

}  // namespace fakecuda

// Calls of the entry point `name` (e.g. "cuEventRecord") so far, failed ones included;
// "foreign:cuEventRecord": those made on threads not the library's (FXM_FAKECUDA_LIBRARY_THREADS).
FAKE_API unsigned long long fakecuda_call_count(const char* name) {
  fakecuda::Counts& c = fakecuda::counts();
  std::lock_guard<std::mutex> g(c.mu);
  auto it = c.calls.find(name ? name : "");
  return it == c.calls.end() ? 0 : it->second;
}
