// A Collective's ring all-reduce (collective.h): a buffer too large to send
// whole goes round the ring of members in chunks, reduce-scatter then
// all-gather.
#include <cstring>
#include <tuple>

#include "collectives/collective.h"

namespace moolib {

size_t Collective::Ring::chunks(size_t segment) const {
  size_t len = segmentBegin[segment + 1] - segmentBegin[segment];
  return (len + chunkElements - 1) / chunkElements;
}

std::pair<size_t, size_t> Collective::Ring::chunkRange(size_t segment, size_t chunk) const {
  size_t begin = segmentBegin[segment] + chunk * chunkElements;
  return {begin, std::min(begin + chunkElements, segmentBegin[segment + 1])};
}

void Collective::sendChunk(uint8_t phase, size_t buffer, size_t step, size_t segment,
                           size_t chunk) {
  auto m = bufferMessage(phase, buffer);
  m.step = uint32_t(step);
  m.segment = uint32_t(segment);
  m.chunk = uint32_t(chunk);
  auto [begin, end] = rings_[buffer].chunkRange(segment, chunk);
  send(right(), m, {view(buffer, begin, end)});
}

void Collective::onRing(const CollectiveMessage& m, const BufferPtr& data) {
  auto& ring = rings_[m.buffer];
  auto& b = buffers_[m.buffer];
  int64_t step = m.step, me = int64_t(self_);
  bool scatter = m.phase == CollectiveMessage::kReduceScatter;
  size_t want = scatter ? mod(me - 1 - step) : mod(me - step);
  bool ok =
      m.step + 1 < n_ && m.source == left() && m.segment == want && m.chunk < ring.chunks(want);
  size_t begin = 0, end = 0;
  if (ok) {
    std::tie(begin, end) = ring.chunkRange(m.segment, m.chunk);
    ok = data->size() == (end - begin) * ring.elementSize;
  }
  if (!ok) {
    return fail(concat(describe(), " failed: member '", members_[m.source],
                       "' sent an unexpected part (phase ", int(m.phase), " step ", m.step,
                       " segment ", m.segment, " chunk ", m.chunk, ", ", data->size(), " bytes)"),
                true);
  }
  uint8_t* dst = b.data + begin * ring.elementSize;
  bool last = m.step + 2 == n_;
  if (scatter) {
    sumInto(b.dtype, dst, data->data(), end - begin);
    // The segment moves on: partially reduced to the next member, or, once
    // complete here, into the all-gather.
    if (last) {
      sendChunk(CollectiveMessage::kAllGather, m.buffer, 0, m.segment, m.chunk);
    } else {
      sendChunk(CollectiveMessage::kReduceScatter, m.buffer, m.step + 1, m.segment, m.chunk);
    }
  } else {
    std::memcpy(dst, data->data(), data->size());
    if (!last) sendChunk(CollectiveMessage::kAllGather, m.buffer, m.step + 1, m.segment, m.chunk);
  }
  received();
}

}  // namespace moolib
