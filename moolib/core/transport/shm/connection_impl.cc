#include "transport/shm/connection_impl.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "logging.h"

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

ShmConnection::Mapping::~Mapping() {
  if (base) ::munmap(base, size);
}

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
    if (s.busy || s.mapping->size < segment.size ||
        s.mapping->size > 2 * segmentCapacity(segment.size))
      continue;
    if (best == pool_.size() || s.mapping->size < pool_[best].mapping->size) best = i;
  }
  if (best == pool_.size()) {
    size_t capacity = segmentCapacity(segment.size);
    if (poolBytes_ + capacity > kMaxPoolBytes) return true;
    Fd fd(::memfd_create("moolib-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    // Sealed against resizing: a receiver maps it and must never fault on a
    // page the sender took away (SIGBUS).
    if (!fd || ::ftruncate(fd.get(), off_t(capacity)) != 0 ||
        ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      MOO_LOG(kError, "shared memory segment of ", capacity, " bytes: ", errnoString(errno));
      return true;
    }
    void* base =
        ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
    if (base == MAP_FAILED) {
      MOO_LOG(kError, "mmap of a shared segment of ", capacity, " bytes: ", errnoString(errno));
      return true;
    }
    PoolSegment s;
    s.fd = std::move(fd);
    s.mapping = std::make_shared<Mapping>();
    s.mapping->base = static_cast<uint8_t*>(base);
    s.mapping->size = capacity;
    pool_.push_back(std::move(s));
    poolBytes_ += capacity;
  }
  PoolSegment& s = pool_[best];
  s.busy = true;
  if (!s.announced) {
    s.announced = true;
    fds.push_back(s.fd.get());
  }
  std::shared_ptr<Mapping> mapping = s.mapping;
  lock.unlock();
  std::memcpy(mapping->base, segment.data, segment.size);
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
    int seals = ::fcntl(fd.get(), F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK))
      throw WireError("received a shared segment that can shrink");
    struct stat st;
    if (::fstat(fd.get(), &st) != 0 || st.st_size <= 0)
      throw WireError("cannot size a received shared segment");
    size_t size = size_t(st.st_size);
    if (size > kMaxPoolBytes || receivedBytes_ + size > kMaxPoolBytes) {
      throw WireError(concat("peer shares more than ", kMaxPoolBytes, " bytes of segments"));
    }
    // Not prefaulted: the sender's pages are resident already, and a sparse
    // segment must not become resident here just by being announced.
    void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (base == MAP_FAILED)
      throw WireError(concat("cannot map a received shared segment: ", errnoString(errno)));
    auto m = std::make_shared<Mapping>();
    m->base = static_cast<uint8_t*>(base);
    m->size = size;
    receivedBytes_ += size;
    it = received_.emplace(desc.sharedId, std::move(m)).first;
  }
  std::shared_ptr<Mapping> m = it->second;
  if (desc.offset > m->size || desc.length > m->size - desc.offset) {
    throw WireError(concat("shared segment reference [", desc.offset, ", +", desc.length,
                           ") outside its ", m->size, "-byte segment"));
  }
  std::weak_ptr<StreamConnection> weak = shared_from_this();
  uint32_t id = desc.sharedId;
  return std::make_shared<Buffer>(m->base + desc.offset, desc.length, [m, weak, id] {
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
