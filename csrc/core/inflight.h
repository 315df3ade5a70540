// In-flight registry for communication calls (framework neutral).
//
// Every collective that sok_keras issues is bracketed by Begin(key) and
// End(token). A watchdog thread reads Snapshot() and, when an entry is older
// than the communication timeout, aborts the collectives of the process with
// an error that names the key, instead of letting the process hang forever.
#ifndef SOK_CORE_INFLIGHT_H_
#define SOK_CORE_INFLIGHT_H_

#include <cstdint>
#include <string>
#include <vector>

namespace sok {
namespace inflight {

struct Entry {
  std::string key;
  double seconds;  // time since Begin
};

// Records `key` as in flight now; returns a token (> 0) for End.
int64_t Begin(const std::string& key);

// Removes the entry of `token`. Unknown tokens (already ended) are ignored,
// so End may be called more than once for one token.
void End(int64_t token);

// The entries in flight, oldest first.
std::vector<Entry> Snapshot();

}  // namespace inflight
}  // namespace sok

#endif  // SOK_CORE_INFLIGHT_H_
