#include "base/log.h"

#include <cstdio>

namespace fxm {

bool log_enabled(LogLevel level) {
  return static_cast<int>(level) <= static_cast<int>(env_config().log_level);
}

void log_line(LogLevel level, int rank, const std::string& msg) {
  static const char* names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  const char* name = names[static_cast<int>(level)];
  if (rank >= 0) {
    std::fprintf(stderr, "flagcx_mesh %s [rank %d] %s\n", name, rank, msg.c_str());
  } else {
    std::fprintf(stderr, "flagcx_mesh %s %s\n", name, msg.c_str());
  }
  std::fflush(stderr);
}

}  // namespace fxm
