#include "core/env.h"

#include <cstdlib>
#include <cstring>

namespace fxm {
namespace {

LogLevel parse_level(const char* s) {
  if (s == nullptr) return LogLevel::kWarn;
  if (strcasecmp(s, "error") == 0) return LogLevel::kError;
  if (strcasecmp(s, "info") == 0) return LogLevel::kInfo;
  if (strcasecmp(s, "debug") == 0) return LogLevel::kDebug;
  return LogLevel::kWarn;
}

EnvConfig read_env() {
  EnvConfig cfg;
  if (const char* s = std::getenv("FLAGCX_MESH_IFNAME")) cfg.ifname = s;
  if (const char* s = std::getenv("FLAGCX_MESH_TIMEOUT")) {
    char* end = nullptr;
    double v = std::strtod(s, &end);
    if (end != s && v > 0) cfg.timeout_s = v;
  }
  cfg.log_level = parse_level(std::getenv("FLAGCX_MESH_LOG"));
  return cfg;
}

}  // namespace

std::string transport_env() {
  const char* s = std::getenv("FLAGCX_MESH_TRANSPORT");
  return s ? s : "";
}

const EnvConfig& env_config() {
  static const EnvConfig cfg = read_env();
  return cfg;
}

}  // namespace fxm
