// Shared-memory regions for collectives among processes on one host.
//
// A member copies its data into a region of its own (a memfd) and tells the
// others where it is: (pid, fd, id). They open it through /proc/<pid>/fd/<fd>
// and map it read-only, so each member reads its peers' data in place with no
// copy through a socket. A region lives as long as its owner keeps it; a
// process that dies takes its regions with it once peers unmap them (nothing
// is left in /dev/shm).
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace moolib {

// Who can map whose regions: processes with equal keys (same host, PID
// namespace and user). Empty if the key cannot be determined.
const std::string& localShmKey();

struct RegionRef {
  uint64_t id = 0;
  uint32_t pid = 0;
  uint32_t fd = 0;
  uint64_t bytes = 0;
};

// A region this process owns and writes.
class OwnRegion {
 public:
  explicit OwnRegion(size_t bytes);
  ~OwnRegion();
  OwnRegion(const OwnRegion&) = delete;
  OwnRegion& operator=(const OwnRegion&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  RegionRef ref() const;

 private:
  int fd_ = -1;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  uint64_t id_ = 0;
};

// A peer's region, mapped read-only.
class PeerRegion {
 public:
  explicit PeerRegion(const RegionRef& ref);  // throws with a clear message
  ~PeerRegion();
  PeerRegion(const PeerRegion&) = delete;
  PeerRegion& operator=(const PeerRegion&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Own regions for reuse, and peers' regions already mapped, of one group.
class RegionCache {
 public:
  // A free region of at least bytes; hand it back with release().
  std::shared_ptr<OwnRegion> acquire(size_t bytes);
  void release(std::shared_ptr<OwnRegion> region);
  std::shared_ptr<PeerRegion> map(const RegionRef& ref);

 private:
  std::mutex mutex_;
  std::vector<std::shared_ptr<OwnRegion>> free_;
  // Most recently used first; bounded.
  std::list<std::pair<std::pair<uint32_t, uint64_t>, std::shared_ptr<PeerRegion>>> mapped_;
};

}  // namespace moolib
