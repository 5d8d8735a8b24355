// A Collective's shared-memory all-reduce (collective.h), for members on one
// host: each sums its slice of every member's region in place, then copies
// the others' slices; three rounds of small messages (ready, reduced, done)
// order the steps, from every member to every other or, among many, in
// log rounds (bruck.h).
#include <algorithm>
#include <cstring>

#include "collectives/collective.h"

namespace moolib {

void Collective::sendShm(uint8_t phase, const RegionRef& region) {
  auto m = shmMessage(phase);
  m.region = region;
  bool done = phase == CollectiveMessage::kShmDone;
  auto post = [&](size_t dest) {
    if (done) {
      // Not waited for: it goes on after this op finished here (see onShm).
      sendFn_(members_[dest], m.encode(), {}, [](const Error&) {});
    } else {
      send(dest, m, {});
    }
  };
  if (!bruck_) {
    for (size_t dest = 0; dest != n_; ++dest) {
      if (dest != self_) post(dest);
    }
    return;
  }
  auto& rounds = done ? doneRounds_ : reducedRounds_;
  std::vector<size_t> steps;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_) return;
    while (auto k = rounds.nextSend()) steps.push_back(*k);
  }
  for (size_t k : steps) {
    m.step = uint32_t(k);
    post(rounds.sendTo(k));
  }
}

bool Collective::shmAllReduced() const {
  return reducedHere_ && (bruck_ ? reducedRounds_.complete() : shmReduced_ == n_ - 1);
}

bool Collective::shmAllDone() const { return bruck_ ? doneRounds_.complete() : shmDone_ == n_ - 1; }

std::pair<size_t, size_t> Collective::slice(size_t buffer, size_t member) const {
  size_t count = buffers_[buffer].bytes / dtypeSize(buffers_[buffer].dtype);
  return {count * member / n_, count * (member + 1) / n_};
}

Collective::Mapped Collective::mapRegion(size_t member, const RegionRef& ref) {
  std::shared_ptr<const ShmRegion> region;
  try {
    MOO_ENFORCE(ref.bytes >= shmBytes_, "its region is smaller than the data");
    region = regions_->map(ref);
  } catch (const StaleRegionError& e) {
    // Its owner dropped it, which it does when this collective failed there:
    // not a lack of shared memory here. The failure's own reason is on its
    // way (the owner's abort, the broker's membership change, or a send to
    // a departed member failing); failing now would hide it. The deadline
    // bounds the wait.
    std::lock_guard<std::mutex> lock(mutex_);
    staleRegion_ = concat(describe(), " failed: member '", members_[member],
                          "' dropped its region before this member read it (its part ended "
                          "there): ",
                          e.what());
    return kStale;
  } catch (const std::exception& e) {
    fail(Error(ErrorCode::kSharedMemoryUnavailable,
               concat(describe(), " failed: cannot share memory with member '", members_[member],
                      "': ", e.what())),
         true);
    return kFailed;
  }
  bool duplicate;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    duplicate = peerRegions_[member] != nullptr;
    if (!duplicate) {
      peerRegions_[member] = std::move(region);
      ++shmReady_;
    }
  }
  if (duplicate) {
    fail(concat(describe(), " failed: member '", members_[member], "' is ready twice"), true);
    return kFailed;
  }
  return kMapped;
}

void Collective::onShm(const CollectiveMessage& m, std::vector<BufferPtr> data) {
  if (m.phase == CollectiveMessage::kShmReady) {
    if (bruck_) return onBruck(m, std::move(data));
    // A stale region fails the op later (see mapRegion), not this message.
    if (mapRegion(m.source, m.region) != kMapped) return;
    maybeShmReduce();
    received();
    return;
  }
  bool reduced = m.phase == CollectiveMessage::kShmReduced;
  bool ok = true, retire = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (bruck_) {
      auto& rounds = reduced ? reducedRounds_ : doneRounds_;
      ok = rounds.expects(m.step, m.source);
      if (ok) rounds.arrive(m.step);
    } else {
      ++(reduced ? shmReduced_ : shmDone_);
    }
  }
  if (!ok) {
    return fail(concat(describe(), " failed: member '", members_[m.source],
                       "' sent an unexpected message (shared-memory phase ", int(m.phase),
                       " round ", m.step, ")"),
                true);
  }
  // Among many members, rounds this one was waiting for may go now; "done"
  // ones even after the op finished here, since the others wait for them.
  if (bruck_) sendShm(m.phase);
  if (reduced) {
    maybeShmGather();
    received();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    retire = shmAllDone() && finished_;
  }
  if (retire) this->retire();
}

bool Collective::claimShmStep(bool& started, bool ready, std::shared_ptr<OwnRegion>& own,
                              std::vector<std::shared_ptr<const ShmRegion>>& peers) {
  if (finished_ || started || !ready) return false;
  started = true;
  // Copies: fail() may drop the op's references while the step runs.
  own = ownRegion_;
  peers = peerRegions_;
  return true;
}

void Collective::maybeShmReduce() {
  std::shared_ptr<OwnRegion> own;
  std::vector<std::shared_ptr<const ShmRegion>> peers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!claimShmStep(reduceStarted_, copiedIn_ && shmReady_ == n_ - 1, own, peers)) return;
  }
  // This member's slice of every buffer: the sum of every member's, read in
  // place, block by block so the running sum stays in cache.
  constexpr size_t kBlock = 32 << 10;
  for (size_t b = 0; b != buffers_.size(); ++b) {
    if (algo_[b] != kShmAlgo) continue;
    size_t e = dtypeSize(buffers_[b].dtype);
    auto [begin, end] = slice(b, self_);
    size_t offset = shmOffset_[b] + begin * e;
    size_t bytes = (end - begin) * e;
    size_t step = kBlock / e * e;
    for (size_t at = 0; at < bytes; at += step) {
      size_t n = std::min(step, bytes - at);
      uint8_t* dst = own->region().mutableAt(offset + at, n);
      for (size_t i = 0; i != n_; ++i) {
        if (i != self_) sumInto(buffers_[b].dtype, dst, peers[i]->at(offset + at, n), n / e);
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    reducedHere_ = true;
    reducedRounds_.enter();
  }
  sendShm(CollectiveMessage::kShmReduced);
  maybeShmGather();
}

void Collective::maybeShmGather() {
  std::shared_ptr<OwnRegion> own;
  std::vector<std::shared_ptr<const ShmRegion>> peers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!claimShmStep(gatherStarted_, shmAllReduced(), own, peers)) return;
  }
  for (size_t b = 0; b != buffers_.size(); ++b) {
    if (algo_[b] != kShmAlgo) continue;
    size_t e = dtypeSize(buffers_[b].dtype);
    for (size_t i = 0; i != n_; ++i) {
      auto [begin, end] = slice(b, i);
      size_t offset = shmOffset_[b] + begin * e, bytes = (end - begin) * e;
      const uint8_t* src =
          i == self_ ? own->region().at(offset, bytes) : peers[i]->at(offset, bytes);
      std::memcpy(buffers_[b].data + begin * e, src, bytes);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    gatheredHere_ = true;
    doneRounds_.enter();
  }
  sendShm(CollectiveMessage::kShmDone);
  checkDone();
}

}  // namespace moolib
