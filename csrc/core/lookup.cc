#include "core/lookup.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

namespace sok {
namespace lookup {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// Lowers `target` to `value` if `value` is smaller (lock-free).
void AtomicMin(std::atomic<int64_t>* target, int64_t value) {
  int64_t current = target->load(std::memory_order_relaxed);
  while (value < current &&
         !target->compare_exchange_weak(current, value,
                                        std::memory_order_relaxed)) {
  }
}

void RunParallel(const ParallelFor& parallel_for, int64_t n,
                 int64_t cost_per_unit,
                 const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (parallel_for) {
    parallel_for(n, cost_per_unit, fn);
  } else {
    fn(0, n);
  }
}

// ----------------------------------------------------------------------------
// Deduplication.

// Hash-based dedup splits the ids into 2^kPartitionBits partitions by the
// top bits of their hash and deduplicates the partitions in parallel.
constexpr int kPartitionBits = 3;
constexpr uint64_t kHashMultiplier = 0x9E3779B97F4A7C15ull;

inline uint64_t HashId(int64_t key) {
  return static_cast<uint64_t>(key) * kHashMultiplier;
}

// Maps each distinct id to the index of its first appearance. Open
// addressing with linear probing; grows to keep the load factor <= 1/2.
// Slots are chosen by the hash bits below the partition bits.
class FirstAppearanceTable {
 public:
  explicit FirstAppearanceTable(int64_t expected) {
    int bits = 4;
    while ((int64_t{1} << bits) < 2 * expected && bits < 62) ++bits;
    Resize(bits);
  }

  // Returns the index of `key`, inserting it as keys->size() if new.
  int32_t FindOrInsert(int64_t key, std::vector<int64_t>* keys) {
    uint64_t slot = Hash(key);
    while (true) {
      Slot& s = slots_[slot];
      if (s.key == key) return s.index;
      if (s.key == kEmpty) {
        const int32_t index = static_cast<int32_t>(keys->size());
        s.key = key;
        s.index = index;
        keys->push_back(key);
        if (2 * keys->size() > slots_.size()) Grow(*keys);
        return index;
      }
      slot = (slot + 1) & mask_;
    }
  }

  static constexpr int64_t kEmpty = -1;
  struct Slot {
    int64_t key;
    int32_t index;
  };

  void Prefetch(int64_t key) const { __builtin_prefetch(&slots_[Hash(key)]); }

 private:
  uint64_t Hash(int64_t key) const {
    return (HashId(key) << kPartitionBits) >> shift_;
  }

  void Resize(int bits) {
    slots_.assign(size_t{1} << bits, Slot{kEmpty, 0});
    mask_ = (uint64_t{1} << bits) - 1;
    shift_ = 64 - bits;
    bits_ = bits;
  }

  void Grow(const std::vector<int64_t>& keys) {
    Resize(bits_ + 1);
    for (size_t i = 0; i < keys.size(); ++i) {
      uint64_t slot = Hash(keys[i]);
      while (slots_[slot].key != kEmpty) slot = (slot + 1) & mask_;
      slots_[slot] = Slot{keys[i], static_cast<int32_t>(i)};
    }
  }

