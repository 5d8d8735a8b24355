#include "rpc/wire.h"

namespace moolib {

Error validateHeader(const FrameHeader& h, bool handshaken) {
  if (h.magic != kFrameMagic) return Error(concat("bad frame magic 0x", std::hex, h.magic));
  if (h.version != kWireVersion) return Error(concat("unsupported wire version ", int(h.version)));
  if (h.type == 0 || h.type > uint8_t(FrameType::kMaxType))
    return Error(concat("unknown frame type ", int(h.type)));
  if (h.numSegments > kMaxSegments)
    return Error(concat("frame has ", h.numSegments, " segments (limit ", kMaxSegments, ")"));
  if (h.metaLength > kMaxMetaLength)
    return Error(concat("frame metadata of ", h.metaLength, " bytes (limit ", kMaxMetaLength, ")"));
  if (!handshaken) {
    uint64_t fixedPart = uint64_t(h.numSegments) * sizeof(SegmentDesc) + h.metaLength;
    if (fixedPart > kMaxHandshakeFrame)
      return Error(concat("handshake frame of ", fixedPart, " bytes is too large"));
  }
  return Error();
}

}  // namespace moolib
