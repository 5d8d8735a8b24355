#include "transport/ucx/connection_impl.h"

#if MOOLIB_UCX_HEADERS

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "runtime/logging.h"
#include "transport/stream_connection.h"

namespace moolib {

namespace {

constexpr uint8_t kPreamble = 0x4d;  // 'M': the accepting side is wired up
// Segments up to this size are copied behind the head: one send is cheaper
// than two for them.
constexpr size_t kCopyBelow = 16 << 10;
// A segment this large coming in over UCX's TCP is polled for, not slept on:
// each wake-up on the event fd brings in about a socket buffer's worth, and
// waking costs about as much as reading it
// (docs/decisions/ucx-bulk-polling.md). The poll stops once nothing came for
// a while (UcxRuntime's kBulkQuiet: the sender stalled). Not over shared
// memory, where the poller takes the core the copy needs.
constexpr size_t kBulkBytes = size_t(1) << 20;

void recvCallback(void* request, ucs_status_t status, size_t length, void* user) {
  static_cast<UcxConnection*>(user)->onRecvDone(request, status, length);
}

void closeCallback(void* request, ucs_status_t status, void* user) {
  static_cast<UcxConnection*>(user)->onCloseDone(request);
}

}  // namespace

void UcxConnection::sendCallback(void* request, ucs_status_t status, void* user) {
  auto* tag = static_cast<SendTag*>(user);
  tag->conn->onSendDone(request, status, tag->op);
}

UcxConnection::UcxConnection(std::shared_ptr<UcxRuntime> runtime, std::string local,
                             std::string remote)
    : rt_(std::move(runtime)), local_(std::move(local)), remote_(std::move(remote)) {}

UcxConnection::~UcxConnection() = default;

std::string UcxConnection::statusString(ucs_status_t s) const {
  return rt_->api.ucs_status_string(s);
}

void UcxConnection::dialLocked(ucp_ep_h ep, Context::ConnectFn done) {
  ep_ = ep;
  connectDone_ = std::move(done);
  rt_->live.insert(shared_from_this());
  state_ = RecvState::kPreamble;
  pumpLocked();
}

void UcxConnection::acceptLocked(ucp_ep_h ep, Task wired) {
  ep_ = ep;
  rt_->live.insert(shared_from_this());
  // Handed up only once the preamble has left: until the dialer has
  // confirmed the connection, UCX queues sends, and UCX 1.13 replays them
  // over the final lanes with the message protocol picked for the first
  // ones: a frame of 93-128 bytes then fails on its shared memory ("Invalid
  // am_short length"). The preamble, 1 byte, fits any.
  acceptDone_ = std::move(wired);
  static const uint8_t preamble = kPreamble;
  SendOp& op = sends_[0];
  op.tag = SendTag{this, 0};
  if (!postLocked(op, &preamble, 1)) {
    sends_.erase(0);
  } else if (op.pending) {
    rt_->ensurePollingLocked();
  } else {
    sends_.erase(0);
    wiredLocked();
  }
}

void UcxConnection::wiredLocked() {
  if (!acceptDone_ || closed_) return;
  readLanesLocked();
  rt_->deferred.push_back(std::move(acceptDone_));
  acceptDone_ = nullptr;
}

void UcxConnection::readLanesLocked() {
  // ucp_ep_print_info writes lines such as
  //   "#   lane[1]:  2:sysv/memory.0 md[1]  -> md[1]/sysv/sysdev[255] am am_bw#0"
  // the transport/device of each lane (the connection manager's lane has none).
  char* text = nullptr;
  size_t size = 0;
  FILE* out = ::open_memstream(&text, &size);
  if (!out) return;
  rt_->api.ucp_ep_print_info(ep_, out);
  ::fclose(out);
  std::istringstream all(std::string(text, size));
  ::free(text);
  std::string lanes, line;
  while (std::getline(all, line)) {
    size_t colon = line.find("]: ");  // "lane[1]: " then the lane's resource
    if (line.find("lane[") == std::string::npos || colon == std::string::npos) continue;
    std::string item;
    std::istringstream(line.substr(colon + 3)) >> item;
    size_t index = item.find(':');  // "2:sysv/memory.0": the resource's index first
    if (index == std::string::npos || item.find('/') == std::string::npos) continue;
    item = item.substr(index + 1);
    if (("," + lanes + ",").find("," + item + ",") == std::string::npos) {
      lanes += (lanes.empty() ? "" : ",") + item;
    }
  }
  lanes_ = lanes;
  tcpOnly_ = !lanes.empty();
  std::istringstream each(lanes);
  std::string lane;
  while (std::getline(each, lane, ',')) tcpOnly_ = tcpOnly_ && lane.rfind("tcp/", 0) == 0;
}

void UcxConnection::bulkLocked(bool on) {
  if (on == bulk_) return;
  bulk_ = on;
  if (on) {
    ++rt_->bulkReceives;
  } else {
    --rt_->bulkReceives;
  }
}

bool UcxConnection::serveWhile(const std::function<bool()>& done, TimePoint deadline,
                               bool claimed) {
  flush();  // the call this thread waits for may be in a held-back burst
  if (!claimed && (closed_ || !rt_->claim())) return false;
  rt_->serve([&] { return done() || closed_.load(); }, deadline);
  rt_->unown();
  return true;
}

void UcxConnection::start(FrameFn onFrame, CloseFn onClose) {
  {
    std::lock_guard<std::mutex> lock(inboxMutex_);
    onFrame_ = std::move(onFrame);
    onClose_ = std::move(onClose);
  }
  {
    std::lock_guard<std::mutex> lock(rt_->mutex);
    started_ = true;
    if (!closed_ && state_ == RecvState::kIdle) {
      state_ = RecvState::kHeader;
      pumpLocked();
    }
    markDirtyLocked();
  }
  rt_->runDeferred();
}

void UcxConnection::send(OutgoingFrame&& frame) {
  if (closed_) return;
  QueuedFrame q;
  FrameHeader h{kFrameMagic,
                kWireVersion,
                uint8_t(frame.type),
                0,
                uint32_t(frame.segments.size()),
                uint32_t(frame.meta.size()),
                0};
  size_t copied = 0;
  for (auto& s : frame.segments) copied += s.size < kCopyBelow ? s.size : 0;
  q.head.reserve(sizeof(h) + frame.segments.size() * sizeof(SegmentDesc) + frame.meta.size() +
                 copied);
  q.head.append(reinterpret_cast<const char*>(&h), sizeof(h));
  for (auto& s : frame.segments) {
    SegmentDesc d{s.size, uint32_t(SegmentKind::kInline), 0, 0};
    q.head.append(reinterpret_cast<const char*>(&d), sizeof(d));
  }
  q.head.append(frame.meta);
  // Segments in order: the small ones copied behind the head until the first
  // large one; from there each goes out as its own send (the stream keeps
  // the order), the small ones after it too.
  size_t i = 0;
  for (; i != frame.segments.size() && frame.segments[i].size < kCopyBelow; ++i) {
    q.head.append(reinterpret_cast<const char*>(frame.segments[i].data), frame.segments[i].size);
  }
  for (; i != frame.segments.size(); ++i) {
    if (frame.segments[i].size) q.segments.push_back(std::move(frame.segments[i]));
  }
  uint64_t total = q.head.size();
  for (auto& s : q.segments) total += s.size;

  // Only replies are corked: a request a function sends must not wait for
  // the rest of its batch.
  bool corked = frame.type == FrameType::kResponse &&
                corkIfBatching(std::static_pointer_cast<Corkable>(shared_from_this()));
  SendOp finished;  // dropped after the lock, outside the mutex
  std::unique_lock<std::mutex> lock(rt_->mutex);
  if (closed_ || !ep_) return;
  bytesSent_ += total;
  queue_.push_back(std::move(q));
  if (corked) return;
  if (burst_.writeNow(queue_.size())) {
    bool ok = flushLocked(finished);
    lock.unlock();
    if (!ok) rt_->runDeferred();
    return;
  }
  if (!flushTimer_) {
    std::weak_ptr<UcxConnection> weak = shared_from_this();
    flushTimer_ = Loop::instance().addTimer(Clock::now() + SendBurst::kDelay, [weak] {
      if (auto self = weak.lock()) self->flush();
    });
  }
}

void UcxConnection::flush() {
  SendOp finished;
  bool ok;
  {
    std::lock_guard<std::mutex> lock(rt_->mutex);
    flushTimer_ = 0;  // a pending timer finds the queue empty
    ok = flushLocked(finished);
  }
  if (!ok) rt_->runDeferred();
}

bool UcxConnection::flushLocked(SendOp& finished) {
  if (queue_.empty() || closed_ || !ep_) return true;
  uint64_t id = nextSend_++;
  // A map node: its address (the requests' user data) is stable.
  SendOp& op = sends_[id];
  op.tag = SendTag{this, id};
  // The heads of consecutive frames are joined into one send, up to a frame
  // with large segments, which go out from the caller's memory after it.
  // Reserved (a frame at most opens one head): a head's bytes stay put once
  // posted. Taken out of queue_ first, as a failed post closes the
  // connection, which empties it.
  std::vector<QueuedFrame> queued;
  queued.swap(queue_);
  op.heads.reserve(queued.size());
  op.heads.emplace_back();
  bool ok = true;
  for (size_t k = 0; ok && k != queued.size(); ++k) {
    QueuedFrame& q = queued[k];
    std::string& head = op.heads.back();
    if (head.empty()) {
      head = std::move(q.head);  // a lone frame: no copy
    } else {
      head.append(q.head);
    }
    bool last = k + 1 == queued.size();
    if (q.segments.empty() && !last) continue;
    ok = postLocked(op, head.data(), head.size());
    for (size_t j = 0; ok && j != q.segments.size(); ++j) {
      ok = postLocked(op, q.segments[j].data, q.segments[j].size);
    }
    if (!last) op.heads.emplace_back();
  }
  // Kept alive until the sends are done, and after a failure dropped with op
  // (outside the mutex).
  takeSegments(queued, op.segments);
  // The queue's storage is kept for the next sends.
  queued.clear();
  if (queue_.empty()) queue_.swap(queued);
  auto it = sends_.find(id);  // a failure above may have cleared them all
  if (it != sends_.end() && it->second.pending == 0) {
    finished = std::move(it->second);
    sends_.erase(it);
  } else if (it != sends_.end()) {
    rt_->ensurePollingLocked();
  }
  return ok;
}

void UcxConnection::takeSegments(std::vector<QueuedFrame>& from, std::vector<OutSegment>& to) {
  for (auto& q : from) {
    for (auto& seg : q.segments) to.push_back(std::move(seg));
  }
}

bool UcxConnection::postLocked(SendOp& op, const void* data, size_t size) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &UcxConnection::sendCallback;
  p.user_data = &op.tag;
  ucs_status_ptr_t r = rt_->api.ucp_stream_send_nbx(ep_, data, size, &p);
  if (UCS_PTR_IS_ERR(r)) {
    failLocked(concat("UCX send: ", statusString(UCS_PTR_STATUS(r))));
    return false;
  }
  if (r) {
    op.pending++;
    rt_->sendsInFlight++;
  }
  return true;
}

