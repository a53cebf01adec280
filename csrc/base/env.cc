#include "base/env.h"

#include <cstdlib>
#include <cstring>

#include "base/status.h"

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

std::string cuda_path_env() {
  const char* s = std::getenv("FLAGCX_MESH_CUDA_PATH");
  return s ? s : "";
}

std::string cuda_driver_env() {
  const char* s = std::getenv("FLAGCX_MESH_CUDA_DRIVER");
  return s ? s : "";
}

namespace {

const char* launcher_var(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    fail(Code::kInvalidArgument, -1, 0,
         std::string(name) + " is not set (start the program with python -m flagcx_mesh.launch -n N)");
  }
  return v;
}

int launcher_int(const char* name) {
  const char* v = launcher_var(name);
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > (1 << 30)) {
    fail(Code::kInvalidArgument, -1, 0, std::string(name) + "=" + v + " is not a rank or rank count");
  }
  return static_cast<int>(x);
}

}  // namespace

LauncherEnv launcher_env() {
  LauncherEnv e;
  e.rank = launcher_int("FLAGCX_MESH_RANK");
  e.nranks = launcher_int("FLAGCX_MESH_NRANKS");
  e.unique_id_hex = launcher_var("FLAGCX_MESH_UNIQUE_ID");
  return e;
}

const EnvConfig& env_config() {
  static const EnvConfig cfg = read_env();
  return cfg;
}

}  // namespace fxm