  std::vector<Slot> slots_;
  uint64_t mask_ = 0;
  int shift_ = 0;
  int bits_ = 0;
};

struct KeyIndex {
  uint64_t key;   // Sort key: ascending key is the required output order.
  int64_t index;  // Index of first appearance.
};

// Sorts items by key (all keys in [0, max_key]) with a stable LSD radix
// sort over 11-bit digits.
void RadixSort(std::vector<KeyIndex>* items, uint64_t max_key) {
  constexpr int kBits = 11;
  constexpr size_t kBuckets = size_t{1} << kBits;
  const size_t n = items->size();
  std::vector<KeyIndex> buffer(n);
  KeyIndex* from = items->data();
  KeyIndex* to = buffer.data();
  std::vector<size_t> offsets(kBuckets);
  for (int shift = 0; shift < 64 && (max_key >> shift) != 0; shift += kBits) {
    std::fill(offsets.begin(), offsets.end(), 0);
    for (size_t i = 0; i < n; ++i) {
      ++offsets[(from[i].key >> shift) &
                (kBuckets - 1)];
    }
    size_t sum = 0;
    for (size_t& offset : offsets) {
      const size_t count = offset;
      offset = sum;
      sum += count;
    }
    for (size_t i = 0; i < n; ++i) {
      const size_t digit =
          (from[i].key >> shift) & (kBuckets - 1);
      to[offsets[digit]++] = from[i];
    }
    std::swap(from, to);
  }
  if (from != items->data()) std::copy(from, from + n, items->data());
}

// Where ids live. The output order is by rank, then by local row (which is
// the order of the ids within a rank).
struct Layout {
  int64_t num_ranks;
  int64_t owner;
  int64_t Rank(int64_t id) const {
    return owner >= 0 ? owner : id % num_ranks;
  }
  int64_t LocalRow(int64_t id) const {
    return owner >= 0 ? id : id / num_ranks;
  }
};

// Dedup through a direct-address table over [0, max_id]; used when the id
// range is small relative to nnz. Produces the output order without sorting.
template <typename Tid>
void DedupDirect(const Tid* ids, int64_t nnz, int64_t max_id,
                 const Layout& layout, const ParallelFor& parallel_for,
                 int32_t* inverse, DedupResult* result) {
  const int64_t span = max_id + 1;
  // slot[id]: -1 if id is not looked up, else (after marking) its index.
  std::vector<int32_t> slot(span, -1);
  for (int64_t i = 0; i < nnz; ++i) slot[ids[i]] = 0;
  int32_t next = 0;
  auto visit = [&](int64_t id) {  // Called once per id, in output order.
    if (slot[id] < 0) return;
    slot[id] = next++;
    result->unique_ids.push_back(id);
    result->local_rows.push_back(layout.LocalRow(id));
    ++result->counts[layout.Rank(id)];
  };
  if (layout.owner >= 0) {
    for (int64_t id = 0; id < span; ++id) visit(id);
  } else {
    for (int64_t r = 0; r < layout.num_ranks && r < span; ++r) {
      for (int64_t id = r; id < span; id += layout.num_ranks) visit(id);
    }
  }
  RunParallel(parallel_for, nnz, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) inverse[i] = slot[ids[i]];
  });
}

