#include "collectives/collective.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "rpc/wire.h"
#include "runtime/logging.h"

namespace moolib {

namespace {
// Buffers up to this size go direct (one hop, N-1 copies sent) among up to
// kDirectMaxMembers, by recursive doubling among more (log2(N) hops and
// copies); larger ones go round the ring in chunks of kChunkBytes.
constexpr size_t kDirectMaxBytes = 64 << 10;
constexpr size_t kDirectMaxMembers = 8;
constexpr size_t kChunkBytes = 256 << 10;
// A RegionRef on the wire.
constexpr size_t kRefBytes = 24;

void writeRef(Writer& w, const RegionRef& ref) {
  w.u64(ref.id);
  w.u32(ref.pid);
  w.u32(ref.fd);
  w.u64(ref.bytes);
}

RegionRef readRef(Reader& r) {
  RegionRef ref;
  ref.id = r.u64();
  ref.pid = r.u32();
  ref.fd = r.u32();
  ref.bytes = r.u64();
  return ref;
}

OutSegment outSegment(const BufferPtr& b) { return OutSegment{b->data(), b->size(), b}; }

std::string_view bytesOf(const BufferPtr& b) {
  return {reinterpret_cast<const char*>(b->data()), b->size()};
}
}  // namespace

std::string CollectiveMessage::encode() const {
  Writer w;
  w.u8(kind);
  w.u64(key.syncId);
  w.str(key.name);
  w.u64(key.seq);
  w.u8(mode);
  w.u8(phase);
  w.u32(source);
  w.u32(numMembers);
  w.u32(numBuffers);
  w.u32(buffer);
  w.u32(step);
  w.u32(segment);
  w.u32(chunk);
  w.u8(dtype);
  w.u64(bufferBytes);
  w.u64(structure);
  w.str(error);
  writeRef(w, region);
  w.u8(uint8_t(code));
  return w.take();
}

CollectiveMessage CollectiveMessage::decode(std::string_view data) {
  Reader r(data);
  CollectiveMessage m;
  m.kind = r.u8();
  m.key.syncId = r.u64();
  m.key.name = r.str(1024);
  m.key.seq = r.u64();
  m.mode = r.u8();
  m.phase = r.u8();
  m.source = r.u32();
  m.numMembers = r.u32();
  m.numBuffers = r.u32();
  m.buffer = r.u32();
  m.step = r.u32();
  m.segment = r.u32();
  m.chunk = r.u32();
  m.dtype = r.u8();
  m.bufferBytes = r.u64();
  m.structure = r.u64();
  m.error = r.str(64 << 10);
  m.region = readRef(r);
  if (r.remaining() > 0) m.code = errorCodeFromWire(r.u8());
  if (m.code == ErrorCode::kOk) m.code = ErrorCode::kFailed;  // an abort is a failure
  if (m.kind != kData && m.kind != kAbort)
    throw WireError(concat("unknown collective message kind ", int(m.kind)));
  if (m.mode != kSum && m.mode != kGather)
    throw WireError(concat("unknown collective mode ", int(m.mode)));
  if (m.phase < kDirect || m.phase > kDoubling)
    throw WireError(concat("unknown collective phase ", int(m.phase)));
  if (m.dtype >= uint8_t(DType::kCount))
    throw WireError(concat("unknown element type ", int(m.dtype)));
  return m;
}

Collective::Collective(OpKey key, std::vector<std::string> members, size_t self,
                       std::vector<TypedBuffer> buffers, std::shared_ptr<RegionCache> regions,
                       uint64_t structure, SendFn send)
    : key_(std::move(key)),
      members_(std::move(members)),
      self_(self),
      n_(members_.size()),
      mode_(CollectiveMessage::kSum),
      structure_(structure),
      buffers_(std::move(buffers)),
      sendFn_(std::move(send)),
      regions_(std::move(regions)) {
  MOO_ENFORCE(self_ < n_, "this peer is not a member");
  bruck_ = n_ > kDirectMaxMembers;
  uint64_t layout = 1469598103934665603ull;  // FNV-1a over what must match
  auto mix = [&](uint64_t v) { layout = (layout ^ v) * 1099511628211ull; };
  mix(n_);
  for (size_t b = 0; b != buffers_.size(); ++b) {
    auto& buf = buffers_[b];
    buf.bytes = 0;
    for (auto& p : buf.parts) buf.bytes += p.size;
    buf.result = allocateBuffer(buf.bytes);
    buf.data = buf.result->data();
    buf.keepalive = buf.result;
    size_t e = dtypeSize(buf.dtype);
    MOO_ENFORCE(buf.bytes % e == 0, "buffer of ", buf.bytes, " bytes is not a whole number of ",
                dtypeName(buf.dtype));
    Algorithm algo = buf.bytes > kDirectMaxBytes ? (regions_ && n_ > 1 ? kShmAlgo : kRingAlgo)
                     : n_ <= kDirectMaxMembers   ? kDirectAlgo
                                                 : kDoublingAlgo;
    algo_.push_back(algo);
    doubling_.emplace_back();
    if (algo == kDoublingAlgo) {
      doubling_.back().plan = DoublingPlan::make(n_, self_);
      doubling_.back().arrived.resize(doubling_.back().plan.stages.size());
    }
    // Shared-memory buffers are copied straight into the region instead.
    if (algo != kShmAlgo) copyParts(buf, buf.data);
    shmOffset_.push_back(shmBytes_);
    if (algo == kShmAlgo) {
      hasShm_ = true;
      shmBytes_ += (buf.bytes + 63) / 64 * 64;
      mix(b);
      mix(buf.bytes);
      mix(uint64_t(buf.dtype));
    }
    Ring ring;
    if (algo == kRingAlgo) {
      size_t count = buf.bytes / e;
      ring.elementSize = e;
      ring.chunkElements = std::max<size_t>(1, kChunkBytes / e);
      for (size_t g = 0; g <= n_; ++g) ring.segmentBegin.push_back(count * g / n_);
    }
    rings_.push_back(std::move(ring));
  }
  shmLayout_ = layout;
  peerRegions_.resize(n_);
  contributions_.assign(buffers_.size(), std::vector<BufferPtr>(n_));
  gathered_.resize(n_);
  if (bruck_ && hasShm_) {
    gatherRounds_ = reducedRounds_ = doneRounds_ = LogRounds(n_, self_);
  }
  initCounts();
}

Collective::Collective(OpKey key, std::vector<std::string> members, size_t self,
                       std::vector<OutSegment> segments, SendFn send)
    : key_(std::move(key)),
      members_(std::move(members)),
      self_(self),
      n_(members_.size()),
      mode_(CollectiveMessage::kGather),
      ownBlock_(std::move(segments)),
      sendFn_(std::move(send)) {
  MOO_ENFORCE(self_ < n_, "this peer is not a member");
  MOO_ENFORCE(!ownBlock_.empty(), "an all-gather needs at least one segment");
  gathered_.resize(n_);
  bruck_ = n_ > kDirectMaxMembers;
  if (bruck_) gatherRounds_ = LogRounds(n_, self_);
  initCounts();
}

void Collective::initCounts() {
  if (n_ == 1) return;
  // One message from and to every other member, or one a round.
  size_t perRound = bruck_ ? gatherRounds_.rounds() : n_ - 1;
  if (mode_ == CollectiveMessage::kGather) {
    expectedReceives_ = expectedSends_ = perRound;
    return;
  }
  if (hasShm_) {
    // ready and reduced; "done" messages only retire the op (see onShm) and
    // are not waited for here.
    expectedReceives_ += 2 * perRound;
    expectedSends_ += 2 * perRound;
  }
  for (size_t b = 0; b != buffers_.size(); ++b) {
    if (algo_[b] == kShmAlgo) continue;
    if (algo_[b] == kDirectAlgo) {
      expectedReceives_ += n_ - 1;
      expectedSends_ += n_ - 1;
      continue;
    }
    if (algo_[b] == kDoublingAlgo) {
      expectedReceives_ += doubling_[b].plan.stages.size();
      expectedSends_ += doubling_[b].plan.sends();
      continue;
    }
    auto& ring = rings_[b];
    for (size_t s = 0; s + 1 < n_; ++s) {
      int64_t step = int64_t(s), me = int64_t(self_);
      expectedReceives_ += ring.chunks(mod(me - 1 - step)) + ring.chunks(mod(me - step));
      expectedSends_ += ring.chunks(mod(me - step)) + ring.chunks(mod(me + 1 - step));
    }
  }
}

void Collective::copyParts(TypedBuffer& buf, uint8_t* dst) {
  for (auto& p : buf.parts) {
    if (p.size) std::memcpy(dst, p.data, p.size);
    dst += p.size;
  }
  buf.parts.clear();  // the caller's memory is not needed any more
}

std::string Collective::describe() const { return concat("all_reduce '", key_.name, "'"); }

OutSegment Collective::view(size_t buffer, size_t begin, size_t end) const {
  auto& b = buffers_[buffer];
  size_t e = dtypeSize(b.dtype);
  return OutSegment{b.data + begin * e, (end - begin) * e, b.keepalive};
}

void Collective::start() {
  if (n_ == 1) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finished_ = true;
    }
    finish();
    return;
  }
  if (mode_ == CollectiveMessage::kGather) {
    if (bruck_) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        gatherRounds_.enter();
      }
      sendBruck();
    } else {
      auto m = message(CollectiveMessage::kDirect);
      m.numBuffers = uint32_t(ownBlock_.size());
      for (size_t dest = 0; dest != n_; ++dest) {
        if (dest != self_) send(dest, m, ownBlock_);
      }
    }
  } else {
    if (hasShm_) {
      std::shared_ptr<OwnRegion> own;
      try {
        own = regions_->acquire(shmBytes_);
      } catch (const std::exception& e) {
        return fail(Error(ErrorCode::kSharedMemoryUnavailable,
                          concat(describe(), " failed: cannot create shared memory: ", e.what())),
                    true);
      }
      for (size_t b = 0; b != buffers_.size(); ++b) {
        if (algo_[b] == kShmAlgo)
          copyParts(buffers_[b], own->region().mutableAt(shmOffset_[b], buffers_[b].bytes));
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (finished_) return;
        ownRegion_ = own;
        copiedIn_ = true;
        if (bruck_) {
          Writer w;
          writeRef(w, own->ref());
          ownBlock_ = {ownedSegment(w.take())};
          gatherRounds_.enter();
        }
      }
      if (bruck_) {
        sendBruck();
      } else {
        sendShm(CollectiveMessage::kShmReady, own->ref());
      }
    }
    for (size_t b = 0; b != buffers_.size(); ++b) {
      if (algo_[b] == kShmAlgo) continue;
      if (algo_[b] == kDirectAlgo) {
        auto d = bufferMessage(CollectiveMessage::kDirect, b);
        auto whole = view(b, 0, buffers_[b].bytes / dtypeSize(buffers_[b].dtype));
        for (size_t dest = 0; dest != n_; ++dest) {
          if (dest != self_) send(dest, d, {whole});
        }
        continue;
      }
      if (algo_[b] == kDoublingAlgo) {
        if (auto first = doubling_[b].plan.first) sendDoubling(b, *first);
        {
          std::lock_guard<std::mutex> lock(mutex_);
          doubling_[b].busy = false;
        }
        advanceDoubling(b);
        continue;
      }
      for (size_t c = 0; c != rings_[b].chunks(self_); ++c)
        sendChunk(CollectiveMessage::kReduceScatter, b, 0, self_, c);
    }
  }
  if (hasShm_) maybeShmReduce();
  checkDone();
}

