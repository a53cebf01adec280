#include "transport/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "base/status.h"

namespace fxm::shm {

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = o.data_;
    size_ = o.size_;
    name_ = std::move(o.name_);
    owner_ = o.owner_;
    o.data_ = nullptr;
    o.size_ = 0;
    o.owner_ = false;
  }
  return *this;
}

namespace {

uint8_t* map_fd(int fd, size_t size, int* err) {
  void* p = ::mmap(nullptr, size == 0 ? 1 : size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *err = errno;
    return nullptr;
  }
  return static_cast<uint8_t*>(p);
}

// "/fxm-" + 32 hex digits of the kernel's random source.
std::string random_name() {
  uint8_t bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno != EINTR) fail(Code::kSystem, -1, errno, "getrandom for a shared-memory name");
    if (n > 0) got += static_cast<size_t>(n);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string name = "/fxm-";
  for (uint8_t b : bytes) {
    name += kHex[b >> 4];
    name += kHex[b & 15];
  }
  return name;
}

// shm_open(O_CREAT | O_EXCL); fails naming the segment unless the name is
// taken (EEXIST), which returns -1 with *taken set.
int create_fd(const std::string& name, bool* taken) {
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  *taken = fd < 0 && errno == EEXIST;
  if (fd < 0 && !*taken) fail(Code::kSystem, -1, errno, "shm_open(" + name + ") for a window");
  return fd;
}

}  // namespace

Segment Segment::create_unique(size_t size) {
  for (int attempt = 0; attempt < kNameAttempts; ++attempt) {
    std::string name = random_name();
    bool taken = false;
    int fd = create_fd(name, &taken);
    if (!taken) return from_new_fd(fd, name, size);
  }
  fail(Code::kSystem, -1, EEXIST, "shm_open for a window: " + std::to_string(kNameAttempts) +
                                      " random names in a row already existed in /dev/shm");
}

Segment Segment::create(const std::string& name, size_t size) {
  bool taken = false;
  int fd = create_fd(name, &taken);
  if (taken) fail(Code::kSystem, -1, EEXIST, "shm_open(" + name + ") for a window");
  return from_new_fd(fd, name, size);
}

Segment Segment::from_new_fd(int fd, const std::string& name, size_t size) {
  int err = 0;
  if (::ftruncate(fd, static_cast<off_t>(size == 0 ? 1 : size)) != 0) err = errno;
  // tmpfs grants pages lazily: reserve them now, or a write past what /dev/shm
  // can hold raises SIGBUS in whichever process touches the page.
  if (!err) err = ::posix_fallocate(fd, 0, static_cast<off_t>(size == 0 ? 1 : size));
  uint8_t* p = err ? nullptr : map_fd(fd, size, &err);
  ::close(fd);
  if (p == nullptr) {
    ::shm_unlink(name.c_str());
    fail(Code::kSystem, -1, err,
         "sizing/mapping a " + std::to_string(size) + "-byte shared-memory window (is /dev/shm large enough?)");
  }
  Segment s;
  s.data_ = p;
  s.size_ = size;
  s.name_ = name;
  s.owner_ = true;
  return s;
}

Segment Segment::open(const std::string& name, size_t size, int* err, uint64_t file[2]) {
  Segment s;
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    *err = errno;
    return s;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < (size == 0 ? 1 : size)) {
    *err = EINVAL;
    ::close(fd);
    return s;
  }
  if (file) {
    file[0] = st.st_dev;
    file[1] = st.st_ino;
  }
  s.data_ = map_fd(fd, size, err);
  ::close(fd);
  if (s.data_ != nullptr) s.size_ = size;
  return s;
}

void Segment::unlink() {
  if (owner_ && !name_.empty()) ::shm_unlink(name_.c_str());
  owner_ = false;
}

void Segment::reset() {
  if (data_ != nullptr) ::munmap(data_, size_ == 0 ? 1 : size_);
  unlink();
  data_ = nullptr;
  size_ = 0;
}

namespace {

// The first line of a small file ("" when it cannot be read). Plain read(2):
// the core uses no iostreams, which would set up a C++ locale.
std::string first_line(const char* path) {
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  char buf[128];
  ssize_t n;
  do {
    n = ::read(fd, buf, sizeof(buf));
  } while (n < 0 && errno == EINTR);
  ::close(fd);
  std::string s(buf, n > 0 ? static_cast<size_t>(n) : 0);
  return s.substr(0, s.find('\n'));
}

}  // namespace

std::string host_id() {
  std::string boot = first_line("/proc/sys/kernel/random/boot_id");
  struct stat st {};
  ::stat("/dev/shm", &st);
  return boot + ":" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
}

}  // namespace fxm::shm
