#include "core/window_setup.h"

#include <sys/random.h>
#include <unistd.h>

#include "base/clock.h"
#include "transport/binding.h"
#include "transport/cuda/copy_batch.h"
#include "transport/cuda/fd_pass.h"

namespace fxm {

uint64_t random_cookie() {
  uint64_t v = 0;
  while (v == 0) {
    if (::getrandom(&v, sizeof(v), 0) != static_cast<ssize_t>(sizeof(v))) {
      v = static_cast<uint64_t>(Clock::now().time_since_epoch().count()) * 0x9E3779B97F4A7C15ull ^
          static_cast<uint64_t>(::getpid());
    }
  }
  return v;
}

WindowDesc describe_local(const Window& w, const std::string& host, const std::string& shm_name) {
  WindowDesc d;
  d.kind = w.kind;
  d.size = w.size;
  d.addr = reinterpret_cast<uint64_t>(w.base);
  d.pid = static_cast<int32_t>(::getpid());
  d.host = host;
  d.pid_ns = pid_namespace();
  d.shm_name = shm_name;
  d.cookie_addr = reinterpret_cast<uint64_t>(w.cookie);
  d.cookie = w.nonce;
  return d;
}

void seal_window(Window& w, const WindowDesc& d) {
  if (w.cookie) __atomic_store_n(w.cookie, window_seal(d, w.index), __ATOMIC_RELEASE);
}

std::shared_ptr<Window> wrap_device_window(void* base, uint64_t size) {
  auto w = std::make_shared<Window>();
  w->kind = WindowKind::kDevice;
  w->dev = cuda::DeviceMemory::wrap(base, size);
  w->device = w->dev->ordinal();
  w->base = w->dev->base();
  w->size = size;
  cuda::prepare_copy_kernel(w->device);  // batches of staged ops land in it (copy_batch.h)
  return w;
}

void export_device(Window& w, WindowDesc* d) {
  d->dev = w.dev->export_for_peers();
  if (d->dev.vmm.empty()) return;
  d->fd_token = random_cookie();
  w.fd_server = std::make_unique<cuda::FdServer>(w.dev->fds(), d->fd_token);
  d->fd_socket = w.fd_server->name();
}

}  // namespace fxm