template <typename Tid>
void DedupHashed(const Tid* ids, int64_t nnz, const Layout& layout,
                 const ParallelFor& parallel_for, int32_t* inverse,
                 DedupResult* result) {
  // 1. Group the positions by partition (a counting sort).
  constexpr int64_t kPartitions = int64_t{1} << kPartitionBits;
  auto partition_of = [ids](int64_t i) {
    return static_cast<int64_t>(HashId(static_cast<int64_t>(ids[i])) >>
                                (64 - kPartitionBits));
  };
  std::vector<int64_t> part_offsets(kPartitions + 1, 0);
  for (int64_t i = 0; i < nnz; ++i) ++part_offsets[partition_of(i) + 1];
  for (int64_t p = 0; p < kPartitions; ++p) {
    part_offsets[p + 1] += part_offsets[p];
  }
  std::vector<int32_t> positions(nnz);
  {
    std::vector<int64_t> fill(part_offsets.begin(), part_offsets.end() - 1);
    for (int64_t i = 0; i < nnz; ++i) {
      positions[fill[partition_of(i)]++] = static_cast<int32_t>(i);
    }
  }

  // 2. Deduplicate each partition; inverse points into its distinct ids.
  std::vector<std::vector<int64_t>> part_keys(kPartitions);
  RunParallel(parallel_for, kPartitions, nnz / kPartitions * 100,
              [&](int64_t begin, int64_t end) {
    constexpr int64_t kAhead = 8;
    for (int64_t p = begin; p < end; ++p) {
      const int32_t* pos = positions.data() + part_offsets[p];
      const int64_t count = part_offsets[p + 1] - part_offsets[p];
      std::vector<int64_t>* keys = &part_keys[p];
      FirstAppearanceTable table(std::min<int64_t>(count, int64_t{1} << 20));
      for (int64_t k = 0; k < count; ++k) {
        if (k + kAhead < count) {
          table.Prefetch(static_cast<int64_t>(ids[pos[k + kAhead]]));
        }
        inverse[pos[k]] =
            table.FindOrInsert(static_cast<int64_t>(ids[pos[k]]), keys);
      }
    }
  });

  // 3. Concatenate the partitions' distinct ids; shift the inverse.
  std::vector<int64_t> key_offsets(kPartitions + 1, 0);
  for (int64_t p = 0; p < kPartitions; ++p) {
    key_offsets[p + 1] =
        key_offsets[p] + static_cast<int64_t>(part_keys[p].size());
  }
  const int64_t num_unique = key_offsets[kPartitions];
  std::vector<int64_t> keys(num_unique);
  RunParallel(parallel_for, kPartitions, nnz / kPartitions * 4,
              [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      std::copy(part_keys[p].begin(), part_keys[p].end(),
                keys.begin() + key_offsets[p]);
      std::vector<int64_t>().swap(part_keys[p]);
      const int32_t shift = static_cast<int32_t>(key_offsets[p]);
      for (int64_t k = part_offsets[p]; k < part_offsets[p + 1]; ++k) {
        inverse[positions[k]] += shift;
      }
    }
  });

  // 4. Sort the distinct ids into the output order with the key
  // rank * rows_per_rank + local_row.
  int64_t max_key = 0;
  for (int64_t key : keys) {
    max_key = std::max(max_key, key);
    ++result->counts[layout.Rank(key)];
  }
  // Unsigned: the largest key, <= max_key + num_ranks - 1, cannot overflow.
  const uint64_t rows_per_rank =
      layout.owner >= 0
          ? 0
          : static_cast<uint64_t>(max_key / layout.num_ranks) + 1;
  std::vector<KeyIndex> sorted(num_unique);
  RunParallel(parallel_for, num_unique, 8, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t id = keys[k];
      sorted[k] = KeyIndex{
          static_cast<uint64_t>(layout.Rank(id)) * rows_per_rank +
              static_cast<uint64_t>(layout.LocalRow(id)),
          k};
    }
  });
  RadixSort(&sorted,
            layout.owner >= 0
                ? static_cast<uint64_t>(max_key)
                : static_cast<uint64_t>(layout.num_ranks) * rows_per_rank - 1);

  // 5. Emit the outputs and remap the inverse to the sorted order.
  result->unique_ids.resize(num_unique);
  result->local_rows.resize(num_unique);
  std::vector<int32_t> position(num_unique);
  RunParallel(parallel_for, num_unique, 8, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t id = keys[sorted[p].index];
      result->unique_ids[p] = id;
      result->local_rows[p] = layout.LocalRow(id);
      position[sorted[p].index] = static_cast<int32_t>(p);
    }
  });
  RunParallel(parallel_for, nnz, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) inverse[i] = position[inverse[i]];
  });
}

// ----------------------------------------------------------------------------
// Segment pooling.

// Groups positions [0, nnz) by key (a stable counting sort): the positions
// with key k are order[offsets[k] .. offsets[k + 1]), ascending. When the
// keys are already sorted, `order` stays empty (it is the identity).
template <typename Tkey>
void GroupPositions(const Tkey* keys, int64_t nnz, int64_t num_keys,
                    std::vector<int64_t>* offsets,
                    std::vector<int64_t>* order) {
  offsets->assign(num_keys + 1, 0);
  bool sorted = true;
  for (int64_t i = 0; i < nnz; ++i) {
    ++(*offsets)[static_cast<int64_t>(keys[i]) + 1];
    if (i > 0 && keys[i] < keys[i - 1]) sorted = false;
  }
  for (int64_t k = 0; k < num_keys; ++k) {
    (*offsets)[k + 1] += (*offsets)[k];
  }
  order->clear();
  if (sorted) return;
  order->resize(nnz);
  std::vector<int64_t> fill(offsets->begin(), offsets->end() - 1);
  for (int64_t i = 0; i < nnz; ++i) {
    (*order)[fill[static_cast<int64_t>(keys[i])]++] = i;
  }
}

}  // namespace