void Collective::sendBruck() {
  struct Out {
    size_t dest;
    uint32_t round;
    std::vector<OutSegment> data;
  };
  std::vector<Out> outs;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_) return;
    while (auto k = gatherRounds_.nextSend()) {
      BlockHeader header;
      std::vector<OutSegment> data(1);
      for (size_t owner : gatherRounds_.blockOwners(self_, *k)) {
        size_t before = data.size();
        if (owner == self_) {
          data.insert(data.end(), ownBlock_.begin(), ownBlock_.end());
        } else {
          for (auto& b : gathered_[owner]) data.push_back(outSegment(b));
        }
        header.blocks.push_back({uint32_t(owner), uint32_t(data.size() - before)});
      }
      data[0] = ownedSegment(header.encode());
      outs.push_back({gatherRounds_.sendTo(*k), uint32_t(*k), std::move(data)});
    }
  }
  for (auto& o : outs) {
    auto m = mode_ == CollectiveMessage::kGather ? message(CollectiveMessage::kDirect)
                                                 : shmMessage(CollectiveMessage::kShmReady);
    m.step = o.round;
    send(o.dest, m, std::move(o.data));
  }
}

void Collective::onBruck(const CollectiveMessage& m, std::vector<BufferPtr> data) {
  bool shm = mode_ == CollectiveMessage::kSum;
  std::vector<std::pair<size_t, RegionRef>> refs;
  bool ok;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ok = gatherRounds_.expects(m.step, m.source) && !data.empty();
    std::vector<size_t> owners;
    BlockHeader header;
    if (ok) {
      owners = gatherRounds_.blockOwners(m.source, m.step);
      try {
        header = BlockHeader::decode(bytesOf(data[0]), owners.size());
      } catch (const WireError&) {
        ok = false;
      }
      ok = ok && header.blocks.size() == owners.size();
    }
    size_t total = 1;
    for (size_t i = 0; ok && i != owners.size(); ++i) {
      auto& b = header.blocks[i];
      ok = b.member == owners[i] && gathered_[owners[i]].empty() && b.segments >= 1 &&
           b.segments <= data.size() - total && (!shm || b.segments == 1);
      total += ok ? b.segments : 0;
    }
    ok = ok && total == data.size();
    for (size_t i = 0, at = 1; ok && i != owners.size(); ++i) {
      auto& slot = gathered_[owners[i]];
      slot.assign(data.begin() + at, data.begin() + at + header.blocks[i].segments);
      at += header.blocks[i].segments;
      if (shm) {
        ok = slot[0]->size() == kRefBytes;
        if (!ok) break;
        Reader r(bytesOf(slot[0]));
        refs.emplace_back(owners[i], readRef(r));
      }
    }
    if (ok) gatherRounds_.arrive(m.step);
  }
  if (!ok) {
    return fail(concat(describe(), " failed: member '", members_[m.source],
                       "' sent a duplicate or malformed part (round ", m.step, ")"),
                true);
  }
  sendBruck();
  for (auto& [member, ref] : refs) {
    if (mapRegion(member, ref) == kFailed) return;
  }
  if (shm) maybeShmReduce();
  received();
}

