#include "transport/shm/connection_impl.h"

#include <cstring>

#include "runtime/logging.h"

namespace moolib {

namespace {
// Smaller segments are cheaper to copy through the socket than to manage.
constexpr size_t kMinSharedSegment = 64 << 10;
constexpr size_t kMaxPoolBytes = size_t(2) << 30;

size_t segmentCapacity(size_t n) {
  size_t c = kMinSharedSegment;
  while (c < n) c <<= 1;
  return c;
}
}  // namespace

ConnectionPtr ShmConnection::create(Fd fd) {
  return std::make_shared<ShmConnection>(std::move(fd), "shm", "shm");
}

ShmConnection::ShmConnection(Fd fd, std::string local, std::string remote)
    : StreamConnection(std::move(fd), std::move(local), std::move(remote)) {
  passesFds_ = true;
}

ShmConnection::~ShmConnection() = default;

bool ShmConnection::encodeSegment(const OutSegment& segment, SegmentDesc& desc,
                                  std::vector<int>& fds) {
  desc = SegmentDesc{segment.size, uint32_t(SegmentKind::kInline), 0, 0};
  if (segment.size < kMinSharedSegment) return true;
  std::unique_lock<std::mutex> lock(poolMutex_);
  size_t best = pool_.size();
  for (size_t i = 0; i != pool_.size(); ++i) {
    auto& s = pool_[i];
    if (s.busy || s.region->size() < segment.size ||
        s.region->size() > 2 * segmentCapacity(segment.size))
      continue;
    if (best == pool_.size() || s.region->size() < pool_[best].region->size()) best = i;
  }
  if (best == pool_.size()) {
    size_t capacity = segmentCapacity(segment.size);
    if (poolBytes_ + capacity > kMaxPoolBytes) return true;
    PoolSegment s;
    try {
      // Sealed: the receiver maps it and must never fault on a page the
      // sender took away (SIGBUS).
      s.region = std::make_shared<ShmRegion>(
          ShmRegion::create("moolib-shm", capacity, ShmRegion::kSealed | ShmRegion::kPopulate));
    } catch (const ShmError& e) {
      MOO_LOG(kError, e.what());
      return true;
    }
    pool_.push_back(std::move(s));
    poolBytes_ += capacity;
  }
  PoolSegment& s = pool_[best];
  s.busy = true;
  if (!s.announced) {
    s.announced = true;
    fds.push_back(s.region->fd());
  }
  std::shared_ptr<ShmRegion> region = s.region;
  lock.unlock();
  std::memcpy(region->mutableAt(0, segment.size), segment.data, segment.size);
  desc = SegmentDesc{segment.size, uint32_t(SegmentKind::kShared), uint32_t(best), 0};
  return false;
}

BufferPtr ShmConnection::decodeShared(const SegmentDesc& desc) {
  auto it = received_.find(desc.sharedId);
  if (it == received_.end()) {
    if (receivedFds_.empty())
      throw WireError(concat("shared segment ", desc.sharedId, " arrived without its memory"));
    Fd fd(receivedFds_.front());
    receivedFds_.pop_front();
    ShmRegion::MapOptions options;
    options.requireSealed = true;
    options.maxBytes = kMaxPoolBytes - receivedBytes_;
    std::shared_ptr<ShmRegion> region;
    try {
      region = std::make_shared<ShmRegion>(ShmRegion::map(fd.get(), options));
    } catch (const ShmError& e) {
      throw WireError(concat("shared segment ", desc.sharedId, ": ", e.what()));
    }
    receivedBytes_ += region->size();
    it = received_.emplace(desc.sharedId, std::move(region)).first;
  }
  std::shared_ptr<ShmRegion> region = it->second;
  if (desc.offset > region->size() || desc.length > region->size() - desc.offset) {
    throw WireError(concat("shared segment reference [", desc.offset, ", +", desc.length,
                           ") outside its ", region->size(), "-byte segment"));
  }
  uint8_t* data = region->mutableAt(desc.offset, desc.length);
  std::weak_ptr<StreamConnection> weak = shared_from_this();
  uint32_t id = desc.sharedId;
  return std::make_shared<Buffer>(data, desc.length, [region, weak, id] {
    if (auto conn = weak.lock()) {
      Writer w;
      w.u32(id);
      static_cast<ShmConnection*>(conn.get())->sendInternal(FrameType::kShmRelease, w.take());
    }
  });
}

bool ShmConnection::handleInternal(IncomingFrame& frame) {
  if (frame.type != FrameType::kShmRelease) return false;
  Reader r(frame.meta);
  uint32_t id = r.u32();
  std::lock_guard<std::mutex> lock(poolMutex_);
  if (id >= pool_.size()) throw WireError(concat("release of unknown shared segment ", id));
  pool_[id].busy = false;
  return true;
}

}  // namespace moolib
