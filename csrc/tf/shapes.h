// Output shapes sized by input values (a count, a number of rows, another
// input's dimensions), built with an error instead of TensorShape's CHECK,
// which aborts the process where a dimension is negative or the number of
// elements overflows int64 (QA: `segment_combine(..., num_segments=2**62)`
// killed the Python process).
#ifndef SOK_TF_SHAPES_H_
#define SOK_TF_SHAPES_H_

#include <cstdint>
#include <initializer_list>
#include <string>

#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/lib/core/errors.h"

namespace sok {

// The shape `dims`, or InvalidArgument (prefixed by `where`) naming them.
inline absl::Status CheckedShape(const std::string& where,
                                 std::initializer_list<int64_t> dims,
                                 ::tensorflow::TensorShape* shape) {
  const absl::Status status =
      ::tensorflow::TensorShape::BuildTensorShape(dims, shape);
  if (status.ok()) return status;
  return ::tensorflow::errors::InvalidArgument(
      where, "the output's shape cannot be made: ", status.message());
}

// `like` with dimension 0 set to `rows` ([rows] + like[1:]), or
// InvalidArgument as CheckedShape.
inline absl::Status CheckedRowsShape(const std::string& where,
                                     const ::tensorflow::TensorShape& like,
                                     int64_t rows,
                                     ::tensorflow::TensorShape* shape) {
  *shape = like;
  const absl::Status status = shape->SetDimWithStatus(0, rows);
  if (status.ok()) return status;
  return ::tensorflow::errors::InvalidArgument(
      where, "the output's shape cannot be made: ", status.message());
}

// The bytes of one row of `shape` (the product of its dimensions after the
// first, times `elem_bytes`) in *bytes, or InvalidArgument where that
// overflows int64 (a tensor of 0 rows can have rows of any width).
inline absl::Status RowBytes(const std::string& where,
                             const ::tensorflow::TensorShape& shape,
                             int64_t elem_bytes, int64_t* bytes) {
  *bytes = elem_bytes;
  for (int d = 1; d < shape.dims(); ++d) {
    const int64_t size = shape.dim_size(d);
    if (size != 0 && *bytes > INT64_MAX / size) {
      return ::tensorflow::errors::InvalidArgument(
          where, "the rows of shape ", shape.DebugString(),
          " are too wide: their bytes overflow int64");
    }
    *bytes *= size;
  }
  return absl::OkStatus();
}

}  // namespace sok

#endif  // SOK_TF_SHAPES_H_
