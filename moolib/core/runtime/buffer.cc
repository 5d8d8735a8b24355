#include "runtime/buffer.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace moolib {

namespace {

constexpr size_t kAlignment = 64;
// Blocks at least this large are cached on release and reused.
constexpr size_t kCacheMinSize = size_t(1) << 20;
constexpr size_t kCacheMaxBytes = size_t(512) << 20;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Block = std::unique_ptr<uint8_t, FreeDeleter>;

class BlockCache {
 public:
  Block take(size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(size);
    if (it == blocks_.end()) return nullptr;
    Block b = std::move(it->second);
    blocks_.erase(it);
    bytes_ -= size;
    return b;
  }
  void give(size_t size, Block block) {
    if (size > kCacheMaxBytes / 2) return;
    std::lock_guard<std::mutex> lock(mutex_);
    // Make room by evicting the smallest blocks first.
    while (bytes_ + size > kCacheMaxBytes && !blocks_.empty()) {
      bytes_ -= blocks_.begin()->first;
      blocks_.erase(blocks_.begin());
    }
    blocks_.emplace(size, std::move(block));
    bytes_ += size;
  }

 private:
  std::mutex mutex_;
  std::multimap<size_t, Block> blocks_;
  size_t bytes_ = 0;
};

BlockCache& cache() {
  // Leaked: buffers may be released by threads running after static destruction.
  static BlockCache* c = new BlockCache();
  return *c;
}

size_t roundUp(size_t n) {
  if (n < kCacheMinSize) return (n + kAlignment - 1) / kAlignment * kAlignment;
  constexpr size_t kStep = size_t(1) << 20;
  return (n + kStep - 1) / kStep * kStep;
}

}  // namespace

Buffer::~Buffer() {
  if (capacity_ >= kCacheMinSize) {
    cache().give(capacity_, Block(data_));
  } else if (capacity_) {
    std::free(data_);
  } else if (release_) {
    release_();
  }
}

namespace {

// Small received segments (the pickle stream of a call, most often) live in
// the same heap block as their Buffer and its reference count: one
// allocation per segment instead of three.
constexpr size_t kInlineBytes = 192;
struct InlineBuffer {
  alignas(kAlignment) uint8_t bytes[kInlineBytes];
  Buffer buffer;
  explicit InlineBuffer(size_t size) : buffer(bytes, size, nullptr) {}
};

}  // namespace

BufferPtr allocateBuffer(size_t size) {
  if (size <= kInlineBytes) {
    auto holder = std::make_shared<InlineBuffer>(size);
    return BufferPtr(holder, &holder->buffer);
  }
  size_t capacity = roundUp(std::max<size_t>(size, 1));
  Block block;
  if (capacity >= kCacheMinSize) block = cache().take(capacity);
  if (!block) {
    block.reset(static_cast<uint8_t*>(std::aligned_alloc(kAlignment, capacity)));
    if (!block) throw std::bad_alloc();
  }
  auto buffer = std::make_shared<Buffer>(block.get(), size, capacity);
  block.release();  // owned by the buffer now
  return buffer;
}

BufferPtr copyToBuffer(const OutSegment& segment) {
  BufferPtr b = allocateBuffer(segment.size);
  if (segment.size) std::memcpy(b->data(), segment.data, segment.size);
  return b;
}

OutSegment ownedSegment(std::string bytes) {
  auto held = std::make_shared<const std::string>(std::move(bytes));
  return OutSegment{reinterpret_cast<const uint8_t*>(held->data()), held->size(), held};
}

}  // namespace moolib