void UcxConnection::sendRaw(std::string bytes) {
  SendOp finished;
  std::lock_guard<std::mutex> lock(rt_->mutex);
  if (!flushLocked(finished) || closed_ || !ep_) return;
  uint64_t id = nextSend_++;
  SendOp& op = sends_[id];
  op.tag = SendTag{this, id};
  op.heads.push_back(std::move(bytes));
  if (postLocked(op, op.heads.back().data(), op.heads.back().size()) && op.pending) {
    rt_->ensurePollingLocked();
  } else if (sends_.count(id)) {
    sends_.erase(id);
  }
}

void UcxConnection::onSendDone(void* request, ucs_status_t status, uint64_t op) {
  rt_->api.ucp_request_free(request);
  rt_->sendsInFlight--;
  auto it = sends_.find(op);
  if (it != sends_.end() && --it->second.pending == 0) {
    // Dropped outside the mutex: a segment's keepalive may be a tensor.
    auto done = std::make_shared<SendOp>(std::move(it->second));
    sends_.erase(it);
    rt_->deferred.push_back([done] {});
  }
  if (status != UCS_OK && status != UCS_ERR_CANCELED) {
    failLocked(concat("UCX send failed: ", statusString(status)));
  } else if (op == 0) {
    wiredLocked();
  }
  maybeRetireLocked();
}

