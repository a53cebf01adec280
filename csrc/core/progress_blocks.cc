// Batches of staged writes at the target (kPutBlocks: base/wire.h, sent by
// transport/cuda/staged_batch.h). The frame's block list lands first; then
// every block is checked against the window it names (registered here, device
// memory, all on one device, inside the window): a batch with one bad block is
// refused whole, and none of its bytes lands. The bytes that follow land
// through the staging ring a staged put uses (take_landing_ring,
// staged_landing_buffers() pinned buffers of a chunk each); each full buffer is scattered into the
// windows by one launch of the copy kernel on the landing stream (or the
// driver's copies), while the next one fills. The frame is one op: acknowledged
// (or refused) once, after every scatter completed.
// Batches of staged reads (kGetBlocks) are checked the same way and answered
// as a streamed get whose chunks are gathered out of the windows by one launch
// each; the initiator scatters each landing buffer of the answer likewise.
#include <algorithm>
#include <cstring>

#include "base/log.h"
#include "base/status.h"
#include "core/progress_items.h"
#include "transport/cuda/copy_batch.h"
#include "transport/cuda/staged_batch.h"
#include "transport/cuda/device_scratch.h"
#include "transport/cuda/staging.h"

namespace fxm {

using wire::FrameType;

void Engine::on_blocks_header(int s, InConn& in, uint64_t payload) {
  std::memcpy(&in.blocks_head, in.buf, sizeof(in.blocks_head));
  const wire::BlocksHeader& h = in.blocks_head;
  uint64_t list = uint64_t{h.count} * sizeof(wire::BlockEntry);
  uint64_t carried = h.bytes;  // the blocks' bytes this frame carries (striped: lane 0's part)
  if (h.flags != 0) {
    bool striped = lanes_ > 1 && h.flags == (wire::kBlocksStriped | static_cast<uint32_t>(lanes_ - 1) << 8) &&
                   h.bytes >= static_cast<uint64_t>(lanes_);
    if (!striped) {
      lose(peer_of(s), "protocol error: a batch of writes striped over " + std::to_string((h.flags >> 8) + 1) +
                           " lanes, or of unknown flags " + std::to_string(h.flags) + " (this connection has " +
                           std::to_string(lanes_) + " lanes)");
      in.closed = true;
      return;
    }
    carried = wire::stripe_first(h.bytes, lanes_);
  }
  if (h.count == 0 || h.count > wire::kMaxBlocksPerFrame || payload < list || payload - list != carried) {
    lose(peer_of(s), "protocol error: a batch of writes whose block list does not fit its frame");
    in.closed = true;
    return;
  }
  in.blocks_peer = peer_of(s);
  in.blocks.resize(h.count);
}

namespace {

// "block 3 of a batch of 10 staged writes (4096 bytes to window #0 at offset 8192)" (reads: from;
// host memory here: "writes", not staged).
std::string block_words(const std::vector<wire::BlockEntry>& blocks, size_t i, bool writes, bool staged = true) {
  const wire::BlockEntry& b = blocks[i];
  return "block " + std::to_string(i) + " of a batch of " + std::to_string(blocks.size()) + (staged ? " staged " : " ") +
         (writes ? "writes (" : "reads (") + std::to_string(b.len) + " bytes " + (writes ? "to" : "from") +
         " window #" + std::to_string(b.win) + " at offset " + std::to_string(b.off) + ")";
}

}  // namespace

// Every block before any byte lands (or is read); the windows named stay entered until the frame
// ends (reset()); in.scatter gets each block's place in its window.
std::string Engine::check_blocks(InConn& in, bool land) {
  uint64_t sum = 0;
  in.block_windows.assign(in.blocks.size(), nullptr);
  auto places = std::make_shared<ScatterList>();
  places->reserve(in.blocks.size());
  for (size_t i = 0; i < in.blocks.size(); ++i) {
    const wire::BlockEntry& b = in.blocks[i];
    Window* w = nullptr;
    for (Window* e : in.entered_once) {
      if (e->index == b.win) w = e;
    }
    if (w == nullptr) {
      w = windows_->find(b.win);
      bool staged = i > 0 ? in.device >= 0 : (w == nullptr || w->kind == WindowKind::kDevice);
      if (!w) return block_words(in.blocks, i, land, staged) + ": no such window here";
      if (!w->enter(true)) return block_words(in.blocks, i, land, staged) + ": the window was deregistered here";
      in.entered_once.push_back(w);
    }
    bool host = w->kind != WindowKind::kDevice;
    if (i == 0) in.device = host ? -1 : w->device;  // the batch's kind: its first block's
    auto words = [&] { return block_words(in.blocks, i, land, in.device >= 0); };  // on failure only
    if (w->kind == WindowKind::kSignal) return words() + ": a signal window here";
    if (host != (in.device < 0)) {
      return words() + (host ? ": host memory here, the batch's blocks before it device memory"
                             : ": device memory here, the batch's blocks before it host memory");
    }
    if (host && !land) return words() + ": host memory here (staged reads come from device memory)";
    if (!host && w->device != in.device) {
      return words() + ": on device " + std::to_string(w->device) + ", the batch's blocks before it on device " +
             std::to_string(in.device);
    }
    if (b.off > w->size || b.len > w->size - b.off) {
      return words() + ": out of range (" + std::to_string(w->size) + " bytes here)";
    }
    in.block_windows[i] = w;
    places->emplace_back(w->base + b.off, b.len);
    sum += b.len;
  }
  in.scatter = std::move(places);
  if (!land) return "";
  if (sum != in.blocks_head.bytes) {
    return op_words(in) + ": its blocks add up to " + std::to_string(sum) + " bytes";
  }
  if (sum == 0 || in.device < 0) return "";  // host blocks land in place (host_blocks_spot)
  std::string failed = take_landing_ring(in, in.carried(), nullptr, in.device);
  return failed.empty() ? "" : op_words(in) + ": " + failed;
}

// The list lands in place; then the bytes in the ring's buffer being filled (a full one is
// scattered first). A refused batch's bytes go to the sink.
uint8_t* Engine::blocks_spot(int s, InConn& in, size_t* want) {
  uint64_t at = in.total - in.remaining;
  uint64_t list = in.blocks.size() * sizeof(wire::BlockEntry);
  in.io_window = nullptr;
  if (at < list) {
    *want = static_cast<size_t>(std::min<uint64_t>(*want, list - at));
    return reinterpret_cast<uint8_t*>(in.blocks.data()) + at;
  }
  if (!in.blocks_checked) {
    in.blocks_checked = true;
    in.refused = check_blocks(in, true);
    if (!in.refused.empty()) {
      FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, "refused " + in.refused + " from peer " + std::to_string(in.blocks_peer));
    }
    if (in.blocks_head.flags != 0) admit_striped_blocks(s, in);  // refused or not: its stripes are read
  }
  if (!in.refused.empty()) return nullptr;
  if (in.device < 0) return host_blocks_spot(in, at - list, want);
  return ring_blocks_spot(in, at - list, want);
}

