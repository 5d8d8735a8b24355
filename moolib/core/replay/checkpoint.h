// The replay table's checkpoint file: its encoding (a SHA-256 digest over
// everything before it, checked before a load parses anything), its bounds-
// checked reading, the atomic write of a file (temporary, fsync, rename,
// directory fsync), the temporaries a killed writer left, and the
// incarnation file next to a checkpoint. The table (replay/table.cc) and its
// item store say what goes in; docs/architecture.md (section "The replay
// table") has the layout.
#pragma once

#include <openssl/evp.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/socket.h"

namespace moolib::replay {

constexpr char kCheckpointMagic[8] = {'M', 'O', 'O', 'R', 'E', 'P', 'L', '\0'};
// 2: the table's incarnation, and each item's.
constexpr uint32_t kCheckpointVersion = 2;

// Bytes in a checkpoint's encoding, in memory: what a save copies under the
// table's lock.
class ByteWriter {
 public:
  void write(const void* data, size_t n) {
    auto* p = static_cast<const uint8_t*>(data);
    bytes_.insert(bytes_.end(), p, p + n);
  }
  template <typename T>
  void put(T v) {
    write(&v, sizeof(v));
  }
  void putString(const std::string& s) {
    put<uint64_t>(s.size());
    write(s.data(), s.size());
  }
  void reserve(size_t n) { bytes_.reserve(n); }
  const uint8_t* data() const { return bytes_.data(); }
  size_t size() const { return bytes_.size(); }

 private:
  std::vector<uint8_t> bytes_;
};

struct MdCtxFree {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};
using MdCtx = std::unique_ptr<EVP_MD_CTX, MdCtxFree>;

// Buffered writes to a file that hash everything written; finish() appends
// the digest.
class CheckpointWriter {
 public:
  CheckpointWriter(int fd, std::string path);
  void write(const void* data, size_t n);
  template <typename T>
  void put(T v) {
    write(&v, sizeof(v));
  }
  void finish();

 private:
  void raw(const void* data, size_t n);
  void flush();
  void writeAll(const uint8_t* p, size_t n);
  int fd_;
  std::string path_;
  MdCtx md_;
  std::vector<uint8_t> buf_;
};

// Reads a checkpoint, bounds-checking every length against what is left of
// the file; what it reads failing a check throws std::invalid_argument
// naming the file.
class CheckpointReader {
 public:
  // Opens the checkpoint at path and checks its magic and its digest over
  // the whole file before anything is parsed; reading goes on after the
  // magic.
  explicit CheckpointReader(const std::string& path);
  [[noreturn]] void corrupt(const std::string& what) const;
  void read(void* data, uint64_t n);
  template <typename T>
  T get() {
    T v;
    read(&v, sizeof(v));
    return v;
  }
  std::string getString(uint64_t limit, const char* what);
  // The bytes left before the digest.
  uint64_t left() const { return left_; }

 private:
  Fd fd_;
  std::string path_;
  uint64_t left_ = 0;
  uint8_t buf_[1 << 16];
  size_t pos_ = 0, len_ = 0;
};

// Writes `path` atomically and durably: `write` fills a fresh temporary next
// to it (given its descriptor and name), which is then fsynced, renamed over
// `path` and the directory fsynced; the temporary is removed if anything
// throws. The stale temporaries of `path` are removed first.
void writeAtomically(const std::string& path,
                     const std::function<void(int fd, const std::string& tmp)>& write);

// Removes the temporaries of `path` (as writeAtomically names them) whose
// writer is dead: left by a process killed while it wrote. Another file,
// or one of a live process, is never touched.
void removeStaleTemporaries(const std::string& path);

// The incarnation file next to a checkpoint holds the last incarnation a
// load of it began, written before that table hands out a key. 0 when there
// is no such file; throws std::invalid_argument if it is corrupt.
uint64_t readIncarnation(const std::string& file);
void writeIncarnation(const std::string& file, uint64_t incarnation);

}  // namespace moolib::replay
