// A UCX connection: one UCP endpoint (client-server, made through a
// sockaddr) carrying moolib's frames on UCP's stream API.
//
// Protocol, per direction: the accepting side first sends one preamble byte
// (the dialer's connect completes when it arrives: the endpoint is wired
// up). Then frames exactly as the stream transports write them (rpc/wire.h), all
// segments inline. A frame goes out as its head (header, descriptors,
// metadata and any small segments copied behind them) followed by each large
// segment sent from the caller's memory without a copy. Frames queued
// together (a corked batch of replies, a burst of calls: SendBurst) go out
// with their heads joined into one send. The receiver reads
// the head, then every segment straight into the buffer it hands up. UCX
// moves the bytes over whatever it chose (RDMA, its shared memory, TCP;
// UCX_TLS and UCX_NET_DEVICES select), registering memory as it needs.
//
// Threads: every UCX call is made under the runtime's mutex, and the runtime
// progresses the worker (transport/ucx/runtime.h). UCX callbacks only record
// what happened (under that mutex); frames and close notices are handed to
// the RPC layer afterwards, outside it, in order per connection.
#pragma once

#include "transport/ucx/ucx_api.h"

#if MOOLIB_UCX_HEADERS

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "runtime/loop.h"
#include "runtime/socket.h"
#include "transport/burst.h"
#include "transport/transport.h"
#include "transport/ucx/runtime.h"

