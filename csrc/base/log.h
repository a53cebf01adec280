// Minimal leveled logging to stderr: "flagcx_mesh WARN [rank 3] message".
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
