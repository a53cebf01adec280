// Initialisation, devices, primary contexts, error names, fault injection.
#include <pthread.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "fake_cuda.h"

namespace fakecuda {
namespace {

constexpr int kMaxDevices = 16;
constexpr size_t kDefaultGranularity = size_t(2) << 20;

struct Context {
  int device;
};

struct State {
  std::mutex mu;
  std::atomic<bool> initialized{false};
  int devices = 1;
  size_t granularity = kDefaultGranularity;
  bool no_stream_memops = false;
  long copy_to_device_delay_ms = 0;
  long copy_from_device_delay_ms = 0;
  long host_unregister_us_per_mib = 100;
  std::atomic<long> not_ready_query_delay_us{0};  // set at run time (fxmFakeSetNotReadyQueryDelay)
  bool environment_read = false;
  bool forked = false;  // a child forked after cuInit: its streams' threads are gone
  std::map<std::string, CUresult> failures;
  std::map<std::string, long> failures_from;  // the call from which each fails (1: every call)
  std::map<std::string, long> failures_count;  // how many calls from it fail (0: every one after)
  Context contexts[kMaxDevices];
};

State& state() {
  static State* s = new State;  // never destroyed: stream threads may outlive exit()
  return *s;
}

thread_local Context* current_context = nullptr;

// As with the real driver, a child forked from an initialised process cannot
// use it: every call answers CUDA_ERROR_NOT_INITIALIZED instead of waiting
// on stream threads that do not exist in the child.
void forked_child() {
  State& s = state();
  if (!s.initialized.load()) return;
  s.forked = true;
  s.initialized.store(false);
}

std::string base_name(std::string name) {
  if (name.size() > 3 && name.compare(name.size() - 3, 3, "_v2") == 0) name.resize(name.size() - 3);
  return name;
}

// FXM_FAKECUDA_FAIL="cuIpcGetMemHandle=1,cuMemCreate=801,cuLaunchKernel=719@2": an entry
// point fails with that code, from its Nth call on where "@N" follows (from the first otherwise);
// "@N:K": its calls N to N+K-1 only (a driver that refuses once, then works again).
bool parse_failures(const char* text, std::map<std::string, CUresult>* out, std::map<std::string, long>* from,
                    std::map<std::string, long>* count) {
  std::string all = text ? text : "";
  size_t pos = 0;
  while (pos < all.size()) {
    size_t end = all.find(',', pos);
    if (end == std::string::npos) end = all.size();
    std::string item = all.substr(pos, end - pos);
    pos = end + 1;
    if (item.empty()) continue;
    size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) return false;
    char* tail = nullptr;
    long code = std::strtol(item.c_str() + eq + 1, &tail, 10);
    if (tail == item.c_str() + eq + 1) return false;
    long nth = 1, calls = 0;
    if (*tail == '@') {
      char* at = tail + 1;
      nth = std::strtol(at, &tail, 10);
      if (tail == at || nth < 1) return false;
      if (*tail == ':') {
        at = tail + 1;
        calls = std::strtol(at, &tail, 10);
        if (tail == at || calls < 1) return false;
      }
    }
    if (*tail != '\0') return false;
    (*out)[base_name(item.substr(0, eq))] = static_cast<CUresult>(code);
    (*from)[base_name(item.substr(0, eq))] = nth;
    (*count)[base_name(item.substr(0, eq))] = calls;
  }
  return true;
}

long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* tail = nullptr;
  long x = std::strtol(v, &tail, 0);
  return *tail == '\0' ? x : -1;
}

CUresult read_environment(State& s) {
  long devices = env_long("FXM_FAKECUDA_DEVICES", 1);
  long gran = env_long("FXM_FAKECUDA_GRANULARITY", static_cast<long>(kDefaultGranularity));
  long delay = env_long("FXM_FAKECUDA_COPY_TO_DEVICE_DELAY_MS", 0);
  long from_delay = env_long("FXM_FAKECUDA_COPY_FROM_DEVICE_DELAY_MS", 0);
  long unregister_us = env_long("FXM_FAKECUDA_HOST_UNREGISTER_US_PER_MIB", 100);
  if (devices < 0 || devices > kMaxDevices || gran <= 0 || (gran & 4095) != 0 || delay < 0 || from_delay < 0 ||
      unregister_us < 0)
    return kInvalidValue;
  s.host_unregister_us_per_mib = unregister_us;
  s.copy_to_device_delay_ms = delay;
  s.copy_from_device_delay_ms = from_delay;
  if (!parse_failures(std::getenv("FXM_FAKECUDA_FAIL"), &s.failures, &s.failures_from, &s.failures_count)) {
    return kInvalidValue;
  }
  s.devices = static_cast<int>(devices);
  s.granularity = static_cast<size_t>(gran);
  const char* memops = std::getenv("FXM_FAKECUDA_NO_STREAM_MEMOPS");
  s.no_stream_memops = memops && *memops && std::strcmp(memops, "0") != 0;
  for (int i = 0; i < kMaxDevices; ++i) s.contexts[i].device = i;
  return kSuccess;
}

