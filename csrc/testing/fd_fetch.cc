// flagcx_mesh_test_fetch_fds: the cuda-vmm import's fd fetch, callable from a
// test (tests/test_fd_server.py) against a server of the test's making.
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "flagcx_mesh_testing.h"
#include "transport/cuda/fd_pass.h"

extern "C" FLAGCX_MESH_API int flagcx_mesh_test_fetch_fds(const char* name, uint64_t token, size_t count,
                                                          int timeout_ms, char* why, size_t why_len) {
  std::string reason;
  std::vector<int> fds = fxm::cuda::fetch_fds(name ? name : "", token, count, timeout_ms, &reason, 0);  // (any server)
  for (int fd : fds) ::close(fd);
  if (why != nullptr && why_len > 0) {
    size_t n = std::min(reason.size(), why_len - 1);
    std::memcpy(why, reason.data(), n);
    why[n] = '\0';
  }
  return fds.empty() && count > 0 ? -1 : static_cast<int>(fds.size());
}