template <typename Tid>
IdError FindFirstInvalidId(const Tid* ids, int64_t nnz, int64_t vocab_size,
                           const ParallelFor& parallel_for) {
  std::atomic<int64_t> first(std::numeric_limits<int64_t>::max());
  RunParallel(parallel_for, nnz, 2, [&](int64_t begin, int64_t end) {
    if (begin >= first.load(std::memory_order_relaxed)) return;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t id = static_cast<int64_t>(ids[i]);
      if (id < 0 || id >= vocab_size) {
        AtomicMin(&first, i);
        return;
      }
    }
  });
  IdError error;
  const int64_t position = first.load();
  if (position != std::numeric_limits<int64_t>::max()) {
    error.position = position;
    error.value = static_cast<int64_t>(ids[position]);
  }
  return error;
}

template <typename Tid>
LookupStatus DedupBucketize(const Tid* ids, int64_t nnz, int64_t num_ranks,
                            int64_t owner, const ParallelFor& parallel_for,
                            int32_t* inverse, DedupResult* result) {
  if (num_ranks < 1) {
    return LookupStatus::Error("num_ranks must be at least 1, got " +
                               std::to_string(num_ranks) + ".");
  }
  if (owner >= num_ranks) {
    return LookupStatus::Error(
        "owner must be -1 or less than num_ranks (" +
        std::to_string(num_ranks) + "), got " + std::to_string(owner) + ".");
  }
  if (nnz > kInt32Max) {
    return LookupStatus::Error("the number of ids (" + std::to_string(nnz) +
                               ") must fit in int32.");
  }
  result->unique_ids.clear();
  result->local_rows.clear();
  result->counts.assign(num_ranks, 0);
  if (nnz == 0) return LookupStatus::Ok();

  int64_t max_id = 0;
  for (int64_t i = 0; i < nnz; ++i) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id < 0) {
      return LookupStatus::Error("id " + IdText(id) +
                                 " at position " + std::to_string(i) +
                                 " is negative.");
    }
    max_id = std::max(max_id, id);
  }
  const Layout layout{num_ranks, owner < 0 ? -1 : owner};
  // A direct-address table costs 4 bytes per id in [0, max_id]; the hash
  // table costs about 32 bytes per distinct id plus a sort.
  if (max_id < 4 * nnz + (int64_t{1} << 16)) {
    DedupDirect(ids, nnz, max_id, layout, parallel_for, inverse, result);
  } else {
    DedupHashed(ids, nnz, layout, parallel_for, inverse, result);
  }
  return LookupStatus::Ok();
}

LookupStatus ParseCombiner(const std::string& name, Combiner* combiner) {
  if (name == "sum") {
    *combiner = Combiner::kSum;
  } else if (name == "mean") {
    *combiner = Combiner::kMean;
  } else if (name == "sqrtn") {
    *combiner = Combiner::kSqrtn;
  } else {
    return LookupStatus::Error("combiner must be 'sum', 'mean' or 'sqrtn', "
                               "got '" + name + "'.");
  }
  return LookupStatus::Ok();
}

template <typename Tseg>
LookupStatus ValidateSegmentIndices(const int32_t* inverse,
                                    const Tseg* segment_ids, int64_t nnz,
                                    int64_t num_rows, int64_t num_segments,
                                    const ParallelFor& parallel_for) {
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  std::atomic<int64_t> bad_inverse(kNone);
  std::atomic<int64_t> bad_segment(kNone);
  RunParallel(parallel_for, nnz, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (inverse[i] < 0 || inverse[i] >= num_rows) {
        AtomicMin(&bad_inverse, i);
        break;
      }
    }
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = static_cast<int64_t>(segment_ids[i]);
      if (s < 0 || s >= num_segments) {
        AtomicMin(&bad_segment, i);
        break;
      }
    }
  });
  const int64_t i = bad_inverse.load();
  if (i != kNone) {
    return LookupStatus::Error(
        "inverse[" + std::to_string(i) + "] = " + std::to_string(inverse[i]) +
        " is out of range [0, " + std::to_string(num_rows) + ").");
  }
  const int64_t s = bad_segment.load();
  if (s != kNone) {
    return LookupStatus::Error(
        "segment_ids[" + std::to_string(s) +
        "] = " + std::to_string(static_cast<int64_t>(segment_ids[s])) +
        " is out of range [0, " + std::to_string(num_segments) + ").");
  }
  return LookupStatus::Ok();
}

