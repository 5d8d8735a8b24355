#include "shm/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "runtime/host.h"

namespace moolib {

namespace {

constexpr const char* kCollectiveName = "moolib-collective";
constexpr size_t kKeepFree = 4;
constexpr size_t kKeepMapped = 64;
constexpr size_t kRegionGranule = 1 << 20;

template <typename... Args>
[[noreturn]] void fail(int err, Args&&... args) {
  throw ShmError(concat(std::forward<Args>(args)..., ": ", errnoString(err)), err);
}

uint8_t* mapOrThrow(int fd, size_t bytes, ShmRegion::Access access, bool populate,
                    const std::string& what) {
  int prot = access == ShmRegion::Access::kReadWrite ? PROT_READ | PROT_WRITE : PROT_READ;
  void* p = ::mmap(nullptr, bytes, prot, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
  if (p == MAP_FAILED) fail(errno, "cannot map ", what, " of ", bytes, " bytes");
  return static_cast<uint8_t*>(p);
}

// The link's target, as readlink gives it; false with errno set on failure.
bool readLink(const std::string& path, std::string& target) {
  char buf[256];
  ssize_t n = ::readlink(path.c_str(), buf, sizeof(buf));
  if (n < 0) return false;
  target.assign(buf, size_t(n));
  return true;
}

// A memfd's link reads "/memfd:<name> (deleted)": it never had a path.
bool isMemfdNamed(const std::string& target, const std::string& name) {
  std::string want = "/memfd:" + name;
  return target == want || target == want + " (deleted)";
}

}  // namespace

ShmRegion::ShmRegion(ShmRegion&& o) noexcept
    : fd_(std::move(o.fd_)),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      access_(o.access_) {}

ShmRegion& ShmRegion::operator=(ShmRegion&& o) noexcept {
  if (this != &o) {
    unmap();
    fd_ = std::move(o.fd_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    access_ = o.access_;
  }
  return *this;
}

ShmRegion::~ShmRegion() { unmap(); }

void ShmRegion::unmap() {
  if (data_) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

ShmRegion ShmRegion::create(const std::string& name, size_t bytes, unsigned flags) {
  if (bytes == 0) throw ShmError(concat("shared region '", name, "': it needs at least one byte"));
  ShmRegion r;
  unsigned mfdFlags = MFD_CLOEXEC | (flags & kSealed ? MFD_ALLOW_SEALING : 0);
  r.fd_.reset(::memfd_create(name.c_str(), mfdFlags));
  if (!r.fd_) fail(errno, "cannot create the shared region '", name, "' (memfd_create)");
  if (::ftruncate(r.fd_.get(), off_t(bytes)) != 0)
    fail(errno, "cannot size the shared region '", name, "' to ", bytes, " bytes");
  if ((flags & kSealed) &&
      ::fcntl(r.fd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    fail(errno, "cannot seal the shared region '", name, "'");
  r.data_ = mapOrThrow(r.fd_.get(), bytes, Access::kReadWrite, flags & kPopulate,
                       concat("the shared region '", name, "'"));
  r.size_ = bytes;
  r.access_ = Access::kReadWrite;
  return r;
}

ShmRegion ShmRegion::map(int fd, const MapOptions& options) {
  if (options.requireSealed) {
    int seals = ::fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK))
      throw ShmError("received a shared region that can shrink (not sealed with F_SEAL_SHRINK)");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail(errno, "cannot size a received shared region");
  size_t fileBytes = size_t(std::max<off_t>(st.st_size, 0));
  size_t bytes = options.bytes ? options.bytes : fileBytes;
  if (bytes == 0) throw ShmError("received an empty shared region");
  if (fileBytes < bytes) {
    throw ShmError(concat("the received shared region is ", fileBytes, " bytes, smaller than the ",
                          bytes, " to map"));
  }
  if (bytes > options.maxBytes) {
    throw ShmError(concat("the received shared region is ", bytes, " bytes, more than the ",
                          options.maxBytes, " it may map"));
  }
  ShmRegion r;
  // Not prefaulted: the sender's pages are resident already, and a sparse
  // region must not become resident here just by being mapped.
  r.data_ = mapOrThrow(fd, bytes, options.access, false, "a received shared region");
  r.size_ = bytes;
  r.access_ = options.access;
  return r;
}

ShmRegion ShmRegion::openPeer(uint32_t pid, int fd, const std::string& name, size_t bytes,
                              Access access) {
  std::string path = concat("/proc/", pid, "/fd/", fd);
  std::string what = concat("the shared region of process ", pid);
  if (bytes == 0) throw ShmError(concat(what, " (", path, "): an empty region"));
  // An O_PATH handle reads nothing and has no side effects, whatever the
  // file is; it is checked to be the memfd before that very file is opened.
  Fd handle(::open(path.c_str(), O_PATH | O_CLOEXEC));
  if (!handle) {
    int err = errno;
    if (err == ENOENT) {
      throw StaleRegionError(
          concat("cannot open ", what, " (", path, "): ", errnoString(err), ": it was closed"),
          err);
    }
    fail(err, "cannot open ", what, " (", path, ")");
  }
  std::string self = concat("/proc/self/fd/", handle.get());
  std::string target;
  if (!readLink(self, target)) fail(errno, "cannot open ", what, " (", path, ")");
  if (!isMemfdNamed(target, name)) {
    throw StaleRegionError(
        concat(what, " (", path, ") is '", target, "', not a memfd named '", name, "'"));
  }
  int mode = access == Access::kReadWrite ? O_RDWR : O_RDONLY;
  Fd file(::open(self.c_str(), mode | O_CLOEXEC));
  if (!file) fail(errno, "cannot open ", what, " (", path, ")");
  int seals = ::fcntl(file.get(), F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    // Made unsealed by someone else, or one being made now in a reused fd.
    throw StaleRegionError(
        concat(what, " (", path, ") can shrink (not sealed with F_SEAL_SHRINK)"));
  }
  struct stat st {};
  if (::fstat(file.get(), &st) != 0) fail(errno, "cannot size ", what);
  if (uint64_t(std::max<off_t>(st.st_size, 0)) < bytes) {
    throw StaleRegionError(
        concat(what, " is ", st.st_size, " bytes, smaller than the ", bytes, " announced"));
  }
  ShmRegion r;
  r.data_ = mapOrThrow(file.get(), bytes, access, false, what);
  r.size_ = bytes;
  r.access_ = access;
  return r;
}

const uint8_t* ShmRegion::at(size_t offset, size_t length) const {
  MOO_ENFORCE(offset <= size_ && length <= size_ - offset, "bytes [", offset, ", +", length,
              ") outside the ", size_, "-byte shared region");
  return data_ + offset;
}

uint8_t* ShmRegion::mutableAt(size_t offset, size_t length) {
  MOO_ENFORCE(writable(), "the shared region is mapped read-only");
  return const_cast<uint8_t*>(at(offset, length));
}

const std::string& localShmKey() {
  static const std::string key = [] {
    char ns[128] = {0};
    ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
    if (n <= 0) return std::string();
    return concat(hostIdentity(), "/", std::string(ns, size_t(n)), "/uid", ::getuid());
  }();
  return key;
}

OwnRegion::OwnRegion(size_t bytes)
    : region_(ShmRegion::create(kCollectiveName, bytes, ShmRegion::kSealed)), id_(randomU64()) {
  std::memcpy(region_.mutableAt(0, sizeof(id_)), &id_, sizeof(id_));
}

RegionRef OwnRegion::ref() const {
  return RegionRef{id_, uint32_t(::getpid()), uint32_t(region_.fd()), region_.size()};
}

std::shared_ptr<OwnRegion> RegionCache::acquire(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if ((*it)->size() >= bytes && (best == free_.end() || (*it)->size() < (*best)->size()))
        best = it;
    }
    if (best != free_.end()) {
      auto region = *best;
      free_.erase(best);
      return region;
    }
  }
  size_t rounded = (bytes + kRegionGranule - 1) / kRegionGranule * kRegionGranule;
  return std::make_shared<OwnRegion>(std::max(rounded, kRegionGranule));
}

void RegionCache::release(std::shared_ptr<OwnRegion> region) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(std::move(region));
  if (free_.size() > kKeepFree) {
    // Drop the smallest: the large ones are what repeated reductions need.
    auto smallest = std::min_element(free_.begin(), free_.end(),
                                     [](auto& a, auto& b) { return a->size() < b->size(); });
    free_.erase(smallest);
  }
}

std::shared_ptr<const ShmRegion> RegionCache::map(const RegionRef& ref) {
  auto key = std::make_pair(ref.pid, ref.id);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = mapped_.begin(); it != mapped_.end(); ++it) {
      if (it->first == key && it->second->size() >= ref.bytes) {
        mapped_.splice(mapped_.begin(), mapped_, it);
        return it->second;
      }
    }
  }
  std::shared_ptr<const ShmRegion> region = std::make_shared<ShmRegion>(ShmRegion::openPeer(
      ref.pid, int(ref.fd), kCollectiveName, ref.bytes, ShmRegion::Access::kReadOnly));
  uint64_t id = 0;
  std::memcpy(&id, region->at(0, sizeof(id)), sizeof(id));
  if (id != ref.id) {
    throw StaleRegionError(concat("the shared region of process ", ref.pid, " (fd ", ref.fd,
                                  ") is another region now: the one announced was closed"));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  mapped_.emplace_front(key, region);
  while (mapped_.size() > kKeepMapped) mapped_.pop_back();
  return region;
}

void RegionCache::forgetMapped() {
  decltype(mapped_) dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dropped.swap(mapped_);
  }
  // Unmapped here, outside the lock.
}

}  // namespace moolib
