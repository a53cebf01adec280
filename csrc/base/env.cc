#include "base/env.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <string>

#include <sys/resource.h>
#include <unistd.h>

#include "base/status.h"

namespace fxm {
namespace {

void add_error(std::string* error, const std::string& what) {
  if (!error->empty()) *error += "; ";
  *error += what;
}

// FLAGCX_MESH_LOG: unset or empty is warn; a value that is no level is an error
// (logging stays at warn until an entry point reports it).
LogLevel parse_level(const char* s, std::string* error) {
  if (s == nullptr || *s == '\0') return LogLevel::kWarn;
  if (strcasecmp(s, "error") == 0) return LogLevel::kError;
  if (strcasecmp(s, "warn") == 0 || strcasecmp(s, "warning") == 0) return LogLevel::kWarn;
  if (strcasecmp(s, "info") == 0) return LogLevel::kInfo;
  if (strcasecmp(s, "debug") == 0) return LogLevel::kDebug;
  add_error(error, std::string("FLAGCX_MESH_LOG=") + s + " is not one of error, warn, info, debug");
  return LogLevel::kWarn;
}

// A variable of seconds: unset or empty keeps *out; else a finite number > 0,
// or `error` names the variable and its value.
void parse_seconds(const char* name, double* out, std::string* error) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return;
  char* end = nullptr;
  double v = std::strtod(s, &end);
  if (end != s && *end == '\0' && std::isfinite(v) && v > 0) {
    *out = v;
    return;
  }
  add_error(error, std::string(name) + "=" + s + " is not a number of seconds > 0 (finite)");
}

EnvConfig read_env() {
  EnvConfig cfg;
  if (const char* s = std::getenv("FLAGCX_MESH_IFNAME")) cfg.ifname = s;
  parse_seconds("FLAGCX_MESH_TIMEOUT", &cfg.timeout_s, &cfg.error);
  parse_seconds("FLAGCX_MESH_ROOT_IDLE_TIMEOUT", &cfg.root_idle_s, &cfg.error);
  cfg.log_level = parse_level(std::getenv("FLAGCX_MESH_LOG"), &cfg.error);
  return cfg;
}

}  // namespace

void require_valid_env() {
  if (!env_config().error.empty()) fail(Code::kInvalidArgument, -1, 0, env_config().error);
}

std::string ucx_lib_env() {
  const char* s = std::getenv("FLAGCX_MESH_UCX_LIB");
  return s ? s : "";
}

std::string ucx_error_mode_env() {
  const char* s = std::getenv("FLAGCX_MESH_UCX_ERROR_MODE");
  return s ? s : "";
}

std::string transport_env() {
  const char* s = std::getenv("FLAGCX_MESH_TRANSPORT");
  return s ? s : "";
}

int default_tcp_lanes(uint64_t sockets_per_lane) {
  long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
  uint64_t lanes = static_cast<uint64_t>(std::min<long>(4, std::max<long>(1, cores / 2)));
  rlimit fds{};
  if (sockets_per_lane > 0 && ::getrlimit(RLIMIT_NOFILE, &fds) == 0 && fds.rlim_cur != RLIM_INFINITY) {
    uint64_t fit = static_cast<uint64_t>(fds.rlim_cur) / 2 / sockets_per_lane;  // half the fds at most
    lanes = std::max<uint64_t>(1, std::min(lanes, fit));
  }
  return static_cast<int>(lanes);
}

int tcp_lanes_env(uint64_t sockets_per_lane) {
  const char* s = std::getenv("FLAGCX_MESH_TCP_LANES");
  if (s == nullptr || *s == '\0') return default_tcp_lanes(sockets_per_lane);
  char* end = nullptr;
  long v = std::strtol(s, &end, 10);
  if (*end != '\0' || v < 1 || v > kMaxTcpLanes) {
    fail(Code::kInvalidArgument, -1, 0, std::string("FLAGCX_MESH_TCP_LANES=") + s + ": not a whole number from 1 to " +
                                            std::to_string(kMaxTcpLanes));
  }
  return static_cast<int>(v);
}

int tcp_lane_spin_us_env() {
  static const int value = [] {
    const char* s = std::getenv("FLAGCX_MESH_TCP_LANE_SPIN_US");
    if (s == nullptr || *s == '\0') return 50;
    char* end = nullptr;
    long v = std::strtol(s, &end, 10);
    if (*end != '\0' || v < 0 || v > 10000) {
      fail(Code::kInvalidArgument, -1, 0, std::string("FLAGCX_MESH_TCP_LANE_SPIN_US=") + s +
                                              ": not a whole number of microseconds from 0 to 10000");
    }
    return static_cast<int>(v);
  }();
  return value;
}

