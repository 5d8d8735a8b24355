// A Connection over a non-blocking stream socket: the framing, the write queue
// and the lifecycle shared by the TCP and shared-memory transports. Backends
// override only the hooks that move segments out of band.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/loop.h"
#include "runtime/socket.h"
#include "transport/burst.h"
#include "transport/ownership.h"
#include "transport/transport.h"

namespace moolib {

class StreamConnection : public Connection,
                         public FdHandler,
                         public Corkable,
                         public std::enable_shared_from_this<StreamConnection> {
 public:
  StreamConnection(Fd fd, std::string local, std::string remote);
  ~StreamConnection() override;

  void start(FrameFn onFrame, CloseFn onClose) override;
  void send(OutgoingFrame&& frame) override;
  void flush() override;
  void close(const Error& reason) override;
  void setHandshaken() override { handshaken_ = true; }
  bool closed() const override { return closed_.load(); }
  std::string localAddress() const override { return local_; }
  std::string remoteAddress() const override { return remote_; }
  uint64_t bytesSent() const override { return bytesSent_.load(); }
  uint64_t bytesReceived() const override { return bytesReceived_.load(); }
  void onEvents(uint32_t events) override;
  void uncork() override;
  bool serveWhile(const std::function<bool()>& done, TimePoint deadline,
                  bool claimed = false) override;
  bool claim() override;
  void unclaim() override { unown(); }
  void takeBack() override;
  bool serveSticky(TimePoint deadline) override;

  // Largest message accepted after the handshake.
  static constexpr uint64_t kMaxMessageBytes = uint64_t(64) << 30;

 protected:
  // Fills desc for an outgoing segment. Returns true when its bytes must follow
  // inline; a backend may instead place them out of band, adding any file
  // descriptors the peer needs (sent with the frame, borrowed until then).
  virtual bool encodeSegment(const OutSegment& segment, SegmentDesc& desc, std::vector<int>& fds);
  // Resolves a segment the peer placed out of band.
  virtual BufferPtr decodeShared(const SegmentDesc& desc);
  // Frames the transport consumes itself; true when consumed.
  virtual bool handleInternal(IncomingFrame& frame) { return false; }
  virtual void onClosedInternal() {}
  // Sends a transport-internal frame (no segments).
  void sendInternal(FrameType type, std::string meta);

  bool passesFds_ = false;
  // TCP: raise the socket's receive low-water mark while a large segment
  // streams in (tuneLowWater).
  bool tunesLowWater_ = false;
  std::deque<int> receivedFds_;  // poller only

 private:
  struct WriteItem {
    std::string head;
    std::vector<OutSegment> segments;
    std::vector<int> fds;
    size_t total = 0;
    size_t written = 0;
  };
  enum class ReadState { kHeader, kDescs, kMeta, kSegments };

  // Writes queued items until the socket would block. writeMutex_ held.
  void flushLocked();
  // Re-registers interest when the fd sits in the epoll set.
  void updateArm();
  uint32_t wantedEvents() const;
  // Reads and writes what the events allow; runs on the one thread that
  // handles the connection (a loop worker, or a thread in serveWhile).
  void handle(uint32_t events);
  bool tryOwn();
  // Hands the fd back to the loop.
  void unown();
  // Serves the fd on this thread until done() or the deadline; false if it
  // could not take the fd (owned: it took it already). Requests read run here
  // when runInline.
  bool serve(const std::function<bool()>& done, TimePoint deadline, bool owned, bool runInline,
             bool* active);
  void readSome();
  // Bytes of the segment being read that are still to come from the socket
  // (none staged ahead of them); 0 outside a segment.
  size_t segmentStillToCome() const;
  void tuneLowWater();
  void finalize();
  void fail(const std::string& why);
  // Consumes staged bytes; false once the connection failed.
  bool parse();
  bool beginSegment();
  // Ensures need staged bytes fit from stageBegin_ on.
  void makeRoom(size_t need);
  void deliver();
  ssize_t receive(void* data, size_t size);

  Fd fd_;
  std::string local_, remote_;
  FrameFn onFrame_;
  CloseFn onClose_;
  std::atomic<bool> closed_{false};
  std::atomic<bool> handshaken_{false};
  Error closeReason_;
  std::atomic<uint64_t> bytesSent_{0}, bytesReceived_{0};

  std::mutex writeMutex_;
  std::deque<WriteItem> writeQueue_;
  std::atomic<bool> wantWrite_{false};
  SendBurst burst_;
  uint64_t flushTimer_ = 0;  // pending flush of a coalesced burst

  // Who handles the fd: the loop or a thread in serveWhile, serveSticky or a
  // request run inline (transport/ownership.h).
  std::mutex stateMutex_;
  IoOwnership own_{stateMutex_};

  // Read side; touched only by the thread handling the connection.
  std::vector<uint8_t> staging_;
  size_t stageBegin_ = 0, stageEnd_ = 0;
  ReadState state_ = ReadState::kHeader;
  FrameHeader header_{};
  std::vector<SegmentDesc> descs_;
  IncomingFrame frame_;
  size_t segmentIndex_ = 0;
  size_t segmentFilled_ = 0;
  int lowWater_ = 1;  // the socket's SO_RCVLOWAT
};

}  // namespace moolib
