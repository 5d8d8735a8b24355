#include "transport/ownership.h"

#include <utility>

namespace moolib {

void IoOwnership::attachLocked(int fd, uint64_t token, bool armed) {
  fd_ = fd;
  token_ = token;
  armed_ = armed;
}

bool IoOwnership::beginHandlingLocked() {
  if (owned_ || closed_ || handling_) return false;
  armed_ = false;
  handling_ = true;
  return true;
}

void IoOwnership::endHandlingLocked(uint32_t events) {
  handling_ = false;
  armLocked(events);
}

void IoOwnership::armLocked(uint32_t events) {
  if (owned_ || armed_ || closed_) return;
  armed_ = true;
  Loop::instance().rearm(fd_, token_, events);
}

void IoOwnership::updateLocked(uint32_t events) {
  if (armed_ && token_) Loop::instance().rearm(fd_, token_, events);
}

bool IoOwnership::takeBackLocked() {
  if (!lent_) return false;
  lent_ = false;
  owned_ = false;
  return true;
}

bool IoOwnership::closeLocked() {
  if (closed_) return false;
  closed_ = true;
  armed_ = false;
  return true;
}

bool IoOwnership::tryOwnLocked() {
  if (owned_ || handling_ || closed_ || !token_) return false;
  owned_ = true;
  if (armed_) {
    armed_ = false;
    Loop::instance().rearm(fd_, token_, 0);
  }
  return true;
}

bool IoOwnership::claimLocked() {
  if (lent_ && lender_ == std::this_thread::get_id()) {
    lent_ = false;
    return true;
  }
  return tryOwnLocked();
}

bool IoOwnership::runLent(const std::shared_ptr<FdHandler>& handler) {
  {
    std::lock_guard<std::mutex> lock(guard_);
    lent_ = true;
    lender_ = std::this_thread::get_id();
  }
  Loop::instance().runInlineTasks(handler);
  std::lock_guard<std::mutex> lock(guard_);
  return std::exchange(lent_, false) || tryOwnLocked();
}

}  // namespace moolib
