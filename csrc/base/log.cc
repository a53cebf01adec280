#include "base/log.h"

#include <sys/time.h>
#include <unistd.h>

#include <cstdio>
#include <ctime>

namespace fxm {

bool log_enabled(LogLevel level) {
  return static_cast<int>(level) <= static_cast<int>(env_config().log_level);
}

namespace {

// "2026-12-05T14:07:01.123456Z": UTC, microseconds.
void format_now(char* out, size_t size) {
  timeval tv{};
  ::gettimeofday(&tv, nullptr);
  tm utc{};
  ::gmtime_r(&tv.tv_sec, &utc);
  char day[32];
  std::strftime(day, sizeof day, "%Y-%m-%dT%H:%M:%S", &utc);
  std::snprintf(out, size, "%s.%06ldZ", day, static_cast<long>(tv.tv_usec));
}

}  // namespace

// "flagcx_mesh WARN 2026-12-05T14:07:01.123456Z pid 4711 [rank 3] message": one write per line.
void log_line(LogLevel level, int rank, const std::string& msg) {
  static const char* names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  const char* name = names[static_cast<int>(level)];
  char now[48];
  format_now(now, sizeof now);
  char where[32] = "";
  if (rank >= 0) std::snprintf(where, sizeof where, " [rank %d]", rank);
  std::fprintf(stderr, "flagcx_mesh %s %s pid %d%s %s\n", name, now, static_cast<int>(::getpid()), where, msg.c_str());
  std::fflush(stderr);
}

}  // namespace fxm
