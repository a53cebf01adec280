// Striped puts at their target: admission of stripes, early admission of the next striped put,
// and completion in order (the threads and their counters: progress_lanes.cc).
//
// Admission. Lane 0 reading a striped put's head (kPut + kPutStriped) admits its stripes:
// stripes_admitted_ of the slot grows to its number, and a stripe numbered above it is not read
// past its header (stripe_waits), so no stripe overtakes an earlier frame of lane 0.
//
// Early admission. Once its lane-0 part landed, a put whose stripes are still landing is held
// (held_puts_, oldest first; at most kMaxAdmitted striped puts admitted and not applied, the
// one lane 0 reads included) and lane 0 reads on. The next frame's headers are read, but it is
// acted on only when it is the head of a striped put of the same layout as the last one held
// (same window, offset, lane-0 length and lane count: its lane-0 part covers the bytes of that
// put's lane-0 part, which landed, and none of any held put's stripes). Any other frame stops
// lane 0 right there (lane0_held_) until every held put was applied (a head of that layout
// stopped by the bound: until one was); then finish_held() acts on it and lane 0 reads on. The
// lane-0 head does not carry the put's whole length, so a stripe checks its own layout: one
// that covers other bytes than the stripe before it on its lane (stripe_moved_) also waits
// until every lane landed its stripe of the put before (those bytes may be another lane's
// stripe of it). So no byte is written by a later op before an earlier op's write of it landed.
//
// Completion. Each lane's worker stores the number of the stripe it landed (lane_landed_, after
// its bytes); put n is whole once every lane landed n (landed_all). Held puts are applied in
// order by the reader of lane 0: each one's signal, then its ack (or the refusal of a stripe of
// it, taken by its number), its window left once. Of a lost peer's held puts, those whose stripes
// all landed are applied, the others dropped unapplied.
//
// Striped batches of writes (kPutBlocks + wire::kBlocksStriped, wire version 8). Lane 0 admits a
// batch's stripes only once it read and checked the whole list (admit_striped_blocks): the
// verdict, each block's place and the windows go to the lanes as one StripedBlocks record (set
// under mu_ before the admission's release). A stripe (kStripeOfBlocks) takes the record at its
// first byte, checks that it is the part lane 0 announced (number, offset, length; else the peer
// is lost), enters the windows itself and lands from its offset in the blocks (host: in place;
// device: through a landing ring of its own, scattered on its lane's thread). Lane 0's part is
// held, with the windows its list entered, until every lane landed; then the batch is applied
// once (one ack or refusal). A batch is acted on only when nothing is held, and nothing is
// admitted early behind it: its stripes land anywhere in its blocks.
#include <algorithm>
#include <cstring>

#include "base/log.h"
#include "base/status.h"
#include "core/progress_items.h"

