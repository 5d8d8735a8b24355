#include "replay/table.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "replay/checkpoint.h"
#include "runtime/error.h"

namespace moolib {

using replay::ByteWriter;
using replay::CheckpointReader;
using replay::CheckpointWriter;
using replay::kCheckpointMagic;
using replay::kCheckpointVersion;

namespace {

replay::RateLimits limitsOf(const ReplayConfig& c) {
  return {c.minSize, c.samplesPerInsert, c.errorBuffer};
}

}  // namespace

void Replay::validate(const ReplayConfig& c) {
  auto bad = [](const std::string& m) { throw std::invalid_argument(m); };
  if (c.capacity <= 0) bad(concat("replay capacity must be positive, got ", c.capacity));
  if (!std::isfinite(c.alpha) || c.alpha < 0) {
    bad(concat("replay alpha must be finite and >= 0, got ", c.alpha));
  }
  replay::RateLimiter::validate(limitsOf(c), c.capacity);
}

Replay::Replay(const ReplayConfig& config, uint64_t seed)
    : capacity_(config.capacity),
      selector_(config.selector),
      alpha_(config.alpha),
      limiter_(limitsOf(config)),
      rng_(seed),
      store_(config.capacity) {
  validate(config);
  priorities_.assign(size_t(capacity_), 0.0);
  incarnations_.assign(size_t(capacity_), 0);
  if (selector_ == ReplaySelector::kPrioritized) tree_.emplace(capacity_);
}

Replay::~Replay() { close(); }

void Replay::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  closed_ = true;
  limiter_.wakeAll();
}

void Replay::checkOpenLocked() const { MOO_ENFORCE(!closed_, "replay table is closed"); }

void Replay::setSchema(const std::vector<ReplayLeaf>& leaves, const std::string& meta) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkOpenLocked();
  if (store_.setLayout(leaves)) meta_ = meta;
}

bool Replay::hasSchema() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return store_.hasLayout();
}

void Replay::setMeta(const std::string& meta) {
  std::lock_guard<std::mutex> lock(mutex_);
  meta_ = meta;
}

std::string Replay::meta() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return meta_;
}

double Replay::weight(double priority) const {
  return alpha_ == 1.0 ? priority : std::pow(priority, alpha_);
}

void Replay::rebuildTreeLocked() {
  if (!tree_) return;
  tree_->clear();
  for (int64_t k = head_; k < tail_; ++k) {
    int64_t slot = k % capacity_;
    tree_->setLeaf(slot, weight(priorities_[size_t(slot)]));
  }
  tree_->rebuild();
}

int64_t Replay::keyLocked(int64_t counter) const {
  return int64_t(incarnations_[size_t(counter % capacity_)]) << kReplayCounterBits | counter;
}

void Replay::evictOldestLocked() {
  int64_t slot = head_ % capacity_;
  store_.evict(slot);
  // Its slot is written again by the insert that evicts it.
  if (tree_) tree_->setLeaf(slot, 0.0);
  ++head_;
  ++evictions_;
}