template <typename T, typename Tseg>
void SegmentCombine(const T* rows, int64_t dim, const int32_t* inverse,
                    const Tseg* segment_ids, const T* weights, int64_t nnz,
                    int64_t num_segments, Combiner combiner,
                    const ParallelFor& parallel_for, T* out) {
  std::vector<int64_t> offsets;
  std::vector<int64_t> order;
  GroupPositions(segment_ids, nnz, num_segments, &offsets, &order);
  const bool identity = order.empty();
  const int64_t cost = (nnz / std::max<int64_t>(num_segments, 1) + 1) *
                       (dim * 2 + 8);
  RunParallel(parallel_for, num_segments, cost, [&](int64_t begin,
                                                    int64_t end) {
    // The float32 sums of a 16-bit table (unused for float and double).
    std::vector<AccOf<T>> scratch(std::is_same<AccOf<T>, T>::value ? 0 : dim);
    for (int64_t b = begin; b < end; ++b) {
      RowPooler<T> pooler(out + b * dim, dim, scratch.data());
      for (int64_t k = offsets[b]; k < offsets[b + 1]; ++k) {
        const int64_t i = identity ? k : order[k];
        const T* row = rows + static_cast<int64_t>(inverse[i]) * dim;
        if (weights == nullptr) {
          pooler.Add(row);
        } else {
          pooler.Add(row, weights[i]);
        }
      }
      pooler.Finish(combiner);
    }
  });
}

namespace {

// The gradient the terms of SegmentCombineGrad read, in Acc: grad itself
// (a float or double sum), or a copy loaded into Acc and, where
// `denominator` is given, divided by each segment's (div_no_nan: the
// forward divides after summing). One rounding, at the store of the sums.
template <typename T>
const AccOf<T>* ScaledGrad(const T* grad, int64_t dim, int64_t num_segments,
                           const AccOf<T>* denominator,
                           const ParallelFor& parallel_for,
                           std::vector<AccOf<T>>* scaled) {
  using Acc = AccOf<T>;
  using S = Storage<T>;
  if constexpr (std::is_same<Acc, T>::value) {
    if (denominator == nullptr) return grad;
  }
  scaled->resize(num_segments * dim);
  Acc* out = scaled->data();
  RunParallel(parallel_for, num_segments, dim * 4 + 8,
              [&](int64_t begin, int64_t end) {
                for (int64_t b = begin; b < end; ++b) {
                  const T* g = grad + b * dim;
                  Acc* s = out + b * dim;
                  if (denominator == nullptr) {
                    for (int64_t d = 0; d < dim; ++d) s[d] = S::Load(g[d]);
                    continue;
                  }
                  const Acc den = denominator[b];
                  for (int64_t d = 0; d < dim; ++d) {
                    s[d] = den == Acc(0) ? Acc(0) : S::Load(g[d]) / den;
                  }
                }
              });
  return out;
}

// out[u] = the sum over k in [offsets[u], offsets[u + 1]) of
// source[segment_ids[i]] * weights[i] (i = order[k], or k without an
// order), left to right within kGradChunk terms and then over the chunks'
// partial sums (the tree of core/lookup.h, as on the GPU).
template <typename T, typename Tseg, typename Toff>
void SumGrouped(const AccOf<T>* source, int64_t dim, const Tseg* segment_ids,
                const T* weights, const Toff* offsets, const int64_t* order,
                int64_t nnz, int64_t num_rows,
                const ParallelFor& parallel_for, T* out) {
  using Acc = AccOf<T>;
  using S = Storage<T>;
  constexpr bool kWide = std::is_same<Acc, T>::value;
  const int64_t cost = (nnz / std::max<int64_t>(num_rows, 1) + 1) *
                       (dim * 2 + 8);
  RunParallel(parallel_for, num_rows, cost, [&](int64_t begin, int64_t end) {
    std::vector<Acc> buffer(kWide ? 0 : dim);
    std::vector<Acc> partials;
    std::vector<Acc> next;
    for (int64_t u = begin; u < end; ++u) {
      Acc* o;
      if constexpr (kWide) {
        o = out + u * dim;
      } else {
        o = buffer.data();
      }
      const int64_t first = static_cast<int64_t>(offsets[u]);
      const int64_t n = static_cast<int64_t>(offsets[u + 1]) - first;
      // Sums terms [from, to) of row u left to right into acc[0, dim).
      auto sum_terms = [&](int64_t from, int64_t to, Acc* acc) {
        std::fill(acc, acc + dim, Acc(0));
        for (int64_t k = first + from; k < first + to; ++k) {
          const int64_t i = order == nullptr ? k : order[k];
          const Acc* g = source + static_cast<int64_t>(segment_ids[i]) * dim;
          if (weights == nullptr) {
            for (int64_t d = 0; d < dim; ++d) acc[d] += g[d];
          } else {
            const Acc w = S::Load(weights[i]);
            for (int64_t d = 0; d < dim; ++d) acc[d] += g[d] * w;
          }
        }
      };
      if (n <= kGradChunk) {
        sum_terms(0, n, o);
      } else {
        int64_t count = (n + kGradChunk - 1) / kGradChunk;
        partials.assign(count * dim, Acc(0));
        for (int64_t j = 0; j < count; ++j) {
          sum_terms(j * kGradChunk, std::min(n, (j + 1) * kGradChunk),
                    partials.data() + j * dim);
        }
        while (count > 1) {
          const int64_t m = (count + kGradChunk - 1) / kGradChunk;
          Acc* dst = o;
          if (m > 1) {
            next.assign(m * dim, Acc(0));
            dst = next.data();
          }
          for (int64_t j = 0; j < m; ++j) {
            Acc* acc = dst + j * dim;
            std::fill(acc, acc + dim, Acc(0));
            const int64_t stop = std::min(count, (j + 1) * kGradChunk);
            for (int64_t k = j * kGradChunk; k < stop; ++k) {
              const Acc* p = partials.data() + k * dim;
              for (int64_t d = 0; d < dim; ++d) acc[d] += p[d];
            }
          }
          if (m > 1) partials.swap(next);
          count = m;
        }
      }
      if constexpr (!kWide) {
        T* stored = out + u * dim;
        for (int64_t d = 0; d < dim; ++d) stored[d] = S::Store(o[d]);
      }
    }
  });
}

}  // namespace

