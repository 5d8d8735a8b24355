#include "collectives/bruck.h"

#include <algorithm>

#include "rpc/wire.h"
#include "runtime/error.h"

namespace moolib {

LogRounds::LogRounds(size_t members, size_t self) : n_(members), self_(self) {
  MOO_ENFORCE(members >= 1 && self < members, "log rounds of ", members, " members, member ", self);
  while ((size_t(1) << rounds_) < n_) ++rounds_;
  arrived_.assign(rounds_, false);
}

size_t LogRounds::sendTo(size_t round) const { return (self_ + (size_t(1) << round)) % n_; }

size_t LogRounds::receiveFrom(size_t round) const {
  return (self_ + n_ - (size_t(1) << round) % n_) % n_;
}

std::vector<size_t> LogRounds::blockOwners(size_t sender, size_t round) const {
  size_t held = size_t(1) << round;
  size_t count = std::min(held, n_ - held);
  std::vector<size_t> owners;
  for (size_t t = 0; t != count; ++t) owners.push_back((sender + n_ - t) % n_);
  return owners;
}

std::vector<size_t> LogRounds::partners() const {
  std::vector<size_t> out;
  for (size_t k = 0; k != rounds_; ++k) out.push_back(receiveFrom(k));
  return out;
}

bool LogRounds::expects(size_t round, size_t from) const {
  return round < rounds_ && from == receiveFrom(round) && !arrived_[round];
}

void LogRounds::arrive(size_t round) { arrived_.at(round) = true; }

std::optional<size_t> LogRounds::nextSend() {
  if (!entered_ || sent_ == rounds_) return std::nullopt;
  // Round k carries what rounds 0..k-1 brought (Bruck's blocks, or the word
  // that those members entered).
  for (size_t k = 0; k != sent_; ++k) {
    if (!arrived_[k]) return std::nullopt;
  }
  return sent_++;
}

bool LogRounds::complete() const {
  if (!entered_ || sent_ != rounds_) return false;
  for (bool a : arrived_) {
    if (!a) return false;
  }
  return true;
}

std::string BlockHeader::encode() const {
  Writer w;
  w.u32(uint32_t(blocks.size()));
  for (auto& b : blocks) {
    w.u32(b.member);
    w.u32(b.segments);
  }
  return w.take();
}

BlockHeader BlockHeader::decode(std::string_view data, size_t maxBlocks) {
  Reader r(data);
  uint32_t count = r.u32();
  if (count > maxBlocks || count > r.remaining() / 8)
    throw WireError(concat("a block header of ", count, " blocks overruns its segment"));
  BlockHeader h;
  h.blocks.resize(count);
  for (auto& b : h.blocks) {
    b.member = r.u32();
    b.segments = r.u32();
  }
  if (r.remaining() != 0) throw WireError("a block header has trailing bytes");
  return h;
}

}  // namespace moolib