void Collective::retire() {
  std::shared_ptr<OwnRegion> own;
  std::function<void()> onRetired;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (retired_) return;
    retired_ = true;
    own = std::move(ownRegion_);
    peerRegions_.assign(n_, nullptr);
    onRetired = std::move(onRetired_);
  }
  // Every member said it is done reading this region: it can be reused.
  if (own && !failed_) regions_->release(std::move(own));
  if (onRetired) onRetired();
}

void Collective::setOnRetired(std::function<void()> fn) {
  bool now;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    now = retired_;
    if (!now) onRetired_ = std::move(fn);
  }
  if (now) fn();
}

void Collective::send(size_t dest, CollectiveMessage m, std::vector<OutSegment> data) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_) return;
    ++sent_;
  }
  std::weak_ptr<Collective> weak = shared_from_this();
  std::string peer = members_[dest];
  sendFn_(peer, m.encode(), std::move(data), [weak, peer](const Error& error) {
    auto self = weak.lock();
    if (!self) return;
    if (error) {
      // A member whose links all closed (its process died, or it closed its
      // Rpc), or whose Group is gone (closed: the group's function is no
      // longer defined there), has left the group, even before the broker
      // says so: the same kind of failure as when the broker's word comes first.
      bool left =
          error.code() == ErrorCode::kConnectionLost || error.code() == ErrorCode::kNotDefined;
      auto code = left ? ErrorCode::kMembershipChanged : error.code();
      return self->fail(Error(code, concat(self->describe(), " failed: member '", peer,
                                           "' did not take its data: ", error.what())),
                        true);
    }
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      ++self->acked_;
    }
    self->checkDone();
  });
}

