/*!
 * \file ccl/ccl_reduce.cc
 * \brief Element-wise reductions over the buffers of k workers, for every dtype the cpu collective
 * backend reduces (see ccl_reduce.h).
 */
#include "ccl/ccl_reduce.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "ccl/ccl_util.h"

namespace tvm_ext {
namespace ccl {

const char* ReduceKindName(int kind) {
  static const char* names[] = {"sum", "prod", "min", "max", "avg"};
  return (kind >= 0 && kind <= 4) ? names[kind] : "unknown";
}

namespace {

template <typename To, typename From>
To BitCast(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}

}  // namespace

float HalfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  if (exp == 0x1f) return BitCast<float>(sign | 0x7f800000u | (man << 13));  // inf, nan
  return BitCast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t FloatToHalf(float f) {
  uint32_t x = BitCast<uint32_t>(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (ax < 0x38800000u) {                        // below 2^-14: a subnormal half (or zero)
    float scaled = BitCast<float>(ax) * 16777216.0f;  // exact: a power-of-two scaling
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  uint32_t rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
  return sign | static_cast<uint16_t>(h);
}

float BFloatToFloat(uint16_t b) { return BitCast<float>(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBFloat(float f) {
  uint32_t x = BitCast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // nan
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

namespace {

/*! \brief One reduction step on the accumulator type (integers wrap around, as on GPUs). */
template <typename A, int K>
inline A Apply(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
    if constexpr (K == kSum || K == kAvg) return a + b;
    if constexpr (K == kProd) return a * b;
    if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<A>::quiet_NaN();
    if constexpr (K == kMin) return b < a ? b : a;
    return b > a ? b : a;
  } else {
    using U = std::conditional_t<(sizeof(A) < 4), uint32_t, std::make_unsigned_t<A>>;
    if constexpr (K == kSum || K == kAvg) {
      return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
    }
    if constexpr (K == kProd) return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
    if constexpr (K == kMin) return b < a ? b : a;
    return b > a ? b : a;
  }
}

template <typename T>
struct PlainType {
  using Storage = T;
  using Acc = T;
  static Acc Load(T v) { return v; }
  static T Store(Acc a) { return a; }
  template <int K>
  static Acc Combine(Acc a, Acc b) {
    return Apply<Acc, K>(a, b);
  }
};

struct HalfType {
  using Storage = uint16_t;
  using Acc = float;
  static Acc Load(uint16_t v) { return HalfToFloat(v); }
  static uint16_t Store(Acc a) { return FloatToHalf(a); }
  template <int K>
  static Acc Combine(Acc a, Acc b) {
    return Apply<Acc, K>(a, b);
  }
};

struct BFloatType {
  using Storage = uint16_t;
  using Acc = float;
  static Acc Load(uint16_t v) { return BFloatToFloat(v); }
  static uint16_t Store(Acc a) { return FloatToBFloat(a); }
  template <int K>
  static Acc Combine(Acc a, Acc b) {
    return Apply<Acc, K>(a, b);
  }
};

/*! \brief bool: sum and max are "any", prod and min are "all". */
struct BoolType {
  using Storage = uint8_t;
  using Acc = uint8_t;
  static Acc Load(uint8_t v) { return v != 0; }
  static uint8_t Store(Acc a) { return a; }
  template <int K>
  static Acc Combine(Acc a, Acc b) {
    return (K == kProd || K == kMin) ? (a & b) : (a | b);
  }
};

/*!
 * \brief Reduce elements [lo, hi) over all senders in rank order and write the result into every
 * receiver. A block is read from all senders before it is written, so send == recv is safe.
 */
template <typename Traits, int K>
void ReduceSlice(const void* const* sends, void* const* recvs, int n, int64_t lo, int64_t hi) {
  using S = typename Traits::Storage;
  using A = typename Traits::Acc;
  constexpr int64_t kBlock = 512;
  A acc[kBlock];
  for (int64_t begin = lo; begin < hi; begin += kBlock) {
    int64_t m = std::min(kBlock, hi - begin);
    const S* first = static_cast<const S*>(sends[0]) + begin;
    for (int64_t i = 0; i < m; ++i) acc[i] = Traits::Load(first[i]);
    for (int r = 1; r < n; ++r) {
      const S* src = static_cast<const S*>(sends[r]) + begin;
      for (int64_t i = 0; i < m; ++i) {
        acc[i] = Traits::template Combine<K>(acc[i], Traits::Load(src[i]));
      }
    }
    if constexpr (K == kAvg) {
      for (int64_t i = 0; i < m; ++i) acc[i] = static_cast<A>(acc[i] / static_cast<A>(n));
    }
    for (int r = 0; r < n; ++r) {
      S* dst = static_cast<S*>(recvs[r]) + begin;
      for (int64_t i = 0; i < m; ++i) dst[i] = Traits::Store(acc[i]);
    }
  }
}

template <typename Traits>
ReduceFn ForKind(int kind) {
  switch (kind) {
    case kSum:
      return &ReduceSlice<Traits, kSum>;
    case kProd:
      return &ReduceSlice<Traits, kProd>;
    case kMin:
      return &ReduceSlice<Traits, kMin>;
    case kMax:
      return &ReduceSlice<Traits, kMax>;
    case kAvg:
      return &ReduceSlice<Traits, kAvg>;
  }
  return nullptr;
}

}  // namespace

/*! \brief The reduction for a dtype and kind, or nullptr with the reason in `why`. */
ReduceFn FindReduce(DLDataType t, int kind, std::string* why) {
  if (kind < 0 || kind > 4) {
    *why = "unknown reduce kind " + std::to_string(kind) +
           " (TVM numbers sum=0 prod=1 min=2 max=3 avg=4)";
    return nullptr;
  }
  if (t.lanes != 1) {
    *why = "vector dtype " + DTypeName(t) + " cannot be reduced";
    return nullptr;
  }
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 16) return ForKind<HalfType>(kind);
      if (t.bits == 32) return ForKind<PlainType<float>>(kind);
      if (t.bits == 64) return ForKind<PlainType<double>>(kind);
      break;
    case kDLBfloat:
      if (t.bits == 16) return ForKind<BFloatType>(kind);
      break;
    case kDLInt:
      if (t.bits == 8) return ForKind<PlainType<int8_t>>(kind);
      if (t.bits == 16) return ForKind<PlainType<int16_t>>(kind);
      if (t.bits == 32) return ForKind<PlainType<int32_t>>(kind);
      if (t.bits == 64) return ForKind<PlainType<int64_t>>(kind);
      break;
    case kDLUInt:
      if (t.bits == 8) return ForKind<PlainType<uint8_t>>(kind);
      if (t.bits == 16) return ForKind<PlainType<uint16_t>>(kind);
      if (t.bits == 32) return ForKind<PlainType<uint32_t>>(kind);
      if (t.bits == 64) return ForKind<PlainType<uint64_t>>(kind);
      break;
    case kDLBool:
      if (kind == kAvg) {
        *why = "avg of bool is not defined (use sum/max for any, prod/min for all)";
        return nullptr;
      }
      if (t.bits == 8) return ForKind<BoolType>(kind);
      break;
    default:
      break;
  }
  *why = "allreduce does not support dtype " + DTypeName(t) +
         " (supported: float16/32/64, bfloat16, int8-64, uint8-64, bool)";
  return nullptr;
}

}  // namespace ccl
}  // namespace tvm_ext