ReplayProgress Replay::insert(int64_t n, const std::vector<ReplaySpan>& leaves,
                              const double* priorities, int64_t* keysOut, double waitSeconds) {
  if (n <= 0)
    throw std::invalid_argument(concat("replay insert of ", n, " items: need at least 1"));
  for (int64_t i = 0; priorities && i < n; ++i) {
    if (!std::isfinite(priorities[i]) || priorities[i] < 0) {
      throw std::invalid_argument(concat("replay insert: the priority at batch index ", i, " is ",
                                         priorities[i], "; priorities must be finite and >= 0"));
    }
  }
  std::vector<ReplayLeaf> layout;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    checkOpenLocked();
    MOO_ENFORCE(store_.hasLayout(), "replay insert before the item layout was set");
    layout = store_.layout();
  }
  MOO_ENFORCE(leaves.size() == layout.size(), "replay insert: ", leaves.size(),
              " leaves, expected ", layout.size());
  size_t framesPerItem = 0;
  for (size_t j = 0; j < layout.size(); ++j) {
    MOO_ENFORCE(leaves[j].size == size_t(n * layout[j].itemBytes), "replay insert: leaf ", j,
                " has ", leaves[j].size, " bytes, expected ", n * layout[j].itemBytes);
    framesPerItem += size_t(layout[j].frames);
  }
  // Hashed before the lock is taken: it is most of the cost of a dedup insert.
  std::vector<uint64_t> hashes = replay::ItemStore::hashFrames(layout, leaves, n);

  replay::RateLimiter::Wait wait(waitSeconds);
  ReplayProgress progress;
  std::vector<const uint8_t*> src(layout.size());
  std::unique_lock<std::mutex> lock(mutex_);
  // The sum tree's parents over the slots this call filled since it last
  // released the lock: fixed before every release, an exception included.
  struct Run {
    std::optional<replay::SumTree>& tree;
    int64_t first = 0, count = 0;
    void flush() {
      if (tree) tree->fixParents(first, count);
      count = 0;
    }
    ~Run() { flush(); }
  } run{tree_};
  while (progress.done < n) {
    checkOpenLocked();
    if (limiter_.canInsert(tail_ - head_)) {
      int64_t i = progress.done;
      for (size_t j = 0; j < layout.size(); ++j) src[j] = leaves[j].data + i * layout[j].itemBytes;
      MOO_ENFORCE(tail_ < kReplayCounterMask, "replay insert: this table has used all of its ",
                  kReplayCounterMask, " keys");
      if (tail_ - head_ == capacity_) evictOldestLocked();
      int64_t slot = tail_ % capacity_;
      if (run.count++ == 0) run.first = slot;
      store_.put(slot, src, hashes.data() + size_t(i) * framesPerItem);
      double priority = priorities ? priorities[i] : 1.0;
      priorities_[size_t(slot)] = priority;
      // The run's parents are fixed once, when the lock is released.
      if (tree_) tree_->setLeaf(slot, weight(priority));
      incarnations_[size_t(slot)] = uint16_t(incarnation_);
      keysOut[i] = keyLocked(tail_);
      ++tail_;
      limiter_.inserted();
      ++progress.done;
      continue;
    }
    run.flush();
    // Samplers may be waiting for what this batch inserted so far.
    limiter_.wakeSamplers();
    if (!limiter_.awaitInsert(lock, wait,
                              [this] { return closed_ || limiter_.canInsert(tail_ - head_); })) {
      progress.waited = limiter_.insertTimeout(n, progress.done, waitSeconds);
      break;
    }
  }
  run.flush();
  progress.size = tail_ - head_;
  if (progress.done > 0) limiter_.wakeSamplers();
  return progress;
}

int64_t Replay::drawLocked(double* probability) {
  int64_t size = tail_ - head_;
  if (selector_ == ReplaySelector::kUniform) {
    auto r = uint64_t((static_cast<unsigned __int128>(rng_()) * uint64_t(size)) >> 64);
    *probability = 1.0 / double(size);
    return head_ + int64_t(r);
  }
  double total = tree_->total();
  if (!(total > 0)) {
    throw std::invalid_argument(
        "replay sample: every item has priority 0, so none can be drawn by priority");
  }
  int64_t slot = tree_->find(double(rng_() >> 11) * 0x1.0p-53 * total);
  *probability = tree_->leaf(slot) / total;
  int64_t headSlot = head_ % capacity_;
  return head_ + (slot - headSlot + capacity_) % capacity_;
}

