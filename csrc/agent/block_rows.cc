#include "agent/block_rows.h"

#include <string>

#include "base/status.h"

namespace fxm::agent {

BlockRows::BlockRows(std::vector<BlockLayer> layers, std::vector<int64_t> src_runs, std::vector<int64_t> dst_runs,
                     int64_t size, bool dense, int64_t src_blocks, int64_t dst_blocks)
    : layers_(std::move(layers)), src_runs_(std::move(src_runs)), dst_runs_(std::move(dst_runs)),
      runs_(layers_.empty() ? 0 : src_runs_.size() / layers_.size()), size_(size), dense_(dense),
      src_blocks_(src_blocks), dst_blocks_(dst_blocks) {
  if (layers_.empty() || runs_ == 0 || src_runs_.size() != runs_ * layers_.size() || dst_runs_.size() != src_runs_.size() ||
      (dense_ && runs_ != 1) || size_ < 0) {
    fail(Code::kInvalidArgument, -1, 0,
         "block rows: " + std::to_string(layers_.size()) + " layers with " + std::to_string(src_runs_.size()) + " / " +
             std::to_string(dst_runs_.size()) + " run offsets" + (dense_ ? " (dense: one run a block)" : ""));
  }
}

bool BlockRows::rows(const int64_t* src, const int64_t* dst, size_t n, std::vector<int64_t>* out) const {
  for (size_t k = 0; k < n; ++k) {
    if (src[k] < 0 || src[k] >= src_blocks_ || dst[k] < 0 || dst[k] >= dst_blocks_) return false;
  }
  // (first block, blocks) of each row a layer's run makes: consecutive ids on both sides merge when dense
  std::vector<std::pair<size_t, int64_t>> spans;
  spans.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    if (dense_ && !spans.empty() && src[k] == src[k - 1] + 1 && dst[k] == dst[k - 1] + 1) {
      ++spans.back().second;
    } else {
      spans.push_back({k, 1});
    }
  }
  size_t at = out->size();
  out->resize(at + layers_.size() * spans.size() * runs_ * 5);
  int64_t* row = out->data() + at;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const BlockLayer& g = layers_[l];
    const int64_t* sr = src_runs_.data() + l * runs_;
    const int64_t* dr = dst_runs_.data() + l * runs_;
    for (const auto& [k, blocks] : spans) {
      int64_t s = src[k] * g.src_stride, d = dst[k] * g.dst_stride, len = blocks * size_;
      for (size_t r = 0; r < runs_; ++r, row += 5) {
        row[0] = g.src_index;
        row[1] = s + sr[r];
        row[2] = g.dst_index;
        row[3] = d + dr[r];
        row[4] = len;
      }
    }
  }
  return true;
}

}  // namespace fxm::agent