// A batch of staged writes (or a stripe of one): the bytes go to the ring's buffer being filled; a
// full one is scattered first. `received`: the blocks' bytes received so far.
uint8_t* Engine::ring_blocks_spot(InConn& in, uint64_t received, size_t* want) {
  if (in.stage.empty()) return nullptr;
  uint64_t filled = received - in.landed;
  if (filled == in.staged) {
    std::string failed = land_on_device(in, filled);
    if (!failed.empty()) {
      in.refused = failed;
      return nullptr;
    }
    filled = 0;
  }
  *want = static_cast<size_t>(std::min<uint64_t>(*want, in.staged - filled));
  return in.stage[in.filling].buf.get() + filled;
}

// The last buffer's scatter, then every scatter completed: "" or why the bytes did not land.
std::string Engine::land_blocks_rest(InConn& in, uint64_t carried) {
  std::string refused = in.refused;
  if (refused.empty() && in.device >= 0 && !in.stage.empty()) {
    refused = land_on_device(in, carried - in.landed);
    if (refused.empty()) refused = wait_landed(in);
  }
  return refused;
}

// A batch of host writes: each block's bytes land in place, block after block (in list order: a
// later block over the same bytes wins). `received`: the blocks' bytes received so far; `landed`
// the count the cursor (block_at, block_off) stands at.
uint8_t* Engine::host_blocks_spot(InConn& in, uint64_t received, size_t* want) {
  const ScatterList& places = *in.scatter;
  advance_pieces(places, &in.block_at, &in.block_off, received - in.landed);
  in.landed = received;
  if (in.block_at == places.size()) return nullptr;  // (no byte is left to come)
  in.io_window = in.block_windows[in.block_at];  // each read into it counted in its io (read_some)
  const auto& [at, len] = places[in.block_at];
  *want = static_cast<size_t>(std::min<uint64_t>(*want, len - in.block_off));
  return at + in.block_off;
}