CollectiveMessage Collective::message(uint8_t phase) const {
  CollectiveMessage m;
  m.key = key_;
  m.mode = mode_;
  m.phase = phase;
  m.source = uint32_t(self_);
  m.numMembers = uint32_t(n_);
  m.structure = structure_;
  return m;
}

CollectiveMessage Collective::shmMessage(uint8_t phase) const {
  auto m = message(phase);
  m.numBuffers = uint32_t(buffers_.size());
  m.bufferBytes = shmLayout_;
  return m;
}

CollectiveMessage Collective::bufferMessage(uint8_t phase, size_t buffer) const {
  auto m = message(phase);
  m.numBuffers = uint32_t(buffers_.size());
  m.buffer = uint32_t(buffer);
  m.dtype = uint8_t(buffers_[buffer].dtype);
  m.bufferBytes = buffers_[buffer].bytes;
  return m;
}

void Collective::onMessage(const std::string& from, const CollectiveMessage& m,
                           std::vector<BufferPtr> data) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (retired_ || (finished_ && m.phase != CollectiveMessage::kShmDone)) return;
  }
  if (m.kind == CollectiveMessage::kAbort) {
    if (std::find(members_.begin(), members_.end(), from) == members_.end()) return;
    return fail(Error(m.code, concat(describe(), " failed on member '", from, "': ", m.error)),
                false);
  }
  if (m.source >= n_ || members_[m.source] != from) {
    return fail(concat(describe(), " failed: a message from '", from,
                       "' claims to come from member ", m.source),
                true);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (heard_.size() != n_) heard_.assign(n_, false);
    heard_[m.source] = true;
  }
  if (m.numMembers != n_ || m.mode != mode_) {
    return fail(concat(describe(), " failed: member '", from, "' sees ", m.numMembers,
                       " members and a different operation (custom op on some members only?)"),
                true);
  }
  if (mode_ == CollectiveMessage::kGather) {
    if (bruck_) return onBruck(m, std::move(data));
    return onDirect(m, std::move(data));
  }
  if (m.structure != structure_) {
    return fail(concat(describe(), " failed: members passed data of different structures (nest ",
                       "keys, nesting, shapes or dtypes): member '", from, "' and member '",
                       members_[self_], "' differ"),
                true);
  }
  if (m.phase >= CollectiveMessage::kShmReady && m.phase <= CollectiveMessage::kShmDone) {
    if (!hasShm_ || m.numBuffers != buffers_.size() || m.bufferBytes != shmLayout_) {
      return fail(concat(describe(), " failed: members passed different data (member '", from,
                         "' has another number, size or type of buffers)"),
                  true);
    }
    return onShm(m, std::move(data));
  }
  if (m.numBuffers != buffers_.size() || m.buffer >= buffers_.size() ||
      m.dtype != uint8_t(buffers_[m.buffer].dtype) || m.bufferBytes != buffers_[m.buffer].bytes) {
    auto mine = m.buffer < buffers_.size() ? concat(buffers_[m.buffer].bytes, " bytes of ",
                                                    dtypeName(buffers_[m.buffer].dtype))
                                           : std::string("nothing");
    return fail(
        concat(describe(), " failed: members passed different data: member '", from, "' has ",
               m.numBuffers, " buffer(s), buffer ", m.buffer, " being ", m.bufferBytes,
               " bytes of ", dtypeName(DType(m.dtype)), ", where this member has ", buffers_.size(),
               " buffer(s), that one being ", mine),
        true);
  }
  auto algo = m.phase == CollectiveMessage::kDirect     ? kDirectAlgo
              : m.phase == CollectiveMessage::kDoubling ? kDoublingAlgo
                                                        : kRingAlgo;
  if (algo != algo_[m.buffer] || data.size() != 1) {
    return fail(concat(describe(), " failed: member '", from, "' sent an unexpected message"),
                true);
  }
  if (algo == kDirectAlgo) return onDirect(m, std::move(data));
  if (algo == kDoublingAlgo) return onDoubling(m, std::move(data[0]));
  onRing(m, data[0]);
}

