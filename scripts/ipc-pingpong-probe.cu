// How soon an 8-byte write from one process into another's device memory (a legacy IPC handle,
// as cuda-ipc maps it) can be known done on one GPU, by the ways a library may issue it and see
// it complete (docs/benchmarks.md, "The notification's floor on one GPU"). Two processes play ping-pong:
// each writes 8 bytes into the other's buffer, waits until its copy completed, then says so
// over a pipe; the other, woken by the pipe, answers the same way. Half the round trip, median
// and 10th / 90th percentiles of 2000 after 200 warm-up, per way:
//   pipe    no device write: the pipe's hop alone
//   memcpy  cuMemcpyAsync (device to device) on a non-blocking stream, cuEventQuery spun
//   kernel  a one-thread kernel storing the 8 bytes, cuEventQuery spun
//   memcpy-yield  as memcpy, the spin yielding the core between queries
//   memcpy-sync   as memcpy, cudaStreamSynchronize (the runtime's default spin-then-yield)
//   nvcc -O2 -o ipc-pingpong-probe scripts/ipc-pingpong-probe.cu && ./ipc-pingpong-probe
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>
#include <vector>

#define CK(x) do { cudaError_t ck_ = (x); if (ck_) { printf("%s: %s\n", #x, cudaGetErrorString(ck_)); exit(1);} } while (0)

namespace {

constexpr int kWarm = 200, kIters = 2000;
enum Way { kPipe, kMemcpy, kKernel, kMemcpyYield, kMemcpySync, kWays };
const char* kNames[kWays] = {"pipe", "memcpy", "kernel", "memcpy-yield", "memcpy-sync"};

__global__ void store8(unsigned long long* dst, unsigned long long v) { *dst = v; }

void put_all(int fd, const void* p, size_t n) {
  if (write(fd, p, n) != static_cast<ssize_t>(n)) exit(1);
}
void get_all(int fd, void* p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, static_cast<char*>(p) + got, n - got);
    if (r <= 0) exit(1);
    got += r;
  }
}

struct End {
  int rd, wr;  // the pipe from the other process, to it
  unsigned long long *mine, *theirs, *src;
  cudaStream_t s;
  cudaEvent_t done;
};

// Writes 8 bytes into the other's buffer and waits, the chosen way, until the write completed.
void write_and_wait(End& e, Way way, unsigned long long v) {
  if (way == kPipe) return;
  if (way == kKernel) {
    store8<<<1, 1, 0, e.s>>>(e.theirs, v);
  } else {
    CK(cudaMemcpyAsync(e.theirs, e.src, 8, cudaMemcpyDeviceToDevice, e.s));
  }
  if (way == kMemcpySync) {
    CK(cudaStreamSynchronize(e.s));
    return;
  }
  CK(cudaEventRecord(e.done, e.s));
  while (cudaEventQuery(e.done) == cudaErrorNotReady) {
    if (way == kMemcpyYield) sched_yield();
  }
}

// One process's side: `first` pings, the other answers. Returns the half round trips (us).
std::vector<double> play(End& e, Way way, bool first) {
  std::vector<double> half;
  char token = 'x';
  for (int i = 0; i < kWarm + kIters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    if (first) {
      write_and_wait(e, way, i);
      put_all(e.wr, &token, 1);
      get_all(e.rd, &token, 1);
    } else {
      get_all(e.rd, &token, 1);
      write_and_wait(e, way, i);
      put_all(e.wr, &token, 1);
    }
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (i >= kWarm) half.push_back(us / 2);
  }
  return half;
}

// A process's end: its buffer exported, the other's opened.
End open_end(int rd, int wr) {
  End e{rd, wr, nullptr, nullptr, nullptr, nullptr, nullptr};
  CK(cudaMalloc(&e.mine, 1 << 20));
  CK(cudaMalloc(&e.src, 8));
  CK(cudaMemset(e.src, 7, 8));
  cudaIpcMemHandle_t h;
  CK(cudaIpcGetMemHandle(&h, e.mine));
  put_all(wr, &h, sizeof(h));
  get_all(rd, &h, sizeof(h));
  CK(cudaIpcOpenMemHandle(reinterpret_cast<void**>(&e.theirs), h, cudaIpcMemLazyEnablePeerAccess));
  CK(cudaStreamCreateWithFlags(&e.s, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&e.done, cudaEventDisableTiming));
  store8<<<1, 1, 0, e.s>>>(e.theirs, 0);  // loads the kernel
  CK(cudaStreamSynchronize(e.s));
  return e;
}

}  // namespace

int main() {
  int ab[2], ba[2];
  if (pipe(ab) != 0 || pipe(ba) != 0) return 1;
  pid_t pid = fork();
  bool first = pid != 0;
  close(first ? ab[0] : ba[0]);  // each keeps the read end of the other's pipe and its own write end:
  close(first ? ba[1] : ab[1]);  // a peer that dies is an end of file, not a read that never returns
  End e = first ? open_end(ba[0], ab[1]) : open_end(ab[0], ba[1]);
  for (int w = 0; w < kWays; ++w) {
    std::vector<double> half = play(e, static_cast<Way>(w), first);
    if (!first) continue;
    std::sort(half.begin(), half.end());
    auto at = [&](double q) { return half[static_cast<size_t>(q * (half.size() - 1))]; };
    printf("%-14s half round trip %8.1f us (p10 %7.1f, p90 %7.1f)\n", kNames[w], at(0.5), at(0.1), at(0.9));
    fflush(stdout);
  }
  if (!first) return 0;
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
