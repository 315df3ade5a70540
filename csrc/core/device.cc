#include "core/device.h"

namespace sok {

bool BuiltWithCuda() {
#ifdef SOK_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace sok
