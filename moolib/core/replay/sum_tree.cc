#include "replay/sum_tree.h"

#include <algorithm>

namespace moolib::replay {

SumTree::SumTree(int64_t capacity) : capacity_(capacity) {
  while (leaves_ < capacity_) leaves_ *= 2;
  nodes_.assign(size_t(2 * leaves_), 0.0);
}

void SumTree::setLeaf(int64_t slot, double value) { nodes_[size_t(leaves_ + slot)] = value; }

void SumTree::set(int64_t slot, double value) {
  setLeaf(slot, value);
  fixParents(slot, 1);
}

void SumTree::fixParents(int64_t first, int64_t count) {
  if (count <= 0) return;
  // Parents are recomputed from their children, never adjusted by a delta,
  // so rounding errors do not accumulate over millions of updates. A run of
  // n consecutive slots (a batch insert) costs O(n + log capacity) this way.
  auto fix = [this](int64_t lo, int64_t hi) {
    lo += leaves_;
    hi += leaves_;
    while (lo > 1) {
      lo /= 2;
      hi /= 2;
      for (int64_t i = lo; i <= hi; ++i) {
        nodes_[size_t(i)] = nodes_[size_t(2 * i)] + nodes_[size_t(2 * i + 1)];
      }
    }
  };
  if (count >= capacity_) {
    fix(0, capacity_ - 1);
    return;
  }
  int64_t end = first + count;
  if (end <= capacity_) {
    fix(first, end - 1);
  } else {
    fix(first, capacity_ - 1);
    fix(0, end - capacity_ - 1);
  }
}

void SumTree::clear() { std::fill(nodes_.begin(), nodes_.end(), 0.0); }

void SumTree::rebuild() {
  for (int64_t i = leaves_ - 1; i >= 1; --i) {
    nodes_[size_t(i)] = nodes_[size_t(2 * i)] + nodes_[size_t(2 * i + 1)];
  }
}

int64_t SumTree::find(double u) const {
  int64_t i = 1;
  while (i < leaves_) {
    double left = nodes_[size_t(2 * i)], right = nodes_[size_t(2 * i + 1)];
    // Rounding can leave u just past the last positive leaf: never descend
    // into a subtree of zero weight.
    if ((u < left && left > 0) || !(right > 0)) {
      i = 2 * i;
    } else {
      u -= left;
      i = 2 * i + 1;
    }
  }
  return i - leaves_;
}

}  // namespace moolib::replay