void Collective::onDirect(const CollectiveMessage& m, std::vector<BufferPtr> data) {
  bool ok;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (mode_ == CollectiveMessage::kGather) {
      ok = gathered_[m.source].empty() && !data.empty() && data.size() == m.numBuffers;
      if (ok) gathered_[m.source] = std::move(data);
    } else {
      auto& slot = contributions_[m.buffer][m.source];
      ok = !slot && data[0]->size() == buffers_[m.buffer].bytes;
      if (ok) slot = std::move(data[0]);
    }
  }
  if (!ok) {
    return fail(concat(describe(), " failed: member '", members_[m.source],
                       "' sent a duplicate or malformed part"),
                true);
  }
  received();
}

void Collective::received() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++received_;
  }
  checkDone();
}

void Collective::checkDone() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ || received_ != expectedReceives_ || sent_ != expectedSends_ ||
        acked_ != expectedSends_)
      return;
    if (hasShm_ && n_ > 1 && !gatheredHere_) return;
    finished_ = true;
  }
  cancelDeadline();
  finish();
}

void Collective::finish() {
  if (mode_ == CollectiveMessage::kGather) {
    Writer counts;
    std::vector<BufferPtr> out{nullptr};
    for (size_t i = 0; i != n_; ++i) {
      if (i == self_) {
        counts.u32(uint32_t(ownBlock_.size()));
        for (auto& s : ownBlock_) out.push_back(copyToBuffer(s));
      } else {
        counts.u32(uint32_t(gathered_[i].size()));
        for (auto& s : gathered_[i]) out.push_back(s);
      }
    }
    std::string meta = counts.take();
    out[0] = copyToBuffer(
        OutSegment{reinterpret_cast<const uint8_t*>(meta.data()), meta.size(), nullptr});
    gathered_.clear();
    future_->setResult(std::move(out));
    retire();
    return;
  }
  // Direct buffers: every member adds the contributions in member order, so
  // every member gets the same bits.
  for (size_t b = 0; b != buffers_.size(); ++b) {
    if (algo_[b] != kDirectAlgo || n_ == 1) continue;
    auto& buf = buffers_[b];
    size_t count = buf.bytes / dtypeSize(buf.dtype);
    auto part = [&](size_t i) { return i == self_ ? buf.data : contributions_[b][i]->data(); };
    std::vector<uint8_t> sum(part(0), part(0) + buf.bytes);
    for (size_t i = 1; i != n_; ++i) sumInto(buf.dtype, sum.data(), part(i), count);
    std::memcpy(buf.data, sum.data(), buf.bytes);
  }
  contributions_.clear();
  bool retireNow;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    retireNow = !hasShm_ || n_ == 1 || shmAllDone();
  }
  std::vector<BufferPtr> results;
  for (auto& b : buffers_) results.push_back(b.result);
  future_->setResult(std::move(results));
  if (retireNow) retire();
}

