// The engine's queued and incoming frames, shared by progress.cc (the
// thread, connections, counters) and progress_ops.cc (one-sided frames).
#pragma once

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/progress.h"

namespace fxm {

struct Engine::OutItem {
  std::vector<uint8_t> head;      // frame header + op header (+ owned payload)
  const uint8_t* data = nullptr;  // borrowed payload (puts; get answers are copied into head)
  uint64_t len = 0;
  uint64_t sent = 0;
  uint64_t msg_bytes = 0;  // two-sided message bytes it carries (back-pressure)
  uint64_t answer_bytes = 0;  // get answer bytes it carries (get credits)
  std::shared_ptr<uint8_t> owned;  // the payload `data` points into, when the item owns it
  uint64_t total() const { return head.size() + len; }
};

// A message received, or dropped here (`dropped` says why; recv() raises it in its place).
struct Engine::Inbound {
  std::vector<uint8_t> bytes;
  std::string dropped;
};

struct Engine::InConn {
  enum State { kHeader, kOpHeader, kPayload } st = kHeader;
  uint8_t buf[64];
  size_t got = 0, need = wire::kFrameHeaderSize;
  wire::FrameHeader f;
  wire::PutHeader put;
  uint64_t req_id = 0;
  uint8_t* dst = nullptr;  // payload destination; nullptr: discard
  // A put into a device window lands in `stage` first (a pinned staging buffer
  // of `staged` bytes, at most kStageChunkBytes), copied into device_dst at
  // dst_off + landed each time it fills, and at the end.
  std::shared_ptr<uint8_t> stage;
  uint64_t staged = 0;
  uint64_t landed = 0;
  Window* device_dst = nullptr;
  uint64_t total = 0, remaining = 0;
  std::vector<uint8_t> msg;  // a message or refusal: grows as its bytes arrive (see grow_message)
  Window* entered = nullptr;  // the window a put lands in (Window::enter), left at reset()
  std::string refused;        // why the target drops this put or message (empty: applied)
  bool closed = false;
  void reset() {
    st = kHeader;
    got = 0;
    need = wire::kFrameHeaderSize;
    dst = nullptr;
    device_dst = nullptr;
    landed = 0;
    stage.reset();  // back to the staging pool
    if (entered) entered->leave();
    entered = nullptr;
    refused.clear();
    std::vector<uint8_t>().swap(msg);
  }
};

template <typename T>
inline std::vector<uint8_t> frame(wire::FrameType type, const T* op, uint64_t payload) {
  size_t oplen = op ? sizeof(T) : 0;
  std::vector<uint8_t> b(wire::kFrameHeaderSize + oplen);
  wire::encode_frame({type, 0, oplen + payload}, b.data());
  if (op) std::memcpy(b.data() + wire::kFrameHeaderSize, op, oplen);
  return b;
}

}  // namespace fxm