size_t agent_max_views_env() {
  const char* s = std::getenv("FLAGCX_MESH_AGENT_MAX_VIEWS");
  long n = s ? std::strtol(s, nullptr, 10) : 0;
  return n > 0 ? static_cast<size_t>(n) : 4096;
}

PortRange agent_ports_env() {
  const char* s = std::getenv("FLAGCX_MESH_AGENT_PORTS");
  if (!s || !*s) return {};
  char* end = nullptr;
  long first = std::strtol(s, &end, 10), last = first;
  if (end != s && *end == '-') {
    const char* rest = end + 1;
    last = std::strtol(rest, &end, 10);
    if (end == rest) end = const_cast<char*>(rest) - 1;  // "P-": malformed
  }
  if (end == s || *end != '\0' || first < 1 || last > 65535 || first > last) {
    fail(Code::kInvalidArgument, -1, 0, std::string("FLAGCX_MESH_AGENT_PORTS=") + s +
                                            ": not a port or a range of ports P-Q (1 to 65535, P <= Q)");
  }
  return {static_cast<int>(first), static_cast<int>(last)};
}

std::string cuda_path_env() {
  const char* s = std::getenv("FLAGCX_MESH_CUDA_PATH");
  return s ? s : "";
}

std::string cuda_batch_copy_env() {
  const char* s = std::getenv("FLAGCX_MESH_CUDA_BATCH_COPY");
  return s ? s : "";
}

std::string tcp_batch_env() {
  const char* s = std::getenv("FLAGCX_MESH_TCP_BATCH");
  return s ? s : "";
}

std::string agent_cookie_table_env() {
  const char* s = std::getenv("FLAGCX_MESH_AGENT_COOKIE_TABLE");
  return s ? s : "";
}

std::string agent_secret_env() {
  const char* s = std::getenv("FLAGCX_MESH_AGENT_SECRET");
  return s ? s : "";
}

std::string cuda_driver_env() {
  const char* s = std::getenv("FLAGCX_MESH_CUDA_DRIVER");
  return s ? s : "";
}

std::string staged_chunk_env() {
  const char* s = std::getenv("FLAGCX_MESH_STAGED_CHUNK_BYTES");
  return s ? s : "";
}

std::string staged_inflight_env() {
  const char* s = std::getenv("FLAGCX_MESH_STAGED_INFLIGHT_BYTES");
  return s ? s : "";
}

std::string staged_bounce_env() {
  const char* s = std::getenv("FLAGCX_MESH_STAGED_BOUNCE");
  return s ? s : "";
}

std::string staged_landing_env() {
  const char* s = std::getenv("FLAGCX_MESH_STAGED_LANDING_BUFFERS");
  return s ? s : "";
}

std::string staged_kernel_env() {
  const char* s = std::getenv("FLAGCX_MESH_STAGED_KERNEL_BYTES");
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

double default_timeout_s() {
  require_valid_env();
  return env_config().timeout_s;
}

double root_idle_timeout_s() {
  require_valid_env();
  return env_config().root_idle_s;
}

double build_timeout_s(double seconds, const char* what) {
  if (seconds == 0) return default_timeout_s();
  check_timeout(seconds, what, false);
  return seconds;
}

void check_call_timeout(double seconds, const std::string& what) {
  if (seconds != 0) check_timeout(seconds, what.c_str(), true);
}

Deadline call_deadline(double seconds, double default_s, const std::string& what) {
  check_call_timeout(seconds, what);
  return Deadline::after_seconds(seconds != 0 ? seconds : default_s);
}

void check_timeout(double seconds, const char* what, bool no_limit_ok) {
  if (std::isfinite(seconds) && seconds > 0) return;
  if (no_limit_ok && std::isinf(seconds) && seconds > 0) return;
  char value[64];
  std::snprintf(value, sizeof(value), "%g", seconds);
  fail(Code::kInvalidArgument, -1, 0,
       std::string(what) + " must be a finite number of seconds > 0" + (no_limit_ok ? " (or inf: no limit)" : "") +
           ", got " + value);
}

}  // namespace fxm
