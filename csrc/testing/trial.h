// One build trial over the test adaptor, for the self-test, the race bench
// and the tests: create a test adaptor, build with the chosen builder, check
// the result, close everything. Optionally a fault wrapper makes one adaptor
// call fail, to check how failures are reported.
// Thread-safety: each call uses its own adaptor; the bootstrap is shared.
#pragma once

#include <string>

#include "adaptor/builder.h"
#include "flagcx_mesh_testing.h"

namespace fxm::adaptor {

struct TrialOptions {
  int builder = FLAGCX_MESH_BUILD_ORDERED;
  uint32_t jitter_us = 0;
  uint64_t seed = 1;
  double timeout_s = 10.0;
  bool carry_bytes = true;
  uint32_t self_connect_delay_us = 0;
  bool wiring_check = true;
  int tag_base = 0x6d780000;
  bool verify = true;     // after success, prove slot p is rank p over the new comms
  int mode = FLAGCX_MESH_TEST_ADAPTOR_IB;  // the test adaptor's mode
  uint32_t socks_per_conn = 1;             // its sockets per connection (SOCKET mode)
  // "own": the bootstrap as given; "flagcx": wrapped as FlagCX's (no deadline
  // in recv) with an abort hook; "flagcx-noabort": the same without the hook.
  std::string bootstrap = "own";
  std::string fail_call;  // "" or an adaptor call name: that call returns kInjectedFault ...
  int fail_after = 0;     // ... on its (fail_after + 1)-th invocation
  bool fail_exits = false;  // ... or instead the process exits at once (_exit(kInjectedExit))
  // "garbage" | "silent" | "forged" | "": each rank first opens one more
  // connection to its first peer that sends garbage (needs carry_bytes),
  // nothing, or a copy of the rank's identity header with a wrong MAC, like a
  // stranger
  std::string stranger;
};
constexpr int kInjectedFault = 42;
constexpr int kInjectedExit = 86;

struct TrialResult {
  std::string outcome;  // "completed" | "hung" | "miswired" | "failed"
  int code = 0;         // fxm::Code of the failure (0 when completed)
  int peer = -1;
  std::string error;
  double seconds = 0;             // the build call alone
  bool outputs_untouched = true;  // on failure: the output arrays were not written
  bool verified = false;          // completed and the post-build check passed
  int bad_closes = 0;             // adaptor comms closed twice (or never opened)
  int left_open = 0;              // adaptor comms never closed by the end of the trial
  int mr_left = 0;                // memory registrations never deregistered
  int bad_deregs = 0;             // deregistrations of a handle not registered (or twice)
  bool boot_aborted = false;      // the build called the bootstrap's abort hook
};

// Errors of kind kInvalidArgument are thrown; every other failure is a result.
TrialResult run_trial(const BootOps& boot, const TrialOptions& opt);

}  // namespace fxm::adaptor
