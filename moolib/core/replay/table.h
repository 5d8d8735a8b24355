// A prioritized experience replay table (Ape-X, R2D2), with Reverb's rate
// limiter; moolib/replay/table.py adds the Python API (nests, dtypes, shapes).
//
// The core sees an item as one fixed-size byte string per leaf. An item's
// counter is its insertion counter, and eviction is strictly oldest first, so
// the live counters are always the range [head, tail) and counter c lives in
// slot c % capacity: no key-to-slot map, and an item evicted meanwhile is
// recognised by comparison. Its key is the counter with the incarnation of the
// table that inserted it above (see kReplayCounterBits), so a table restored
// from a checkpoint never hands out again the key of an item it lost.
//
// The table composes its parts, each in this folder: the item store
// (item_store.h), the rate limiter (rate_limiter.h), the sum tree of a
// prioritized table (sum_tree.h) and the checkpoint file (checkpoint.h). It
// holds the one lock and calls them under it; it owns the keys, the
// priorities and the draws. docs/architecture.md (section "The replay
// table") explains the choices.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "replay/item_store.h"
#include "replay/rate_limiter.h"
#include "replay/sum_tree.h"

namespace moolib {

enum class ReplaySelector { kUniform, kPrioritized, kFifo };

// A key: the incarnation that inserted the item (16 bits) above its insertion
// counter (40 bits), 56 bits in all; a sharded client puts the shard above.
constexpr int kReplayCounterBits = 40;
constexpr int64_t kReplayCounterMask = (int64_t(1) << kReplayCounterBits) - 1;
constexpr uint32_t kReplayMaxIncarnation = 0xFFFF;

struct ReplayConfig {
  int64_t capacity = 0;
  ReplaySelector selector = ReplaySelector::kPrioritized;
  double alpha = 0.6;
  int64_t minSize = 1;
  // samplesPerInsert <= 0: no ratio is enforced (only minSize).
  double samplesPerInsert = 0;
  double errorBuffer = 0;
};

struct ReplayProgress {
  int64_t done = 0;
  // Why the call stopped before it was done (a timeout); empty when done.
  std::string waited;
  int64_t size = 0;  // table size when the last item was taken (sample)
  // sample: the table became sampleable, but outs did not match the schema
  // (the caller had none before the first insert): call again with outputs.
  bool needOutputs = false;
};

struct ReplayInfo {
  int64_t size = 0, capacity = 0, inserts = 0, samples = 0, evictions = 0;
  double priorityMass = 0;
  int64_t storedBytes = 0, frames = 0, frameBytes = 0;
  int64_t waitingInserters = 0, waitingSamplers = 0;
  int64_t incarnation = 0;
};

class Replay {
 public:
  Replay(const ReplayConfig& config, uint64_t seed);
  ~Replay();
  Replay(const Replay&) = delete;
  Replay& operator=(const Replay&) = delete;

  // Fixes the item layout (the first insert does it). `meta` is the Python
  // side's description of the structure, kept for checkpoints. Calling it
  // again with the same leaves is a no-op; different ones throw.
  void setSchema(const std::vector<ReplayLeaf>& leaves, const std::string& meta);
  bool hasSchema() const;
  // An opaque description kept for checkpoints (the Python side's settings).
  void setMeta(const std::string& meta);
  std::string meta() const;

  // Inserts n items (leaves[j] holds n * itemBytes of leaf j; priorities n
  // doubles or null for 1), writing their keys to keysOut. Waits on the rate
  // limiter at most waitSeconds in all; what was inserted before a timeout
  // stays. Throws std::invalid_argument (nothing inserted) on a bad priority.
  ReplayProgress insert(int64_t n, const std::vector<ReplaySpan>& leaves, const double* priorities,
                        int64_t* keysOut, double waitSeconds);
  // Samples n items into outs (n * itemBytes per leaf), keys and the
  // probability each had of being drawn.
  ReplayProgress sample(int64_t n, const std::vector<ReplaySpan>& outs, int64_t* keysOut,
                        double* probsOut, double waitSeconds);
  // Returns how many keys were present. Validates every priority first.
  int64_t updatePriorities(int64_t n, const int64_t* keys, const double* priorities);

  // Changes what a checkpoint restores by default (load overrides).
  void reconfigure(double alpha, int64_t minSize, double samplesPerInsert, double errorBuffer);
  void reseed(uint64_t seed);
  ReplayConfig config() const;
  std::vector<ReplayLeaf> layout() const;
  int64_t size() const;
  double priorityMass() const;
  ReplayInfo info() const;

  // Fails every waiting and later call with "replay table is closed".
  void close();

  // Writes the table to path atomically; its state is copied under the lock
  // and written (hashed, fsynced) after it is released.
  void save(const std::string& path) const;
  // Restores a table saved at path as the next incarnation of it: one more
  // than any that path's checkpoint or incarnation file (path + ".incarnation",
  // written here before this returns) knows of, for the keys it inserts.
  static std::unique_ptr<Replay> load(const std::string& path);

  // Throws std::invalid_argument unless the limiter settings can make progress.
  static void validate(const ReplayConfig& config);

 private:
  static std::unique_ptr<Replay> loadChecked(const std::string& path);

  ReplayConfig configLocked() const;
  void checkOpenLocked() const;

  void evictOldestLocked();
  // The key of the live item of insertion counter `counter`.
  int64_t keyLocked(int64_t counter) const;

  int64_t drawLocked(double* probability);
  double weight(double priority) const;
  void rebuildTreeLocked();

  // One mutex for the table: every part below (the limiter, the item store,
  // the sum tree) is called under it and holds no lock of its own, which
  // keeps an item from being evicted while it is copied out and an insert,
  // a sample and an update consistent with each other.
  mutable std::mutex mutex_;
  const int64_t capacity_;
  const ReplaySelector selector_;
  double alpha_;
  replay::RateLimiter limiter_;  // the other settings, the counters and the waits
  std::mt19937_64 rng_;
  bool closed_ = false;
  int64_t evictions_ = 0;

  std::string meta_;
  // The items' contents; it has a layout once the schema is set.
  replay::ItemStore store_;

  int64_t head_ = 0, tail_ = 0;         // live keys: [head_, tail_)
  uint32_t incarnation_ = 0;            // the high bits of the keys this table hands out
  std::vector<double> priorities_;      // per slot
  std::vector<uint16_t> incarnations_;  // per slot: the incarnation that inserted it
  // Over the slots' priority^alpha; prioritized tables only.
  std::optional<replay::SumTree> tree_;
};

}  // namespace moolib
