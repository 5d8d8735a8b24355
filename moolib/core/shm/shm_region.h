// Shared-memory regions: memory that processes on one host map and read or
// write in place, with no copy through a socket.
//
// ShmRegion is the one way moolib makes or maps shared memory: the shm
// transport's segments, the collectives' regions, and (from Python, as
// moolib._core.ShmRegion) the replay service's segments and EnvPool's region.
// A region is always a memfd, never a file in /dev/shm: its memory lives while
// any process holds its fd or a mapping of it and goes with the last of them,
// so a process that dies leaves nothing behind. Its fds are close-on-exec:
// a process started meanwhile inherits none of them.
//
// Collectives: a member copies its data into a region of its own and tells the
// others where it is, (pid, fd, id); they open it through /proc/<pid>/fd/<fd>
// and map it read-only, so each member reads its peers' data in place.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/socket.h"

namespace moolib {

// A region that could not be made, opened or mapped. The message names the
// region and the reason (the system's, where a call failed); error() is the
// errno of that call, 0 when the refusal is moolib's own.
class ShmError : public Exception {
 public:
  explicit ShmError(const std::string& message, int error = 0)
      : Exception(message), error_(error) {}
  int error() const { return error_; }

 private:
  int error_;
};

// (pid, fd) no longer names the region that was announced: its owner closed
// it, and the fd is gone or now holds another file or region. A stale
// reference, not a lack of shared memory.
class StaleRegionError : public ShmError {
 public:
  using ShmError::ShmError;
};

class ShmRegion {
 public:
  enum class Access : uint8_t { kReadOnly, kReadWrite };

  // create()'s flags.
  enum Flags : unsigned {
    kNone = 0,
    // The size is sealed (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL): a process
    // that maps the region can never fault on a page its owner took away
    // (SIGBUS), so a receiver may map it even from a peer it does not trust.
    kSealed = 1,
    // Every page faulted in now, so the first writes do not pay for it.
    kPopulate = 2,
  };

  // map()'s checks of memory someone else made.
  struct MapOptions {
    Access access = Access::kReadWrite;
    // How many bytes from the start to map; 0: the whole file, which must
    // then not be empty. The file must be at least this large.
    size_t bytes = 0;
    // Refused when more would be mapped.
    size_t maxBytes = SIZE_MAX;
    // Refused unless sealed against shrinking (see kSealed).
    bool requireSealed = false;
  };

  // No region: no memory, no fd.
  ShmRegion() = default;
  ShmRegion(ShmRegion&& o) noexcept;
  ShmRegion& operator=(ShmRegion&& o) noexcept;
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;
  ~ShmRegion();

  // A new memfd of bytes (at least 1), mapped read-write. name is what
  // /proc/<pid>/fd and /proc/<pid>/maps show ("/memfd:<name>"), and what
  // openPeer() checks. The region keeps its fd, to hand to others, until
  // closeFd(). Throws ShmError.
  static ShmRegion create(const std::string& name, size_t bytes, unsigned flags = kNone);

  // Maps the memfd fd, which came from elsewhere (a socket's SCM_RIGHTS, a
  // Python caller). The caller keeps fd; the region keeps only the mapping.
  // Throws ShmError.
  static ShmRegion map(int fd, const MapOptions& options);

  // Maps bytes of a memfd that process pid holds as fd, through
  // /proc/<pid>/fd/<fd>; the region keeps only the mapping. Only a memfd
  // named name is opened, and it must hold at least bytes: a stale or
  // forged (pid, fd), or another host's pid, never maps another file. It
  // must be sealed against shrinking (kSealed): a peer that could take pages
  // away would crash this process (SIGBUS) where it reads them. Opening
  // needs the right to read the process's fds (same user, not made
  // undumpable). Throws ShmError; StaleRegionError when the fd is gone, or
  // is not such a memfd (sealed, large enough): the announced one was closed.
  static ShmRegion openPeer(uint32_t pid, int fd, const std::string& name, size_t bytes,
                            Access access);

  // The memfd, or -1 when the region holds none (mapped, or closeFd()).
  int fd() const { return fd_.get(); }
  size_t size() const { return size_; }
  bool writable() const { return access_ == Access::kReadWrite; }

  // [offset, offset + length) of the region; throws when it reaches outside,
  // or, for mutableAt, when the region is mapped read-only.
  const uint8_t* at(size_t offset, size_t length) const;
  uint8_t* mutableAt(size_t offset, size_t length);

  // Closes the fd. The memory stays mapped here, and lives for whoever else
  // holds the fd or a mapping.
  void closeFd() { fd_.reset(); }

 private:
  void unmap();

  Fd fd_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  Access access_ = Access::kReadOnly;
};

// Who can map whose regions: processes with equal keys (same host, PID
// namespace and user). Empty if the key cannot be determined.
const std::string& localShmKey();

// Where a member's collective region is, as its peers are told.
struct RegionRef {
  uint64_t id = 0;
  uint32_t pid = 0;
  uint32_t fd = 0;
  uint64_t bytes = 0;
};

// A collective region starts with this header, its id: a peer that maps it
// by (pid, fd) checks the id, since fds are reused (RegionCache::map).
constexpr size_t kRegionHeaderBytes = 64;

// A collective region this process owns and writes, and the id its peers
// cache their mappings under (fds are reused; ids are random).
class OwnRegion {
 public:
  explicit OwnRegion(size_t bytes);
  ShmRegion& region() { return region_; }
  size_t size() const { return region_.size(); }
  RegionRef ref() const;

 private:
  ShmRegion region_;
  uint64_t id_ = 0;
};

// Own regions for reuse, and peers' regions already mapped (read-only), of
// one group.
class RegionCache {
 public:
  // A free region of at least bytes; hand it back with release().
  std::shared_ptr<OwnRegion> acquire(size_t bytes);
  void release(std::shared_ptr<OwnRegion> region);
  // Throws ShmError when the region cannot be mapped, StaleRegionError when
  // (pid, fd) no longer holds the region ref names.
  std::shared_ptr<const ShmRegion> map(const RegionRef& ref);
  // Unmaps the peers' regions (those a collective in flight holds stay mapped
  // until it ends): on a membership change, so that members that left do not
  // keep their memory alive here.
  void forgetMapped();

 private:
  std::mutex mutex_;
  std::vector<std::shared_ptr<OwnRegion>> free_;
  // Most recently used first; bounded.
  std::list<std::pair<std::pair<uint32_t, uint64_t>, std::shared_ptr<const ShmRegion>>> mapped_;
};

}  // namespace moolib
