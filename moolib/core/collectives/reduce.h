// The arithmetic of all-reduce: element types as they cross the wire, and
// summing one block of them into another.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moolib {

// Element types of reduced buffers. The numbering is part of the wire format.
enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt8 = 4,
  kInt16 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kUInt8 = 8,
  kBool = 9,
  kComplex64 = 10,
  kComplex128 = 11,
  kCount = 12,
};

// Throws on an unknown name; names are torch's ("float32", "bfloat16", ...).
DType dtypeFromName(const std::string& name);
const char* dtypeName(DType dtype);
size_t dtypeSize(DType dtype);

// dst[i] += src[i] for count elements (bool: logical or; integers wrap).
// Either pointer may be unaligned.
void sumInto(DType dtype, uint8_t* dst, const uint8_t* src, size_t count);

}  // namespace moolib