// The pieces of the blocks the buffer's n bytes belong to (a block straddling buffers is cut at
// their ends), copied while every window they go to is still registered (Window::begin_io; a
// batch of reads lands in the caller's memory, which no window here guards).
cuda::SharedEvent Engine::scatter_blocks(InConn& in, uint64_t n) {
  InConn::Landing& full = in.stage[in.filling];
  const uint8_t* buf = full.buf.get();
  std::vector<cuda::KernelCopy> copies;
  const ScatterList& places = *in.scatter;
  for (uint64_t k = 0; k < n && in.block_at < places.size();) {
    const auto& [at, len] = places[in.block_at];
    uint64_t take = std::min(n - k, len - in.block_off);
    if (take > 0) {
      copies.push_back({reinterpret_cast<cuda::CUdeviceptr>(at + in.block_off),
                        reinterpret_cast<cuda::CUdeviceptr>(buf + k), take});
    }
    k += take;
    in.block_off += take;
    if (in.block_off == len) {
      ++in.block_at;
      in.block_off = 0;
    }
  }
  size_t begun = 0;
  for (; begun < in.entered_once.size() && in.entered_once[begun]->begin_io(); ++begun) {
  }
  auto end_io = [&] {
    for (size_t k = 0; k < begun; ++k) in.entered_once[k]->end_io();
  };
  if (begun < in.entered_once.size()) {
    in.entered_once[begun]->cut_off.fetch_add(1);
    end_io();
    fail(Code::kInvalidArgument, in.blocks_peer, 0,
         "window #" + std::to_string(in.entered_once[begun]->index) + " was deregistered here while the batch was landing");
  }
  std::unique_ptr<cuda::CopyList> list;
  cuda::SharedEvent done;
  try {
    cuda::CUstream s = cuda::landing_stream(in.device);
    done = full.scratch ? cuda::copy_run_through(in.device, s, copies, false, const_cast<uint8_t*>(buf), n,
                                                 cuda::scratch_address(full.scratch), &list, landing_what(in))
                        : cuda::copy_run(in.device, s, copies, cuda::device_addressable(buf), &list, landing_what(in));
  } catch (...) {
    if (list) list.release();  // a launch may have read it: never reused
    end_io();
    throw;
  }
  end_io();
  full.list = std::move(list);
  return done;
}

// The last buffer's scatter, then every scatter completed, before the one ack (or refusal); a
// striped batch's only once every lane landed its part (hold_striped_blocks).
void Engine::on_blocks_done(int s, InConn& in) {
  if (!in.blocks_checked) {  // (a list with no bytes after it)
    in.blocks_checked = true;
    in.refused = check_blocks(in, true);
    if (in.blocks_head.flags != 0) admit_striped_blocks(s, in);
  }
  std::string refused = land_blocks_rest(in, in.carried());
  if (in.blocks_head.flags != 0 && hold_striped_blocks(s, in, &refused)) return;
  apply_put(s, wire::PutHeader{}, refused, true);
}

void Engine::on_get_blocks_header(int s, InConn& in, uint64_t payload) {
  std::memcpy(&in.get_blocks, in.buf, sizeof(in.get_blocks));
  const wire::GetBlocksHeader& h = in.get_blocks;
  if (h.count == 0 || h.count > wire::kMaxBlocksPerFrame || payload != uint64_t{h.count} * sizeof(wire::BlockEntry)) {
    lose(peer_of(s), "protocol error: a batch of staged reads whose block list does not fit its frame");
    in.closed = true;
    return;
  }
  in.blocks_peer = peer_of(s);
  in.blocks.resize(h.count);
}