ReplayProgress Replay::sample(int64_t n, const std::vector<ReplaySpan>& outs, int64_t* keysOut,
                              double* probsOut, double waitSeconds) {
  if (n <= 0)
    throw std::invalid_argument(concat("replay sample of ", n, " items: need at least 1"));
  replay::RateLimiter::Wait wait(waitSeconds);
  ReplayProgress progress;
  std::unique_lock<std::mutex> lock(mutex_);
  while (progress.done < n) {
    checkOpenLocked();
    if (limiter_.canSample(tail_ - head_)) {
      const std::vector<ReplayLeaf>& layout = store_.layout();
      if (outs.size() != layout.size()) {
        progress.needOutputs = true;
        break;
      }
      if (progress.done == 0) {
        for (size_t j = 0; j < layout.size(); ++j) {
          MOO_ENFORCE(outs[j].size == size_t(n * layout[j].itemBytes), "replay sample: output ", j,
                      " has ", outs[j].size, " bytes, expected ", n * layout[j].itemBytes);
        }
      }
      int64_t i = progress.done;
      int64_t key;
      double p = 1.0;
      if (selector_ == ReplaySelector::kFifo) {
        // The oldest items in insertion order, round again if n > size.
        key = head_ + i % (tail_ - head_);
      } else {
        key = drawLocked(&p);
      }
      store_.copyOut(key % capacity_, outs, i);
      keysOut[i] = keyLocked(key);
      probsOut[i] = p;
      limiter_.sampled();
      ++progress.done;
      progress.size = tail_ - head_;
      continue;
    }
    limiter_.wakeInserters();
    if (!limiter_.awaitSample(lock, wait,
                              [this] { return closed_ || limiter_.canSample(tail_ - head_); })) {
      progress.waited = limiter_.sampleTimeout(n, progress.done, waitSeconds, tail_ - head_);
      break;
    }
  }
  if (progress.size == 0) progress.size = tail_ - head_;
  if (progress.done > 0) limiter_.wakeInserters();
  return progress;
}

int64_t Replay::updatePriorities(int64_t n, const int64_t* keys, const double* priorities) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(priorities[i]) || priorities[i] < 0) {
      throw std::invalid_argument(concat("replay update_priorities: the priority for key ", keys[i],
                                         " is ", priorities[i],
                                         "; priorities must be finite and >= 0"));
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  checkOpenLocked();
  int64_t updated = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t key = keys[i];
    int64_t counter = key & kReplayCounterMask;
    if (key < 0 || counter < head_ || counter >= tail_) continue;
    int64_t slot = counter % capacity_;
    // Another incarnation's key: an item that table lost, never this one.
    if ((key >> kReplayCounterBits) != incarnations_[size_t(slot)]) continue;
    priorities_[size_t(slot)] = priorities[i];
    if (tree_) tree_->set(slot, weight(priorities[i]));
    ++updated;
  }
  return updated;
}

void Replay::reconfigure(double alpha, int64_t minSize, double samplesPerInsert,
                         double errorBuffer) {
  std::lock_guard<std::mutex> lock(mutex_);
  ReplayConfig c = configLocked();
  c.alpha = alpha;
  c.minSize = minSize;
  c.samplesPerInsert = samplesPerInsert;
  c.errorBuffer = errorBuffer;
  validate(c);
  bool rebuild = c.alpha != alpha_;
  alpha_ = c.alpha;
  // Wakes every waiter: the new limits may let it go on.
  limiter_.setLimits(limitsOf(c));
  if (rebuild) rebuildTreeLocked();
}

void Replay::reseed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(mutex_);
  rng_.seed(seed);
}

ReplayConfig Replay::config() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return configLocked();
}

ReplayConfig Replay::configLocked() const {
  ReplayConfig c;
  c.capacity = capacity_;
  c.selector = selector_;
  c.alpha = alpha_;
  c.minSize = limiter_.limits().minSize;
  c.samplesPerInsert = limiter_.limits().samplesPerInsert;
  c.errorBuffer = limiter_.limits().errorBuffer;
  return c;
}

std::vector<ReplayLeaf> Replay::layout() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return store_.layout();
}

int64_t Replay::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return tail_ - head_;
}

double Replay::priorityMass() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return tree_ ? tree_->total() : double(tail_ - head_);
}

ReplayInfo Replay::info() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ReplayInfo r;
  r.size = tail_ - head_;
  r.capacity = capacity_;
  r.inserts = limiter_.inserts();
  r.samples = limiter_.samples();
  r.evictions = evictions_;
  r.priorityMass = tree_ ? tree_->total() : double(r.size);
  r.frames = store_.frames();
  r.frameBytes = store_.frameBytes();
  r.waitingInserters = limiter_.waitingInserters();
  r.waitingSamplers = limiter_.waitingSamplers();
  r.incarnation = incarnation_;
  // What the live items take: their dense bytes and frame ids, the distinct
  // frames with their bookkeeping (record, hash-map node), the priority
  // (plus its sum-tree share) and the incarnation.
  int64_t perItem = int64_t(sizeof(double) + sizeof(uint16_t)) +
                    (tree_ ? 2 * int64_t(sizeof(double)) : 0) + store_.bytesPerItem();
  r.storedBytes = r.size * perItem + store_.frameStorageBytes();
  return r;
}

