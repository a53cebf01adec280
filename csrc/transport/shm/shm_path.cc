#include "transport/shm/shm_path.h"

#include "base/status.h"
#include "transport/binding.h"
#include "transport/self/self_path.h"
#include "transport/signal_ops.h"

namespace fxm {
namespace {

// The segment the description names, mapped, once it is bound to the peer (binding.h): the file
// opened by name must be the one the peer's proven process maps at the described address.
// Empty with *why set when not (nothing of a refused file is read or written).
shm::Segment open_bound(const PathRequest& req, const WindowDesc& d, uint64_t bytes, std::string* why) {
  std::string unbound = req.binding ? req.binding->for_mapping() : "not bound to the peer";
  if (!unbound.empty()) {
    *why = "shm refused: " + unbound;
    return {};
  }
  int err = 0;
  uint64_t file[2] = {0, 0};
  shm::Segment seg = shm::Segment::open(d.shm_name, bytes, &err, file);
  if (!seg) {
    *why = "mapping its shared memory failed: " + errno_text(err);
    return {};
  }
  std::string theirs = maps_file_at(d.pid, d.addr, bytes, file[0], file[1]);
  if (!theirs.empty()) {
    *why = "shm refused: field shm name: " + d.shm_name + " is not " + peer_words(req) + "'s segment (pid " +
           std::to_string(d.pid) + ": " + theirs + ")";
    return {};  // seg unmaps here
  }
  return seg;
}

}  // namespace

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
  if ((req.forced == ForcedTransport::kCma || req.forced == ForcedTransport::kUcx) && !signal) {
    *why = req.forced == ForcedTransport::kCma ? "FLAGCX_MESH_TRANSPORT=cma" : "FLAGCX_MESH_TRANSPORT=ucx";
    return nullptr;
  }
  uint64_t nslots = d.size / 8;
  if (signal && (d.size % 8 != 0 || !signal_slots_valid(nslots))) {  // the core refuses it earlier
    *why = "its signal window size " + std::to_string(d.size) + " is not 1 .. 2^32 slots";
    return nullptr;
  }
  shm::Segment seg = open_bound(req, d, signal ? signal_segment_bytes(nslots) : d.size, why);
  if (!seg) return nullptr;
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