template <typename T, typename Tseg>
void SegmentCombineGrad(const T* grad, int64_t dim, const int32_t* inverse,
                        const Tseg* segment_ids, const T* weights, int64_t nnz,
                        int64_t num_segments, int64_t num_rows,
                        Combiner combiner, const ParallelFor& parallel_for,
                        T* out) {
  using Acc = AccOf<T>;
  using S = Storage<T>;
  // For mean and sqrtn, each segment's denominator over its terms, in
  // position order.
  std::vector<Acc> denominator;
  if (combiner != Combiner::kSum) {
    denominator.assign(num_segments, Acc(0));
    for (int64_t i = 0; i < nnz; ++i) {
      const Acc w = weights == nullptr ? Acc(1) : S::Load(weights[i]);
      denominator[static_cast<int64_t>(segment_ids[i])] +=
          combiner == Combiner::kMean ? w : w * w;
    }
    if (combiner == Combiner::kSqrtn) {
      for (Acc& den : denominator) den = std::sqrt(den);
    }
  }
  std::vector<Acc> scaled;
  const Acc* source = ScaledGrad(
      grad, dim, num_segments,
      combiner == Combiner::kSum ? nullptr : denominator.data(), parallel_for,
      &scaled);
  std::vector<int64_t> offsets;
  std::vector<int64_t> order;
  GroupPositions(inverse, nnz, num_rows, &offsets, &order);
  SumGrouped<T, Tseg, int64_t>(source, dim, segment_ids, weights,
                               offsets.data(),
                               order.empty() ? nullptr : order.data(), nnz,
                               num_rows, parallel_for, out);
}

