// What a replay table's items hold, slot by slot: each leaf either dense, in
// chunks allocated on first use (memory follows the size, not the
// capacity), or deduplicated, as ids of content-addressed, refcounted frames
// shared by every item and leaf that holds the same bytes. It holds no
// lock: the table calls it under its own, except hashFrames.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace moolib {

// One leaf of an item. A dedup leaf is `frames` frames of itemBytes / frames
// bytes each, stored content-addressed (shared by every item and leaf that
// holds the same frame).
struct ReplayLeaf {
  int64_t itemBytes = 0;
  int64_t frames = 0;  // 0: stored densely
};

// A view of caller memory: n items of a leaf back to back.
struct ReplaySpan {
  uint8_t* data = nullptr;
  size_t size = 0;
};

namespace replay {

class ByteWriter;
class CheckpointReader;
class CheckpointWriter;

// The frames a checkpoint holds, each once, numbered densely in order of
// first use. They are held by reference, so a save writes them after the
// table's lock is released: a frame's bytes never change, and one a save
// holds is not reused.
class FrameSnapshot {
 public:
  // Their count, then each one's size and bytes.
  void write(CheckpointWriter& w) const;

 private:
  friend class ItemStore;
  std::unordered_map<uint32_t, uint32_t> number_;  // store id -> number in the file
  std::vector<std::shared_ptr<const uint8_t[]>> data_;
  std::vector<uint32_t> bytes_;
};

class ItemStore {
 public:
  explicit ItemStore(int64_t capacity);
  ItemStore(const ItemStore&) = delete;
  ItemStore& operator=(const ItemStore&) = delete;

  // Fixes the layout: true when it was set now, false when it already was
  // this one. Throws std::invalid_argument for a bad layout or another one.
  bool setLayout(const std::vector<ReplayLeaf>& leaves);
  bool hasLayout() const { return !leaves_.empty(); }
  const std::vector<ReplayLeaf>& layout() const { return leaves_; }

  // The hashes of the dedup frames of n items (leaves[j] holds leaf j of
  // each), item by item in the order put() takes them. It needs no lock:
  // hashing is most of the cost of a dedup insert.
  static std::vector<uint64_t> hashFrames(const std::vector<ReplayLeaf>& layout,
                                          const std::vector<ReplaySpan>& leaves, int64_t n);

  // The item in `slot` is evicted: its frames are released by the put()
  // that fills the slot again, after the new item took its own, so a frame
  // both share is kept rather than freed and copied again.
  void evict(int64_t slot);
  // Stores an item: src[j] is its leaf j, `hashes` its frames' (hashFrames).
  void put(int64_t slot, const std::vector<const uint8_t*>& src, const uint64_t* hashes);
  // Copies the item in `slot` to item `index` of outs (one span a leaf).
  void copyOut(int64_t slot, const std::vector<ReplaySpan>& outs, int64_t index) const;

  int64_t frames() const { return liveFrames_; }
  int64_t frameBytes() const { return liveFrameBytes_; }
  // What an item takes beyond its frames: its dense bytes and frame ids.
  int64_t bytesPerItem() const;
  // What the distinct frames take, with their bookkeeping (record, hash-map
  // node).
  int64_t frameStorageBytes() const;

  // A checkpoint: the frames of the items in `slot` are added to `frames`,
  // and the item written as its dense bytes and the frames' numbers there.
  void snapshotFrames(int64_t slot, FrameSnapshot& frames) const;
  void writeItem(int64_t slot, const FrameSnapshot& frames, ByteWriter& out) const;
  // Restores the frames (FrameSnapshot::write), then each item, then checks
  // that every frame is held by one.
  void readFrames(CheckpointReader& r);
  void readItem(int64_t slot, CheckpointReader& r);
  void checkFramesHeld(const CheckpointReader& r) const;

 private:
  struct Frame {
    uint64_t hash = 0;
    uint32_t refs = 0;
    uint32_t nextSameHash = 0;  // kNoFrame ends the chain
    uint32_t bytes = 0;
    // Shared with a save in progress, which writes it after the lock is released.
    std::shared_ptr<uint8_t[]> data;
  };
  static constexpr uint32_t kNoFrame = UINT32_MAX;

  uint8_t* denseSlot(size_t leaf, int64_t slot);
  const uint8_t* denseSlot(size_t leaf, int64_t slot) const;
  uint32_t* frameIds(size_t leaf, int64_t slot);
  const uint32_t* frameIds(size_t leaf, int64_t slot) const;
  uint32_t internFrame(const uint8_t* data, uint32_t bytes, uint64_t hash);
  void releaseFrame(uint32_t id);

  int64_t capacity_;
  std::vector<ReplayLeaf> leaves_;
  int64_t chunkItems_ = 1;
  // Per leaf: dense storage in lazily allocated chunks of chunkItems_ slots,
  // or for a dedup leaf, `frames` frame ids per slot.
  std::vector<std::vector<std::unique_ptr<uint8_t[]>>> chunks_;
  std::vector<std::vector<uint32_t>> ids_;
  std::vector<uint32_t> evictedIds_;  // the frames of the item evict() named

  std::vector<Frame> frames_;
  std::vector<uint32_t> freeFrames_;
  std::unordered_map<uint64_t, uint32_t> frameByHash_;  // first frame of each hash chain
  int64_t liveFrames_ = 0, liveFrameBytes_ = 0;
};

}  // namespace replay
}  // namespace moolib
