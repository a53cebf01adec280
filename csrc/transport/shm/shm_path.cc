#include "transport/shm/shm_path.h"

#include "base/status.h"
#include "transport/binding.h"
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
  std::string unbound = req.binding ? req.binding->for_mapping() : "not bound to the peer";
  if (!unbound.empty()) {
    *why = "shm refused: " + unbound;
    return nullptr;
  }
  uint64_t bytes = signal ? signal_segment_bytes(nslots) : d.size;
  uint64_t file[2] = {0, 0};
  shm::Segment seg = shm::Segment::open(d.shm_name, bytes, &err, file);
  if (!seg) {
    *why = "mapping its shared memory failed: " + errno_text(err);
    return nullptr;
  }
  // The file opened by name must be the one the peer's process maps at the described address.
  std::string theirs = maps_file_at(d.pid, d.addr, bytes, file[0], file[1]);
  if (!theirs.empty()) {
    *why = "shm refused: field shm name: " + d.shm_name + " is not " + peer_words(req) + "'s segment (pid " +
           std::to_string(d.pid) + ": " + theirs + ")";
    return nullptr;  // seg unmaps here: nothing of it was read or written
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