template <typename T, typename Tid>
LookupStatus PooledGradPlan(const Tid* ids, int64_t nnz,
                            const int64_t* splits, int64_t batch,
                            int64_t bag_width, const T* weights,
                            int64_t num_rows, Combiner combiner,
                            const ParallelFor& parallel_for,
                            const PooledGradPlanAllocate<T>& allocate,
                            PooledGradError* error) {
  using Acc = AccOf<T>;
  using S = Storage<T>;
  (void)bag_width;  // the splits are given either way
  *error = PooledGradError();
  if (batch < 0 || nnz < 0) {
    return LookupStatus::Error("negative batch or id count");
  }
  if (nnz > std::numeric_limits<int32_t>::max()) {
    return LookupStatus::Error("the number of ids (" + std::to_string(nnz) +
                               ") must fit in int32.");
  }
  for (int64_t b = 0; b < batch; ++b) {
    if (splits[b] > splits[b + 1] || (b == 0 && splits[0] != 0)) {
      error->bad_bag = b;
      return LookupStatus::Ok();
    }
  }
  if (splits[batch] != nnz || (batch == 0 && splits[0] != 0)) {
    error->bad_bag = batch;
    return LookupStatus::Ok();
  }
  // The padding-free ids, their bags and weights, in position order (what
  // the boolean masks of the Python gradient produced).
  std::vector<Tid> kept;
  std::vector<int64_t> positions;
  std::vector<int64_t> segments;
  kept.reserve(static_cast<size_t>(nnz));
  positions.reserve(static_cast<size_t>(nnz));
  segments.reserve(static_cast<size_t>(nnz));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = splits[b]; i < splits[b + 1]; ++i) {
      if (static_cast<int64_t>(ids[i]) == -1) continue;
      kept.push_back(ids[i]);
      positions.push_back(i);
      segments.push_back(b);
    }
  }
  const int64_t n = static_cast<int64_t>(kept.size());
  const IdError bad = FindFirstInvalidId(kept.data(), n, num_rows,
                                         parallel_for);
  if (!bad.ok()) {
    error->position = positions[bad.position];
    error->value = bad.value;
    return LookupStatus::Ok();
  }
  std::vector<int32_t> inverse(static_cast<size_t>(n));
  DedupResult dedup;
  LookupStatus st = DedupBucketize(kept.data(), n, 1, -1, parallel_for,
                                   inverse.data(), &dedup);
  if (!st.ok()) return st;
  const int64_t num_unique = static_cast<int64_t>(dedup.local_rows.size());
  PooledGradPlanBuffers<T> out;
  st = allocate(num_unique, n, &out);
  if (!st.ok()) return st;
  std::copy(dedup.local_rows.begin(), dedup.local_rows.end(), out.rows);
  // The kept positions grouped by row (ascending within a row).
  std::vector<int64_t> offsets;
  std::vector<int64_t> order;
  GroupPositions(inverse.data(), n, num_unique, &offsets, &order);
  for (int64_t u = 0; u <= num_unique; ++u) {
    out.offsets[u] = static_cast<int32_t>(offsets[u]);
  }
  for (int64_t k = 0; k < n; ++k) {
    const int64_t j = order.empty() ? k : order[k];
    out.segments[k] = segments[j];
    if (weights != nullptr) out.sorted_weights[k] = weights[positions[j]];
  }
  if (combiner != Combiner::kSum) {
    for (int64_t b = 0; b < batch; ++b) {
      Acc den = Acc(0);
      for (int64_t i = splits[b]; i < splits[b + 1]; ++i) {
        if (static_cast<int64_t>(ids[i]) == -1) continue;
        const Acc w = weights == nullptr ? Acc(1) : S::Load(weights[i]);
        den += combiner == Combiner::kMean ? w : w * w;
      }
      out.denominator[b] =
          combiner == Combiner::kSqrtn ? Acc(std::sqrt(den)) : den;
    }
  }
  return LookupStatus::Ok();
}

template <typename T>
void PooledGradCombine(const T* grad, int64_t dim, int64_t batch,
                       const int32_t* offsets, int64_t num_unique,
                       const int64_t* segments, int64_t kept,
                       const T* sorted_weights, const AccOf<T>* denominator,
                       const ParallelFor& parallel_for, T* rows_grad) {
  if (num_unique == 0 || dim <= 0) return;
  std::vector<AccOf<T>> scaled;
  const AccOf<T>* source =
      ScaledGrad(grad, dim, batch, denominator, parallel_for, &scaled);
  SumGrouped<T, int64_t, int32_t>(source, dim, segments, sorted_weights,
                                  offsets, nullptr, kept, num_unique,
                                  parallel_for, rows_grad);
}

