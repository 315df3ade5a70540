#include "core/inflight.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>

namespace sok {
namespace inflight {
namespace {

using Clock = std::chrono::steady_clock;

struct Record {
  std::string key;
  Clock::time_point start;
};

struct Registry {
  std::mutex mu;
  int64_t next = 1;
  std::map<int64_t, Record> entries;  // ordered by token = by start time
};

Registry& Get() {
  static Registry* registry = new Registry();  // never destroyed
  return *registry;
}

}  // namespace

int64_t Begin(const std::string& key) {
  Registry& r = Get();
  std::lock_guard<std::mutex> lock(r.mu);
  int64_t token = r.next++;
  r.entries.emplace(token, Record{key, Clock::now()});
  return token;
}

void End(int64_t token) {
  Registry& r = Get();
  std::lock_guard<std::mutex> lock(r.mu);
  r.entries.erase(token);
}

std::vector<Entry> Snapshot() {
  Registry& r = Get();
  std::lock_guard<std::mutex> lock(r.mu);
  const Clock::time_point now = Clock::now();
  std::vector<Entry> out;
  out.reserve(r.entries.size());
  for (const auto& kv : r.entries) {
    out.push_back(Entry{
        kv.second.key,
        std::chrono::duration<double>(now - kv.second.start).count()});
  }
  return out;
}

}  // namespace inflight
}  // namespace sok