namespace {

// Where each block starts in the answer's bytes; false when they do not add up to `bytes`.
bool block_starts(const ScatterList& places, uint64_t bytes, std::vector<uint64_t>* starts) {
  uint64_t at = 0;
  starts->reserve(places.size());
  for (const auto& p : places) {
    starts->push_back(at);
    at += p.second;
  }
  return at == bytes;
}

// Each copy out of the windows runs inside their io (Window::begin_io: false once one was
// deregistered, and the answer gives up); they are left once no copy reads them any more.
void guard_windows(cuda::StagedPayload& p, const std::vector<Window*>& windows) {
  p.guard_source(
      [windows] {
        for (size_t k = 0; k < windows.size(); ++k) {
          if (windows[k]->begin_io()) continue;
          windows[k]->cut_off.fetch_add(1);
          while (k-- > 0) windows[k]->end_io();
          return false;
        }
        return true;
      },
      [windows] {
        for (Window* w : windows) w->end_io();
      });
  p.hold_source([windows] {
    for (Window* w : windows) w->leave();
  });
}

}  // namespace

// Checked whole (a bad block refuses the get, naming it); then answered as a streamed get whose
// chunks are gathered out of the windows, which stay entered until the last chunk was copied.
void Engine::on_get_blocks_request(int s, InConn& in) {
  const wire::GetBlocksHeader h = in.get_blocks;
  auto starts = std::make_shared<std::vector<uint64_t>>();
  std::string why = check_blocks(in, false);
  if (why.empty() && !block_starts(*in.scatter, h.bytes, starts.get())) {
    why = "a batch of " + std::to_string(h.count) + " staged reads: its blocks do not add up to " +
          std::to_string(h.bytes) + " bytes";
  }
  if (!why.empty()) {
    FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, "refused " + why + " from peer " + std::to_string(peer_of(s)));
    refuse(s, why, wire::kRefusedGet | h.req_id);
    return;
  }
  if (!take_answer_credit(s, h.bytes)) {
    lose(peer_of(s), "protocol error: get requests for more than " + std::to_string(kMaxGetBytesInFlight >> 20) +
                         " MiB of answers at once");
    return;
  }
  std::vector<Window*> windows;
  windows.swap(in.entered_once);  // now the answer's (guard_windows)
  answer_blocks(s, h, std::move(windows), in.scatter, std::move(starts), in.block_windows[0]->device);
}

void Engine::answer_blocks(int s, const wire::GetBlocksHeader& h, std::vector<Window*> windows,
                           std::shared_ptr<const ScatterList> places, std::shared_ptr<std::vector<uint64_t>> starts,
                           int device) {
  std::shared_ptr<cuda::StagedPayload> p;
  try {
    p = std::make_shared<cuda::StagedPayload>(this, peer_of(s), h.bytes, device,
                                              Deadline::after_seconds(timeout_s_), false);
  } catch (const std::exception& e) {  // Error or bad_alloc: nothing was sent
    for (Window* w : windows) w->leave();
    {
      std::lock_guard<std::mutex> lock(mu_);
      answer_bytes_[s] -= h.bytes;  // the credit taken for it
    }
    refuse(s, "a batch of " + std::to_string(h.count) + " staged reads: staging its answer failed: " + e.what(),
           wire::kRefusedGet | h.req_id);
    return;
  }
  guard_windows(*p, windows);
  p->count_in(&answer_held_, &answer_peak_);
  uint64_t chunk = p->chunk(), total = h.bytes;
  p->answer_gathered(
      device,
      [places, starts, chunk, total, device](uint64_t i, uint8_t* dst, std::unique_ptr<cuda::CopyList>* list) {
        uint64_t from = i * chunk;
        auto copies = cuda::chunk_pieces(*places, *starts, from, std::min(total, from + chunk), dst, true);
        return cuda::copy_run(device, cuda::landing_stream(device), copies, cuda::device_addressable(dst), list,
                              "answering a batch of staged reads");
      },
      Deadline::after_seconds(timeout_s_));
  queue_answer(s, std::move(p), h.req_id, h.bytes);
}

}  // namespace fxm
