// Leveled logging to stderr, one line each:
// "flagcx_mesh WARN 2026-12-05T14:07:01.123456Z pid 4711 [rank 3] message" (UTC).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/env.h"

namespace fxm {

bool log_enabled(LogLevel level);
void log_line(LogLevel level, int rank, const std::string& msg);

// Capture: while on, log lines go to a bounded queue instead of stderr (for a language
// binding's logger: it drains the queue from a thread of its own, so no line calls into it).
struct CapturedLine {
  LogLevel level;
  std::string text;  // "[rank 3] message" or "message": no level, time or pid
};
void log_capture(bool on);
// Up to `max` captured lines, waiting up to timeout_s for the first; *dropped: lines lost to
// the queue's bound (kLogCaptureMax) since the last call.
std::vector<CapturedLine> log_take(double timeout_s, size_t max, uint64_t* dropped);
constexpr size_t kLogCaptureMax = 10000;

// While alive, this thread's log lines speak as `who` (e.g. "agent prefill-0: "): a line that
// does not begin with it gets it in front, in place of "[rank r]" too. An agent sets it on its
// threads, so that lines of layers that do not know the agent (an interface choice, a device
// copy) name it all the same. Scopes nest; the outer one is back when the inner one ends.
class LogSpeaker {
 public:
  explicit LogSpeaker(std::string who);
  ~LogSpeaker();
  LogSpeaker(const LogSpeaker&) = delete;
  LogSpeaker& operator=(const LogSpeaker&) = delete;

 private:
  std::string outer_;
};

#define FXM_LOG(level, rank, msg)                                 \
  do {                                                            \
    if (::fxm::log_enabled(level)) ::fxm::log_line(level, rank, msg); \
  } while (0)
#define FXM_ERROR(rank, msg) FXM_LOG(::fxm::LogLevel::kError, rank, msg)
#define FXM_WARN(rank, msg) FXM_LOG(::fxm::LogLevel::kWarn, rank, msg)
#define FXM_INFO(rank, msg) FXM_LOG(::fxm::LogLevel::kInfo, rank, msg)
#define FXM_DEBUG(rank, msg) FXM_LOG(::fxm::LogLevel::kDebug, rank, msg)

}  // namespace fxm
