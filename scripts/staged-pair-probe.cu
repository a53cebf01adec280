// Whether two processes sharing one GPU slow each other's staged chunks (docs/benchmarks.md,
// "Where a staged batch waits, and two processes on one GPU"). The staged benchmarks run the
// sender and the target on one GPU: the sender gathers each 1 MiB chunk into pinned host memory, the target scatters each landed chunk
// back, both with the library's copy kernel, a launch and an event per chunk, up to 4 chunks in
// flight, as the path does. Between hosts each side has its GPU to itself. This probe times the
// gather alone, the scatter alone, then both at once in two processes, GB/s each (by wall clock
// over 4096 rounds of CHUNK bytes of BLOCK-byte blocks; BLOCK divides CHUNK). Each side's blocks
// lie in 8 chunks of device memory, which the GPU's L2 may hold: the bench streams 256 MiB.
//   nvcc -O2 -o staged-pair-probe scripts/staged-pair-probe.cu && ./staged-pair-probe [BLOCK] [CHUNK]
#include <unistd.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include <deque>
#include <vector>
// The library's own kernel (not compiled by the build: turned into the PTX the library embeds).
#include "../csrc/transport/cuda/kernels/copy_blocks.cu"

#define CK(x) do { cudaError_t ck_ = (x); if (ck_) { printf("%s: %s\n", #x, cudaGetErrorString(ck_)); exit(1);} } while (0)

namespace {

constexpr int kRounds = 4096, kAhead = 4;

// One side: `rounds` chunks of `per` blocks, gathered into (or scattered out of) mapped pinned
// memory a launch each, the oldest event waited once 4 are in flight. Returns GB/s.
double chunks(bool gather, size_t bs, size_t chunk, int fd_go) {
  size_t per = chunk / bs ? chunk / bs : 1, pool = chunk * 8;
  char *dev, *host, *hostd;
  CK(cudaMalloc(&dev, pool));
  CK(cudaHostAlloc(&host, chunk * kAhead, cudaHostAllocMapped | cudaHostAllocPortable));
  CK(cudaHostGetDevicePointer((void**)&hostd, host, 0));
  fxm_copy *list, *listd;
  CK(cudaHostAlloc(&list, sizeof(fxm_copy) * per * kAhead, cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer((void**)&listd, list, 0));
  for (int slot = 0; slot < kAhead; ++slot) {
    for (size_t i = 0; i < per; ++i) {  // every other block of the pool: scattered
      auto blk = (unsigned long long)(dev + ((slot * per + i) * 2 % (pool / bs)) * bs);
      auto piece = (unsigned long long)(hostd + slot * chunk + i * bs);
      list[slot * per + i] = gather ? fxm_copy{piece, blk, bs} : fxm_copy{blk, piece, bs};
    }
  }
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> ev(kAhead);
  for (auto& event : ev) CK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  unsigned y = static_cast<unsigned>((bs + 65535) / 65536);
  fxm_copy_blocks<<<dim3(per, y), 256, 0, s>>>(listd, 65536);  // warm
  CK(cudaStreamSynchronize(s));
  if (fd_go >= 0) {  // both processes start together
    char c;
    if (read(fd_go, &c, 1) != 1) exit(1);
  }
  auto t0 = std::chrono::steady_clock::now();
  std::deque<int> flying;
  for (int r = 0; r < kRounds; ++r) {
    int slot = r % kAhead;
    if (flying.size() == kAhead) {
      while (cudaEventQuery(ev[flying.front()]) == cudaErrorNotReady) {
      }
      flying.pop_front();
    }
    fxm_copy_blocks<<<dim3(per, y), 256, 0, s>>>(listd + slot * per, 65536);
    CK(cudaEventRecord(ev[slot], s));
    flying.push_back(slot);
  }
  CK(cudaStreamSynchronize(s));
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return chunk * double(kRounds) / secs / 1e9;
}

// Runs one side in a child process (CUDA is initialized only there); prints its figure.
pid_t side(bool gather, size_t bs, size_t chunk, const char* when, int fd_go) {
  pid_t pid = fork();
  if (pid != 0) return pid;
  double gbps = chunks(gather, bs, chunk, fd_go);
  printf("%-8s %-28s %8.2f GB/s\n", gather ? "gather" : "scatter", when, gbps);
  fflush(stdout);
  _exit(0);
}

// Waits for every child; false when one failed.
bool wait_all() {
  bool ok = true;
  int status = 0;
  while (wait(&status) > 0) ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  size_t bs = argc > 1 ? atol(argv[1]) : 65536, chunk = argc > 2 ? atol(argv[2]) : (1 << 20);
  if (bs == 0 || bs > chunk || chunk % bs != 0) {
    printf("BLOCK must divide CHUNK (got %zu and %zu)\n", bs, chunk);
    return 2;
  }
  printf("blocks of %zu bytes, chunks of %zu bytes, %d chunks a side\n", bs, chunk, kRounds);
  for (bool gather : {true, false}) {
    side(gather, bs, chunk, "alone", -1);
    if (!wait_all()) return 1;
  }
  for (int round = 0; round < 2; ++round) {
    int go[2];
    if (pipe(go) != 0) return 1;
    side(true, bs, chunk, "beside the scatter's process", go[0]);
    side(false, bs, chunk, "beside the gather's process", go[0]);
    sleep(5);  // both set up
    if (write(go[1], "xx", 2) != 2) return 1;
    if (!wait_all()) return 1;
    close(go[0]);
    close(go[1]);
  }
  return 0;
}
