#include "agent/want_server.h"

#include "agent/block_pull.h"
#include "agent/connection.h"

namespace fxm::agent {

void WantServer::offer(uint64_t token, std::string req, std::vector<std::vector<int64_t>> groups, double timeout_s) {
  withdraw(token);
  auto old = offers_.find(req);
  if (old != offers_.end()) req_of_.erase(old->second.token);
  req_of_[token] = req;
  offers_[std::move(req)] = Offer{token, std::move(groups), timeout_s};
}

uint64_t WantServer::withdraw(uint64_t token) {
  auto it = req_of_.find(token);
  if (it != req_of_.end()) {
    offers_.erase(it->second);
    req_of_.erase(it);
  }
  return in_flight(token);
}

uint64_t WantServer::in_flight(uint64_t token) const {
  auto it = in_flight_.find(token);
  return it == in_flight_.end() ? 0 : it->second;
}

void WantServer::serve_layout(const std::shared_ptr<Connection>& conn, const std::array<uint32_t, 4>& part,
                              Regions locals, Regions remotes, GroupTables group_tables) {
  for (auto it = layouts_.begin(); it != layouts_.end();) {
    std::shared_ptr<Connection> c = it->second.conn.lock();
    it = !c || c->ended() ? layouts_.erase(it) : std::next(it);
  }
  LayoutKey key{conn.get(), part, group_tables.size()};
  layouts_[key] = Layout{conn, std::move(locals), std::move(remotes), std::move(group_tables)};
}

void WantServer::forget_layouts(const Connection* conn) {
  for (auto it = layouts_.begin(); it != layouts_.end();) {
    it = std::get<0>(it->first) == conn ? layouts_.erase(it) : std::next(it);
  }
}

// The tables of `key`, unless its connection is gone (then dropped). An entry of a connection freed
// since (another at its address now) has lost its weak reference: dropped too.
const WantServer::Layout* WantServer::layout(const std::shared_ptr<Connection>& conn, const LayoutKey& key) {
  auto it = layouts_.find(key);
  if (it == layouts_.end()) return nullptr;
  if (it->second.conn.lock() != conn || conn->ended()) {
    layouts_.erase(it);
    return nullptr;
  }
  return &it->second;
}

std::string WantServer::push_for(const Want& w, const std::shared_ptr<Connection>& conn, PullJob* job) {
  auto o = offers_.find(w.req);
  if (o == offers_.end()) return "no blocks are offered for request " + w.req;
  const Offer& offer = o->second;
  size_t groups = w.counts.size();
  if (offer.held.size() != groups) {
    return "the want names " + std::to_string(groups) + " groups, the offer holds " + std::to_string(offer.held.size());
  }
  const Layout* l = layout(conn, LayoutKey{conn.get(), {w.si, w.sn, w.di, w.dn}, groups});
  if (!l) return "no tables for this connection, part and " + std::to_string(groups) + " groups";
  job->groups.clear();
  size_t at = 0;
  for (size_t g = 0; g < groups; ++g) {
    const std::vector<int64_t>& held = offer.held[g];
    uint64_t n = w.counts[g];
    if (n > held.size()) {
      return "group " + std::to_string(g) + ": " + std::to_string(n) + " blocks wanted, " +
             std::to_string(held.size()) + " held";
    }
    PullGroup pg;
    pg.tables = l->tables[g];
    pg.local_ids.assign(held.end() - static_cast<ptrdiff_t>(n), held.end());  // (the wanter may have the first ones)
    pg.remote_ids.assign(w.dst.begin() + static_cast<ptrdiff_t>(at), w.dst.begin() + static_cast<ptrdiff_t>(at + n));
    at += n;
    job->groups.push_back(std::move(pg));
  }
  job->token = offer.token;
  job->conn = conn;
  job->locals = l->locals;
  job->remotes = l->remotes;
  job->on_landed = w.answer;
  job->write = true;
  job->readers = w.readers != 0 ? w.readers : w.sn;
  job->late_s = offer.timeout_s;
  return "";
}

uint64_t WantServer::begin(uint64_t token) {
  ++in_flight_[token];
  return ++pushes_;
}

void WantServer::end(uint64_t token) {
  auto it = in_flight_.find(token);
  if (it != in_flight_.end() && --it->second == 0) in_flight_.erase(it);
}

void WantServer::record(ServedEvent e) {
  if (e.kind == kServedEnded) end(e.token);
  events_.push_back(std::move(e));
}

std::vector<ServedEvent> WantServer::take() {
  std::vector<ServedEvent> out;
  out.swap(events_);
  return out;
}

}  // namespace fxm::agent