void UcxConnection::pumpLocked() {
  while (!closed_ && !recvPending_ && ep_) {
    void* target = nullptr;
    size_t size = 0;
    switch (state_) {
      case RecvState::kIdle:
      case RecvState::kHeld:
        return;
      case RecvState::kPreamble:
        target = &preamble_;
        size = 1;
        break;
      case RecvState::kHeader:
        target = &header_;
        size = sizeof(header_);
        break;
      case RecvState::kFixed:
        target = fixed_.data();
        size = fixed_.size();
        break;
      case RecvState::kSegment:
        target = frame_.segments[segmentIndex_]->data();
        size = frame_.segments[segmentIndex_]->size();
        break;
    }
    if (size == 0) {
      if (!advanceLocked(0)) return;
      continue;
    }
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.recv_stream = &recvCallback;
    p.user_data = this;
    p.flags = UCP_STREAM_RECV_FLAG_WAITALL;
    size_t length = 0;
    ucs_status_ptr_t r = rt_->api.ucp_stream_recv_nbx(ep_, target, size, &length, &p);
    if (UCS_PTR_IS_ERR(r)) {
      failLocked(concat("UCX receive: ", statusString(UCS_PTR_STATUS(r))));
      return;
    }
    if (r) {
      recvPending_ = true;
      recvRequest_ = r;
      return;
    }
    if (!advanceLocked(length)) return;
  }
}

