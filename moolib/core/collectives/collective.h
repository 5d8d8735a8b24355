// One collective operation of a group (an all-reduce or an all-gather), as
// seen by one member: what it sends, what it expects, and when it is done.
//
// Sum all-reduce of a typed buffer:
// - small buffers go "direct" among few members: every member sends its
//   buffer to every other, and each sums all contributions in member order,
//   so results are bitwise identical everywhere in one hop; among more, by
//   recursive doubling (doubling.h): log2(N) exchanges a member, each pair
//   adding the lower member's partial sum to the higher one's, so both get
//   the same bits;
// - larger ones go round a ring: reduce-scatter then all-gather over N
//   segments, each cut into chunks that are forwarded as soon as they are
//   reduced (pipelined), so each member sends and receives about 2(N-1)/N of
//   the buffer and the final value of each segment is computed by one member
//   and copied to the others.
// - when every member is on this host (and allows shared memory), large
//   buffers go through shared memory instead: each member copies its data
//   into a region of its own, sums its 1/N slice straight from every
//   member's region, and copies the summed slices of the others into its
//   result; three rounds of tiny messages order the steps (ready: where each
//   region is; reduced; done: nobody reads this member's region any more, so
//   it may be reused), and no data goes through a socket. Among up to 8
//   members each round goes from every member to every other (3N(N-1)
//   messages); among more, "ready" is an all-gather of the regions' refs
//   (below) and "reduced" and "done" are dissemination barriers (bruck.h:
//   in round k a member tells i+2^k and waits for i-2^k), 3N*ceil(log2 N)
//   messages in all.
// All-gather (used for custom reduce ops, which run in Python, and the
// Accumulator's election) sends every member's opaque segments to every
// other member among up to 8 (N(N-1) messages), and among more goes by
// Bruck's algorithm (bruck.h): ceil(log2 N) rounds, in each of which a member
// passes the blocks it holds to the member 2^k after it, N*ceil(log2 N)
// messages, each member talking to at most 2*ceil(log2 N) others.
//
// Messages are group calls; the receiver acknowledges each once it has taken
// the data, so a sender knows its memory is no longer referenced. An op is
// done when every expected message was processed and every send
// acknowledged. Any inconsistency (other shape, type, sender) fails the op
// here and, through an abort message, on every other member.
//
// Files: collective.cc (the messages, starting, the direct sum, the
// all-gather, completion and failure), collective_ring.cc,
// collective_shm.cc and collective_doubling.cc (those all-reduces).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/bruck.h"
#include "collectives/doubling.h"
#include "collectives/reduce.h"
#include "rpc/rpc.h"
#include "runtime/future.h"
#include "shm/shm_region.h"

namespace moolib {

struct OpKey {
  uint64_t syncId = 0;
  std::string name;
  uint64_t seq = 0;
  bool operator<(const OpKey& o) const {
    return std::tie(syncId, name, seq) < std::tie(o.syncId, o.name, o.seq);
  }
};

// The data of one element type: this member's contribution is its parts,
// concatenated; the op allocates the result (from the buffer cache, so
// repeated reductions do not fault in fresh pages) and sums into it.
struct TypedBuffer {
  DType dtype = DType::kFloat32;
  std::vector<OutSegment> parts;
  // Set by the op.
  size_t bytes = 0;
  uint8_t* data = nullptr;
  BufferPtr result;
  std::shared_ptr<const void> keepalive;
};

// Segment 0 of every group call.
struct CollectiveMessage {
  enum Kind : uint8_t { kData = 1, kAbort = 2 };
  enum Mode : uint8_t { kSum = 1, kGather = 2 };
  enum Phase : uint8_t {
    kDirect = 1,
    kReduceScatter = 2,
    kAllGather = 3,
    kShmReady = 4,
    kShmReduced = 5,
    kShmDone = 6,
    kDoubling = 7  // step: see DoublingPlan
  };
  uint8_t kind = kData;
  OpKey key;
  uint8_t mode = kSum;
  uint8_t phase = kDirect;
  uint32_t source = 0;  // the sender's index in the member list
  uint32_t numMembers = 0;
  uint32_t numBuffers = 0;  // sum: buffers in the op; gather: the sender's segments
  uint32_t buffer = 0;
  uint32_t step = 0;  // also the round (bruck.h) among more than 8 members
  uint32_t segment = 0;
  uint32_t chunk = 0;
  uint8_t dtype = 0;
  uint64_t bufferBytes = 0;
  // A digest of the sender's data structure (nest keys, nesting, shapes,
  // dtypes): equal flat sizes are not enough for the sum to mean anything.
  uint64_t structure = 0;
  std::string error;  // kAbort
  // kShmReady up to 8 members; among more, the refs are the blocks of an
  // all-gather, in the data (see BlockHeader).
  RegionRef region;
  // kAbort: the ErrorCode the op failed with. Encoded last, so that a peer
  // that predates it reads the rest; decoded as kFailed when absent.
  ErrorCode code = ErrorCode::kFailed;
  std::string encode() const;
  static CollectiveMessage decode(std::string_view data);
};

class Collective : public std::enable_shared_from_this<Collective> {
 public:
  // Sends meta + data to a member; onAck(error) runs once it was taken
  // (no error) or could not be delivered.
  using SendFn =
      std::function<void(const std::string& peer, std::string meta, std::vector<OutSegment> data,
                         std::function<void(const Error& error)> onAck)>;

