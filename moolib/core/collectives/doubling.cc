#include "collectives/doubling.h"

#include <algorithm>

#include "runtime/error.h"

namespace moolib {

size_t DoublingPlan::sends() const {
  size_t n = first ? 1 : 0;
  for (auto& s : stages) n += s.then ? 1 : 0;
  return n;
}

size_t DoublingPlan::stageOf(uint32_t step) const {
  auto it =
      std::find_if(stages.begin(), stages.end(), [&](const Stage& s) { return s.step == step; });
  return size_t(it - stages.begin());
}

DoublingPlan DoublingPlan::make(size_t members, size_t self) {
  MOO_ENFORCE(members >= 2 && self < members, "recursive doubling of ", members,
              " members, member ", self);
  size_t p = 1;
  uint32_t rounds = 0;
  while (p * 2 <= members) {
    p *= 2;
    ++rounds;
  }
  DoublingPlan plan;
  if (self >= p) {
    plan.first = Send{self - p, 0};
    plan.stages.push_back({kUnfold, rounds + 1, self - p, std::nullopt});
    return plan;
  }
  bool folds = self + p < members;
  Send exchange{self ^ 1, 1};
  if (folds) {
    plan.stages.push_back({kFold, 0, self + p, exchange});
  } else {
    plan.first = exchange;
  }
  for (uint32_t k = 1; k <= rounds; ++k) {
    std::optional<Send> then;
    if (k < rounds) {
      then = Send{self ^ (size_t(1) << k), k + 1};
    } else if (folds) {
      then = Send{self + p, rounds + 1};
    }
    plan.stages.push_back({kExchange, k, self ^ (size_t(1) << (k - 1)), then});
  }
  return plan;
}

}  // namespace moolib
