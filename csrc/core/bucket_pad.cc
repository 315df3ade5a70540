#include "core/bucket_pad.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace sok {
namespace bucket {
namespace {

// Rough cycles per byte copied, for the parallel-for cost model.
constexpr int64_t kCyclesPerByte = 1;

int64_t RowCost(int64_t row_bytes) {
  return std::max<int64_t>(1, row_bytes * kCyclesPerByte);
}

}  // namespace

Status BucketExponent(const int64_t* counts, int64_t num_ranks,
                      int64_t* exponent) {
  int64_t max_count = 1;
  for (int64_t i = 0; i < num_ranks; ++i) {
    for (int64_t j = 0; j < num_ranks; ++j) {
      const int64_t c = counts[i * num_ranks + j];
      if (c < 0) {
        return Status::Error("counts_matrix[" + std::to_string(i) + ", " +
                             std::to_string(j) + "] is negative (" +
                             std::to_string(c) + ")");
      }
      max_count = std::max(max_count, c);
    }
  }
  if (max_count > (int64_t{1} << kMaxExponent)) {
    return Status::Error("the largest count (" + std::to_string(max_count) +
                         ") exceeds the largest bucket (2^" +
                         std::to_string(kMaxExponent) + ")");
  }
  int64_t e = 0;
  while ((int64_t{1} << e) < max_count) ++e;
  *exponent = e;
  return Status::Ok();
}

Status CountSum(const int64_t* counts, int64_t num_ranks, int64_t rank,
                bool row, int64_t* sum) {
  int64_t total = 0;
  for (int64_t j = 0; j < num_ranks; ++j) {
    const int64_t c =
        row ? counts[rank * num_ranks + j] : counts[j * num_ranks + rank];
    if (__builtin_add_overflow(total, c, &total)) {
      return Status::Error(std::string("sum(counts_matrix") +
                           (row ? "[rank, :]" : "[:, rank]") +
                           ") overflows int64");
    }
  }
  *sum = total;
  return Status::Ok();
}

Status CheckPaddedSize(int64_t num_ranks, int64_t exponent,
                       int64_t row_bytes) {
  int64_t rows = 0;
  int64_t bytes = 0;
  if (exponent < 0 || exponent > kMaxExponent ||
      __builtin_mul_overflow(num_ranks, int64_t{1} << exponent, &rows) ||
      __builtin_mul_overflow(rows, std::max<int64_t>(row_bytes, 1), &bytes)) {
    return Status::Error("the padded buffer (" + std::to_string(num_ranks) +
                         " x 2^" + std::to_string(exponent) + " rows of " +
                         std::to_string(row_bytes) +
                         " bytes) is too large");
  }
  return Status::Ok();
}

void BucketPad(const char* x, int64_t row_bytes, const int64_t* counts,
               int64_t num_ranks, int64_t rank, int64_t bucket,
               const ParallelFor& parallel_for, char* padded) {
  if (row_bytes <= 0) return;
  const int64_t* send = counts + rank * num_ranks;
  std::vector<int64_t> offset(num_ranks + 1, 0);
  for (int64_t j = 0; j < num_ranks; ++j) offset[j + 1] = offset[j] + send[j];
  const int64_t total = num_ranks * bucket;
  parallel_for(total, RowCost(row_bytes), [&](int64_t begin, int64_t end) {
    int64_t slot = begin;
    while (slot < end) {
      const int64_t j = slot / bucket;
      const int64_t lo = slot - j * bucket;
      const int64_t hi = std::min(bucket, end - j * bucket);
      const int64_t n = send[j];
      char* dst = padded + slot * row_bytes;
      if (lo < n) {
        const int64_t copy = std::min(hi, n) - lo;
        std::memcpy(dst, x + (offset[j] + lo) * row_bytes, copy * row_bytes);
        dst += copy * row_bytes;
      }
      const int64_t zero_from = std::max(lo, n);
      if (zero_from < hi) {
        std::memset(dst, 0, (hi - zero_from) * row_bytes);
      }
      slot = j * bucket + hi;
    }
  });
}

void BucketUnpad(const char* received, int64_t row_bytes,
                 const int64_t* counts, int64_t num_ranks, int64_t rank,
                 int64_t bucket, const ParallelFor& parallel_for, char* out) {
  if (row_bytes <= 0) return;
  std::vector<int64_t> offset(num_ranks + 1, 0);
  for (int64_t j = 0; j < num_ranks; ++j) {
    offset[j + 1] = offset[j] + counts[j * num_ranks + rank];
  }
  const int64_t total = offset[num_ranks];
  parallel_for(total, RowCost(row_bytes), [&](int64_t begin, int64_t end) {
    // The first source block that holds row `begin`.
    int64_t j = std::upper_bound(offset.begin(), offset.end(), begin) -
                offset.begin() - 1;
    int64_t row = begin;
    while (row < end) {
      while (offset[j + 1] <= row) ++j;  // skip empty blocks
      const int64_t stop = std::min(end, offset[j + 1]);
      const int64_t pos = row - offset[j];
      std::memcpy(out + row * row_bytes,
                  received + (j * bucket + pos) * row_bytes,
                  (stop - row) * row_bytes);
      row = stop;
    }
  });
}

}  // namespace bucket
}  // namespace sok
