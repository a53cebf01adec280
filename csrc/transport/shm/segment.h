// POSIX shared-memory segments for library-allocated windows: the owner
// creates and maps one, peers on the same host map it by name, and the owner
// unlinks the name once every peer has mapped it (nothing leaks on a crash).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fxm::shm {

class Segment {
 public:
  Segment() = default;
  Segment(Segment&& o) noexcept { *this = std::move(o); }
  Segment& operator=(Segment&& o) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() { reset(); }

  // Creates, sizes and maps a new segment (zero-filled). Throws Error.
  static Segment create(const std::string& name, size_t size);
  // The same under a fresh random name ("/fxm-" + 32 hex digits from
  // getrandom, nothing derived from any id): a name another local user
  // created first (EEXIST) is skipped for a new one, up to kNameAttempts times.
  static Segment create_unique(size_t size);
  static constexpr int kNameAttempts = 16;
  // Maps an existing segment; returns an empty Segment and sets *err on failure.
  // With `file`, the opened file's device and inode go there (binding.h proves whose it is).
  static Segment open(const std::string& name, size_t size, int* err, uint64_t file[2] = nullptr);

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  explicit operator bool() const { return data_ != nullptr; }
  void unlink();  // removes the name; mappings stay valid
  void reset();   // unmaps (and unlinks if still owned and named)

 private:
  // Sizes and maps a just-created fd (closed here) as the owner of `name`.
  static Segment from_new_fd(int fd, const std::string& name, size_t size);

  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  bool owner_ = false;
};

// Identifies "same host, same /dev/shm": boot id + the device/inode of /dev/shm.
std::string host_id();

}  // namespace fxm::shm
