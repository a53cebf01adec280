// Window cookies that peers on this host read with a load instead of a
// process_vm_readv per call.
//
// A process that publishes many windows to peers that check them often (an
// agent: a peer reads a region's cookie back before each call that writes it
// over cma or a device path) keeps their cookies in one memory file, mapped
// here at an address aligned to the table's size. A cookie's address then
// names its table: a peer reads the table's header once through cma (which
// also proves the pid is that process), fetches the file by its descriptor
// number (pidfd_getfd, else /proc/<pid>/fd/<n>: both need the ptrace rights
// cma needs), maps it read-only and, from then on, loads cookies from it.
// Anything that fails on the way leaves the peer reading cookies through cma
// as before; nothing here can make a revoked cookie read as valid.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace fxm::cma {

class CookieTable {
 public:
  static constexpr uint64_t kBytes = 1ull << 20;  // the mapping's size and alignment
  CookieTable();  // never throws: a table that cannot be made hands out no slots
  ~CookieTable();
  CookieTable(const CookieTable&) = delete;
  CookieTable& operator=(const CookieTable&) = delete;

  // The slot for window `index` (written by the owner only), or null when
  // there is no table or the index is past its capacity (then the caller
  // keeps the cookie in memory of its own, read back through cma).
  uint64_t* slot(uint32_t index);
  bool ok() const { return base_ != nullptr; }
  const std::string& why_not() const { return why_not_; }

 private:
  void release();
  void give_up(const std::string& why);  // no table, and why
  uint8_t* base_ = nullptr;
  int fd_ = -1;
  std::string why_not_;
};

// A peer process's cookie tables, mapped here on first use.
class PeerCookies {
 public:
  PeerCookies() = default;
  ~PeerCookies();
  PeerCookies(const PeerCookies&) = delete;
  PeerCookies& operator=(const PeerCookies&) = delete;

  // The cookie now at `addr` in process `pid`: loaded from its mapped table,
  // else read through cma. 0 or the errno of the cma read. A read that tried
  // to map a table for the first time says how it went in `first_try`
  // ("mapped", or why not; for the caller's log); others leave it alone.
  int read(pid_t pid, uint64_t addr, uint64_t* out, std::string* first_try);

 private:
  const uint8_t* map_table(pid_t pid, uint64_t table_addr, std::string* why);

  std::mutex mu_;
  std::map<std::pair<pid_t, uint64_t>, const uint8_t*> tables_;  // null: tried, not mappable
};

}  // namespace fxm::cma