void Collective::setDeadline(double seconds) {
  std::weak_ptr<Collective> weak = shared_from_this();
  auto when = Clock::now() +
              std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  uint64_t id = Loop::instance().addTimer(when, [weak, seconds] {
    if (auto self = weak.lock()) self->onDeadline(seconds);
  });
  std::lock_guard<std::mutex> lock(mutex_);
  if (finished_) {
    Loop::instance().cancelTimer(id);
  } else {
    deadlineTimer_ = id;
  }
}

void Collective::cancelDeadline() {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    id = std::exchange(deadlineTimer_, 0);
  }
  if (id) Loop::instance().cancelTimer(id);
}

void Collective::onDeadline(double seconds) {
  std::string silent, others, stale;
  bool ring;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_) return;
    deadlineTimer_ = 0;
    stale = staleRegion_;
    if (heard_.size() != n_) heard_.assign(n_, false);
    // On a ring only the left neighbour sends to this member: the others'
    // state shows only through it.
    ring = !algo_.empty() &&
           std::all_of(algo_.begin(), algo_.end(), [](auto a) { return a == kRingAlgo; });
    // The members this one hears from directly: all but on a ring (its left
    // neighbour), by recursive doubling or by log rounds (its partners).
    std::vector<bool> direct(n_, false);
    auto gatherPartners = [&] {
      if (!bruck_) return direct.assign(n_, true);
      for (size_t p : gatherRounds_.partners()) direct[p] = true;
    };
    if (algo_.empty()) gatherPartners();
    for (size_t b = 0; b != algo_.size(); ++b) {
      if (algo_[b] == kRingAlgo) {
        direct[left()] = true;
      } else if (algo_[b] == kDoublingAlgo) {
        for (auto& stage : doubling_[b].plan.stages) direct[stage.peer] = true;
      } else if (algo_[b] == kShmAlgo) {
        gatherPartners();
      } else {
        direct.assign(n_, true);
      }
    }
    for (size_t i = 0; i != n_; ++i) {
      bool expected = direct[i];
      if (i == self_ || (expected && heard_[i])) continue;
      auto& list = expected ? silent : others;
      list += concat(list.empty() ? "" : ", ", "'", members_[i], "'");
    }
  }
  if (!stale.empty()) return fail(Error(ErrorCode::kMembershipChanged, stale), true);
  std::string why;
  if (!silent.empty()) {
    why = concat("waiting for member(s) ", silent,
                 " (they have not started it with this name, or are stuck)");
  } else if (!others.empty()) {
    why = concat(ring ? "the ring stalled" : "a partner's message never came", ": one of ", others,
                 " has not started it or is stuck");
  } else {
    why = "every member started it but it did not complete (messages lost?)";
  }
  auto error = concat(describe(), " timed out after ", seconds, " s (", n_, " members): ", why);
  MOO_LOG(kError, error);
  fail(Error(ErrorCode::kTimeout, error), true);
}

void Collective::fail(const Error& error, bool broadcast) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_) return;
    finished_ = true;
    // A member may still read our region: it is dropped, never reused.
    failed_ = true;
  }
  cancelDeadline();
  MOO_LOG(kVerbose, error.what());
  if (broadcast && n_ > 1) {
    auto m = message(CollectiveMessage::kDirect);
    m.kind = CollectiveMessage::kAbort;
    m.error = error.what();
    m.code = error.code();
    std::string meta = m.encode();
    for (size_t dest = 0; dest != n_; ++dest) {
      if (dest != self_) sendFn_(members_[dest], meta, {}, [](const Error&) {});
    }
  }
  future_->setError(error);
  retire();
}

}  // namespace moolib
