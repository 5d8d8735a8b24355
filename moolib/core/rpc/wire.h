// The wire format shared by every stream transport.
//
// A frame is:
//   FrameHeader (24 bytes, little endian)
//   numSegments x SegmentDesc (24 bytes each)
//   meta bytes (metaLength)
//   the bytes of every inline segment, in order
//
// Segment 0 of an RPC frame is the pickle stream, the others its out-of-band
// buffers. A segment is either inline (its bytes follow in the stream) or, on
// the shared-memory transport, a reference into a shared segment.
//
// Every length and count is checked against limits before anything is
// allocated: a frame that breaks them closes its connection. See also
// docs/architecture.md, section 3.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/buffer.h"
#include "runtime/error.h"

namespace moolib {

constexpr uint32_t kFrameMagic = 0x314f4f4d;  // "MOO1"
constexpr uint8_t kWireVersion = 1;
constexpr uint32_t kMaxSegments = 8192;
constexpr uint32_t kMaxMetaLength = 1 << 20;
// Until a connection has completed its handshake it may only send this much.
constexpr uint64_t kMaxHandshakeFrame = 64 << 10;

enum class FrameType : uint8_t {
  kHello = 1,       // protocol version, nonce, role, whether a key is required
  kAuth = 2,        // HMAC proof over both nonces
  kIdentify = 3,    // name, incarnation, host identity, listen addresses
  kRequest = 4,     // call id, function name; segments: pickle + buffers
  kResponse = 5,    // call id, status, error text; segments: pickle + buffers
  kKeepalive = 6,   // nothing; proves the link is alive
  kFindPeer = 7,    // name wanted
  kPeerInfo = 8,    // name, found, host identity, addresses
  kShmRelease = 9,  // transport-internal: shared segments the receiver let go
  kMaxType = 9,
};

struct FrameHeader {
  uint32_t magic;
  uint8_t version;
  uint8_t type;
  uint16_t reserved;
  uint32_t numSegments;
  uint32_t metaLength;
  uint64_t reserved2;
};
static_assert(sizeof(FrameHeader) == 24, "wire layout");

enum class SegmentKind : uint32_t { kInline = 0, kShared = 1 };

struct SegmentDesc {
  uint64_t length;
  uint32_t kind;
  uint32_t sharedId;  // kShared: the sender's segment id
  uint64_t offset;    // kShared: offset in that segment
};
static_assert(sizeof(SegmentDesc) == 24, "wire layout");

// Checks a header read from the network. Returns an error describing the first
// violated limit.
Error validateHeader(const FrameHeader& h, bool handshaken);

// Appends fixed-size little-endian integers and length-prefixed strings.
class Writer {
 public:
  void u8(uint8_t v) { raw(&v, 1); }
  void u32(uint32_t v) { raw(&v, 4); }
  void u64(uint64_t v) { raw(&v, 8); }
  void f64(double v) { raw(&v, 8); }
  void str(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    raw(s.data(), s.size());
  }
  void strings(const std::vector<std::string>& v) {
    u32(static_cast<uint32_t>(v.size()));
    for (auto& s : v) str(s);
  }
  std::string take() { return std::move(out_); }

 private:
  void raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string out_;
};

// Reads what Writer wrote; throws WireError on any overrun.
class WireError : public Exception {
 public:
  using Exception::Exception;
};

class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  uint8_t u8() { return fixed<uint8_t>(); }
  uint32_t u32() { return fixed<uint32_t>(); }
  uint64_t u64() { return fixed<uint64_t>(); }
  double f64() { return fixed<double>(); }
  std::string str(size_t maxLength = kMaxMetaLength) {
    uint32_t n = u32();
    if (n > maxLength || n > remaining())
      throw WireError(concat("string of ", n, " bytes overruns the frame"));
    std::string s(data_.substr(pos_, n));
    pos_ += n;
    return s;
  }
  std::vector<std::string> strings(size_t maxCount = 1024) {
    uint32_t n = u32();
    if (n > maxCount || n > remaining() / 4)
      throw WireError(concat("list of ", n, " strings overruns the frame"));
    std::vector<std::string> v;
    v.reserve(n);
    for (uint32_t i = 0; i != n; ++i) v.push_back(str());
    return v;
  }
  size_t remaining() const { return data_.size() - pos_; }

 private:
  template <typename T>
  T fixed() {
    if (remaining() < sizeof(T)) throw WireError("frame metadata is truncated");
    T v;
    std::memcpy(&v, data_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string_view data_;
  size_t pos_ = 0;
};

// A frame as the RPC layer sees it, independent of the transport.
struct OutgoingFrame {
  FrameType type;
  std::string meta;
  std::vector<OutSegment> segments;
};

struct IncomingFrame {
  FrameType type;
  std::string meta;
  std::vector<BufferPtr> segments;
};

}  // namespace moolib
