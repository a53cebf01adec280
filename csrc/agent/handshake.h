// The agents' connection handshake: the mesh's (wire.h: header, nonces,
// HMAC-SHA256 proofs of the key both ways) in the agent roles, followed on
// each side by an identity block (the agent's name, the incarnation it
// expects at the other end, zeros for any, and its tcp lanes) that both MACs
// cover, then the acceptor's verdict frame (kAdmit: "" admitted, else why not).
// A connection of L > 1 lanes (L: the smaller of both sides' offers) is its
// first socket (lane 0) and L - 1 more, each dialed after lane 0 was admitted
// with the same handshake, naming its lane and lane 0's token.
//   connector -> acceptor  hello + ident                 (96 + ext_len)
//   acceptor -> connector  answer head + MAC + ident     (128 + ext_len)
//   connector -> acceptor  proof                         (32)
//   acceptor -> connector  kAdmit frame + reason         (16 + len)
#pragma once

#include <string>
#include <vector>

#include "agent/agent.h"

namespace fxm::agent::hs {

constexpr size_t kMaxUcxWorker = 8192;  // a UCX worker address (transport/ucx), at most (a longer one is not sent)
constexpr size_t kMaxIdent = 256 + 2 + kMaxUcxWorker;
constexpr size_t kMaxVerdict = 1024;

struct Ident {
  std::string name;
  Incarnation expect{};  // the incarnation this side expects of the other; zeros: any
  uint8_t lanes = 1;     // lane 0: the lanes this side offers; a lane > 0: the connection's
  uint8_t lane = 0;      // which socket of the connection this is
  uint64_t token = 0;    // the connector's random tag of the connection (the acceptor echoes it)
  // Lane 0, when this side wants UCX (transport/ucx): its worker address, the one its peer's ucx
  // paths connect to (so a region descriptor never names the worker). Encoded after the rest
  // (2-byte length, then the bytes) only when set; an acceptor sends its own only to a connector
  // that sent one, so peers without UCX see the identity block they always saw.
  std::string ucx_worker;
};
std::vector<uint8_t> encode_ident(const Ident& id);
bool decode_ident(const std::vector<uint8_t>& b, Ident* out);

// An agent header: role, this agent's incarnation (in mesh_id), the length of its identity block.
wire::ConnHeader header(wire::Role role, const Incarnation& mine, uint32_t ext_len);
// Decodes and checks the agent shape (role, no rank fields, ext_len in range).
wire::Reject check_header(const uint8_t raw[wire::kConnHeaderSize], wire::Role want, wire::ConnHeader* h);
// The MAC `prover` sends, over both heads and both identity blocks.
wire::Mac mac(const crypto::Key& key, wire::Role prover, const uint8_t hello[wire::kHelloSize],
              const uint8_t answer[wire::kHelloSize], const std::vector<uint8_t>& hello_ident,
              const std::vector<uint8_t>& answer_ident);
std::vector<uint8_t> verdict_frame(const std::string& why);

struct Dialed {
  tcp::Fd fd;
  PeerInfo peer;
  int lanes = 1;  // the lanes the acceptor offers (lane 0) or echoes (a lane > 0)
};
// The connector's side, blocking until `deadline`: connect, hello, check the
// answer's proof and identity (`expect`: the incarnation it must be, or
// null), prove, read the verdict. Throws Error naming `to` and the cause.
Dialed dial(const tcp::SockAddr& to, const Ident& me, const Incarnation& mine, const crypto::Key& key,
            const Deadline& deadline, const std::string& who);
// Lanes 1 .. me.lanes - 1 of the connection lane 0 opened (me: its identity,
// token and lanes, expecting the incarnation that answered), their steps run
// side by side; lane k is element k - 1.
std::vector<Dialed> dial_lanes(const tcp::SockAddr& to, const Ident& me, const Incarnation& mine,
                               const crypto::Key& key, const Deadline& deadline, const std::string& who);

}  // namespace fxm::agent::hs
