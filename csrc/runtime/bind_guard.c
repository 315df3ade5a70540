/* A bind() that keeps a rank's servers off the network.
 *
 * TensorFlow's gRPC server listens on the wildcard address ("0.0.0.0:port",
 * which gRPC opens as a dual-stack "[::]:port"), whatever address TF_CONFIG
 * gives the task, and it is unauthenticated. Loaded with LD_PRELOAD into
 * each rank (sokrun does it; sok_keras.init() re-executes the process with
 * it otherwise), this bind() rewrites a bind to the wildcard address into a
 * bind to SOK_BIND_HOST (an IPv4 or IPv6 address: 127.0.0.1 for a one-host
 * job, the rank's own address across hosts). Every other bind is passed on
 * unchanged. Plain C, no TensorFlow.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr*, socklen_t);

static bind_fn real_bind(void) {
  static bind_fn fn = NULL;
  if (fn == NULL) fn = (bind_fn)dlsym(RTLD_NEXT, "bind");
  return fn;
}

__attribute__((visibility("default"))) int bind(int fd,
                                                const struct sockaddr* addr,
                                                socklen_t len) {
  bind_fn next = real_bind();
  if (next == NULL) {
    errno = ENOSYS;
    return -1;
  }
  const char* host = getenv("SOK_BIND_HOST");
  if (host == NULL || host[0] == '\0' || addr == NULL) {
    return next(fd, addr, len);
  }
  struct in_addr v4;
  struct in6_addr v6;
  const int is_v4 = inet_pton(AF_INET, host, &v4) == 1;
  const int is_v6 = !is_v4 && inet_pton(AF_INET6, host, &v6) == 1;
  if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
    struct sockaddr_in a;
    memcpy(&a, addr, sizeof(a));
    if (a.sin_addr.s_addr == htonl(INADDR_ANY) && is_v4) {
      a.sin_addr = v4;
      return next(fd, (const struct sockaddr*)&a, sizeof(a));
    }
  } else if (addr->sa_family == AF_INET6 &&
             len >= (socklen_t)sizeof(struct sockaddr_in6)) {
    struct sockaddr_in6 a;
    memcpy(&a, addr, sizeof(a));
    if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr) && (is_v4 || is_v6)) {
      if (is_v4) { /* a dual-stack socket: the v4-mapped address */
        memset(&a.sin6_addr, 0, sizeof(a.sin6_addr));
        a.sin6_addr.s6_addr[10] = 0xff;
        a.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&a.sin6_addr.s6_addr[12], &v4, 4);
      } else {
        a.sin6_addr = v6;
      }
      return next(fd, (const struct sockaddr*)&a, sizeof(a));
    }
  }
  return next(fd, addr, len);
}
