// Frame receive of the progress engine: reads each receive connection,
// decodes frame and op headers (checking their lengths against their type)
// and hands payloads to where they land (progress_ops.cc).
#include <algorithm>
#include <cstring>

#include "base/status.h"
#include "core/progress_items.h"
#include "transport/tcp/socket.h"

namespace fxm {

using wire::FrameType;

namespace {

size_t op_header_size(FrameType t) {
  switch (t) {
    case FrameType::kPut:
    case FrameType::kStripe: return sizeof(wire::PutHeader);
    case FrameType::kGetReq: return sizeof(wire::GetHeader);
    case FrameType::kPutBlocks: return sizeof(wire::BlocksHeader);
    case FrameType::kGetBlocks: return sizeof(wire::GetBlocksHeader);
    case FrameType::kGetResp:
    case FrameType::kAck:
    case FrameType::kRefused: return 8;
    default: return 0;
  }
}

}  // namespace

// A put's payload (or a stripe's, or a block of a batch of host writes) lands in a host window
// one socket read at a time; each read counts itself in the window's io (window.h). A window
// deregistered meanwhile is not entered again: the frame is refused and its remaining bytes go
// to the sink.
bool Engine::WindowIo::enter(InConn& in, Window* into) {
  if (into->begin_io()) {
    w = into;
    return true;
  }
  if (in.refused.empty()) {
    into->cut_off.fetch_add(1);
    bool striped = in.f.type == FrameType::kStripe && (in.put.flags & wire::kStripeOfBlocks);
    bool batch = in.f.type == FrameType::kPutBlocks || striped;
    std::string what = striped  ? "block " + std::to_string(in.block_at) + " of a striped batch of writes to window #" +
                                      std::to_string(into->index)
                       : batch ? "block " + std::to_string(in.block_at) + " of a batch of " + std::to_string(in.blocks.size()) +
                                     " writes to window #" + std::to_string(into->index)
                               : "a put of " + std::to_string(in.total) + " bytes to window #" + std::to_string(in.put.dst_win);
    in.refused = what + ": it was deregistered here while the " + (batch ? "batch" : "put") + " was landing (" +
                 std::to_string(in.total - in.remaining) + " bytes had landed; the rest was discarded)";
  }
  in.dst = nullptr;
  return false;
}

void Engine::read_some(int s) {
  InConn& in = *in_[s];
  size_t budget = 8u << 20;  // then let other connections have a turn
  bool drained = false;      // a read got less than it asked for: the socket was empty then
  bool took_left = false;    // the progress thread took back a frame a waiter left it
  while (budget > 0 && !in.closed && !(drained && in.buffered() == 0)) {
    if (s < total_ && !owns_conn(s) && waiter_stops(s, in)) return;  // the progress thread's frame
    if (s < total_ && owns_conn(s) && left_to_progress_[s] != kNotLeft) {
      took_left = true;  // read whatever the mailbox held: up to the next frame's start
      if (take_back_left(s, in)) continue;  // (acted on: read on from there)
    }
    if (took_left && in.st == InConn::kHeader && in.got == 0 && mailbox_full(s)) return;
    if (s < total_ ? lane0_held_[s] : stripe_waits(s)) {
      return;  // waits for the other lanes (progress_lanes.cc); what is read ahead stays
    }
    uint8_t* where;
    size_t want;
    LandingLock landing(landing_mu_);
    WindowIo io;  // the window this read lands in, counted until the read ends
    if (in.st == InConn::kPayload) {
      // A get answer lands in the user's buffer: lose() waits for this read to end.
      if (in.f.type == FrameType::kGetResp) landing.lock();
      want = static_cast<size_t>(std::min<uint64_t>(in.remaining, budget));
      where = landing_spot(s, in, &want);
      Window* into = in.entered ? in.entered : in.io_window;  // (io_window: a batch's host block)
      if (where && into && in.device_at == nullptr && !io.enter(in, into)) where = nullptr;  // revoked
      if (!where) {
        size_t sink = 0;
        where = discard_for(s, &sink);
        want = std::min(want, sink);
      }
    } else {
      where = in.buf + in.got;
      want = in.need - in.got;
    }
    size_t done = 0;
    if (in.buffered() > 0) {
      done = std::min(want, in.buffered());
      std::memcpy(where, in.ahead.get() + in.ahead_pos, done);
      in.ahead_pos += done;
    } else if (in.st == InConn::kPayload && want == in.remaining) {
      // The payload's end, and what follows it read ahead in the same call: a batch of puts
      // costs one read per frame, its payload straight into place.
      if (!in.ahead) in.ahead.reset(new uint8_t[InConn::kReadAhead]);
      in.ahead_pos = in.ahead_end = 0;
      if (!read_socket(s, in, where, want, &done, in.ahead.get(), InConn::kReadAhead)) return;
      in.ahead_end = done > want ? done - want : 0;
      drained = done < want + InConn::kReadAhead;
      done = std::min(done, want);
    } else if (in.st == InConn::kPayload && want >= InConn::kReadAhead) {
      if (!read_socket(s, in, where, want, &done)) return;
      drained = done < want;
    } else {
      landing.unlock();
      if (!in.ahead) in.ahead.reset(new uint8_t[InConn::kReadAhead]);
      in.ahead_pos = in.ahead_end = 0;
      if (!read_socket(s, in, in.ahead.get(), InConn::kReadAhead, &in.ahead_end)) return;
      drained = in.ahead_end < InConn::kReadAhead;  // the poll reports what comes next
      continue;
    }
    landing.unlock();
    budget -= std::min(budget, done);
    if (in.st == InConn::kPayload) {
      in.remaining -= done;
      if (in.remaining == 0) on_payload_done(s, in);
    } else if ((in.got += done) == in.need) {
      if (in.st == InConn::kHeader) on_header(s, in);
      else on_op_header(s, in);
    }
  }
}

// One non-blocking read of connection s into `where` (then, once it is full, into `then`); false
// when nothing came (*done 0) or it closed (before its goodbye: the peer is lost).
bool Engine::read_socket(int s, InConn& in, uint8_t* where, size_t want, size_t* done, uint8_t* then,
                         size_t then_want) {
  tcp::IoResult r = tcp::read_some2(conns_->recv[s].get(), where, want, then, then_want);
  *done = r.done;
  if (r.done > 0 && s < total_) ++frames_read_;
  if (r.ok()) return r.done > 0;
  in.closed = true;
  bool clean;
  {
    std::lock_guard<std::mutex> lock(mu_);
    clean = bye_conn_[s];
  }
  // Without its goodbye: a close that gave up on unsent frames (1 s) looks the same as an end.
  if (!clean) {
    lose(peer_of(s), "its connection" + conn_name(s) + " closed before its goodbye (" + r.describe() +
                         "): its process ended, or it closed its mesh before the frames queued to this rank were sent");
  }
  in.reset();
  cv_.notify_all();
  return false;
}

void Engine::on_header(int s, InConn& in) {
  if (!wire::decode_frame(in.buf, &in.f)) {
    lose(peer_of(s), "protocol error: a malformed frame arrived");
    in.closed = true;
    return;
  }
  size_t oplen = op_header_size(in.f.type);
  bool fixed = in.f.type == FrameType::kAck || in.f.type == FrameType::kBye || in.f.type == FrameType::kGetReq ||
               in.f.type == FrameType::kAckReq;
  if (in.f.length < oplen || (fixed && in.f.length != oplen)) {
    lose(peer_of(s), "protocol error: a frame whose length does not fit its type");
    in.closed = true;
    return;
  }
  in.st = InConn::kOpHeader;
  in.got = 0;
  in.need = oplen;
  if (oplen == 0) on_op_header(s, in);
}

// A goodbye on connection s: a lane's makes its close clean; lane 0's count the peer's.
void Engine::on_bye(int s, int peer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    bye_conn_[s] = true;
    if (s >= total_) return;
    if (++bye_count_[peer] == ncontexts_) bye_[peer] = true;
    // Waits on this peer now fail ("closed its mesh"): an answer it still sends after its
    // goodbye must not land in a buffer its get's caller was told is given up.
    for (auto it = gets_.begin(); it != gets_.end();) {
      if (slot(it->second.peer, it->second.ctx) == s) drop_get(&it);
      else ++it;
    }
  }
  arrived();
}

