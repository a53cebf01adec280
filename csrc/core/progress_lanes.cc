// Lanes of the progress engine: with FLAGCX_MESH_TCP_LANES > 1 each (peer, context) has that
// many send and receive connections, built by the same handshake (wire context ctx + lane *
// contexts). Lane 0 carries every frame as before; the other lanes carry only the stripes of
// large puts (kStripe) and their goodbye.
//
// Order across lanes is kept at the target. A striped put's lane-0 part (kPut + kPutStriped)
// admits the put; a stripe (numbered per slot) is not read past its header until its put was
// admitted, so it cannot overtake an earlier op of lane 0; and lane 0 reads nothing after the
// part until every stripe landed, so no later op (a put to the same bytes, a signal, a get, a
// message) overtakes a stripe. The put is then applied once: its signal, then its ack. A lane
// that dies loses the peer (PeerLost naming it and the lane), so no striped put completes half.
#include <cstring>

#include "base/log.h"
#include "base/status.h"
#include "core/progress_items.h"

namespace fxm {

using wire::FrameType;

std::string Engine::conn_name(int c) const {
  return lane_of(c) == 0 ? "" : " (tcp lane " + std::to_string(lane_of(c)) + ")";
}

void Engine::post_striped(int peer, int ctx, const uint8_t* src, uint64_t len, uint32_t dst_win, uint64_t dst_off,
                          const SignalSpec& sig) {
  int s = slot(peer, ctx);
  uint64_t part = len / lanes_, first = len - part * (lanes_ - 1);
  wire::PutHeader h = put_header(dst_win, dst_off, sig);
  h.flags |= wire::kPutStriped;
  h.pad = static_cast<uint32_t>(lanes_ - 1);
  OutItem head{frame(FrameType::kPut, &h, first), src, first, 0, 0};
  {
    // One critical section: the parts of consecutive striped puts queue in one order on every lane.
    std::lock_guard<std::mutex> lock(mu_);
    ++outstanding_[s];
    in_flight_kind_[s] = PathKind::kTcp;
    ++acks_due_[s];
    issued_[peer].fetch_add(1);
    uint64_t number = ++stripe_seq_[s];
    out_[s].push_back(std::move(head));
    for (int k = 1; k < lanes_; ++k) {
      uint64_t at = first + (k - 1) * part;
      wire::PutHeader p;
      p.dst_win = dst_win;
      p.dst_off = dst_off + at;
      p.sig_slot = number;
      out_[k * total_ + s].push_back({frame(FrameType::kStripe, &p, part), src + at, part, 0, 0});
    }
  }
  if (std::this_thread::get_id() != progress_tid_.load()) wake();
}

bool Engine::lane_readable(int c) const {
  const InConn& in = *in_[c];
  if (in.closed) return false;
  if (c < total_) return mailbox_bytes_[c] < max_unreceived_ && !lane0_held_[c];
  return !(in.st == InConn::kPayload && lane_seq_[c] > stripes_admitted_[base_slot(c)]);
}

bool Engine::on_striped_header(int s, InConn& in) {
  uint64_t payload = in.f.length - in.need;
  if (lanes_ == 1 || in.put.pad != static_cast<uint32_t>(lanes_ - 1) || payload == 0) {
    lose(peer_of(s), "protocol error: a put striped over " + std::to_string(in.put.pad + 1) + " lanes (this mesh has " +
                         std::to_string(lanes_) + ")");
    in.closed = true;
    return false;
  }
  ++stripes_admitted_[s];
  stripes_landed_[s] = 0;
  stripe_refused_[s].clear();
  return true;
}

void Engine::on_stripe_header(int c, InConn& in, uint64_t payload) {
  int s = base_slot(c);
  wire::PutHeader p;
  std::memcpy(&p, in.buf, sizeof(p));
  if (payload == 0 || p.sig_slot != lane_seq_[c] + 1 || p.sig_slot < stripes_admitted_[s]) {
    lose(peer_of(c), "protocol error: stripe #" + std::to_string(p.sig_slot) + " on" + conn_name(c) +
                         " out of order (expected #" + std::to_string(lane_seq_[c] + 1) + ")");
    in.closed = true;
    return;
  }
  lane_seq_[c] = p.sig_slot;  // read_some() stops here until lane 0 admitted that put
  on_put_header(c, in, payload);
  if (in.device_at != nullptr) {  // initiators stripe only to host windows
    in.release_stage();
    in.device_at = nullptr;
    in.dst = nullptr;
    in.refused = "a stripe of a put to device window #" + std::to_string(p.dst_win) + " (not striped there)";
  }
}

void Engine::on_stripe_done(int c, InConn& in) {
  int s = base_slot(c);
  if (!in.refused.empty() && stripe_refused_[s].empty()) stripe_refused_[s] = in.refused;
  ++stripes_landed_[s];
  in.reset();
  if (lane0_held_[s] && stripes_landed_[s] == lanes_ - 1) finish_striped(s);
}

bool Engine::striped_put_waits(int s, InConn& in) {
  if (stripes_landed_[s] < lanes_ - 1) {
    lane0_held_[s] = true;  // finish_striped() applies it once the last stripe landed
    return true;
  }
  if (in.refused.empty() && !stripe_refused_[s].empty()) in.refused = "part of " + stripe_refused_[s];
  stripe_refused_[s].clear();
  stripes_landed_[s] = 0;
  return false;
}

void Engine::finish_striped(int s) {
  InConn& in = *in_[s];
  lane0_held_[s] = false;
  striped_put_waits(s, in);
  on_put_done(s, in);
  in.reset();
}

}  // namespace fxm
