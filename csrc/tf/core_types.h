// Maps TensorFlow's element types to the storage types of core/
// (core/half.h): Eigen::half -> sok::Half, Eigen::bfloat16 -> sok::BFloat16
// (layout-compatible 16-bit types, passed by reinterpret_cast), float and
// double to themselves. Also the TensorFlow type of the accumulation type
// (slots and hyperparameters of the sparse optimizers).
#ifndef SOK_TF_CORE_TYPES_H_
#define SOK_TF_CORE_TYPES_H_

#include <type_traits>

#include "core/half.h"
#include "tensorflow/core/framework/numeric_types.h"

namespace sok {

template <typename T>
struct CoreTypeOf {
  using type = T;
};
template <>
struct CoreTypeOf<Eigen::half> {
  using type = Half;
};
template <>
struct CoreTypeOf<Eigen::bfloat16> {
  using type = BFloat16;
};

// The core/ type of the TF element type T.
template <typename T>
using CoreT = typename CoreTypeOf<T>::type;

static_assert(sizeof(Eigen::half) == sizeof(Half) &&
                  alignof(Eigen::half) == alignof(Half),
              "Eigen::half and sok::Half must be layout-compatible");
static_assert(sizeof(Eigen::bfloat16) == sizeof(BFloat16) &&
                  alignof(Eigen::bfloat16) == alignof(BFloat16),
              "Eigen::bfloat16 and sok::BFloat16 must be layout-compatible");

template <typename T>
CoreT<T>* CorePtr(T* p) {
  return reinterpret_cast<CoreT<T>*>(p);
}
template <typename T>
const CoreT<T>* CorePtr(const T* p) {
  return reinterpret_cast<const CoreT<T>*>(p);
}

// The accumulation type of T as a TF (and core) type: float for the 16-bit
// types, T for float and double.
template <typename T>
using TfAccOf = AccOf<CoreT<T>>;

}  // namespace sok

#endif  // SOK_TF_CORE_TYPES_H_
