// CPU versions of core/blocks.h: parallel over the rows of the gathered
// (or scattered) blocks, through the device's ParallelFor.

#include "core/blocks.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

namespace sok {
namespace blocks {
namespace {

// Rough cycles per byte copied, for the parallel-for cost model.
int64_t RowCost(int64_t row_bytes) { return std::max<int64_t>(1, row_bytes); }

std::string BlockName(int64_t i, const int64_t* starts,
                      const int64_t* lengths) {
  return "block " + std::to_string(i) + " (start " +
         std::to_string(starts[i]) + ", length " + std::to_string(lengths[i]) +
         ")";
}

// offsets[i] = lengths[0] + ... + lengths[i - 1], i <= num_blocks; the
// lengths have been checked (no overflow).
std::vector<int64_t> Offsets(const int64_t* lengths, int64_t num_blocks) {
  std::vector<int64_t> offsets(num_blocks + 1, 0);
  for (int64_t i = 0; i < num_blocks; ++i) {
    offsets[i + 1] = offsets[i] + lengths[i];
  }
  return offsets;
}

// Calls copy(block, first row within the block, rows) for the rows
// [begin, end) of the concatenated blocks.
template <typename Fn>
void ForRows(const std::vector<int64_t>& offsets, int64_t begin, int64_t end,
             const Fn& copy) {
  int64_t j = std::upper_bound(offsets.begin(), offsets.end(), begin) -
              offsets.begin() - 1;
  int64_t row = begin;
  while (row < end) {
    while (offsets[j + 1] <= row) ++j;  // skip empty blocks
    const int64_t stop = std::min(end, offsets[j + 1]);
    copy(j, row - offsets[j], stop - row, row);
    row = stop;
  }
}

}  // namespace

Status CheckBlocks(const int64_t* starts, const int64_t* lengths,
                   int64_t num_blocks, int64_t num_rows, bool disjoint,
                   int64_t* total) {
  int64_t sum = 0;
  for (int64_t i = 0; i < num_blocks; ++i) {
    const int64_t s = starts[i];
    const int64_t l = lengths[i];
    if (s < 0 || l < 0 || s > num_rows || l > num_rows - s) {
      return Status::InvalidArgument(
          BlockName(i, starts, lengths) + " is out of range for " +
          std::to_string(num_rows) + " rows");
    }
    if (__builtin_add_overflow(sum, l, &sum)) {
      return Status::InvalidArgument("the total length of the blocks "
                                     "overflows int64");
    }
  }
  if (disjoint) {
    std::vector<int64_t> order;
    for (int64_t i = 0; i < num_blocks; ++i) {
      if (lengths[i] > 0) order.push_back(i);
    }
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return starts[a] < starts[b];
    });
    for (size_t k = 1; k < order.size(); ++k) {
      const int64_t a = order[k - 1];
      const int64_t b = order[k];
      if (starts[a] + lengths[a] > starts[b]) {
        return Status::InvalidArgument(
            BlockName(std::min(a, b), starts, lengths) + " and " +
            BlockName(std::max(a, b), starts, lengths) +
            " overlap (the blocks must be disjoint)");
      }
    }
  }
  *total = sum;
  return Status::Ok();
}

Status GatherBlocksFunctor<CpuDevice>::operator()(
    const CpuDevice& d, const char* values, int64_t row_bytes,
    const int64_t* starts, const int64_t* lengths, int64_t num_blocks,
    char* out) {
  if (row_bytes <= 0 || num_blocks <= 0) return Status::Ok();
  const std::vector<int64_t> offsets = Offsets(lengths, num_blocks);
  d.parallel_for(
      offsets[num_blocks], RowCost(row_bytes), [&](int64_t begin, int64_t end) {
        ForRows(offsets, begin, end,
                [&](int64_t j, int64_t pos, int64_t rows, int64_t row) {
                  std::memcpy(out + row * row_bytes,
                              values + (starts[j] + pos) * row_bytes,
                              rows * row_bytes);
                });
      });
  return Status::Ok();
}

Status ScatterBlocksFunctor<CpuDevice>::operator()(
    const CpuDevice& d, const char* grad, int64_t row_bytes,
    const int64_t* starts, const int64_t* lengths, int64_t num_blocks,
    int64_t num_rows, char* out) {
  if (row_bytes <= 0) return Status::Ok();
  d.parallel_for(num_rows, RowCost(row_bytes), [&](int64_t begin, int64_t end) {
    std::memset(out + begin * row_bytes, 0, (end - begin) * row_bytes);
  });
  if (num_blocks <= 0) return Status::Ok();
  const std::vector<int64_t> offsets = Offsets(lengths, num_blocks);
  d.parallel_for(
      offsets[num_blocks], RowCost(row_bytes), [&](int64_t begin, int64_t end) {
        ForRows(offsets, begin, end,
                [&](int64_t j, int64_t pos, int64_t rows, int64_t row) {
                  std::memcpy(out + (starts[j] + pos) * row_bytes,
                              grad + row * row_bytes, rows * row_bytes);
                });
      });
  return Status::Ok();
}

}  // namespace blocks
}  // namespace sok