void Replay::save(const std::string& path) const {
  replay::writeAtomically(path, [this](int fd, const std::string& tmp) {
    // The state is copied under the lock (one consistent state; memcpy and
    // frame references, no hashing or I/O), then hashed and written without
    // it, so samples and inserts wait for the copy, not for the disk.
    ByteWriter head, items;
    replay::FrameSnapshot frames;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      head.write(kCheckpointMagic, sizeof(kCheckpointMagic));
      head.put<uint32_t>(kCheckpointVersion);
      head.put<uint32_t>(0);
      const replay::RateLimits& limits = limiter_.limits();
      head.put<int64_t>(capacity_);
      head.put<int32_t>(int32_t(selector_));
      head.put<double>(alpha_);
      head.put<int64_t>(limits.minSize);
      head.put<double>(limits.samplesPerInsert);
      head.put<double>(limits.errorBuffer);
      head.put<int64_t>(head_);
      head.put<int64_t>(tail_);
      head.put<int64_t>(limiter_.inserts());
      head.put<int64_t>(limiter_.samples());
      head.put<int64_t>(evictions_);
      head.put<uint32_t>(incarnation_);
      std::ostringstream rng;
      rng << rng_;
      head.putString(rng.str());
      head.putString(meta_);
      const std::vector<ReplayLeaf>& leaves = store_.layout();
      head.put<uint8_t>(store_.hasLayout() ? 1 : 0);
      head.put<uint64_t>(leaves.size());
      for (auto& l : leaves) {
        head.put<int64_t>(l.itemBytes);
        head.put<int64_t>(l.frames);
      }
      for (int64_t k = head_; k < tail_; ++k) store_.snapshotFrames(k % capacity_, frames);
      items.reserve(size_t((tail_ - head_) *
                           (int64_t(sizeof(double) + sizeof(uint16_t)) + store_.bytesPerItem())));
      for (int64_t k = head_; k < tail_; ++k) {
        int64_t slot = k % capacity_;
        items.put<double>(priorities_[size_t(slot)]);
        items.put<uint16_t>(incarnations_[size_t(slot)]);
        store_.writeItem(slot, frames, items);
      }
    }
    CheckpointWriter w(fd, tmp);
    w.write(head.data(), head.size());
    frames.write(w);
    w.write(items.data(), items.size());
    w.finish();
  });
}

std::unique_ptr<Replay> Replay::load(const std::string& path) {
  std::unique_ptr<Replay> table;
  try {
    table = loadChecked(path);
  } catch (const std::bad_alloc&) {
    throw std::invalid_argument("replay checkpoint " + path +
                                " is corrupt: it asks for more memory than there is");
  }
  replay::removeStaleTemporaries(path);
  // A new incarnation, on disk before this table hands out a key: one that
  // died after loading the same checkpoint used the one before.
  std::string file = path + ".incarnation";
  uint64_t next = std::max<uint64_t>(table->incarnation_, replay::readIncarnation(file)) + 1;
  if (next > kReplayMaxIncarnation) {
    throw std::invalid_argument(concat("replay checkpoint ", path, " was loaded ",
                                       kReplayMaxIncarnation,
                                       " times: no incarnation is left for its keys"));
  }
  replay::writeIncarnation(file, next);
  table->incarnation_ = uint32_t(next);
  return table;
}

