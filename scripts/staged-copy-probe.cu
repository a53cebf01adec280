// How a staged batch's chunks may cross the bus, measured alone on one GPU (docs/benchmarks.md,
// "The staged path's copies, alone"): 4096 blocks of BLOCK bytes scattered in device memory are
// gathered into page-locked host memory and scattered back out of it, as a staged batch's chunks
// are (a launch of the library's copy kernel per CHUNK bytes), either by the kernel reading or
// writing the mapped host memory across the bus itself (the default), with smaller pieces per
// thread block (FLAGCX_MESH_STAGED_KERNEL_BYTES), or through device scratch and one copy of the
// copy engine per chunk (FLAGCX_MESH_STAGED_BOUNCE=on), beside contiguous copies of the same bytes.
// The kernel is the library's (csrc/transport/cuda/kernels/copy_blocks.cu), included.
//   nvcc -O2 -o staged-copy-probe scripts/staged-copy-probe.cu && ./staged-copy-probe [BLOCK] [CHUNK]
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>
#include <cuda_runtime.h>
// The library's own kernel (not compiled by the build: turned into the PTX the library embeds).
#include "../csrc/transport/cuda/kernels/copy_blocks.cu"
using cp = fxm_copy;
#define copy_blocks fxm_copy_blocks

#define CK(x) do { cudaError_t e = (x); if (e) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)
int main(int argc, char** argv) {
  size_t bs = argc > 1 ? atol(argv[1]) : 65536, nb = 4096, chunk = argc > 2 ? atol(argv[2]) : (1 << 20);
  size_t total = bs * nb, pool = total * 2;
  char *dev, *scratch, *host, *hostd;
  CK(cudaMalloc(&dev, pool));
  CK(cudaMalloc(&scratch, total));
  CK(cudaHostAlloc(&host, total, cudaHostAllocMapped | cudaHostAllocPortable));
  CK(cudaHostGetDevicePointer((void**)&hostd, host, 0));
  std::vector<size_t> idx(pool / bs);  // the blocks: nb of the pool's, in random order
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::shuffle(idx.begin(), idx.end(), std::mt19937(1));
  idx.resize(nb);
  cp *list, *listd;  // [0, nb): across the bus; [nb, 2 nb): within device memory
  CK(cudaHostAlloc(&list, sizeof(cp) * nb * 2, cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer((void**)&listd, list, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  auto run = [&](const char* what, auto body) {  // best of 7, by events around the work
    float best = 1e9;
    for (int r = 0; r < 7; ++r) {
      cudaEventRecord(a, s);
      body();
      cudaEventRecord(b, s);
      CK(cudaEventSynchronize(b));
      float ms;
      cudaEventElapsedTime(&ms, a, b);
      best = std::min(best, ms);
    }
    printf("%-62s %8.3f ms %7.2f GB/s\n", what, best, total / best / 1e6);
  };
  size_t per = chunk / bs ? chunk / bs : 1;  // blocks a chunk
  char name[160];
  // The kernel across the bus: one launch for all blocks, or a launch a chunk with `cta` bytes a thread block.
  auto across = [&](const char* way, unsigned long long cta, bool per_chunk) {
    unsigned y = static_cast<unsigned>((bs + cta - 1) / cta);
    if (per_chunk) {
      snprintf(name, sizeof name, "%s, a launch per %zu KiB, %llu KiB a block", way, chunk >> 10, cta >> 10);
    } else {
      snprintf(name, sizeof name, "%s, one launch", way);
    }
    run(name, [&] {
      if (!per_chunk) return (void)copy_blocks<<<dim3(nb, y), 256, 0, s>>>(listd, cta);
      for (size_t i = 0; i < nb; i += per) copy_blocks<<<dim3(per, y), 256, 0, s>>>(listd + i, cta);
    });
  };
  auto fill = [&](bool gather, char* there, cp* at) {  // block i <-> piece i of `there`
    for (size_t i = 0; i < nb; ++i) {
      auto blk = (unsigned long long)(dev + idx[i] * bs), piece = (unsigned long long)(there + i * bs);
      at[i] = gather ? cp{piece, blk, bs} : cp{blk, piece, bs};
    }
  };
  for (bool gather : {true, false}) {
    const char* way = gather ? "gather kernel -> mapped host" : "scatter kernel <- mapped host";
    fill(gather, hostd, list);
    fill(gather, scratch, list + nb);
    across(way, 65536, false);
    for (unsigned long long cta : {65536ull, 16384ull, 4096ull}) across(way, cta, true);
    snprintf(name, sizeof name, gather ? "gather D2D + DMA D2H, per %zu KiB" : "DMA H2D + scatter D2D, per %zu KiB",
             chunk >> 10);
    auto dir = gather ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
    run(name, [&] {
      for (size_t i = 0; i < nb; i += per) {
        char *h = host + i * bs, *d = scratch + i * bs;
        if (!gather) cudaMemcpyAsync(d, h, per * bs, dir, s);
        copy_blocks<<<dim3(per, 1 + (bs - 1) / 65536), 256, 0, s>>>(listd + nb + i, 65536);
        if (gather) cudaMemcpyAsync(h, d, per * bs, dir, s);
      }
    });
    run(gather ? "DMA D2H contiguous" : "DMA H2D contiguous", [&] {
      gather ? cudaMemcpyAsync(host, scratch, total, dir, s) : cudaMemcpyAsync(scratch, host, total, dir, s);
    });
    run(gather ? "DMA per block D2H (a cudaMemcpyAsync each)" : "DMA per block H2D (a cudaMemcpyAsync each)", [&] {
      for (size_t i = 0; i < nb; ++i) {
        char *h = host + i * bs, *blk = dev + idx[i] * bs;
        gather ? cudaMemcpyAsync(h, blk, bs, dir, s) : cudaMemcpyAsync(blk, h, bs, dir, s);
      }
    });
  }
  return 0;
}
