// Leveled logging to stderr, one line each:
// "flagcx_mesh WARN 2026-12-05T14:07:01.123456Z pid 4711 [rank 3] message" (UTC).
#pragma once

#include <string>

#include "base/env.h"

namespace fxm {

bool log_enabled(LogLevel level);
void log_line(LogLevel level, int rank, const std::string& msg);

#define FXM_LOG(level, rank, msg)                                 \
  do {                                                            \
    if (::fxm::log_enabled(level)) ::fxm::log_line(level, rank, msg); \
  } while (0)
#define FXM_ERROR(rank, msg) FXM_LOG(::fxm::LogLevel::kError, rank, msg)
#define FXM_WARN(rank, msg) FXM_LOG(::fxm::LogLevel::kWarn, rank, msg)
#define FXM_INFO(rank, msg) FXM_LOG(::fxm::LogLevel::kInfo, rank, msg)
#define FXM_DEBUG(rank, msg) FXM_LOG(::fxm::LogLevel::kDebug, rank, msg)

}  // namespace fxm