void UcxConnection::onRecvDone(void* request, ucs_status_t status, size_t length) {
  rt_->api.ucp_request_free(request);
  recvPending_ = false;
  recvRequest_ = nullptr;
  if (status != UCS_OK) {
    if (status != UCS_ERR_CANCELED) {
      failLocked(concat("UCX receive failed: ", statusString(status)));
    }
    maybeRetireLocked();
    return;
  }
  if (advanceLocked(length)) pumpLocked();
  maybeRetireLocked();
}

bool UcxConnection::advanceLocked(size_t length) {
  bytesReceived_ += length;
  try {
    switch (state_) {
      case RecvState::kIdle:
      case RecvState::kHeld:
        return true;
      case RecvState::kPreamble: {
        if (preamble_ != kPreamble) {
          failLocked("the peer is not a moolib UCX endpoint");
          return false;
        }
        state_ = RecvState::kIdle;
        if (connectDone_) {
          readLanesLocked();
          if (connectTimer_) Loop::instance().cancelTimer(connectTimer_);
          connectTimer_ = 0;
          auto done = std::move(connectDone_);
          connectDone_ = nullptr;
          auto self = shared_from_this();
          rt_->deferred.push_back([done, self] { done(Error(), self); });
        }
        return true;
      }
      case RecvState::kHeader: {
        if (Error e = validateHeader(header_, handshaken_)) {
          failLocked(e.what());
          return false;
        }
        // Bounded by the header's checks: kMaxSegments descriptors, kMaxMetaLength.
        fixed_.resize(size_t(header_.numSegments) * sizeof(SegmentDesc) + header_.metaLength);
        state_ = RecvState::kFixed;
        return true;
      }
      case RecvState::kFixed: {
        descs_.resize(header_.numSegments);
        std::memcpy(descs_.data(), fixed_.data(), descs_.size() * sizeof(SegmentDesc));
        uint64_t limit =
            handshaken_ ? StreamConnection::kMaxMessageBytes : uint64_t(kMaxHandshakeFrame);
        uint64_t total = 0;
        for (auto& d : descs_) {
          if (d.kind != uint32_t(SegmentKind::kInline)) {
            failLocked(concat("segment kind ", d.kind, " over UCX (only inline segments)"));
            return false;
          }
          if (d.length > limit || total + d.length > limit) {
            failLocked(concat("frame of more than ", limit, " bytes"));
            return false;
          }
          total += d.length;
        }
        frame_.type = FrameType(header_.type);
        frame_.meta.assign(
            reinterpret_cast<const char*>(fixed_.data()) + descs_.size() * sizeof(SegmentDesc),
            header_.metaLength);
        frame_.segments.clear();
        frame_.segments.reserve(descs_.size());
        for (auto& d : descs_) frame_.segments.push_back(allocateBuffer(d.length));
        segmentIndex_ = 0;
        return nextSegmentLocked();
      }
      case RecvState::kSegment:
        ++segmentIndex_;
        return nextSegmentLocked();
    }
  } catch (const std::bad_alloc&) {
    failLocked("out of memory for an incoming frame");
    return false;
  }
  return true;
}

bool UcxConnection::nextSegmentLocked() {
  while (segmentIndex_ < frame_.segments.size() && frame_.segments[segmentIndex_]->size() == 0) {
    ++segmentIndex_;
  }
  if (segmentIndex_ < frame_.segments.size()) {
    state_ = RecvState::kSegment;
    bulkLocked(tcpOnly_ && frame_.segments[segmentIndex_]->size() >= kBulkBytes);
    return true;
  }
  bulkLocked(false);
  deliverLocked();
  state_ = handshaken_ ? RecvState::kHeader : RecvState::kHeld;
  return !closed_;
}

