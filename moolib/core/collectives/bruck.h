// Log-round exchanges among many members: Bruck's all-gather and the
// dissemination barrier, which share their rounds. With R = ceil(log2 N)
// rounds, in round k member i sends one message to i + 2^k and takes one from
// i - 2^k (mod N), and sends round k only once it has taken rounds 0..k-1. So
// an exchange costs N*R messages where one hop from everyone to everyone costs
// N(N-1), and each member talks to at most 2R others, not to all of them.
//
// A barrier's messages carry nothing: once a member has taken all R rounds it
// has heard, through a chain of them, from every member that entered it.
// Bruck's carry blocks (a member's data): after rounds 0..k-1 member i holds
// those of members i, i-1, ..., i-2^k+1, and round k sends the first
// min(2^k, N-2^k) of them, so after R rounds every member holds all N.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moolib {

// One member's progress through the rounds of one exchange.
class LogRounds {
 public:
  LogRounds() = default;
  LogRounds(size_t members, size_t self);

  size_t rounds() const { return rounds_; }
  size_t sendTo(size_t round) const;
  size_t receiveFrom(size_t round) const;
  // Bruck: the members whose blocks `sender`'s message of `round` carries, in
  // the order it carries them.
  std::vector<size_t> blockOwners(size_t sender, size_t round) const;
  // The members this one takes messages from.
  std::vector<size_t> partners() const;

  // Whether round's message from `from` is one this member waits for: a round
  // that exists, from that round's partner, not taken before.
  bool expects(size_t round, size_t from) const;
  // Records it (expects() must hold).
  void arrive(size_t round);
  // This member's own part is ready: it may send.
  void enter() { entered_ = true; }
  // The next round this member may send now, each once; none while it waits.
  std::optional<size_t> nextSend();
  // Entered, every round sent and taken.
  bool complete() const;

 private:
  size_t n_ = 1, self_ = 0, rounds_ = 0, sent_ = 0;
  bool entered_ = false;
  std::vector<bool> arrived_;
};

// Segment 0 of a Bruck message's data: for each block it carries, the owner
// and how many segments (which follow, block after block) are its.
struct BlockHeader {
  struct Block {
    uint32_t member = 0;
    uint32_t segments = 0;
  };
  std::vector<Block> blocks;
  std::string encode() const;
  // Throws WireError when malformed or longer than maxBlocks.
  static BlockHeader decode(std::string_view data, size_t maxBlocks);
};

}  // namespace moolib
