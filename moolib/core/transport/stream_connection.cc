#include "transport/stream_connection.h"

#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "runtime/logging.h"
#include "runtime/spin.h"

namespace moolib {

namespace {
// The staging buffer starts small (connections that never complete the
// handshake stay cheap) and doubles up to this size while reads fill it.
constexpr size_t kInitialStaging = 16 << 10;
constexpr size_t kStagingSize = 256 << 10;
constexpr size_t kMaxPendingFds = 256;
// Segments at least this large are read straight into their buffer.
constexpr size_t kDirectReadMin = 32 << 10;
// While at least twice this much of a segment is still to come over TCP, the
// socket wakes its reader only once this much waits (SO_RCVLOWAT).
constexpr int kLowWater = 256 << 10;
constexpr int kMaxFdsPerMessage = 64;
}  // namespace

StreamConnection::StreamConnection(Fd fd, std::string local, std::string remote)
    : fd_(std::move(fd)), local_(std::move(local)), remote_(std::move(remote)) {
  staging_.resize(kInitialStaging);
}

StreamConnection::~StreamConnection() {
  for (int fd : receivedFds_) ::close(fd);
}

void StreamConnection::start(FrameFn onFrame, CloseFn onClose) {
  onFrame_ = std::move(onFrame);
  onClose_ = std::move(onClose);
  std::lock_guard<std::mutex> lock(stateMutex_);
  own_.attachLocked(fd_.get(),
                    Loop::instance().addFd(fd_.get(), wantedEvents(),
                                           std::weak_ptr<FdHandler>(shared_from_this())),
                    true);
}

uint32_t StreamConnection::wantedEvents() const {
  return uint32_t(EPOLLIN) | (wantWrite_.load() ? uint32_t(EPOLLOUT) : 0u);
}

void StreamConnection::updateArm() {
  std::lock_guard<std::mutex> lock(stateMutex_);
  own_.updateLocked(wantedEvents());
}

bool StreamConnection::encodeSegment(const OutSegment& segment, SegmentDesc& desc,
                                     std::vector<int>&) {
  desc = SegmentDesc{segment.size, uint32_t(SegmentKind::kInline), 0, 0};
  return true;
}

BufferPtr StreamConnection::decodeShared(const SegmentDesc&) {
  throw WireError("shared-memory segment received on a transport without shared memory");
}

void StreamConnection::send(OutgoingFrame&& frame) {
  if (closed_) return;
  WriteItem item;
  FrameHeader h{kFrameMagic,
                kWireVersion,
                uint8_t(frame.type),
                0,
                uint32_t(frame.segments.size()),
                uint32_t(frame.meta.size()),
                0};
  // The descriptors go straight into the head, and the inline segments stay
  // in the frame's own vector (those sent out of band are dropped from it):
  // a small call makes one allocation here, the head.
  item.head.reserve(sizeof(h) + frame.segments.size() * sizeof(SegmentDesc) + frame.meta.size());
  item.head.append(reinterpret_cast<const char*>(&h), sizeof(h));
  size_t kept = 0;
  for (size_t i = 0; i != frame.segments.size(); ++i) {
    SegmentDesc desc;
    bool inlined = encodeSegment(frame.segments[i], desc, item.fds);
    item.head.append(reinterpret_cast<const char*>(&desc), sizeof(desc));
    if (inlined && frame.segments[i].size) {
      item.total += frame.segments[i].size;
      if (kept != i) frame.segments[kept] = std::move(frame.segments[i]);
      ++kept;
    }
  }
  frame.segments.resize(kept);
  item.head.append(frame.meta);
  item.total += item.head.size();
  item.segments = std::move(frame.segments);

  // Only replies are corked: a request a function sends must not wait for
  // the rest of its batch.
  bool corked = frame.type == FrameType::kResponse &&
                corkIfBatching(std::static_pointer_cast<Corkable>(shared_from_this()));
  std::lock_guard<std::mutex> lock(writeMutex_);
  if (closed_) return;
  writeQueue_.push_back(std::move(item));
  if (corked) return;
  bool writeNow = burst_.writeNow(writeQueue_.size());
  if (wantWrite_) return;  // the socket is full; EPOLLOUT will flush
  if (writeNow) {
    flushLocked();
    return;
  }
  if (!flushTimer_) {
    std::weak_ptr<StreamConnection> weak = shared_from_this();
    flushTimer_ = Loop::instance().addTimer(Clock::now() + SendBurst::kDelay, [weak] {
      if (auto self = weak.lock()) {
        std::lock_guard<std::mutex> lock(self->writeMutex_);
        self->flushTimer_ = 0;
        self->flushLocked();
      }
    });
  }
}

void StreamConnection::flush() {
  std::lock_guard<std::mutex> lock(writeMutex_);
  flushLocked();
}

void StreamConnection::uncork() {
  std::lock_guard<std::mutex> lock(writeMutex_);
  flushLocked();
}

void StreamConnection::sendInternal(FrameType type, std::string meta) {
  OutgoingFrame f{type, std::move(meta), {}};
  send(std::move(f));
}

void StreamConnection::flushLocked() {
  while (!writeQueue_.empty() && !closed_) {
    // Gather as many queued frames as one sendmsg takes.
    iovec iov[IOV_MAX];
    int n = 0;
    std::vector<int>* fds = nullptr;
    for (auto& item : writeQueue_) {
      if (n == IOV_MAX) break;
      // Descriptors must travel with the first byte of their frame: never
      // gather a later frame that carries some into this message.
      if (!item.fds.empty()) {
        if (n > 0 || item.written > 0) {
          if (n > 0) break;
        } else {
          fds = &item.fds;
        }
      }
      size_t skip = item.written;
      auto add = [&](const void* data, size_t size) {
        if (skip >= size) {
          skip -= size;
          return;
        }
        if (n == IOV_MAX) return;
        iov[n].iov_base = const_cast<uint8_t*>(static_cast<const uint8_t*>(data)) + skip;
        iov[n].iov_len = size - skip;
        skip = 0;
        ++n;
      };
      add(item.head.data(), item.head.size());
      for (auto& s : item.segments) add(s.data, s.size);
      if (fds) break;
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
    if (fds && !fds->empty()) {
      size_t count = std::min<size_t>(fds->size(), kMaxFdsPerMessage);
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * count);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * count);
      std::memcpy(CMSG_DATA(c), fds->data(), sizeof(int) * count);
    }
    ssize_t r = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      int err = errno;
      closed_ = true;
      closeReason_ = Error(concat("write to ", remote_, " failed: ", errnoString(err)));
      writeQueue_.clear();
      // Whoever handles the fd next sees the hang-up and finalizes.
      ::shutdown(fd_.get(), SHUT_RDWR);
      break;
    }
    if (fds) fds->clear();
    bytesSent_ += r;
    size_t left = size_t(r);
    while (left && !writeQueue_.empty()) {
      WriteItem& front = writeQueue_.front();
      size_t take = std::min(left, front.total - front.written);
      front.written += take;
      left -= take;
      if (front.written == front.total) writeQueue_.pop_front();
    }
  }
  bool want = !writeQueue_.empty() && !closed_;
  if (want != wantWrite_.exchange(want)) updateArm();
}