std::unique_ptr<Replay> Replay::loadChecked(const std::string& path) {
  CheckpointReader r(path);
  // Version 1 predates incarnations: its table and items are incarnation 0.
  uint32_t version = r.get<uint32_t>();
  if (version != 1 && version != kCheckpointVersion) r.corrupt("unknown format version");
  r.get<uint32_t>();
  ReplayConfig c;
  c.capacity = r.get<int64_t>();
  int32_t selector = r.get<int32_t>();
  if (selector < 0 || selector > int32_t(ReplaySelector::kFifo)) r.corrupt("unknown selector");
  c.selector = ReplaySelector(selector);
  c.alpha = r.get<double>();
  c.minSize = r.get<int64_t>();
  c.samplesPerInsert = r.get<double>();
  c.errorBuffer = r.get<double>();
  try {
    validate(c);
  } catch (const std::invalid_argument& e) {
    r.corrupt(e.what());
  }
  // The capacity sizes allocations before any item is read: bound it by
  // what an item costs at least in the file (its priority).
  int64_t head = r.get<int64_t>(), tail = r.get<int64_t>();
  if (head < 0 || tail < head || tail - head > c.capacity ||
      uint64_t(tail - head) > r.left() / sizeof(double)) {
    r.corrupt("bad item range");
  }
  if (c.capacity > (int64_t(1) << 40)) r.corrupt("capacity out of range");
  auto out = std::make_unique<Replay>(c, 0);
  Replay& t = *out;
  t.head_ = head;
  t.tail_ = tail;
  int64_t inserts = r.get<int64_t>(), samples = r.get<int64_t>();
  t.evictions_ = r.get<int64_t>();
  if (inserts < tail || samples < 0 || t.evictions_ < 0 || tail > kReplayCounterMask)
    r.corrupt("bad counters");
  t.limiter_.restore(inserts, samples);
  if (version >= 2) t.incarnation_ = r.get<uint32_t>();
  if (t.incarnation_ > kReplayMaxIncarnation) r.corrupt("bad incarnation");
  std::istringstream rng(r.getString(1 << 16, "random state"));
  rng >> t.rng_;
  if (rng.fail()) r.corrupt("bad random state");
  std::string meta = r.getString(1 << 26, "metadata");
  bool hasSchema = r.get<uint8_t>() != 0;
  uint64_t nLeaves = r.get<uint64_t>();
  if (nLeaves > 4096 || nLeaves * 16 > r.left()) r.corrupt("bad leaf count");
  std::vector<ReplayLeaf> leaves(nLeaves);
  for (auto& l : leaves) {
    l.itemBytes = r.get<int64_t>();
    l.frames = r.get<int64_t>();
    if (l.itemBytes <= 0 || l.itemBytes > (int64_t(1) << 40) || l.frames < 0 ||
        l.frames > l.itemBytes || (l.frames > 0 && l.itemBytes % l.frames != 0)) {
      r.corrupt("bad leaf layout");
    }
  }
  // What each item takes in the file bounds its layout: a forged header
  // cannot make the loader allocate more than the file holds.
  uint64_t fileBytesPerItem = sizeof(double) + (version >= 2 ? sizeof(uint16_t) : 0);
  for (auto& l : leaves) {
    if (l.frames > (int64_t(1) << 16)) r.corrupt("bad leaf layout");
    fileBytesPerItem += l.frames == 0 ? uint64_t(l.itemBytes) : uint64_t(l.frames) * 4;
  }
  if (tail > head && fileBytesPerItem > r.left() / uint64_t(tail - head)) {
    r.corrupt("its items are larger than the file");
  }
  if (hasSchema) {
    try {
      t.setSchema(leaves, meta);
    } catch (const std::invalid_argument& e) {
      r.corrupt(e.what());
    }
  } else {
    if (nLeaves != 0 || tail != head) r.corrupt("items without a layout");
    t.meta_ = meta;
  }
  t.store_.readFrames(r);
  for (int64_t k = head; k < tail; ++k) {
    int64_t slot = k % c.capacity;
    double p = r.get<double>();
    if (!std::isfinite(p) || p < 0) r.corrupt("bad priority");
    t.priorities_[size_t(slot)] = p;
    if (version >= 2) {
      auto incarnation = r.get<uint16_t>();
      if (incarnation > t.incarnation_) r.corrupt("an item of a later incarnation");
      t.incarnations_[size_t(slot)] = incarnation;
    }
    t.store_.readItem(slot, r);
  }
  if (r.left() != 0) r.corrupt("trailing bytes");
  t.store_.checkFramesHeld(r);
  t.rebuildTreeLocked();
  return out;
}

}  // namespace moolib
