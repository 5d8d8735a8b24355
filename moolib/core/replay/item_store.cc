#include "replay/item_store.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "replay/checkpoint.h"
#include "runtime/error.h"

namespace moolib::replay {

namespace {

// Dense storage is allocated in chunks of about this many bytes per leaf, so
// a table's memory follows its size, not its capacity.
constexpr int64_t kChunkBytes = 4 << 20;

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

uint64_t mix(uint64_t h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  return h;
}

uint64_t load64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

// A 64-bit hash of a byte string, for content addressing (equal bytes are
// still compared on a match).
uint64_t frameHash(const uint8_t* p, size_t n) {
  constexpr uint64_t k1 = 0x9E3779B97F4A7C15ULL, k2 = 0xC2B2AE3D27D4EB4FULL,
                     k3 = 0x165667B19E3779F9ULL;
  // Four independent lanes keep the multiplier busy; a frame of Atari is
  // hashed at memory speed.
  uint64_t a = k1 ^ n, b = k2, c = k3, d = k1 ^ k2;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a = rotl(a ^ (load64(p + i) * k2), 31) * k1;
    b = rotl(b ^ (load64(p + i + 8) * k2), 31) * k1;
    c = rotl(c ^ (load64(p + i + 16) * k2), 31) * k1;
    d = rotl(d ^ (load64(p + i + 24) * k2), 31) * k1;
  }
  for (; i + 8 <= n; i += 8) a = rotl(a ^ (load64(p + i) * k2), 27) * k3;
  uint64_t last = 0;
  std::memcpy(&last, p + i, n - i);
  a ^= last * k3;
  return mix(a + rotl(b, 7) + rotl(c, 12) + rotl(d, 18));
}

}  // namespace

void FrameSnapshot::write(CheckpointWriter& w) const {
  w.put<uint64_t>(data_.size());
  for (size_t i = 0; i < data_.size(); ++i) {
    w.put<uint32_t>(bytes_[i]);
    w.write(data_[i].get(), bytes_[i]);
  }
}

ItemStore::ItemStore(int64_t capacity) : capacity_(capacity) {}

bool ItemStore::setLayout(const std::vector<ReplayLeaf>& leaves) {
  if (hasLayout()) {
    bool same = leaves.size() == leaves_.size();
    for (size_t i = 0; same && i < leaves.size(); ++i) {
      same = leaves[i].itemBytes == leaves_[i].itemBytes && leaves[i].frames == leaves_[i].frames;
    }
    if (!same) throw std::invalid_argument("replay items changed layout after the first insert");
    return false;
  }
  if (leaves.empty()) throw std::invalid_argument("a replay item needs at least one leaf");
  int64_t largest = 1;
  for (auto& l : leaves) {
    if (l.itemBytes <= 0) throw std::invalid_argument("replay leaves must have at least one byte");
    if (l.frames < 0 || (l.frames > 0 && l.itemBytes % l.frames != 0)) {
      throw std::invalid_argument("a dedup leaf must split into whole frames");
    }
    if (l.frames == 0) largest = std::max(largest, l.itemBytes);
  }
  leaves_ = leaves;
  chunkItems_ = std::clamp<int64_t>(kChunkBytes / largest, 1, capacity_);
  chunks_.clear();
  chunks_.resize(leaves_.size());
  ids_.clear();
  ids_.resize(leaves_.size());
  int64_t chunks = (capacity_ + chunkItems_ - 1) / chunkItems_;
  for (size_t j = 0; j < leaves_.size(); ++j) {
    if (leaves_[j].frames == 0) {
      chunks_[j].resize(size_t(chunks));
    } else {
      ids_[j].assign(size_t(capacity_ * leaves_[j].frames), kNoFrame);
    }
  }
  return true;
}

std::vector<uint64_t> ItemStore::hashFrames(const std::vector<ReplayLeaf>& layout,
                                            const std::vector<ReplaySpan>& leaves, int64_t n) {
  size_t framesPerItem = 0;
  for (auto& l : layout) framesPerItem += size_t(l.frames);
  std::vector<uint64_t> hashes(framesPerItem * size_t(n));
  if (framesPerItem == 0) return hashes;
  uint64_t* h = hashes.data();
  for (int64_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < layout.size(); ++j) {
      int64_t frames = layout[j].frames;
      if (frames == 0) continue;
      int64_t frameBytes = layout[j].itemBytes / frames;
      const uint8_t* item = leaves[j].data + i * layout[j].itemBytes;
      for (int64_t f = 0; f < frames; ++f) *h++ = frameHash(item + f * frameBytes, frameBytes);
    }
  }
  return hashes;
}

