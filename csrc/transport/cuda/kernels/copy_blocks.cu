// The copies of one batch in one launch (transport/cuda/copy_kernel.h). This
// file is not compiled by the build: scripts/gen-kernels.sh turns it into PTX,
// kept beside it as copy_blocks.ptx.inc, which the library hands to the
// driver at run time (the driver compiles it for the GPU it finds).

// One copy of a batch; the layout of cuda::KernelCopy.
struct fxm_copy {
  unsigned long long dst;
  unsigned long long src;
  unsigned long long len;
};

// One thread block per (copy, chunk): blockIdx.x is the copy, blockIdx.y its
// chunk of `chunk` bytes. 16-byte loads and stores where both ends are 16-byte
// aligned (four in flight per thread), single bytes for the rest.
extern "C" __global__ void __launch_bounds__(256) fxm_copy_blocks(const fxm_copy* copies, unsigned long long chunk) {
  fxm_copy c = copies[blockIdx.x];
  unsigned long long from = (unsigned long long)blockIdx.y * chunk;
  if (from >= c.len) return;
  unsigned long long n = c.len - from < chunk ? c.len - from : chunk;
  char* d = (char*)c.dst + from;
  const char* s = (const char*)c.src + from;
  unsigned long long done = 0;
  if ((((unsigned long long)d | (unsigned long long)s) & 15) == 0) {
    unsigned long long nv = n >> 4;
    uint4* dv = (uint4*)d;
    const uint4* sv = (const uint4*)s;
    unsigned long long k = threadIdx.x, step = blockDim.x;
    for (; k + 3 * step < nv; k += 4 * step) {
      uint4 a = sv[k], b = sv[k + step], e = sv[k + 2 * step], f = sv[k + 3 * step];
      dv[k] = a;
      dv[k + step] = b;
      dv[k + 2 * step] = e;
      dv[k + 3 * step] = f;
    }
    for (; k < nv; k += step) dv[k] = sv[k];
    done = nv << 4;
  }
  for (unsigned long long k = done + threadIdx.x; k < n; k += blockDim.x) d[k] = s[k];
}