  // A sum all-reduce; the result is one segment per buffer. With regions
  // (all members on one host), large buffers go through shared memory.
  // structure: see CollectiveMessage::structure (0: not checked).
  Collective(OpKey key, std::vector<std::string> members, size_t self,
             std::vector<TypedBuffer> buffers, std::shared_ptr<RegionCache> regions,
             uint64_t structure, SendFn send);
  // An all-gather of opaque segments. The result is segment 0 (u32 count per
  // member) followed by every member's segments in member order.
  Collective(OpKey key, std::vector<std::string> members, size_t self,
             std::vector<OutSegment> segments, SendFn send);

  const OpKey& key() const { return key_; }
  FuturePtr future() const { return future_; }
  void start();
  // A message for this op from member `from` (already acknowledged).
  void onMessage(const std::string& from, const CollectiveMessage& m, std::vector<BufferPtr> data);
  // Fails the op here; with broadcast, tells every other member to fail it too.
  void fail(const Error& error, bool broadcast);
  // A kFailed error: members that disagree, a malformed message.
  void fail(const std::string& error, bool broadcast) {
    fail(Error(ErrorCode::kFailed, error), broadcast);
  }
  std::string describe() const;
  // fn runs once no message for this op can come any more (at once if so).
  void setOnRetired(std::function<void()> fn);
  // Fails the op everywhere, naming the members it still waits for, if it
  // has not completed within `seconds` (a member that never starts it, or
  // is stuck, must not make the others wait forever).
  void setDeadline(double seconds);

 private:
  struct Ring {
    size_t elementSize = 1;
    size_t chunkElements = 1;
    std::vector<size_t> segmentBegin;  // N+1 element offsets
    size_t chunks(size_t segment) const;
    std::pair<size_t, size_t> chunkRange(size_t segment,
                                         size_t chunk) const;  // element [begin, end)
  };

