// How a staged batch's chunks may cross the bus, measured alone on one GPU (docs/benchmarks.md,
// "The staged path's copies, alone"): 4096 blocks of BLOCK bytes scattered in device memory are
// gathered into page-locked host memory and scattered back out of it, as a staged batch's chunks
// are (a launch of the library's copy kernel per CHUNK bytes), either by the kernel reading or
// writing the mapped host memory across the bus itself (the default), with smaller pieces per
// thread block (FLAGCX_MESH_STAGED_KERNEL_BYTES), or through device scratch and one copy of the
// copy engine per chunk (FLAGCX_MESH_STAGED_BOUNCE=on), beside contiguous copies of the same bytes.
// The kernel is the library's (csrc/transport/cuda/kernels/copy_blocks.cu), restated here.
//   nvcc -O2 -o staged-copy-probe scripts/staged-copy-probe.cu && ./staged-copy-probe [BLOCK] [CHUNK]
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>
#include <cuda_runtime.h>
struct cp { unsigned long long dst, src, len; };
__global__ void __launch_bounds__(256) copy_blocks(const cp* copies, unsigned long long chunk) {
  cp c = copies[blockIdx.x];
  unsigned long long from = (unsigned long long)blockIdx.y * chunk;
  if (from >= c.len) return;
  unsigned long long n = c.len - from < chunk ? c.len - from : chunk;
  uint4* dv = (uint4*)(c.dst + from); const uint4* sv = (const uint4*)(c.src + from);
  unsigned long long nv = n >> 4, k = threadIdx.x, step = blockDim.x;
  for (; k + 3 * step < nv; k += 4 * step) { uint4 a = sv[k], b = sv[k + step], e = sv[k + 2 * step], f = sv[k + 3 * step];
    dv[k] = a; dv[k + step] = b; dv[k + 2 * step] = e; dv[k + 3 * step] = f; }
  for (; k < nv; k += step) dv[k] = sv[k];
}
#define CK(x) do { cudaError_t e = (x); if (e) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)
int main(int argc, char** argv) {
  size_t bs = argc > 1 ? atol(argv[1]) : 65536, nb = 4096, chunk = argc > 2 ? atol(argv[2]) : (1 << 20);
  size_t total = bs * nb, pool = total * 2;
  char *dev, *scratch, *host;
  CK(cudaMalloc(&dev, pool)); CK(cudaMalloc(&scratch, total)); CK(cudaHostAlloc(&host, total, cudaHostAllocMapped | cudaHostAllocPortable));
  char* hostd; CK(cudaHostGetDevicePointer((void**)&hostd, host, 0));
  std::vector<size_t> idx(pool / bs); for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::shuffle(idx.begin(), idx.end(), std::mt19937(1)); idx.resize(nb);
  cp *list; CK(cudaHostAlloc(&list, sizeof(cp) * nb * 2, cudaHostAllocMapped)); cp* listd; CK(cudaHostGetDevicePointer((void**)&listd, list, 0));
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  auto run = [&](const char* what, auto body) { float best = 1e9; for (int r = 0; r < 7; ++r) { cudaEventRecord(a, s); body(); cudaEventRecord(b, s); CK(cudaEventSynchronize(b)); float ms; cudaEventElapsedTime(&ms, a, b); best = std::min(best, ms); }
    printf("%-58s %8.3f ms %7.2f GB/s\n", what, best, total / best / 1e6); };
  size_t per = chunk / bs; if (per == 0) per = 1;
  // gather: copies blk i -> host chunk
  for (size_t i = 0; i < nb; ++i) list[i] = {(unsigned long long)(hostd + i * bs), (unsigned long long)(dev + idx[i] * bs), bs};
  for (size_t i = 0; i < nb; ++i) list[nb + i] = {(unsigned long long)(scratch + i * bs), (unsigned long long)(dev + idx[i] * bs), bs};
  unsigned cpb = (bs + 65535) / 65536;
  char name[128];
  run("gather kernel -> mapped host, one launch", [&] { copy_blocks<<<dim3(nb, cpb), 256, 0, s>>>(listd, 65536); });
  snprintf(name, sizeof name, "gather kernel -> mapped host, a launch per %zu KiB", chunk >> 10);
  run(name, [&] { for (size_t i = 0; i < nb; i += per) copy_blocks<<<dim3(per, cpb), 256, 0, s>>>(listd + i, 65536); });
  for (unsigned long long cc : {16384ull, 4096ull}) {
    snprintf(name, sizeof name, "gather kernel -> mapped host, per %zu KiB, CTA %llu KiB", chunk >> 10, cc >> 10);
    unsigned cy = (bs + cc - 1) / cc;
    run(name, [&] { for (size_t i = 0; i < nb; i += per) copy_blocks<<<dim3(per, cy), 256, 0, s>>>(listd + i, cc); });
  }
  run("gather kernel -> device scratch, one launch", [&] { copy_blocks<<<dim3(nb, cpb), 256, 0, s>>>(listd + nb, 65536); });
  snprintf(name, sizeof name, "gather D2D + DMA D2H, per %zu KiB", chunk >> 10);
  run(name, [&] { for (size_t i = 0; i < nb; i += per) { copy_blocks<<<dim3(per, cpb), 256, 0, s>>>(listd + nb + i, 65536);
      cudaMemcpyAsync(host + i * bs, scratch + i * bs, per * bs, cudaMemcpyDeviceToHost, s); } });
  run("DMA D2H contiguous", [&] { cudaMemcpyAsync(host, scratch, total, cudaMemcpyDeviceToHost, s); });
  run("DMA per block D2H (cuMemcpyAsync each)", [&] { for (size_t i = 0; i < nb; ++i) cudaMemcpyAsync(host + i * bs, dev + idx[i] * bs, bs, cudaMemcpyDeviceToHost, s); });
  // scatter: host -> blocks
  for (size_t i = 0; i < nb; ++i) list[i] = {(unsigned long long)(dev + idx[i] * bs), (unsigned long long)(hostd + i * bs), bs};
  for (size_t i = 0; i < nb; ++i) list[nb + i] = {(unsigned long long)(dev + idx[i] * bs), (unsigned long long)(scratch + i * bs), bs};
  run("scatter kernel <- mapped host, one launch", [&] { copy_blocks<<<dim3(nb, cpb), 256, 0, s>>>(listd, 65536); });
  snprintf(name, sizeof name, "scatter kernel <- mapped host, a launch per %zu KiB", chunk >> 10);
  run(name, [&] { for (size_t i = 0; i < nb; i += per) copy_blocks<<<dim3(per, cpb), 256, 0, s>>>(listd + i, 65536); });
  for (unsigned long long cc : {16384ull, 4096ull}) {
    snprintf(name, sizeof name, "scatter kernel <- mapped host, per %zu KiB, CTA %llu KiB", chunk >> 10, cc >> 10);
    unsigned cy = (bs + cc - 1) / cc;
    run(name, [&] { for (size_t i = 0; i < nb; i += per) copy_blocks<<<dim3(per, cy), 256, 0, s>>>(listd + i, cc); });
  }
  snprintf(name, sizeof name, "DMA H2D + scatter D2D, per %zu KiB", chunk >> 10);
  run(name, [&] { for (size_t i = 0; i < nb; i += per) { cudaMemcpyAsync(scratch + i * bs, host + i * bs, per * bs, cudaMemcpyHostToDevice, s);
      copy_blocks<<<dim3(per, cpb), 256, 0, s>>>(listd + nb + i, 65536); } });
  run("DMA H2D contiguous", [&] { cudaMemcpyAsync(scratch, host, total, cudaMemcpyHostToDevice, s); });
  return 0;
}
