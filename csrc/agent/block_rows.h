// A request's op table made from its block ids (write_blocks' rows: local_index, local_offset,
// remote_index, remote_offset, size). A KV connector pairs the layers of two caches once (what
// each block of a layer is: its region, its stride, the runs of bytes in it that move) and then
// turns each request's block ids into thousands of rows; made here in one pass, the table costs
// tens of microseconds, not the few dozen tensor operations (each paying a dispatch) it took.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fxm::agent {

struct BlockLayer {
  int64_t src_index = 0, src_stride = 0;  // the source layer's region index, bytes from block to block
  int64_t dst_index = 0, dst_stride = 0;
};

class BlockRows {
 public:
  // `src_runs` / `dst_runs`: layers x runs offsets of each run in a block (slices included);
  // `size`: the bytes of each run that move; `dense`: one run a block, blocks back to back on
  // both sides, so that consecutive ids on both sides merge into one row; ids are checked to be
  // below `src_blocks` / `dst_blocks`. Throws InvalidArgument on inconsistent shapes.
  BlockRows(std::vector<BlockLayer> layers, std::vector<int64_t> src_runs, std::vector<int64_t> dst_runs,
            int64_t size, bool dense, int64_t src_blocks, int64_t dst_blocks);
  // The rows of blocks src[k] -> dst[k] (k < n), layer after layer, each layer's block by block,
  // each block's run by run, into *out (5 values a row). False (out untouched) when an id is not
  // below its side's block count.
  bool rows(const int64_t* src, const int64_t* dst, size_t n, std::vector<int64_t>* out) const;

 private:
  std::vector<BlockLayer> layers_;
  std::vector<int64_t> src_runs_, dst_runs_;
  size_t runs_;
  int64_t size_;
  bool dense_;
  int64_t src_blocks_, dst_blocks_;
};

}  // namespace fxm::agent