void StreamConnection::close(const Error& reason) {
  std::lock_guard<std::mutex> lock(writeMutex_);
  if (closed_) return;
  closed_ = true;
  closeReason_ = reason;
  writeQueue_.clear();
  // The hang-up wakes whoever handles the fd, which then finalizes.
  if (fd_) ::shutdown(fd_.get(), SHUT_RDWR);
}

void StreamConnection::fail(const std::string& why) {
  MOO_LOG(kError, "closing connection ", remote_, " (", transport(), "): ", why);
  close(Error(why));
}

void StreamConnection::finalize() {
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    if (!own_.closeLocked()) return;
  }
  if (own_.token()) Loop::instance().removeFd(fd_.get(), own_.token());
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    fd_.reset();
  }
  onClosedInternal();
  CloseFn onClose = std::move(onClose_);
  onFrame_ = nullptr;
  if (onClose) onClose(closeReason_);
}

ssize_t StreamConnection::receive(void* data, size_t size) {
  if (!passesFds_) return ::recv(fd_.get(), data, size, MSG_DONTWAIT);
  iovec iov{data, size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t r = ::recvmsg(fd_.get(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  // A failed recvmsg (EAGAIN above all) leaves msg as it was: msg_controllen
  // still spans all of control, which holds stale stack bytes (often the
  // header of an earlier read's descriptors). Parsing it would queue stale
  // or garbage descriptors and can read far past control. Only a successful
  // call says how much control data there is. errno is left for the caller.
  if (r < 0) return r;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len >= CMSG_LEN(0)) {
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i != count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        receivedFds_.push_back(fd);
      }
      // Descriptors accompany shared segments and each is consumed by its
      // frame, so a backlog is abuse. Before the handshake completes only
      // one message's worth is tolerated: the read that brings the peer's
      // identify may also bring the first frame that shares memory.
      size_t limit = handshaken_ ? kMaxPendingFds : size_t(kMaxFdsPerMessage);
      if (receivedFds_.size() > limit) {
        fail(handshaken_ ? "too many file descriptors in flight"
                         : "file descriptors before the handshake");
        for (int fd : receivedFds_) ::close(fd);
        receivedFds_.clear();
        return -1;
      }
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) {
    fail("file descriptors were truncated in transit");
    return -1;
  }
  return r;
}

void StreamConnection::onEvents(uint32_t events) {
  {
    // updateArm() may have re-armed the fd between its delivery to another
    // thread and this one getting here (see beginHandlingLocked).
    std::lock_guard<std::mutex> lock(stateMutex_);
    if (!own_.beginHandlingLocked()) return;
  }
  handle(events);
  std::lock_guard<std::mutex> lock(stateMutex_);
  own_.endHandlingLocked(wantedEvents());
}

bool StreamConnection::tryOwn() {
  std::lock_guard<std::mutex> lock(stateMutex_);
  return own_.tryOwnLocked();
}

bool StreamConnection::claim() {
  std::lock_guard<std::mutex> lock(stateMutex_);
  return own_.claimLocked();
}

void StreamConnection::takeBack() {
  std::lock_guard<std::mutex> lock(stateMutex_);
  if (own_.takeBackLocked()) own_.armLocked(wantedEvents());
}

void StreamConnection::unown() {
  std::lock_guard<std::mutex> lock(stateMutex_);
  own_.disownLocked();
  own_.armLocked(wantedEvents());
}

bool StreamConnection::serveWhile(const std::function<bool()>& done, TimePoint deadline,
                                  bool claimed) {
  return serve(done, deadline, claimed, false, nullptr);
}

bool StreamConnection::serveSticky(TimePoint deadline) {
  bool active = false;
  Loop& loop = Loop::instance();
  serve([&loop] { return loop.stickyShouldStop(); }, deadline, false, true, &active);
  return active;
}

bool StreamConnection::serve(const std::function<bool()>& done, TimePoint deadline, bool owned,
                             bool runInline, bool* active) {
  flush();
  if (!owned && !tryOwn()) return false;
  Waiter& waiter = currentWaiter();
  // Null when spinning is off (MOOLIB_SPIN_US=0): the wait is one blocking poll.
  SpinPolicy* spinPolicy = SpinPolicy::budget().count() > 0 ? &SpinPolicy::current() : nullptr;
  while (!done() && Clock::now() < deadline && !closed_) {
    pollfd p[2] = {{fd_.get(), short(POLLIN | (wantWrite_ ? POLLOUT : 0)), 0},
                   {waiter.fd(), POLLIN, 0}};
    int n = 0;
    if (spinPolicy) {
      TimePoint start = Clock::now();
      if (auto spin = spinPolicy->begin(); spin.count() > 0) {
        TimePoint until = std::min(deadline, start + spin);
        // Yields give the core to whoever waits for it (SpinPolicy::kLostCore).
        bool mayYield = spinPolicy->mayYield();
        while ((n = ::poll(p, 2, 0)) == 0) {
          TimePoint now = Clock::now();
          if (now >= until) break;
          if (mayYield) {
            sched_yield();
            mayYield = spinPolicy->yielded(Clock::now() - now);
          }
        }
      }
      bool hit = n > 0;
      if (n == 0) n = ::poll(p, 2, timeoutMs(deadline));
      spinPolicy->end(Clock::now() - start, hit, n > 0);
    } else {
      n = ::poll(p, 2, timeoutMs(deadline));
    }
    if (n <= 0) continue;
    if (p[1].revents) waiter.clear();
    if (!p[0].revents) continue;
    if (active) *active = true;
    uint32_t events = 0;
    if (p[0].revents & POLLIN) events |= EPOLLIN;
    if (p[0].revents & POLLOUT) events |= EPOLLOUT;
    if (p[0].revents & (POLLHUP | POLLERR)) events |= EPOLLIN | EPOLLHUP;
    handle(events);
    // Taken back (a request blocked or ran long, or called back over it and
    // another thread took the fd meanwhile): the loop serves it.
    if (runInline && Loop::hasInlineTasks() && !own_.runLent(shared_from_this())) return true;
  }
  if (closed_) handle(EPOLLIN);
  unown();
  return true;
}

void StreamConnection::handle(uint32_t events) {
  if (events & EPOLLOUT) {
    std::lock_guard<std::mutex> lock(writeMutex_);
    flushLocked();
  }
  if (!closed_ && (events & (EPOLLIN | EPOLLHUP | EPOLLERR))) {
    readSome();
    if (!closed_ && tunesLowWater_) tuneLowWater();
  }
  if (closed_) finalize();
}

// A reader that drained the socket is otherwise woken, through epoll and often
// on another thread, for every few packets of a large segment: a 64 MiB tensor
// cost its receiver a third more CPU than a plain socket's blocking reads. The
// mark never exceeds what is still to come of the segment being read, so the
// bytes it waits for are sure to arrive (or the connection to end, which wakes
// the reader as well).
void StreamConnection::tuneLowWater() {
  int mark = segmentStillToCome() >= size_t(2 * kLowWater) ? kLowWater : 1;
  if (mark == lowWater_) return;
  if (::setsockopt(fd_.get(), SOL_SOCKET, SO_RCVLOWAT, &mark, sizeof(mark)) == 0) lowWater_ = mark;
}

size_t StreamConnection::segmentStillToCome() const {
  if (state_ != ReadState::kSegments || stageBegin_ != stageEnd_ ||
      segmentIndex_ >= frame_.segments.size()) {
    return 0;
  }
  return frame_.segments[segmentIndex_]->size() - segmentFilled_;
}

void StreamConnection::readSome() {
  // Bounded work per wake-up keeps one busy peer from starving the others.
  size_t budget = size_t(64) << 20;
  while (!closed_ && budget) {
    ssize_t r;
    BufferPtr direct;
    if (!passesFds_ && segmentStillToCome() >= kDirectReadMin) {
      direct = frame_.segments[segmentIndex_];
    }
    if (direct) {
      size_t want = std::min(direct->size() - segmentFilled_, budget);
      r = receive(direct->data() + segmentFilled_, want);
      if (r > 0) {
        segmentFilled_ += size_t(r);
        bytesReceived_ += r;
        budget -= std::min<size_t>(budget, size_t(r));
        if (segmentFilled_ == direct->size()) {
          ++segmentIndex_;
          if (!beginSegment()) return;
        }
        // A short read drained the socket: level-triggered readiness brings us
        // back if more arrives, which saves a read that would say EAGAIN.
        if (size_t(r) < want) return;
        continue;
      }
    } else {
      if (stageBegin_ == stageEnd_) stageBegin_ = stageEnd_ = 0;
      if (stageEnd_ == staging_.size()) {
        std::memmove(staging_.data(), staging_.data() + stageBegin_, stageEnd_ - stageBegin_);
        stageEnd_ -= stageBegin_;
        stageBegin_ = 0;
        if (stageEnd_ == staging_.size()) staging_.resize(staging_.size() * 2);
      }
      size_t want = staging_.size() - stageEnd_;
      r = receive(staging_.data() + stageEnd_, want);
      if (r > 0) {
        stageEnd_ += size_t(r);
        if (size_t(r) == want && staging_.size() < kStagingSize && handshaken_) {
          staging_.resize(staging_.size() * 2);
        }
        bytesReceived_ += r;
        budget -= std::min<size_t>(budget, size_t(r));
        if (!parse()) return;
        if (size_t(r) < want) return;
        continue;
      }
    }
    if (r == 0) {
      close(Error(concat("connection closed by peer ", remote_)));
      return;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return;
    if (!closed_) close(Error(concat("read from ", remote_, " failed: ", errnoString(errno))));
    return;
  }
}

bool StreamConnection::parse() {
  try {
    while (!closed_) {
      size_t avail = stageEnd_ - stageBegin_;
      const uint8_t* p = staging_.data() + stageBegin_;
      switch (state_) {
        case ReadState::kHeader: {
          if (avail < sizeof(FrameHeader)) return true;
          std::memcpy(&header_, p, sizeof(header_));
          stageBegin_ += sizeof(header_);
          if (Error e = validateHeader(header_, handshaken_)) {
            fail(e.what());
            return false;
          }
          descs_.resize(header_.numSegments);
          state_ = ReadState::kDescs;
          break;
        }
        case ReadState::kDescs: {
          size_t need = descs_.size() * sizeof(SegmentDesc);
          if (avail < need) {
            makeRoom(need);  // bounded: at most kMaxSegments descriptors
            return true;
          }
          std::memcpy(descs_.data(), p, need);
          stageBegin_ += need;
          uint64_t limit = handshaken_ ? kMaxMessageBytes : kMaxHandshakeFrame;
          uint64_t total = 0;
          for (auto& d : descs_) {
            if (d.kind != uint32_t(SegmentKind::kInline) &&
                d.kind != uint32_t(SegmentKind::kShared)) {
              fail(concat("unknown segment kind ", d.kind));
              return false;
            }
            if (d.kind == uint32_t(SegmentKind::kShared) && !handshaken_) {
              fail("shared-memory segment before the handshake");
              return false;
            }
            if (d.length > limit || total + d.length > limit) {
              fail(concat("frame of more than ", limit, " bytes"));
              return false;
            }
            total += d.length;
          }
          state_ = ReadState::kMeta;
          break;
        }
        case ReadState::kMeta: {
          size_t need = header_.metaLength;
          if (avail < need) {
            makeRoom(need);  // bounded by kMaxMetaLength
            return true;
          }
          frame_.type = FrameType(header_.type);
          frame_.meta.assign(reinterpret_cast<const char*>(p), need);
          stageBegin_ += need;
          frame_.segments.clear();
          frame_.segments.reserve(descs_.size());
          segmentIndex_ = 0;
          state_ = ReadState::kSegments;
          if (!beginSegment()) return false;
          break;
        }
        case ReadState::kSegments: {
          BufferPtr& target = frame_.segments[segmentIndex_];
          size_t take = std::min(avail, target->size() - segmentFilled_);
          std::memcpy(target->data() + segmentFilled_, p, take);
          stageBegin_ += take;
          segmentFilled_ += take;
          if (segmentFilled_ < target->size()) return true;
          ++segmentIndex_;
          if (!beginSegment()) return false;
          break;
        }
      }
    }
  } catch (const WireError& e) {
    fail(e.what());
  } catch (const std::bad_alloc&) {
    fail("out of memory for an incoming frame");
  }
  return !closed_;
}

void StreamConnection::makeRoom(size_t need) {
  if (stageBegin_ + need <= staging_.size()) return;
  size_t avail = stageEnd_ - stageBegin_;
  std::memmove(staging_.data(), staging_.data() + stageBegin_, avail);
  stageBegin_ = 0;
  stageEnd_ = avail;
  if (need > staging_.size()) staging_.resize(need);
}

// Sets up segment segmentIndex_ (skipping those that need no bytes), or
// delivers the frame when all are in.
bool StreamConnection::beginSegment() {
  try {
    while (segmentIndex_ < descs_.size()) {
      const SegmentDesc& d = descs_[segmentIndex_];
      if (frame_.segments.size() <= segmentIndex_) {
        if (d.kind == uint32_t(SegmentKind::kShared)) {
          frame_.segments.push_back(decodeShared(d));
        } else {
          frame_.segments.push_back(allocateBuffer(d.length));
        }
      }
      segmentFilled_ = 0;
      if (d.kind == uint32_t(SegmentKind::kInline) && d.length > 0) return true;
      ++segmentIndex_;
    }
  } catch (const WireError& e) {
    fail(e.what());
    return false;
  } catch (const std::bad_alloc&) {
    fail("out of memory for an incoming frame");
    return false;
  }
  deliver();
  return !closed_;
}

void StreamConnection::deliver() {
  state_ = ReadState::kHeader;
  IncomingFrame frame = std::move(frame_);
  frame_ = IncomingFrame{};
  if (handleInternal(frame)) return;
  if (onFrame_) onFrame_(std::move(frame));
}

}  // namespace moolib