  void initCounts();
  void send(size_t dest, CollectiveMessage m, std::vector<OutSegment> data);
  // A message of this op: what it is and who sends it.
  CollectiveMessage message(uint8_t phase) const;
  // A data message of one buffer: who sends it, and what the buffer is.
  CollectiveMessage bufferMessage(uint8_t phase, size_t buffer) const;
  // A shared-memory round's message, with the layout every member must share.
  CollectiveMessage shmMessage(uint8_t phase) const;
  void sendChunk(uint8_t phase, size_t buffer, size_t step, size_t segment, size_t chunk);
  void onRing(const CollectiveMessage& m, const BufferPtr& data);
  void onDirect(const CollectiveMessage& m, std::vector<BufferPtr> data);
  void onShm(const CollectiveMessage& m, std::vector<BufferPtr> data);
  // Among many members: a Bruck round of the all-gather (gather mode, or the
  // shared-memory regions' refs), and sends the rounds it allows.
  void onBruck(const CollectiveMessage& m, std::vector<BufferPtr> data);
  void sendBruck();
  // Maps a member's region (shm ready); a stale one is noted (the op fails
  // later, with the reason that follows), any other failure fails the op.
  enum Mapped : uint8_t { kMapped, kStale, kFailed };
  Mapped mapRegion(size_t member, const RegionRef& ref);
  void onDoubling(const CollectiveMessage& m, BufferPtr data);
  // Does the buffer's doubling stages whose messages are here, in order.
  void advanceDoubling(size_t buffer);
  void sendDoubling(size_t buffer, DoublingPlan::Send to);
  // Tells the others this member is ready (with its region), has reduced, or
  // is done: each of them directly, or among many members the barrier's
  // rounds that may go now.
  void sendShm(uint8_t phase, const RegionRef& region = {});
  // With mutex_ held: every member reduced, or is done reading.
  bool shmAllReduced() const;
  bool shmAllDone() const;
  // With mutex_ held: starts a shared-memory step once ready, at most once.
  bool claimShmStep(bool& started, bool ready, std::shared_ptr<OwnRegion>& own,
                    std::vector<std::shared_ptr<const ShmRegion>>& peers);
  void maybeShmReduce();
  void maybeShmGather();
  std::pair<size_t, size_t> slice(size_t buffer, size_t member) const;  // element [begin, end)
  void received();
  void onDeadline(double seconds);
  void cancelDeadline();
  void checkDone();
  void finish();
  void retire();
  static void copyParts(TypedBuffer& buf, uint8_t* dst);
  OutSegment view(size_t buffer, size_t begin, size_t end) const;
  size_t left() const { return (self_ + n_ - 1) % n_; }
  size_t right() const { return (self_ + 1) % n_; }
  size_t mod(int64_t v) const { return size_t(((v % int64_t(n_)) + int64_t(n_)) % int64_t(n_)); }

  const OpKey key_;
  const std::vector<std::string> members_;
  const size_t self_, n_;
  const uint8_t mode_;
  const uint64_t structure_ = 0;
  std::vector<TypedBuffer> buffers_;
  // This member's block of the all-gather: in gather mode the caller's
  // segments; among many members with shared memory, its region's ref.
  std::vector<OutSegment> ownBlock_;
  // More than kDirectMaxMembers: the all-gather and the shared-memory rounds
  // go by log rounds (bruck.h), not from every member to every other.
  bool bruck_ = false;
  LogRounds gatherRounds_, reducedRounds_, doneRounds_;
  enum Algorithm : uint8_t { kDirectAlgo, kRingAlgo, kShmAlgo, kDoublingAlgo };
  std::vector<Algorithm> algo_;  // per buffer
  std::vector<Ring> rings_;
  struct Doubling {
    DoublingPlan plan;
    std::vector<BufferPtr> arrived;  // by stage
    size_t next = 0;                 // the stage to do next
    // A thread is doing one; also until start() sent this member's own part
    // (a partner's part may come first, and must not be added to it).
    bool busy = true;
  };
  std::vector<Doubling> doubling_;  // per buffer (used by kDoublingAlgo ones)
  SendFn sendFn_;
  FuturePtr future_ = std::make_shared<FutureState>();

  std::mutex mutex_;
  size_t expectedReceives_ = 0, received_ = 0;
  size_t expectedSends_ = 0, sent_ = 0, acked_ = 0;
  bool finished_ = false;
  // Shared-memory buffers: their offsets in this member's region.
  std::shared_ptr<RegionCache> regions_;
  std::vector<size_t> shmOffset_;
  size_t shmBytes_ = kRegionHeaderBytes;  // the region's size: its header, then the data
  uint64_t shmLayout_ = 0;                // what every member must agree on
  bool hasShm_ = false;
  std::shared_ptr<OwnRegion> ownRegion_;
  std::vector<std::shared_ptr<const ShmRegion>> peerRegions_;
  size_t shmReady_ = 0, shmReduced_ = 0, shmDone_ = 0;
  // Set when a member's region was gone: this op fails, but with the reason
  // its owner (or the broker) gives, which follows; this only if none comes.
  std::string staleRegion_;
  bool retired_ = false, failed_ = false;
  uint64_t deadlineTimer_ = 0;
  std::vector<bool> heard_;  // members a message of this op came from
  std::function<void()> onRetired_;
  bool copiedIn_ = false, reduceStarted_ = false, reducedHere_ = false, gatherStarted_ = false,
       gatheredHere_ = false;
  // Direct sum: contributions[buffer][member].
  std::vector<std::vector<BufferPtr>> contributions_;
  // The others' blocks of the all-gather, by member.
  std::vector<std::vector<BufferPtr>> gathered_;
};

}  // namespace moolib