void UcxConnection::deliverLocked() {
  {
    std::lock_guard<std::mutex> lock(inboxMutex_);
    inbox_.push_back(std::move(frame_));
  }
  frame_ = IncomingFrame{};
  markDirtyLocked();
}

void UcxConnection::markDirtyLocked() {
  std::lock_guard<std::mutex> lock(inboxMutex_);
  if (dirty_ || (inbox_.empty() && !closeQueued_)) return;
  dirty_ = true;
  rt_->dirty.push_back(shared_from_this());
}

void UcxConnection::drain() {
  std::unique_lock<std::mutex> lock(inboxMutex_);
  dirty_ = false;
  if (draining_ || !onFrame_) return;
  draining_ = true;
  for (;;) {
    if (!inbox_.empty()) {
      IncomingFrame f = std::move(inbox_.front());
      inbox_.pop_front();
      if (closeDelivered_) continue;
      auto fn = onFrame_;
      lock.unlock();
      fn(std::move(f));
      resumeAfterHeld();
      lock.lock();
      continue;
    }
    if (closeQueued_ && !closeDelivered_) {
      closeDelivered_ = true;
      auto fn = std::move(onClose_);
      onClose_ = nullptr;
      onFrame_ = [](IncomingFrame&&) {};
      Error reason = closeReason_;
      lock.unlock();
      if (fn) fn(reason);
      lock.lock();
      continue;
    }
    break;
  }
  draining_ = false;
}

void UcxConnection::resumeAfterHeld() {
  {
    std::lock_guard<std::mutex> lock(rt_->mutex);
    if (state_ != RecvState::kHeld || closed_) return;
    state_ = RecvState::kHeader;
    pumpLocked();
  }
  // What the receives completed at once queued (this connection's frames are
  // handed up by the drain that called here).
  rt_->runDeferred();
}

void UcxConnection::close(const Error& reason) {
  {
    std::lock_guard<std::mutex> lock(rt_->mutex);
    closeLocked(reason, false);
  }
  rt_->runDeferred();
}

void UcxConnection::failLocked(const std::string& why) {
  if (closed_) return;
  MOO_LOG(kVerbose, "UCX connection ", remote_, ": ", why);
  closeLocked(Error(why), true);
}

void UcxConnection::closeLocked(const Error& reason, bool force) {
  if (closed_) return;
  // A graceful close sends what a burst held back first; a failed
  // connection drops it (outside the mutex: it may keep tensors alive).
  SendOp finished;
  if (!force) flushLocked(finished);
  takeSegments(queue_, finished.segments);
  queue_.clear();
  if (!finished.segments.empty()) {
    rt_->deferred.push_back([drop = std::make_shared<SendOp>(std::move(finished))] {});
  }
  // A failed flush closed the connection already.
  if (closed_.exchange(true)) return;
  bulkLocked(false);
  if (connectDone_) {
    // Still dialing: the dial fails.
    if (connectTimer_) Loop::instance().cancelTimer(connectTimer_);
    connectTimer_ = 0;
    auto done = std::move(connectDone_);
    connectDone_ = nullptr;
    rt_->deferred.push_back([done, reason] { done(reason, nullptr); });
  }
  // Never handed up; dropped outside the mutex (it holds this connection).
  if (acceptDone_) rt_->deferred.push_back([drop = std::move(acceptDone_)] {});
  acceptDone_ = nullptr;
  {
    std::lock_guard<std::mutex> lock(inboxMutex_);
    closeQueued_ = true;
    closeReason_ = reason;
  }
  if (started_) markDirtyLocked();
  if (recvPending_ && recvRequest_) rt_->api.ucp_request_cancel(rt_->worker, recvRequest_);
  if (ep_) {
    ucp_ep_h ep = ep_;
    ep_ = nullptr;
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = &closeCallback;
    p.user_data = this;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    closing_ = true;
    ucs_status_ptr_t r = rt_->api.ucp_ep_close_nbx(ep, &p);
    if (!UCS_PTR_IS_PTR(r)) closing_ = false;
  }
  maybeRetireLocked();
}

void UcxConnection::onCloseDone(void* request) {
  rt_->api.ucp_request_free(request);
  closing_ = false;
  maybeRetireLocked();
}

void UcxConnection::maybeRetireLocked() {
  // UCX holds raw pointers to this connection until its endpoint is closed
  // and its requests have called back.
  if (!closed_ || closing_ || recvPending_ || !sends_.empty()) return;
  auto self = shared_from_this();
  if (rt_->live.erase(self)) rt_->deferred.push_back([self] {});
}

}  // namespace moolib

#endif