namespace moolib {

class UcxConnection : public Connection,
                      public Corkable,
                      public std::enable_shared_from_this<UcxConnection> {
 public:
  UcxConnection(std::shared_ptr<UcxRuntime> runtime, std::string local, std::string remote);
  ~UcxConnection() override;

  void start(FrameFn onFrame, CloseFn onClose) override;
  void send(OutgoingFrame&& frame) override;
  // Sends bytes as they are (tests of the receiver's checks).
  void sendRaw(std::string bytes);
  void flush() override;
  void uncork() override { flush(); }
  void close(const Error& reason) override;
  void setHandshaken() override { handshaken_ = true; }
  bool closed() const override { return closed_.load(); }
  const char* transport() const override { return "ucx"; }
  std::string localAddress() const override { return local_; }
  std::string remoteAddress() const override { return remote_; }
  uint64_t bytesSent() const override { return bytesSent_.load(); }
  uint64_t bytesReceived() const override { return bytesReceived_.load(); }
  std::string lanes() const override { return lanes_; }
  // The waiting thread progresses UCX itself, so that a reply wakes the
  // thread that waits for it (unless another thread owns the progress).
  bool serveWhile(const std::function<bool()>& done, TimePoint deadline,
                  bool claimed = false) override;
  bool claim() override { return !closed_ && rt_->claim(); }
  void unclaim() override { rt_->unown(); }

  // Runtime side; mutex held.
  // A dialed endpoint: waits for the preamble, then calls done (deferred).
  void dialLocked(ucp_ep_h ep, Context::ConnectFn done);
  // An accepted endpoint: sends the preamble, and calls wired (deferred)
  // once it has left: see acceptLocked.
  void acceptLocked(ucp_ep_h ep, Task wired);
  void failLocked(const std::string& why);
  void setConnectTimer(uint64_t id) { connectTimer_ = id; }
  std::string statusText(ucs_status_t s) const;
  void onSendDone(void* request, ucs_status_t status, uint64_t op);
  static void sendCallback(void* request, ucs_status_t status, void* user);
  void onRecvDone(void* request, ucs_status_t status, size_t length);
  void onCloseDone(void* request);
  // Hands queued frames and the close notice to the RPC layer, in order;
  // without the mutex.
  void drain();

 private:
  // kHeld: a frame arrived before the handshake ended; the next header waits
  // until the RPC layer has handled it, as that may end the handshake and so
  // raise the limits the next header is checked against.
  enum class RecvState { kPreamble, kIdle, kHeader, kFixed, kSegment, kHeld };
  // The user data of the UCX requests of one frame's sends.
  struct SendTag {
    UcxConnection* conn;
    uint64_t op;
  };
  // One flush of the queue: the sends it posted, and what they send from.
  struct SendOp {
    SendTag tag{};
    std::vector<std::string> heads;
    std::vector<OutSegment> segments;
    int pending = 0;
  };
  // A frame sent but not yet posted to UCX: its head (header, descriptors,
  // metadata, small segments) and its large segments.
  struct QueuedFrame {
    std::string head;
    std::vector<OutSegment> segments;
  };

  void closeLocked(const Error& reason, bool force);
  // Posts the queued frames to UCX; what has already left (nothing to keep
  // alive) goes to finished, to be dropped outside the mutex. False if a
  // send failed (the connection closed; runDeferred hands that up).
  bool flushLocked(SendOp& finished);
  // Posts one send of op's; false (and fails the connection) on an error.
  bool postLocked(SendOp& op, const void* data, size_t size);
  // Moves the large segments of frames into to (what keeps them alive).
  static void takeSegments(std::vector<QueuedFrame>& from, std::vector<OutSegment>& to);
  void pumpLocked();
  // Consumes length received bytes of the current step; false once failed.
  bool advanceLocked(size_t length);
  bool nextSegmentLocked();
  void deliverLocked();
  // Lists this connection for runDeferred when it has something to hand up
  // (lock order: the runtime's mutex, then inboxMutex_).
  void markDirtyLocked();
  void maybeRetireLocked();
  // Reads the endpoint's lanes from UCX (for lanes()); before the connection
  // is handed up, never after.
  void readLanesLocked();
  // Counts this connection in the runtime's bulkReceives while it receives a
  // large segment over TCP lanes alone (on), or no longer (off).
  void bulkLocked(bool on);
  // The accepted side's preamble has left: hands the connection up.
  void wiredLocked();
  // Reads on after a frame held by kHeld was handed up; without the mutex.
  void resumeAfterHeld();
  std::string statusString(ucs_status_t s) const;

  std::shared_ptr<UcxRuntime> rt_;
  std::string local_, remote_;
  ucp_ep_h ep_ = nullptr;
  std::atomic<bool> closed_{false};
  std::atomic<bool> handshaken_{false};
  std::atomic<uint64_t> bytesSent_{0}, bytesReceived_{0};
  bool started_ = false;
  Context::ConnectFn connectDone_;  // while dialing
  Task acceptDone_;                 // while the accepted side's preamble waits
  std::string lanes_;
  bool tcpOnly_ = false;  // every lane is UCX's TCP
  bool bulk_ = false;     // counted in the runtime's bulkReceives
  uint64_t connectTimer_ = 0;

  // Sends in flight: id -> what they keep alive (op 0: the preamble).
  std::map<uint64_t, SendOp> sends_;
  std::vector<QueuedFrame> queue_;  // sent, held back to coalesce (SendBurst)
  SendBurst burst_;
  uint64_t flushTimer_ = 0;  // pending flush of a held-back burst
  uint64_t nextSend_ = 1;
  bool closing_ = false;  // ucp_ep_close_nbx in flight
  bool recvPending_ = false;
  void* recvRequest_ = nullptr;

  // Read side (mutex held).
  RecvState state_ = RecvState::kIdle;
  uint8_t preamble_ = 0;
  FrameHeader header_{};
  std::vector<uint8_t> fixed_;  // descriptors and metadata
  std::vector<SegmentDesc> descs_;
  IncomingFrame frame_;
  size_t segmentIndex_ = 0;

  // Handed up outside the mutex, in order.
  std::mutex inboxMutex_;
  std::deque<IncomingFrame> inbox_;
  bool closeQueued_ = false;
  bool closeDelivered_ = false;
  Error closeReason_;
  bool draining_ = false;
  bool dirty_ = false;  // listed in the runtime's dirty list
  FrameFn onFrame_;
  CloseFn onClose_;
};

class UcxListener : public Listener, public std::enable_shared_from_this<UcxListener> {
 public:
  UcxListener(std::shared_ptr<UcxRuntime> runtime, Context::AcceptFn onAccept)
      : rt_(std::move(runtime)), onAccept_(std::move(onAccept)) {}
  // Binds (mutex not held); throws with UCX's reason.
  void bind(const SockAddr& addr, const std::string& host);
  std::string address() const override { return address_; }
  void close() override;
  void onConnRequest(ucp_conn_request_h request);  // mutex held

 private:
  std::shared_ptr<UcxRuntime> rt_;
  Context::AcceptFn onAccept_;
  ucp_listener_h listener_ = nullptr;
  std::string address_;
};

}  // namespace moolib

#endif
