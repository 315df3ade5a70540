// The one status type of core/: ok() or an error message. Kernels return it;
// nothing in core/ throws or exits. TensorFlow-free.
#ifndef SOK_CORE_STATUS_H_
#define SOK_CORE_STATUS_H_

#include <string>
#include <utility>

namespace sok {

class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(std::string message) {
    Status status;
    status.ok_ = false;
    status.message_ = std::move(message);
    return status;
  }
  // The same as Error(); reads better where an argument is at fault.
  static Status InvalidArgument(std::string message) {
    return Error(std::move(message));
  }
  bool ok() const { return ok_; }
  const std::string& message() const { return message_; }

 private:
  bool ok_ = true;
  std::string message_;
};

#define SOK_RETURN_IF_ERROR(expr)            \
  do {                                       \
    ::sok::Status _sok_status = (expr);      \
    if (!_sok_status.ok()) return _sok_status; \
  } while (0)

}  // namespace sok

#endif  // SOK_CORE_STATUS_H_
