/* Preloaded into a rank so its TF gRPC servers listen on one address, not all interfaces.
 *
 * TensorFlow's gRPC server always asks for the wildcard address ("0.0.0.0:PORT", which gRPC
 * turns into the dual-stack "[::]:PORT"). With PARALLAX_BIND_ADDRESS=A and
 * PARALLAX_BIND_PORTS="p1,p2,..." set, a wildcard bind() to one of those ports is turned into
 * a bind() to A (an IPv4 address, written as ::ffff:A on IPv6 sockets). Every other bind()
 * passes through untouched. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int port_listed(unsigned port) {
  const char *ports = getenv("PARALLAX_BIND_PORTS");
  if (!ports) return 0;
  while (*ports) {
    char *end;
    unsigned long listed = strtoul(ports, &end, 10);
    if (end == ports) return 0;
    if (listed == port) return 1;
    ports = (*end == ',') ? end + 1 : end;
  }
  return 0;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  static bind_fn real_bind;
  if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
  const char *address = getenv("PARALLAX_BIND_ADDRESS");
  struct in_addr wanted;
  if (!address || !addr || inet_pton(AF_INET, address, &wanted) != 1) return real_bind(fd, addr, len);
  if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
    struct sockaddr_in v4;
    memcpy(&v4, addr, sizeof v4);
    if (v4.sin_addr.s_addr == htonl(INADDR_ANY) && port_listed(ntohs(v4.sin_port))) {
      v4.sin_addr = wanted;
      return real_bind(fd, (struct sockaddr *)&v4, sizeof v4);
    }
  } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
    struct sockaddr_in6 v6;
    memcpy(&v6, addr, sizeof v6);
    if (memcmp(&v6.sin6_addr, &in6addr_any, sizeof in6addr_any) == 0 && port_listed(ntohs(v6.sin6_port))) {
      memset(&v6.sin6_addr, 0, sizeof v6.sin6_addr);        /* ::ffff:a.b.c.d */
      v6.sin6_addr.s6_addr[10] = v6.sin6_addr.s6_addr[11] = 0xff;
      memcpy(&v6.sin6_addr.s6_addr[12], &wanted, 4);
      return real_bind(fd, (struct sockaddr *)&v6, sizeof v6);
    }
  }
  return real_bind(fd, addr, len);
}
