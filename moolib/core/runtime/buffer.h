// Memory blocks that cross the core: received segments (owned by the core and
// shared with the Python objects built over them) and outgoing segments (views
// of memory owned by someone else, kept alive by an opaque handle).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace moolib {

// A writable block of memory. Whoever made it decides how it is released;
// holders only see data() and size().
class Buffer {
 public:
  // Memory owned elsewhere; release runs when the buffer is dropped.
  Buffer(uint8_t* data, size_t size, std::function<void()> release)
      : data_(data), size_(size), release_(std::move(release)) {}
  // A heap block of capacity bytes that this buffer owns (see allocateBuffer).
  Buffer(uint8_t* block, size_t size, size_t capacity)
      : data_(block), size_(size), capacity_(capacity) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  uint8_t* data_;
  size_t size_;
  size_t capacity_ = 0;  // non-zero: data_ is our heap block
  std::function<void()> release_;
};
using BufferPtr = std::shared_ptr<Buffer>;

// Allocates a 64-byte aligned heap buffer. Large blocks come from a bounded
// cache of recently freed ones, so receiving many large messages does not
// page-fault fresh memory each time.
BufferPtr allocateBuffer(size_t size);

// An outgoing segment: memory to send, and whatever keeps it valid until sent.
struct OutSegment {
  const uint8_t* data = nullptr;
  size_t size = 0;
  std::shared_ptr<const void> keepalive;
};

// Copies an outgoing segment into a buffer the core owns.
BufferPtr copyToBuffer(const OutSegment& segment);

// A segment over bytes the segment itself owns (a message's header, a
// small encoded record): kept alive until every send of it is done.
OutSegment ownedSegment(std::string bytes);

}  // namespace moolib
