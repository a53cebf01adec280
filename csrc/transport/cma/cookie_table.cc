#include "transport/cma/cookie_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/hmac.h"
#include "base/status.h"
#include "transport/cma/cma.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace fxm::cma {
namespace {

constexpr uint64_t kMagic = 0x31544b43584d5846ull;  // "FXMXCKT1"
constexpr uint64_t kSlotsAt = 4096;                  // the header's page, then the slots
constexpr uint64_t kSlots = (CookieTable::kBytes - kSlotsAt) / sizeof(uint64_t);

struct Header {
  uint64_t magic;
  uint64_t base;  // where the owner maps it (a multiple of kBytes)
  int32_t pid;
  int32_t fd;     // the owner's descriptor of the file
  uint64_t tag;   // random: the file a peer fetched is the one whose header it read through cma
};

// A mapping of `fd` at an address aligned to kBytes, or null.
uint8_t* map_aligned(int fd) {
  void* r = ::mmap(nullptr, 2 * CookieTable::kBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return nullptr;
  auto lo = reinterpret_cast<uintptr_t>(r);
  uintptr_t at = (lo + CookieTable::kBytes - 1) & ~(CookieTable::kBytes - 1);
  void* m = ::mmap(reinterpret_cast<void*>(at), CookieTable::kBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  if (m == MAP_FAILED) {
    ::munmap(r, 2 * CookieTable::kBytes);
    return nullptr;
  }
  if (at > lo) ::munmap(r, at - lo);
  uintptr_t end = lo + 2 * CookieTable::kBytes, used = at + CookieTable::kBytes;
  if (end > used) ::munmap(reinterpret_cast<void*>(used), end - used);
  return static_cast<uint8_t*>(m);
}

// The owner's descriptor `fd` of process `pid`, as a descriptor of this process, or -1.
int fetch_fd(pid_t pid, int fd) {
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (pidfd >= 0) {
    int got = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, fd, 0));
    ::close(pidfd);
    if (got >= 0) return got;  // pidfd_getfd sets close-on-exec
  }
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  return ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
}

}  // namespace

CookieTable::CookieTable() {
  fd_ = ::memfd_create("flagcx_mesh-cookies", MFD_CLOEXEC);
  if (fd_ < 0) {
    give_up(std::string("memfd_create: ") + std::strerror(errno));
    return;
  }
  if (::ftruncate(fd_, static_cast<off_t>(kBytes)) != 0 || (base_ = map_aligned(fd_)) == nullptr) {
    give_up(std::string("sizing or mapping the table: ") + std::strerror(errno));
    return;
  }
  Header h{kMagic, reinterpret_cast<uint64_t>(base_), static_cast<int32_t>(::getpid()), fd_, 0};
  try {
    crypto::random_bytes(&h.tag, sizeof(h.tag));
  } catch (const Error& e) {  // no table rather than one a stale file could pass for
    give_up(std::string("a random tag: ") + e.what());
    return;
  }
  std::memcpy(base_, &h, sizeof(h));
}

CookieTable::~CookieTable() { release(); }

void CookieTable::release() {
  if (base_) ::munmap(base_, kBytes);
  if (fd_ >= 0) ::close(fd_);
  base_ = nullptr;
  fd_ = -1;
}

void CookieTable::give_up(const std::string& why) {
  why_not_ = why;
  release();
}

uint64_t* CookieTable::slot(uint32_t index) {
  if (!base_ || index >= kSlots) return nullptr;
  return reinterpret_cast<uint64_t*>(base_ + kSlotsAt) + index;
}

PeerCookies::~PeerCookies() {
  for (auto& [key, m] : tables_) {
    if (m) ::munmap(const_cast<uint8_t*>(m), CookieTable::kBytes);
  }
}

// Null (and why) when the table cannot be mapped: the header read through
// cma (which also says the pid is the process that published the address)
// names a file descriptor; the file fetched must be that table (its size, its header).
const uint8_t* PeerCookies::map_table(pid_t pid, uint64_t table_addr, std::string* why) {
  Header h{};
  int err = cma::read(pid, table_addr, &h, sizeof(h));
  if (err != 0) return *why = std::string("its header cannot be read: ") + std::strerror(err), nullptr;
  if (h.magic != kMagic || h.base != table_addr || h.pid != pid) return *why = "no table there", nullptr;
  int fd = fetch_fd(pid, h.fd);
  if (fd < 0) return *why = std::string("its file cannot be fetched: ") + std::strerror(errno), nullptr;
  struct stat st {};
  void* m = MAP_FAILED;
  if (::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) == CookieTable::kBytes) {
    m = ::mmap(nullptr, CookieTable::kBytes, PROT_READ, MAP_SHARED, fd, 0);
  }
  ::close(fd);
  if (m == MAP_FAILED) return *why = "the fetched file is not a table that maps", nullptr;
  Header seen{};
  std::memcpy(&seen, m, sizeof(seen));
  if (std::memcmp(&seen, &h, sizeof(h)) != 0) {
    ::munmap(m, CookieTable::kBytes);
    return *why = "the fetched file is another table", nullptr;
  }
  return static_cast<const uint8_t*>(m);
}

int PeerCookies::read(pid_t pid, uint64_t addr, uint64_t* out, std::string* first_try) {
  uint64_t table_addr = addr & ~(CookieTable::kBytes - 1);
  uint64_t at = addr - table_addr;
  if (at >= kSlotsAt && at % sizeof(uint64_t) == 0) {
    std::lock_guard<std::mutex> lock(mu_);
    auto key = std::make_pair(pid, table_addr);
    auto it = tables_.find(key);
    if (it == tables_.end()) {
      std::string why;
      it = tables_.emplace(key, map_table(pid, table_addr, &why)).first;
      *first_try = it->second ? "mapped" : why;
    }
    if (it->second) {
      *out = __atomic_load_n(reinterpret_cast<const uint64_t*>(it->second + at), __ATOMIC_ACQUIRE);
      return 0;
    }
  }
  return cma::read(pid, addr, out, sizeof(*out));
}

}  // namespace fxm::cma