uint8_t* ItemStore::denseSlot(size_t leaf, int64_t slot) {
  auto& chunk = chunks_[leaf][size_t(slot / chunkItems_)];
  if (!chunk) chunk = std::make_unique<uint8_t[]>(size_t(chunkItems_ * leaves_[leaf].itemBytes));
  return chunk.get() + (slot % chunkItems_) * leaves_[leaf].itemBytes;
}

const uint8_t* ItemStore::denseSlot(size_t leaf, int64_t slot) const {
  return chunks_[leaf][size_t(slot / chunkItems_)].get() +
         (slot % chunkItems_) * leaves_[leaf].itemBytes;
}

uint32_t* ItemStore::frameIds(size_t leaf, int64_t slot) {
  return ids_[leaf].data() + slot * leaves_[leaf].frames;
}

const uint32_t* ItemStore::frameIds(size_t leaf, int64_t slot) const {
  return ids_[leaf].data() + slot * leaves_[leaf].frames;
}

uint32_t ItemStore::internFrame(const uint8_t* data, uint32_t bytes, uint64_t hash) {
  auto it = frameByHash_.find(hash);
  if (it != frameByHash_.end()) {
    for (uint32_t id = it->second; id != kNoFrame; id = frames_[id].nextSameHash) {
      Frame& f = frames_[id];
      if (f.bytes == bytes && std::memcmp(f.data.get(), data, bytes) == 0) {
        ++f.refs;
        return id;
      }
    }
  }
  uint32_t id;
  if (!freeFrames_.empty()) {
    id = freeFrames_.back();
    freeFrames_.pop_back();
  } else {
    MOO_ENFORCE(frames_.size() < kNoFrame, "replay: too many distinct frames");
    id = uint32_t(frames_.size());
    frames_.emplace_back();
  }
  Frame& f = frames_[id];
  // A recycled frame keeps its buffer when the size matches.
  // Reused only where no save in progress still holds it.
  if (!f.data || f.bytes != bytes || f.data.use_count() > 1) {
    f.data = std::shared_ptr<uint8_t[]>(std::make_unique<uint8_t[]>(bytes));
  }
  std::memcpy(f.data.get(), data, bytes);
  f.hash = hash;
  f.bytes = bytes;
  f.refs = 1;
  if (it != frameByHash_.end()) {
    f.nextSameHash = it->second;
    it->second = id;
  } else {
    f.nextSameHash = kNoFrame;
    frameByHash_.emplace(hash, id);
  }
  ++liveFrames_;
  liveFrameBytes_ += bytes;
  return id;
}

void ItemStore::releaseFrame(uint32_t id) {
  Frame& f = frames_[id];
  if (--f.refs > 0) return;
  auto it = frameByHash_.find(f.hash);
  if (it->second == id) {
    if (f.nextSameHash == kNoFrame) {
      frameByHash_.erase(it);
    } else {
      it->second = f.nextSameHash;
    }
  } else {
    uint32_t prev = it->second;
    while (frames_[prev].nextSameHash != id) prev = frames_[prev].nextSameHash;
    frames_[prev].nextSameHash = f.nextSameHash;
  }
  --liveFrames_;
  liveFrameBytes_ -= f.bytes;
  freeFrames_.push_back(id);
}

void ItemStore::evict(int64_t slot) {
  evictedIds_.clear();
  for (size_t j = 0; j < leaves_.size(); ++j) {
    if (leaves_[j].frames == 0) continue;
    uint32_t* ids = frameIds(j, slot);
    evictedIds_.insert(evictedIds_.end(), ids, ids + leaves_[j].frames);
  }
}

void ItemStore::put(int64_t slot, const std::vector<const uint8_t*>& src, const uint64_t* hashes) {
  for (size_t j = 0; j < leaves_.size(); ++j) {
    const ReplayLeaf& l = leaves_[j];
    if (l.frames == 0) {
      std::memcpy(denseSlot(j, slot), src[j], size_t(l.itemBytes));
      continue;
    }
    uint32_t frameBytes = uint32_t(l.itemBytes / l.frames);
    uint32_t* ids = frameIds(j, slot);
    for (int64_t f = 0; f < l.frames; ++f) {
      ids[f] = internFrame(src[j] + f * frameBytes, frameBytes, *hashes++);
    }
  }
  for (uint32_t id : evictedIds_) releaseFrame(id);
  evictedIds_.clear();
}