struct ErrorText {
  CUresult code;
  const char* name;
  const char* text;
};
constexpr ErrorText kErrors[] = {
    {kSuccess, "CUDA_SUCCESS", "no error"},
    {kInvalidValue, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {kOutOfMemory, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {kNotInitialized, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {kDeinitialized, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {kNoDevice, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {kInvalidDevice, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {kInvalidContext, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {kInvalidHandle, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {kNotFound, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {kNotReady, "CUDA_ERROR_NOT_READY", "device not ready"},
    {kIllegalAddress, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {kHostAlreadyRegistered, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {kHostNotRegistered, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {kNotPermitted, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {kNotSupported, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};

const ErrorText* find_error(CUresult code) {
  for (const ErrorText& e : kErrors)
    if (e.code == code) return &e;
  return nullptr;
}

}  // namespace

bool initialized() { return state().initialized.load(std::memory_order_acquire); }
int device_count() { return state().devices; }
size_t granularity() { return state().granularity; }
bool stream_memops_disabled() { return state().no_stream_memops; }
long copy_to_device_delay_ms() { return state().copy_to_device_delay_ms; }
long copy_from_device_delay_ms() { return state().copy_from_device_delay_ms; }
long host_unregister_us_per_mib() { return state().host_unregister_us_per_mib; }
long not_ready_query_delay_us() { return state().not_ready_query_delay_us.load(); }

CUresult injected_failure(const char* name, long nth) {
  State& s = state();
  if (s.failures.empty()) return kSuccess;  // written once, before the first cuInit returns
  auto it = s.failures.find(name);
  if (it == s.failures.end()) return kSuccess;
  long from = s.failures_from[name], calls = s.failures_count[name];
  bool failing = (from <= 1 || nth >= from) && (calls == 0 || nth < from + calls);
  return failing ? it->second : kSuccess;
}

CUresult injected_failure(const char* name) {  // (cuInit: not counted yet)
  return injected_failure(name, static_cast<long>(fakecuda_call_count(name)));
}

void* primary_context(int device) { return &state().contexts[device]; }

int context_device(void* ctx) {
  State& s = state();
  for (int i = 0; i < s.devices; ++i)
    if (ctx == &s.contexts[i]) return i;
  return -1;
}

int current_device() { return current_context ? current_context->device : -1; }

}  // namespace fakecuda

using namespace fakecuda;

FAKE_API CUresult cuInit(unsigned flags) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  if (flags != 0) return kInvalidValue;
  if (s.initialized.load()) return kSuccess;
  if (s.forked) return kNotInitialized;
  if (!s.environment_read) {
    pthread_atfork(nullptr, nullptr, forked_child);
    if (CUresult r = read_environment(s)) return r;
    s.environment_read = true;
  }
  // A failed cuInit leaves the driver uninitialised, as the real one does.
  if (CUresult inj = injected_failure("cuInit")) return inj;
  if (s.devices == 0) return kNoDevice;
  s.initialized.store(true, std::memory_order_release);
  return kSuccess;
}

FAKE_API CUresult cuDriverGetVersion(int* version) {
  if (!version) return kInvalidValue;
  *version = 13000;
  return kSuccess;
}

FAKE_API CUresult cuGetErrorName(CUresult code, const char** out) {
  const ErrorText* e = find_error(code);
  if (!out) return kInvalidValue;
  *out = e ? e->name : nullptr;
  return e ? kSuccess : kInvalidValue;
}

FAKE_API CUresult cuGetErrorString(CUresult code, const char** out) {
  const ErrorText* e = find_error(code);
  if (!out) return kInvalidValue;
  *out = e ? e->text : nullptr;
  return e ? kSuccess : kInvalidValue;
}

FAKE_API CUresult cuDeviceGetCount(int* count) {
  FAKE_ENTER("cuDeviceGetCount");
  if (!count) return kInvalidValue;
  *count = state().devices;
  return kSuccess;
}

FAKE_API CUresult cuDeviceGet(int* device, int ordinal) {
  FAKE_ENTER("cuDeviceGet");
  if (!device) return kInvalidValue;
  if (ordinal < 0 || ordinal >= state().devices) return kInvalidDevice;
  *device = ordinal;
  return kSuccess;
}

FAKE_API CUresult cuDevicePrimaryCtxRetain(void** ctx, int device) {
  FAKE_ENTER("cuDevicePrimaryCtxRetain");
  if (!ctx) return kInvalidValue;
  if (device < 0 || device >= state().devices) return kInvalidDevice;
  *ctx = primary_context(device);
  return kSuccess;
}

FAKE_API CUresult cuCtxSetCurrent(void* ctx) {
  FAKE_ENTER("cuCtxSetCurrent");
  if (ctx && context_device(ctx) < 0) return kInvalidContext;
  current_context = static_cast<Context*>(ctx);
  return kSuccess;
}

FAKE_API CUresult cuCtxGetCurrent(void** ctx) {
  FAKE_ENTER("cuCtxGetCurrent");
  if (!ctx) return kInvalidValue;
  *ctx = current_context;
  return kSuccess;
}

FAKE_API CUresult cuCtxGetDevice(int* device) {
  FAKE_ENTER("cuCtxGetDevice");
  if (!device) return kInvalidValue;
  if (!current_context) return kInvalidContext;
  *device = context_device(current_context);
  return kSuccess;
}

FAKE_API CUresult cuCtxSynchronize() {
  FAKE_ENTER("cuCtxSynchronize");
  FAKE_NEED_CONTEXT();
  synchronize_all_streams();
  return kSuccess;
}

// A test's switch at run time (not a driver entry point): see not_ready_query_delay_us().
FAKE_API void fxmFakeSetNotReadyQueryDelay(long us) { state().not_ready_query_delay_us.store(us < 0 ? 0 : us); }
