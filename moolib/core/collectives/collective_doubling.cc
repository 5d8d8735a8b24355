// A Collective's recursive doubling (collective.h), for small buffers among
// many members: the stages of its DoublingPlan (doubling.h), each adding a
// partner's partial sum.
#include <cstring>

#include "collectives/collective.h"

namespace moolib {

void Collective::onDoubling(const CollectiveMessage& m, BufferPtr data) {
  auto& d = doubling_[m.buffer];
  size_t stage = d.plan.stageOf(m.step);
  bool ok = stage < d.plan.stages.size() && d.plan.stages[stage].peer == m.source &&
            data->size() == buffers_[m.buffer].bytes;
  if (ok) {
    std::lock_guard<std::mutex> lock(mutex_);
    ok = stage >= d.next && !d.arrived[stage];
    if (ok) d.arrived[stage] = std::move(data);
  }
  if (!ok) {
    return fail(concat(describe(), " failed: member '", members_[m.source],
                       "' sent an unexpected part (recursive doubling step ", m.step, ")"),
                true);
  }
  advanceDoubling(m.buffer);
}

void Collective::advanceDoubling(size_t buffer) {
  auto& d = doubling_[buffer];
  auto& buf = buffers_[buffer];
  size_t count = buf.bytes / dtypeSize(buf.dtype);
  for (;;) {
    BufferPtr theirs;
    const DoublingPlan::Stage* stage;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_ || d.busy || d.next == d.plan.stages.size() || !d.arrived[d.next]) return;
      d.busy = true;
      theirs = std::move(d.arrived[d.next]);
      stage = &d.plan.stages[d.next];
    }
    if (stage->kind == DoublingPlan::kUnfold) {
      std::memcpy(buf.data, theirs->data(), buf.bytes);
    } else if (stage->kind == DoublingPlan::kFold || self_ < stage->peer) {
      sumInto(buf.dtype, buf.data, theirs->data(), count);
    } else {
      // The lower member's partial sum comes first on both sides of a pair.
      sumInto(buf.dtype, theirs->data(), buf.data, count);
      std::memcpy(buf.data, theirs->data(), buf.bytes);
    }
    if (stage->then) sendDoubling(buffer, *stage->then);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++d.next;
      d.busy = false;
    }
    received();
  }
}

void Collective::sendDoubling(size_t buffer, DoublingPlan::Send to) {
  auto& buf = buffers_[buffer];
  auto m = bufferMessage(CollectiveMessage::kDoubling, buffer);
  m.step = to.step;
  // A copy: this member goes on adding into its buffer while the send is out.
  auto copy = copyToBuffer(OutSegment{buf.data, buf.bytes, nullptr});
  send(to.peer, m, {OutSegment{copy->data(), copy->size(), copy}});
}

}  // namespace moolib