void ItemStore::copyOut(int64_t slot, const std::vector<ReplaySpan>& outs, int64_t index) const {
  for (size_t j = 0; j < leaves_.size(); ++j) {
    const ReplayLeaf& l = leaves_[j];
    uint8_t* dst = outs[j].data + index * l.itemBytes;
    if (l.frames == 0) {
      std::memcpy(dst, denseSlot(j, slot), size_t(l.itemBytes));
      continue;
    }
    int64_t frameBytes = l.itemBytes / l.frames;
    const uint32_t* ids = frameIds(j, slot);
    for (int64_t f = 0; f < l.frames; ++f) {
      std::memcpy(dst + f * frameBytes, frames_[ids[f]].data.get(), size_t(frameBytes));
    }
  }
}

int64_t ItemStore::bytesPerItem() const {
  int64_t n = 0;
  for (auto& l : leaves_) n += l.frames == 0 ? l.itemBytes : l.frames * 4;
  return n;
}

int64_t ItemStore::frameStorageBytes() const {
  return liveFrameBytes_ + liveFrames_ * int64_t(sizeof(Frame) + 2 * sizeof(void*) + 16);
}

void ItemStore::snapshotFrames(int64_t slot, FrameSnapshot& frames) const {
  for (size_t j = 0; j < leaves_.size(); ++j) {
    const uint32_t* ids = frameIds(j, slot);
    for (int64_t f = 0; f < leaves_[j].frames; ++f) {
      if (frames.number_.emplace(ids[f], uint32_t(frames.data_.size())).second) {
        frames.data_.push_back(frames_[ids[f]].data);
        frames.bytes_.push_back(frames_[ids[f]].bytes);
      }
    }
  }
}

void ItemStore::writeItem(int64_t slot, const FrameSnapshot& frames, ByteWriter& out) const {
  for (size_t j = 0; j < leaves_.size(); ++j) {
    if (leaves_[j].frames == 0) {
      out.write(denseSlot(j, slot), size_t(leaves_[j].itemBytes));
      continue;
    }
    const uint32_t* ids = frameIds(j, slot);
    for (int64_t f = 0; f < leaves_[j].frames; ++f) out.put<uint32_t>(frames.number_.at(ids[f]));
  }
}

void ItemStore::readFrames(CheckpointReader& r) {
  uint64_t nFrames = r.get<uint64_t>();
  if (nFrames > r.left() / 4) r.corrupt("bad frame count");
  frames_.resize(nFrames);
  for (uint64_t i = 0; i < nFrames; ++i) {
    uint32_t bytes = r.get<uint32_t>();
    if (bytes == 0 || bytes > r.left()) r.corrupt("bad frame size");
    Frame& f = frames_[i];
    f.bytes = bytes;
    f.data = std::shared_ptr<uint8_t[]>(std::make_unique<uint8_t[]>(bytes));
    r.read(f.data.get(), bytes);
    f.hash = frameHash(f.data.get(), bytes);
    auto [it, fresh] = frameByHash_.emplace(f.hash, uint32_t(i));
    f.nextSameHash = fresh ? kNoFrame : it->second;
    it->second = uint32_t(i);
    liveFrameBytes_ += bytes;
  }
  liveFrames_ = int64_t(nFrames);
}

void ItemStore::readItem(int64_t slot, CheckpointReader& r) {
  for (size_t j = 0; j < leaves_.size(); ++j) {
    if (leaves_[j].frames == 0) {
      r.read(denseSlot(j, slot), uint64_t(leaves_[j].itemBytes));
      continue;
    }
    uint64_t frameBytes = uint64_t(leaves_[j].itemBytes / leaves_[j].frames);
    uint32_t* ids = frameIds(j, slot);
    for (int64_t f = 0; f < leaves_[j].frames; ++f) {
      uint32_t id = r.get<uint32_t>();
      if (id >= frames_.size() || frames_[id].bytes != frameBytes) r.corrupt("bad frame reference");
      ids[f] = id;
      ++frames_[id].refs;
    }
  }
}

void ItemStore::checkFramesHeld(const CheckpointReader& r) const {
  for (auto& f : frames_) {
    if (f.refs == 0) r.corrupt("unreferenced frame");
  }
}

}  // namespace moolib::replay
