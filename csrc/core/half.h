// 16-bit floating-point storage types of core/: IEEE binary16 ("half") and
// bfloat16, with bit-exact conversions to and from float that compile for
// the host and (under nvcc) the device, so that a CPU kernel and a GPU kernel
// round identically. TensorFlow-free and CUDA-header-free.
//
// The kernels of core/ never compute in a 16-bit type: they load a stored
// value into its accumulation type (Storage<T>::Acc: float for Half and
// BFloat16; T itself for float and double), do all the arithmetic there
// (sums, means, sqrtn, optimizer rules) and round once, to nearest even, when
// they store a result (Storage<T>::Store).
//
// Half and BFloat16 are layout-compatible with TensorFlow's Eigen::half and
// Eigen::bfloat16 (one uint16_t of bits each): the TF adapters pass tensor
// buffers by reinterpret_cast (tf/core_types.h).
#ifndef SOK_CORE_HALF_H_
#define SOK_CORE_HALF_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SOK_HOST_DEVICE __host__ __device__
#else
#define SOK_HOST_DEVICE
#endif

namespace sok {

// IEEE 754 binary16: 1 sign, 5 exponent, 10 mantissa bits.
struct Half {
  uint16_t bits;
};

// bfloat16: the top 16 bits of a float (1 sign, 8 exponent, 7 mantissa).
struct BFloat16 {
  uint16_t bits;
};

static_assert(sizeof(Half) == 2, "Half must be 16 bits");
static_assert(sizeof(BFloat16) == 2, "BFloat16 must be 16 bits");

namespace half_internal {

SOK_HOST_DEVICE inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

SOK_HOST_DEVICE inline float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

}  // namespace half_internal

// Exact (every binary16 value is a float).
SOK_HOST_DEVICE inline float HalfToFloat(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exponent = (h.bits >> 10) & 0x1Fu;
  uint32_t mantissa = h.bits & 0x3FFu;
  uint32_t out;
  if (exponent == 0x1F) {  // inf / NaN (payload kept)
    out = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {  // normal
    out = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {  // +-0
    out = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    out = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  return half_internal::BitsFloat(out);
}

// Round to nearest, ties to even; overflow gives inf, NaN stays NaN (quiet).
SOK_HOST_DEVICE inline Half FloatToHalf(float f) {
  const uint32_t x = half_internal::FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) {  // inf / NaN
    return Half{static_cast<uint16_t>(sign | (a > 0x7F800000u ? 0x7E00u
                                                              : 0x7C00u))};
  }
  if (a >= 0x477FF000u) {  // >= 65520: rounds to inf
    return Half{static_cast<uint16_t>(sign | 0x7C00u)};
  }
  if (a >= 0x38800000u) {  // >= 2^-14: a normal half
    const uint32_t r = a - 0x38000000u;  // rebias the exponent (127 -> 15)
    const uint32_t rounded = (r + 0xFFFu + ((r >> 13) & 1u)) >> 13;
    return Half{static_cast<uint16_t>(sign | rounded)};
  }
  if (a < 0x33000000u) {  // <= 2^-25: rounds to zero (2^-25 is a tie, to 0)
    return Half{sign};
  }
  // A subnormal half: q = value / 2^-24 = m * 2^(e - 126), rounded.
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // in [14, 24]
  uint32_t q = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (rest > halfway || (rest == halfway && (q & 1u) != 0)) ++q;
  return Half{static_cast<uint16_t>(sign | q)};
}

// Exact.
SOK_HOST_DEVICE inline float BFloat16ToFloat(BFloat16 b) {
  return half_internal::BitsFloat(static_cast<uint32_t>(b.bits) << 16);
}

// Round to nearest, ties to even; NaN stays NaN (quiet).
SOK_HOST_DEVICE inline BFloat16 FloatToBFloat16(float f) {
  const uint32_t x = half_internal::FloatBits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
    return BFloat16{static_cast<uint16_t>((x >> 16) | 0x0040u)};
  }
  return BFloat16{
      static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16)};
}

// How a kernel reads and writes a stored element: Acc is the type its
// arithmetic runs in; Load is exact; Store rounds to nearest even (the
// identity for float and double).
template <typename T>
struct Storage {
  using Acc = T;
  static SOK_HOST_DEVICE Acc Load(T x) { return x; }
  static SOK_HOST_DEVICE T Store(Acc x) { return x; }
};

template <>
struct Storage<Half> {
  using Acc = float;
  static SOK_HOST_DEVICE float Load(Half x) { return HalfToFloat(x); }
  static SOK_HOST_DEVICE Half Store(float x) { return FloatToHalf(x); }
};

template <>
struct Storage<BFloat16> {
  using Acc = float;
  static SOK_HOST_DEVICE float Load(BFloat16 x) { return BFloat16ToFloat(x); }
  static SOK_HOST_DEVICE BFloat16 Store(float x) { return FloatToBFloat16(x); }
};

template <typename T>
using AccOf = typename Storage<T>::Acc;

}  // namespace sok

#endif  // SOK_CORE_HALF_H_
