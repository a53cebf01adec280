// A want: a decode agent's ask that this agent push the blocks it holds for a request into the
// decode's blocks (a KV connector's prefill side serves it: agent/want_server.h). Binary, so that
// the core parses it without Python: the same bytes are made and read by Python through the
// bindings (_core._encode_want / _parse_want), one implementation of the format.
//
// Wire layout, little-endian: kWantPrefix ("fxkv1w"); u8 version (1); u32 si, sn, di, dn; u32
// readers; u16 length + bytes of req; u16 length + bytes of answer; u32 ngroups + u64
// counts[ngroups]; u64 ndst + i64 dst[ndst]; nothing after.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fxm::agent {

inline constexpr std::array<uint8_t, 6> kWantPrefix = {'f', 'x', 'k', 'v', '1', 'w'};
constexpr uint8_t kWantVersion = 1;
constexpr size_t kMaxWantBytes = 4u << 20;  // a want of 100k blocks is 0.8 MiB
constexpr size_t kMaxWantId = 4096;         // bytes of req and of answer
constexpr size_t kMaxWantGroups = 1024;

struct Want {
  std::string req;              // the request the blocks are held for (here)
  std::vector<uint8_t> answer;  // the notification that goes to the wanter after the data
  // Slice si of sn of each held block's heads into slice di of dn of the wanter's.
  uint32_t si = 0, sn = 1, di = 0, dn = 1;
  uint32_t readers = 0;           // decode agents reading the request, each acking its own (0: sn)
  std::vector<uint64_t> counts;   // per KV cache group: how many of dst are its, in order
  std::vector<int64_t> dst;       // the wanter's block ids
};

// The want's bytes; throws InvalidArgument, saying why, for a want parse_want would refuse.
std::vector<uint8_t> encode_want(const Want& w);
// Reads a want from `data`: false, with *why saying what is wrong, for anything else (a wrong
// prefix or version, truncated or trailing bytes, a field out of its range: want.cc).
bool parse_want(const uint8_t* data, size_t n, Want* out, std::string* why);
// "" when the fields make a want parse_want accepts, else why not.
std::string want_refusal(const Want& w);

}  // namespace fxm::agent
