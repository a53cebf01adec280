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

unsigned long long count_call(const char* name) {
  Counts& c = counts();
  std::lock_guard<std::mutex> g(c.mu);
  return ++c.calls[name];
}

}  // namespace fakecuda

// Calls of the entry point `name` (e.g. "cuEventRecord") so far, failed ones included.
FAKE_API unsigned long long fakecuda_call_count(const char* name) {
  fakecuda::Counts& c = fakecuda::counts();
  std::lock_guard<std::mutex> g(c.mu);
  auto it = c.calls.find(name ? name : "");
  return it == c.calls.end() ? 0 : it->second;
}
