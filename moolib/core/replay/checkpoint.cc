#include "replay/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <stdexcept>

#include "runtime/error.h"

namespace moolib::replay {

namespace {

constexpr size_t kDigestBytes = 32;

MdCtx newSha256() {
  MdCtx ctx(EVP_MD_CTX_new());
  MOO_ENFORCE(ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1,
              "replay checkpoint: SHA-256 is not available");
  return ctx;
}

std::pair<std::string, std::string> splitPath(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return {".", path};
  return {slash == 0 ? "/" : path.substr(0, slash), path.substr(slash + 1)};
}

// Where a file is written before it is renamed to `path`: its writer's pid
// in the name tells whose it is.
std::string temporaryFor(const std::string& path) {
  return concat(path, ".tmp.", ::getpid(), ".", std::random_device{}());
}

// Renames a written and fsynced `tmp` to `path`, durably: the rename is on
// disk only once the directory is synced.
void renameDurably(const std::string& tmp, const std::string& path) {
  MOO_ENFORCE(::rename(tmp.c_str(), path.c_str()) == 0, "replay checkpoint: rename ", tmp, " to ",
              path, ": ", std::strerror(errno));
  Fd d(::open(splitPath(path).first.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.get() >= 0) ::fsync(d.get());
}

constexpr char kIncarnationTag[] = "moolib replay incarnation ";

}  // namespace

CheckpointWriter::CheckpointWriter(int fd, std::string path)
    : fd_(fd), path_(std::move(path)), md_(newSha256()) {
  buf_.reserve(1 << 20);
}

void CheckpointWriter::write(const void* data, size_t n) {
  EVP_DigestUpdate(md_.get(), data, n);
  raw(data, n);
}

void CheckpointWriter::finish() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(md_.get(), digest, &len);
  raw(digest, len);
  flush();
}

void CheckpointWriter::raw(const void* data, size_t n) {
  auto* p = static_cast<const uint8_t*>(data);
  if (buf_.size() + n > buf_.capacity()) flush();
  if (n >= buf_.capacity()) {
    writeAll(p, n);
    return;
  }
  buf_.insert(buf_.end(), p, p + n);
}

void CheckpointWriter::flush() {
  writeAll(buf_.data(), buf_.size());
  buf_.clear();
}

void CheckpointWriter::writeAll(const uint8_t* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::write(fd_, p, n);
    if (r < 0 && errno == EINTR) continue;
    MOO_ENFORCE(r > 0, "replay checkpoint: writing ", path_, ": ", std::strerror(errno));
    p += r;
    n -= size_t(r);
  }
}

CheckpointReader::CheckpointReader(const std::string& path)
    : fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)), path_(path) {
  MOO_ENFORCE(fd_.get() >= 0, "replay checkpoint ", path, ": ", std::strerror(errno));
  struct stat st;
  MOO_ENFORCE(::fstat(fd_.get(), &st) == 0, "replay checkpoint ", path, ": ", std::strerror(errno));
  uint64_t fileSize = uint64_t(st.st_size);
  auto refuse = [&](const std::string& why) {
    throw std::invalid_argument("replay checkpoint " + path + " " + why);
  };
  if (fileSize < sizeof(kCheckpointMagic) + kDigestBytes)
    refuse(concat("is truncated (", fileSize, " bytes)"));
  char magic[sizeof(kCheckpointMagic)];
  if (::pread(fd_.get(), magic, sizeof(magic), 0) != ssize_t(sizeof(magic)) ||
      std::memcmp(magic, kCheckpointMagic, sizeof(kCheckpointMagic)) != 0) {
    refuse("is not a moolib replay checkpoint");
  }
  // The digest covers everything before it: checked before anything is parsed.
  MdCtx md = newSha256();
  std::vector<uint8_t> buf(1 << 20);
  uint64_t left = fileSize - kDigestBytes, off = 0;
  while (left > 0) {
    ssize_t r = ::pread(fd_.get(), buf.data(), size_t(std::min<uint64_t>(left, buf.size())), off);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) refuse("could not be read");
    EVP_DigestUpdate(md.get(), buf.data(), size_t(r));
    left -= uint64_t(r);
    off += uint64_t(r);
  }
  unsigned char digest[EVP_MAX_MD_SIZE], stored[kDigestBytes];
  unsigned int len = 0;
  EVP_DigestFinal_ex(md.get(), digest, &len);
  if (::pread(fd_.get(), stored, kDigestBytes, off_t(fileSize - kDigestBytes)) !=
          ssize_t(kDigestBytes) ||
      len != kDigestBytes || std::memcmp(digest, stored, kDigestBytes) != 0) {
    refuse("is damaged or truncated: its SHA-256 checksum does not match");
  }
  left_ = fileSize - kDigestBytes;
  char skip[sizeof(kCheckpointMagic)];
  read(skip, sizeof(skip));
}

