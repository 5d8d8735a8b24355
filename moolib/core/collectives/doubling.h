// Recursive doubling: how members all-reduce small buffers when there are
// many of them. Each member exchanges its partial sum with log2(P) partners in
// turn (P: the largest power of two <= N), so it sends and receives log2(P)
// messages, one more where N is no power of two, instead of N-1 (direct) or
// 2(N-1) one after the other (ring). The N-P members past P first fold their
// data into member i-P and get the result back from it at the end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace moolib {

// One member's part, as the messages it waits for and sends. A message's step
// on the wire: 0 fold, 1..L the exchanges (L = log2(P)), L+1 unfold.
struct DoublingPlan {
  enum Kind : uint8_t { kFold, kExchange, kUnfold };
  struct Send {
    size_t peer;
    uint32_t step;
  };
  struct Stage {
    Kind kind;
    uint32_t step;             // of the message this stage waits for
    size_t peer;               // its sender
    std::optional<Send> then;  // sent once this stage is done
  };
  std::optional<Send> first;  // sent at the start
  std::vector<Stage> stages;  // in the order they are done

  size_t sends() const;
  // The stage that takes the message of `step`, or stages.size().
  size_t stageOf(uint32_t step) const;
  static DoublingPlan make(size_t members, size_t self);
};

}  // namespace moolib
