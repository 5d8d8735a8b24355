#include "collectives/reduce.h"

#include <cstring>
#include <type_traits>

#include "runtime/error.h"

namespace moolib {

namespace {

struct DTypeInfo {
  const char* name;
  size_t size;
};

constexpr DTypeInfo kInfo[] = {
    {"float32", 4}, {"float64", 8}, {"float16", 2},   {"bfloat16", 2},
    {"int8", 1},    {"int16", 2},   {"int32", 4},     {"int64", 8},
    {"uint8", 1},   {"bool", 1},    {"complex64", 8}, {"complex128", 16},
};
static_assert(sizeof(kInfo) / sizeof(kInfo[0]) == size_t(DType::kCount), "one entry per dtype");

float halfToFloat(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    // Subnormal half: normalise into a float.
    int shift = 0;
    while (!(mant & 0x400)) {
      mant <<= 1;
      ++shift;
    }
    bits = sign | (uint32_t(113 - shift) << 23) | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t floatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t absx = x & 0x7fffffff;
  if (absx > 0x7f800000) return uint16_t(sign | 0x7e00);   // NaN
  if (absx >= 0x477ff000) return uint16_t(sign | 0x7c00);  // overflows to infinity
  if (absx < 0x38800000) {
    // Subnormal or zero in half precision: round to nearest even at 2^-24.
    if (absx < 0x33000000) return uint16_t(sign);
    uint32_t mant = (absx & 0x7fffff) | 0x800000;
    int shift = 126 - int(absx >> 23);  // 14..24
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t rounded = absx + 0xfff + ((absx >> 13) & 1) - (112u << 23);
  return uint16_t(sign | (rounded >> 13));
}

float bf16ToFloat(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t floatToBf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return uint16_t((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fff + ((x >> 16) & 1);
  return uint16_t(x >> 16);
}

// The compiler vectorises these loops; the aligned variant lets it skip the
// memcpy dance, the other keeps unaligned access defined.
template <typename T>
void sumPlain(uint8_t* dst, const uint8_t* src, size_t count) {
  if (reinterpret_cast<uintptr_t>(dst) % alignof(T) == 0 &&
      reinterpret_cast<uintptr_t>(src) % alignof(T) == 0) {
    T* __restrict d = reinterpret_cast<T*>(dst);
    const T* __restrict s = reinterpret_cast<const T*>(src);
    for (size_t i = 0; i != count; ++i) d[i] = T(d[i] + s[i]);
    return;
  }
  for (size_t i = 0; i != count; ++i) {
    T a, b;
    std::memcpy(&a, dst + i * sizeof(T), sizeof(T));
    std::memcpy(&b, src + i * sizeof(T), sizeof(T));
    a = T(a + b);
    std::memcpy(dst + i * sizeof(T), &a, sizeof(T));
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void sumHalf(uint8_t* dst, const uint8_t* src, size_t count) {
  for (size_t i = 0; i != count; ++i) {
    uint16_t a, b;
    std::memcpy(&a, dst + 2 * i, 2);
    std::memcpy(&b, src + 2 * i, 2);
    uint16_t r = FromFloat(ToFloat(a) + ToFloat(b));
    std::memcpy(dst + 2 * i, &r, 2);
  }
}

void sumBool(uint8_t* dst, const uint8_t* src, size_t count) {
  for (size_t i = 0; i != count; ++i) dst[i] = uint8_t((dst[i] | src[i]) != 0);
}

}  // namespace

DType dtypeFromName(const std::string& name) {
  for (size_t i = 0; i != size_t(DType::kCount); ++i) {
    if (name == kInfo[i].name) return DType(i);
  }
  throw Exception(concat("all_reduce cannot sum elements of type '", name, "'"));
}

const char* dtypeName(DType dtype) {
  return size_t(dtype) < size_t(DType::kCount) ? kInfo[size_t(dtype)].name : "?";
}

size_t dtypeSize(DType dtype) {
  MOO_ENFORCE(size_t(dtype) < size_t(DType::kCount), "unknown element type ", int(dtype));
  return kInfo[size_t(dtype)].size;
}

void sumInto(DType dtype, uint8_t* dst, const uint8_t* src, size_t count) {
  switch (dtype) {
    case DType::kFloat32:
      return sumPlain<float>(dst, src, count);
    case DType::kFloat64:
      return sumPlain<double>(dst, src, count);
    case DType::kFloat16:
      return sumHalf<halfToFloat, floatToHalf>(dst, src, count);
    case DType::kBFloat16:
      return sumHalf<bf16ToFloat, floatToBf16>(dst, src, count);
    // Signed integers wrap like two's complement (unsigned arithmetic keeps
    // overflow defined).
    case DType::kInt8:
      return sumPlain<uint8_t>(dst, src, count);
    case DType::kInt16:
      return sumPlain<uint16_t>(dst, src, count);
    case DType::kInt32:
      return sumPlain<uint32_t>(dst, src, count);
    case DType::kInt64:
      return sumPlain<uint64_t>(dst, src, count);
    case DType::kUInt8:
      return sumPlain<uint8_t>(dst, src, count);
    case DType::kBool:
      return sumBool(dst, src, count);
    // A complex sum is the sum of its real and imaginary parts.
    case DType::kComplex64:
      return sumPlain<float>(dst, src, count * 2);
    case DType::kComplex128:
      return sumPlain<double>(dst, src, count * 2);
    case DType::kCount:
      break;
  }
  throw Exception(concat("unknown element type ", int(dtype)));
}

}  // namespace moolib
