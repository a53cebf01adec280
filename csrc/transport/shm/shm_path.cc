#include "transport/shm/shm_path.h"

#include "base/status.h"
#include "transport/self/self_path.h"
#include "transport/signal_ops.h"

namespace fxm {

std::unique_ptr<Path> make_shm_path(const PathRequest& req, const WindowDesc& d, std::string* why) {
  if (req.forced == ForcedTransport::kTcp) {
    *why = "FLAGCX_MESH_TRANSPORT=tcp";
    return nullptr;
  }
  if (d.kind == WindowKind::kUser) return nullptr;  // the user's memory is not a segment
  if (d.host != req.host) {
    *why = "peer is on another host";
    return nullptr;
  }
  bool signal = d.kind == WindowKind::kSignal;
  if (req.forced == ForcedTransport::kCma && !signal) {
    *why = "FLAGCX_MESH_TRANSPORT=cma";
    return nullptr;
  }
  int err = 0;
  uint64_t nslots = d.size / 8;
  if (signal && (d.size % 8 != 0 || !signal_slots_valid(nslots))) {  // the core refuses it earlier
    *why = "its signal window size " + std::to_string(d.size) + " is not 1 .. 2^32 slots";
    return nullptr;
  }
  shm::Segment seg = shm::Segment::open(d.shm_name, signal ? signal_segment_bytes(nslots) : d.size, &err);
  if (!seg) {
    *why = "mapping its shared memory failed: " + errno_text(err);
    return nullptr;
  }
  SignalSlots slots;
  if (signal) {
    slots.values = reinterpret_cast<uint64_t*>(seg.data());
    slots.last_src = signal_last_src(seg.data(), nslots);
    slots.notify = signal_notify(seg.data(), nslots);
  }
  uint8_t* base = seg.data();
  return std::make_unique<MappedPath>(PathKind::kShm, base, slots, std::move(seg));
}

}  // namespace fxm