void Engine::on_op_header(int s, InConn& in) {
  int peer = peer_of(s);
  uint64_t payload = in.f.length - in.need;
  in.dst = nullptr;
  if ((s >= total_) != (in.f.type == FrameType::kStripe) && in.f.type != FrameType::kBye) {
    lose(peer, "protocol error: a frame of type " + std::to_string(static_cast<int>(in.f.type)) + " on connection" +
                   (s >= total_ ? conn_name(s) : " (lane 0)") + " (lanes carry only stripes)");
    in.closed = true;
    return;
  }
  if (leave_to_progress(s, in)) return;  // a waiter's read, of a frame for the progress thread
  if (s < total_ && !held_puts_[s].empty() && !admits_early(s, in)) {
    lane0_held_[s] = true;  // not acted on yet: finish_held() goes on from here (progress_admit.cc)
    return;
  }
  // The answers to this pair's earlier gets are the window as of their requests: copied whole
  // before a later put (or a message, after which the application may write) is acted on.
  if (s < total_ && (in.f.type == FrameType::kPut || in.f.type == FrameType::kPutBlocks ||
                     in.f.type == FrameType::kMessage)) {
    snapshot_answers(s);
  }
  switch (in.f.type) {
    case FrameType::kMessage:
      if (payload > kMaxMessageBytes) {
        lose(peer, "protocol error: a " + std::to_string(payload) + "-byte message frame");
        in.closed = true;
        return;
      }
      in.msg.clear();  // committed as its bytes arrive (landing_spot)
      break;
    case FrameType::kPut:
      on_put_header(s, in, payload);
      if ((in.put.flags & wire::kPutStriped) && !on_striped_header(s, in)) return;
      break;
    case FrameType::kPutBlocks:
      on_blocks_header(s, in, payload);
      if (in.closed) return;
      break;
    case FrameType::kGetBlocks:
      on_get_blocks_header(s, in, payload);
      if (in.closed) return;
      break;
    case FrameType::kStripe:
      on_stripe_header(s, in, payload);
      if (in.closed) return;
      break;
    case FrameType::kGetReq: {
      wire::GetHeader g;
      std::memcpy(&g, in.buf, sizeof(g));
      on_get_request(s, g);
      in.reset();
      return;
    }
    case FrameType::kGetResp:
      on_get_answer(s, in, payload);
      if (in.closed) return;
      break;
    case FrameType::kRefused:
      if (payload > wire::kMaxRefusedText) {
        lose(peer, "protocol error: a " + std::to_string(payload) + "-byte refusal");
        in.closed = true;
        return;
      }
      in.msg.assign(payload, 0);
      in.dst = in.msg.data();
      break;
    case FrameType::kAck:
      if (on_ack(s, in.buf)) in.reset();
      return;
    case FrameType::kAckReq:  // acked at the end of this pass (send_acks), even with nothing new
      ack_now_[s] = kAckAsked;
      in.reset();
      return;
    case FrameType::kBye:
      on_bye(s, peer);
      in.reset();
      return;
    default:
      lose(peer, "protocol error: unknown frame type " + std::to_string(static_cast<int>(in.f.type)));
      in.closed = true;
      return;
  }
  in.st = InConn::kPayload;
  in.total = in.remaining = payload;
  if (payload == 0) on_payload_done(s, in);
}

}  // namespace fxm