int64_t FirstRankWithError(const int64_t* gathered, int64_t num_ranks,
                           IdError* error) {
  const int64_t width = num_ranks + 2;
  for (int64_t r = 0; r < num_ranks; ++r) {
    const int64_t position = gathered[r * width + num_ranks];
    if (position != -1) {
      error->position = position;
      error->value = gathered[r * width + num_ranks + 1];
      return r;
    }
  }
  *error = IdError();
  return -1;
}

// Explicit instantiations.
#define SOK_INSTANTIATE_IDS(Tid)                                             \
  template IdError FindFirstInvalidId<Tid>(const Tid*, int64_t, int64_t,     \
                                           const ParallelFor&);              \
  template LookupStatus DedupBucketize<Tid>(const Tid*, int64_t, int64_t,    \
                                            int64_t, const ParallelFor&,     \
                                            int32_t*, DedupResult*);
SOK_INSTANTIATE_IDS(int32_t)
SOK_INSTANTIATE_IDS(int64_t)
#undef SOK_INSTANTIATE_IDS

#define SOK_INSTANTIATE_SEG(Tseg)                                            \
  template LookupStatus ValidateSegmentIndices<Tseg>(                        \
      const int32_t*, const Tseg*, int64_t, int64_t, int64_t,                \
      const ParallelFor&);
SOK_INSTANTIATE_SEG(int32_t)
SOK_INSTANTIATE_SEG(int64_t)
#undef SOK_INSTANTIATE_SEG

#define SOK_INSTANTIATE_COMBINE(T, Tseg)                                     \
  template void SegmentCombine<T, Tseg>(                                     \
      const T*, int64_t, const int32_t*, const Tseg*, const T*, int64_t,     \
      int64_t, Combiner, const ParallelFor&, T*);                            \
  template void SegmentCombineGrad<T, Tseg>(                                 \
      const T*, int64_t, const int32_t*, const Tseg*, const T*, int64_t,     \
      int64_t, int64_t, Combiner, const ParallelFor&, T*);
SOK_INSTANTIATE_COMBINE(float, int32_t)
SOK_INSTANTIATE_COMBINE(float, int64_t)
SOK_INSTANTIATE_COMBINE(double, int32_t)
SOK_INSTANTIATE_COMBINE(double, int64_t)
SOK_INSTANTIATE_COMBINE(Half, int32_t)
SOK_INSTANTIATE_COMBINE(Half, int64_t)
SOK_INSTANTIATE_COMBINE(BFloat16, int32_t)
SOK_INSTANTIATE_COMBINE(BFloat16, int64_t)
#undef SOK_INSTANTIATE_COMBINE

#define SOK_INSTANTIATE_POOLED_GRAD(T, Tid)                                  \
  template LookupStatus PooledGradPlan<T, Tid>(                              \
      const Tid*, int64_t, const int64_t*, int64_t, int64_t, const T*,       \
      int64_t, Combiner, const ParallelFor&, const PooledGradPlanAllocate<T>&, \
      PooledGradError*);
SOK_INSTANTIATE_POOLED_GRAD(float, int32_t)
SOK_INSTANTIATE_POOLED_GRAD(float, int64_t)
SOK_INSTANTIATE_POOLED_GRAD(double, int32_t)
SOK_INSTANTIATE_POOLED_GRAD(double, int64_t)
template void PooledGradCombine<float>(const float*, int64_t, int64_t,
                                       const int32_t*, int64_t,
                                       const int64_t*, int64_t, const float*,
                                       const float*, const ParallelFor&,
                                       float*);
template void PooledGradCombine<double>(const double*, int64_t, int64_t,
                                        const int32_t*, int64_t,
                                        const int64_t*, int64_t,
                                        const double*, const double*,
                                        const ParallelFor&, double*);
#undef SOK_INSTANTIATE_POOLED_GRAD

std::string IdText(int64_t id) {
  if (id == std::numeric_limits<int64_t>::min()) {
    return std::to_string(id) +
           " (int64's minimum, or a float id that is no integer: a "
           "fraction, nan, inf or beyond int64)";
  }
  return std::to_string(id);
}

}  // namespace lookup
}  // namespace sok