void CheckpointReader::corrupt(const std::string& what) const {
  throw std::invalid_argument("replay checkpoint " + path_ + " is corrupt: " + what);
}

void CheckpointReader::read(void* data, uint64_t n) {
  if (n > left_) corrupt("it ends before its contents do");
  left_ -= n;
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    if (pos_ == len_) {
      ssize_t r = ::read(fd_.get(), buf_, sizeof(buf_));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) corrupt("it ends before its contents do");
      pos_ = 0;
      len_ = size_t(r);
    }
    size_t take = std::min<uint64_t>(n, len_ - pos_);
    std::memcpy(p, buf_ + pos_, take);
    pos_ += take;
    p += take;
    n -= take;
  }
}

std::string CheckpointReader::getString(uint64_t limit, const char* what) {
  auto n = get<uint64_t>();
  if (n > limit || n > left_) corrupt(concat(what, " of ", n, " bytes"));
  std::string s(n, '\0');
  read(s.data(), n);
  return s;
}

void writeAtomically(const std::string& path,
                     const std::function<void(int fd, const std::string& tmp)>& write) {
  removeStaleTemporaries(path);
  std::string tmp = temporaryFor(path);
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  MOO_ENFORCE(fd.get() >= 0, "replay checkpoint: cannot create ", tmp, ": ", std::strerror(errno));
  try {
    write(fd.get(), tmp);
    MOO_ENFORCE(::fsync(fd.get()) == 0, "replay checkpoint: fsync ", tmp, ": ",
                std::strerror(errno));
    ::close(fd.release());
    renameDurably(tmp, path);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

void removeStaleTemporaries(const std::string& path) {
  auto [dir, base] = splitPath(path);
  std::string prefix = base + ".tmp.";
  std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir.c_str()), ::closedir);
  if (!d) return;
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(d.get())) {
    std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    // "<pid>.<number>", digits only.
    std::string rest = name.substr(prefix.size());
    auto dot = rest.find('.');
    auto digits = [](const std::string& s) {
      return !s.empty() && s.size() <= 10 &&
             std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
    };
    if (dot == std::string::npos || !digits(rest.substr(0, dot)) || !digits(rest.substr(dot + 1)))
      continue;
    long pid = std::stol(rest.substr(0, dot));
    if (pid <= 0 || pid == ::getpid()) continue;
    if (::kill(pid_t(pid), 0) == -1 && errno == ESRCH) stale.push_back(dir + "/" + name);
  }
  for (auto& p : stale) ::unlink(p.c_str());
}

uint64_t readIncarnation(const std::string& file) {
  Fd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    MOO_ENFORCE(errno == ENOENT, "replay checkpoint: ", file, ": ", std::strerror(errno));
    return 0;
  }
  char buf[64];
  ssize_t n = ::read(fd.get(), buf, sizeof(buf));
  std::string text(buf, size_t(std::max<ssize_t>(n, 0)));
  std::string tag = kIncarnationTag;
  std::string number = text.substr(std::min(text.size(), tag.size()));
  if (!number.empty() && number.back() == '\n') number.pop_back();
  if (text.compare(0, tag.size(), tag) != 0 || number.empty() || number.size() > 5 ||
      !std::all_of(number.begin(), number.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    throw std::invalid_argument(concat("replay checkpoint: ", file, " is corrupt"));
  }
  return std::stoull(number);
}

void writeIncarnation(const std::string& file, uint64_t incarnation) {
  writeAtomically(file, [&](int fd, const std::string& tmp) {
    std::string text = concat(kIncarnationTag, incarnation, "\n");
    MOO_ENFORCE(::write(fd, text.data(), text.size()) == ssize_t(text.size()),
                "replay checkpoint: writing ", tmp, ": ", std::strerror(errno));
  });
}

}  // namespace moolib::replay
