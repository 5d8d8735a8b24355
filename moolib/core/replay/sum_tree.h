// The sum tree of a prioritized replay table: a binary tree over the table's
// slots whose leaves are the items' weights (priority^alpha) and whose root is
// their total, so an item is drawn by prefix sum in O(log capacity).
// It holds no lock: the table calls it under its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moolib::replay {

class SumTree {
 public:
  // A tree of `capacity` leaves, all zero.
  explicit SumTree(int64_t capacity);

  // Sets a leaf; its parents are stale until fixParents covers its slot, so a
  // run of inserts fixes them once.
  void setLeaf(int64_t slot, double value);
  // Sets a leaf and its parents.
  void set(int64_t slot, double value);
  // Recomputes the parents above `count` slots from `first` (wrapping at the
  // capacity).
  void fixParents(int64_t first, int64_t count);
  // Zeroes every leaf; setLeaf then refills them and rebuild() the parents.
  void clear();
  // Recomputes every parent from the leaves.
  void rebuild();

  double total() const { return nodes_[1]; }
  double leaf(int64_t slot) const { return nodes_[size_t(leaves_ + slot)]; }
  // The slot where the prefix sum of the leaves passes u (0 <= u < total(),
  // which must be positive); never one of weight zero.
  int64_t find(double u) const;

 private:
  int64_t capacity_;
  int64_t leaves_ = 1;  // a power of two >= capacity_
  // The root at 1, node i's children at 2i and 2i + 1, the leaves at
  // [leaves_, 2 * leaves_).
  std::vector<double> nodes_;
};

}  // namespace moolib::replay
