// A shared-memory connection: a Unix stream socket carries frames and small
// segments; large segments are copied once into memfd-backed shared segments
// that the receiver maps and reads in place.
//
// Protocol, per direction:
//  1. The sender keeps a pool of segments. A large outgoing segment is copied
//     into a free one (created on demand, prefaulted) and described as
//     (segment id, offset, length). The first frame that uses a segment
//     carries its memfd as SCM_RIGHTS with the frame's first byte.
//  2. The receiver maps each segment once and hands out views of it.
//  3. When the last view of a received segment is released, the receiver
//     sends kShmRelease with its id and the sender may reuse it.
// A segment the receiver never releases is never reused; past the pool's
// budget, segments go inline through the socket instead.
#pragma once

#include <mutex>
#include <unordered_map>
#include <vector>

#include "shm/shm_region.h"
#include "transport/stream_connection.h"

namespace moolib {

class ShmConnection : public StreamConnection {
 public:
  static ConnectionPtr create(Fd fd);
  ShmConnection(Fd fd, std::string local, std::string remote);
  ~ShmConnection() override;
  const char* transport() const override { return "shm"; }

 protected:
  bool encodeSegment(const OutSegment& segment, SegmentDesc& desc, std::vector<int>& fds) override;
  BufferPtr decodeShared(const SegmentDesc& desc) override;
  bool handleInternal(IncomingFrame& frame) override;

 private:
  struct PoolSegment {
    // Shared with the copies in flight: the pool may grow (and move its
    // entries) while a segment is being filled.
    std::shared_ptr<ShmRegion> region;
    bool busy = false;
    bool announced = false;
  };

  std::mutex poolMutex_;
  std::vector<PoolSegment> pool_;  // index is the segment id
  size_t poolBytes_ = 0;

  // Held by the buffers handed out over them too. Handling thread only.
  std::unordered_map<uint32_t, std::shared_ptr<ShmRegion>> received_;
  size_t receivedBytes_ = 0;
};

}  // namespace moolib
