#include "shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "error.h"
#include "host.h"

namespace moolib {

namespace {
constexpr size_t kKeepFree = 4;
constexpr size_t kKeepMapped = 64;
constexpr size_t kRegionGranule = 1 << 20;
}  // namespace

const std::string& localShmKey() {
  static const std::string key = [] {
    char ns[128] = {0};
    ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
    if (n <= 0) return std::string();
    return concat(hostIdentity(), "/", std::string(ns, size_t(n)), "/uid", ::getuid());
  }();
  return key;
}

OwnRegion::OwnRegion(size_t bytes) : size_(bytes), id_(randomU64()) {
  fd_ = ::memfd_create("moolib-collective", MFD_CLOEXEC);
  MOO_ENFORCE(fd_ >= 0, "memfd_create failed: ", std::strerror(errno));
  if (::ftruncate(fd_, off_t(bytes)) != 0) {
    int err = errno;
    ::close(fd_);
    throw Exception(
        concat("cannot size a shared region of ", bytes, " bytes: ", std::strerror(err)));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    ::close(fd_);
    throw Exception(
        concat("cannot map a shared region of ", bytes, " bytes: ", std::strerror(err)));
  }
  data_ = static_cast<uint8_t*>(p);
}

OwnRegion::~OwnRegion() {
  ::munmap(data_, size_);
  ::close(fd_);
}

RegionRef OwnRegion::ref() const {
  return RegionRef{id_, uint32_t(::getpid()), uint32_t(fd_), size_};
}

PeerRegion::PeerRegion(const RegionRef& ref) {
  std::string path = concat("/proc/", ref.pid, "/fd/", ref.fd);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MOO_ENFORCE(fd >= 0, "cannot open the shared region of process ", ref.pid, " (", path,
              "): ", std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0 || uint64_t(st.st_size) < ref.bytes) {
    ::close(fd);
    throw Exception(concat("the shared region of process ", ref.pid, " is smaller than announced"));
  }
  void* p = ref.bytes ? ::mmap(nullptr, ref.bytes, PROT_READ, MAP_SHARED, fd, 0) : nullptr;
  int err = errno;
  ::close(fd);
  MOO_ENFORCE(p != MAP_FAILED, "cannot map the shared region of process ", ref.pid, ": ",
              std::strerror(err));
  data_ = static_cast<uint8_t*>(p);
  size_ = ref.bytes;
}

PeerRegion::~PeerRegion() {
  if (data_) ::munmap(data_, size_);
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

std::shared_ptr<PeerRegion> RegionCache::map(const RegionRef& ref) {
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
  auto region = std::make_shared<PeerRegion>(ref);
  std::lock_guard<std::mutex> lock(mutex_);
  mapped_.emplace_front(key, region);
  while (mapped_.size() > kKeepMapped) mapped_.pop_back();
  return region;
}

}  // namespace moolib