namespace fxm {

using wire::FrameType;

bool Engine::on_striped_header(int s, InConn& in) {
  uint64_t payload = in.f.length - in.need;
  if (lanes_ == 1 || in.put.pad != static_cast<uint32_t>(lanes_ - 1) || payload == 0) {
    lose(peer_of(s), "protocol error: a put striped over " + std::to_string(in.put.pad + 1) + " lanes (this mesh has " +
                         std::to_string(lanes_) + ")");
    in.closed = true;
    return false;
  }
  // Every earlier op of lane 0 was applied, or is a held striped put of this layout: the workers
  // may read this one's stripes now (right after their predecessors on the same lane).
  stripes_admitted_[s].fetch_add(1, std::memory_order_release);
  if (lane_spin_ns_ > 0) lane0_spin_until_ns_.store(steady_ns() + lane_spin_ns_, std::memory_order_relaxed);
  wake_lanes();
  return true;
}

bool Engine::admits_early(int s, const InConn& in) {
  const std::deque<HeldPut>& held = held_puts_[s];
  if (in.f.type != FrameType::kPut) return false;
  wire::PutHeader p;
  std::memcpy(&p, in.buf, sizeof(p));
  const HeldPut& last = held.back();
  if (last.blocks) return false;  // a striped batch's stripes land anywhere in its blocks
  bool same = (p.flags & wire::kPutStriped) && p.dst_win == last.put.dst_win && p.dst_off == last.put.dst_off &&
              p.pad == last.put.pad && in.f.length == last.length;
  if (!same) return false;
  if (held.size() + 1 > kMaxAdmitted) {  // this one would be admitted beside every held one
    admit_limit_waits_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  early_admits_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

uint64_t Engine::landed_all(int s) const {
  uint64_t all = UINT64_MAX;
  for (int lane = 1; lane < lanes_; ++lane) all = std::min(all, lane_landed_[lane * total_ + s].load());
  return all;
}

bool Engine::stripe_waits(int c) const {
  const InConn& in = *in_[c];
  if (in.st != InConn::kPayload) return false;
  int s = base_slot(c);
  if (lane_seq_[c] > stripes_admitted_[s].load(std::memory_order_acquire)) return true;  // its put not admitted yet
  if (!stripe_moved_[c]) return false;
  range_waits_[s].store(true);  // before the look: a lane landing after it then wakes the lanes
  return landed_all(s) + 1 < lane_seq_[c];
}

// The lane-0 part of a striped put landed: applied now when nothing is held and every stripe
// landed, else held (its state moves out of `in`, which reads on).
bool Engine::hold_striped(int s, InConn& in) {
  uint64_t number = stripes_admitted_[s].load(std::memory_order_relaxed);
  if (applies_now(s, number, &in.refused)) return false;
  std::string refused = land_rest(in);  // a device window's part: on the device before it is held
  hold(s, {in.put, in.f.length, number, in.f.length > in.need, in.entered, std::move(refused)});
  in.entered = nullptr;  // left by finish_held()
  in.reset();
  return true;
}

// The lane-0 part of striped op `number` landed: true when it is applied now (nothing held before
// it, every stripe of it landed), its stripes' refusal taken into *refused.
bool Engine::applies_now(int s, uint64_t number, std::string* refused) {
  if (!held_puts_[s].empty() || landed_all(s) < number) return false;
  take_stripe_refusal(s, number, refused);
  return true;
}

void Engine::hold(int s, HeldPut h) {
  if (held_puts_[s].empty() && std::find(held_.begin(), held_.end(), s) == held_.end()) held_.push_back(s);
  held_puts_[s].push_back(std::move(h));
}

void Engine::take_stripe_refusal(int s, uint64_t number, std::string* refused) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = stripe_refused_[s].find(number);
  if (it == stripe_refused_[s].end()) return;
  if (refused->empty()) *refused = "part of " + it->second;
  stripe_refused_[s].erase(it);
}

void Engine::finish_held(int s) {
  std::deque<HeldPut>& held = held_puts_[s];
  bool lost = !lost_reason(peer_of(s)).empty();
  uint64_t landed = landed_all(s);
  while (!held.empty() && held.front().number <= landed) {
    HeldPut h = std::move(held.front());
    held.pop_front();
    h.leave_windows();  // its bytes landed
    if (h.blocks) forget_striped_blocks(s);
    take_stripe_refusal(s, h.number, &h.refused);
    apply_put(s, h.put, std::move(h.refused), h.data);
  }
  if (!held.empty() && lost) {  // its stripes may never land: dropped
    for (HeldPut& h : held) h.leave_windows();
    forget_striped_blocks(s);
    held.clear();
    return;  // lane 0 of a lost peer stays stopped
  }
  InConn& in = *in_[s];
  if (!lane0_held_[s] || in.closed || lost || in.st != InConn::kOpHeader || in.got != in.need) return;
  if (held.empty() || admits_early(s, in)) {  // the frame lane 0 stopped at: acted on now
    lane0_held_[s] = false;
    on_op_header(s, in);
  }
}

void Engine::finish_landed_stripes() {
  for (size_t k = 0; k < held_.size();) {
    int s = held_[k];
    try {
      finish_held(s);
    } catch (const std::exception& e) {
      in_[s]->closed = true;
      lose(peer_of(s), std::string("handling its frames failed: ") + e.what());
      in_[s]->reset();  // leaves the window it entered
    }
    if (!held_puts_[s].empty()) {
      ++k;
      continue;
    }
    held_[k] = held_.back();
    held_.pop_back();
  }
}

void Engine::on_stripe_header(int c, InConn& in, uint64_t payload) {
  wire::PutHeader p;
  std::memcpy(&p, in.buf, sizeof(p));
  if (payload == 0 || p.sig_slot != lane_seq_[c] + 1) {
    lose(peer_of(c), "protocol error: stripe #" + std::to_string(p.sig_slot) + " on" + conn_name(c) +
                         " out of order (expected #" + std::to_string(lane_seq_[c] + 1) + ")");
    in.closed = true;
    return;
  }
  lane_seq_[c] = p.sig_slot;  // read_some() stops here until lane 0 admitted that put
  if (p.flags & wire::kStripeOfBlocks) {  // lands through its batch's list, taken at its first byte
    in.put = p;
    last_stripe_[c] = StripeRange{UINT32_MAX, 0, 0};  // a striped put's stripe after it waits for it whole
    stripe_moved_[c] = false;  // its batch was admitted only once every earlier put was applied
    return;
  }
  StripeRange range{p.dst_win, p.dst_off, payload};
  stripe_moved_[c] = !(range == last_stripe_[c]);
  last_stripe_[c] = range;
  Window* w = windows_->find(p.dst_win);
  if (w != nullptr && w->kind == WindowKind::kDevice) {  // initiators stripe only to host windows
    in.put = p;
    in.refused = "a stripe of a put to device window #" + std::to_string(p.dst_win) + " (not striped there)";
    FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, "refused " + in.refused + " from peer " + std::to_string(peer_of(c)));
    return;
  }
  on_put_header(c, in, payload);
}

// The lane's thread: the stripe's bytes are in the window (or were dropped, refused).
void Engine::on_stripe_done(int c, InConn& in) {
  int s = base_slot(c);
  uint64_t number = lane_seq_[c];
  if (in.put.flags & wire::kStripeOfBlocks) in.refused = land_blocks_rest(in, in.total);  // staged: scattered
  if (!in.refused.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    stripe_refused_[s].emplace(number, in.refused);  // the first refusal of that put is kept
  }
  in.reset();  // leaves the window
  if (lane_spin_ns_ > 0) {  // the next hand-offs: lane 0 applies this put and admits the next one's stripes
    int64_t until = steady_ns() + lane_spin_ns_;
    lane_workers_[lane_of(c) - 1]->spin_until_ns = until;
    lane0_spin_until_ns_.store(until, std::memory_order_relaxed);
  }
  // Stored, then every lane's looked at (both sequentially consistent): of two lanes landing
  // the last stripes of one put, at least one sees the other's, and wakes lane 0.
  lane_landed_[c].store(number);
  if (landed_all(s) < number) return;
  wake_lane(0);
  if (range_waits_[s].exchange(false)) wake_lanes();  // a moved stripe may go on now
}

// ---------------------------------------------------------------- striped batches of writes

// Lane 0 checked the list (refused or not): its stripes may be read now, and land through it.
void Engine::admit_striped_blocks(int s, InConn& in) {
  auto batch = std::make_shared<StripedBlocks>();
  uint64_t bytes = in.blocks_head.bytes;
  batch->part = wire::stripe_part(bytes, lanes_);
  batch->first = wire::stripe_first(bytes, lanes_);
  batch->number = stripes_admitted_[s].load(std::memory_order_relaxed) + 1;
  batch->refused = in.refused;
  batch->device = in.device;
  if (in.refused.empty()) {
    batch->places = in.scatter;
    batch->block_windows = std::make_shared<const std::vector<Window*>>(in.block_windows);
    batch->windows = in.entered_once;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    striped_blocks_[s] = std::move(batch);
  }
  stripes_admitted_[s].fetch_add(1, std::memory_order_release);
  if (lane_spin_ns_ > 0) lane0_spin_until_ns_.store(steady_ns() + lane_spin_ns_, std::memory_order_relaxed);
  wake_lanes();
}

// Every stripe of the slot's striped batch landed (or never will): its list is not kept.
void Engine::forget_striped_blocks(int s) {
  std::shared_ptr<const StripedBlocks> gone;  // (freed after the lock)
  std::lock_guard<std::mutex> lock(mu_);
  gone.swap(striped_blocks_[s]);
}

// Lane 0's part landed: applied now (by on_blocks_done) when every stripe landed, else held
// with the windows its list entered, which stay entered until it is applied.
bool Engine::hold_striped_blocks(int s, InConn& in, std::string* refused) {
  uint64_t number = stripes_admitted_[s].load(std::memory_order_relaxed);
  if (applies_now(s, number, refused)) {
    forget_striped_blocks(s);
    return false;
  }
  HeldPut h{wire::PutHeader{}, in.f.length, number, true, nullptr, *refused};
  h.windows.swap(in.entered_once);
  h.blocks = true;
  hold(s, std::move(h));
  in.reset();
  return true;
}

// A stripe of a batch, at its first byte (its batch was admitted): the batch lane 0 checked, its
// windows entered for this stripe too; then its bytes land block after block from its offset.
uint8_t* Engine::stripe_blocks_spot(int c, InConn& in, size_t* want) {
  if (!in.scatter && in.refused.empty()) {
    std::shared_ptr<const StripedBlocks> batch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      batch = striped_blocks_[base_slot(c)];
    }
    uint64_t at = batch ? batch->first + (lane_of(c) - 1) * batch->part : 0;
    if (!batch || batch->number != lane_seq_[c] || in.put.dst_off != at || in.total != batch->part) {
      in.refused = "protocol error: stripe #" + std::to_string(lane_seq_[c]) + " on" + conn_name(c) +
                   " is not a part of the batch of writes lane 0 announced";
      lose(peer_of(c), in.refused);
      in.closed = true;
      return nullptr;
    }
    if (!batch->refused.empty()) {
      in.refused = batch->refused;  // (lane 0 refused the batch: this part is dropped)
      return nullptr;
    }
    for (Window* w : batch->windows) {
      if (!w->enter(true)) {
        in.refused = "a striped batch of writes to window #" + std::to_string(w->index) + ": it was deregistered here";
        return nullptr;
      }
      in.entered_once.push_back(w);
    }
    in.scatter = batch->places;
    if (batch->device < 0) in.block_windows = *batch->block_windows;  // (each read's window: host blocks only)
    advance_pieces(*in.scatter, &in.block_at, &in.block_off, at);
    in.landed = 0;
    in.blocks_peer = peer_of(c);
    in.device = batch->device;
    if (batch->device >= 0) {  // staged writes: through a landing ring of this stripe's own
      std::string failed = take_landing_ring(in, in.total, nullptr, batch->device);
      if (!failed.empty()) in.refused = op_words(in) + ": " + failed;
    }
  }
  if (!in.refused.empty()) return nullptr;
  uint64_t received = in.total - in.remaining;
  return in.device < 0 ? host_blocks_spot(in, received, want) : ring_blocks_spot(in, received, want);
}

}  // namespace fxm
