/* LD_PRELOAD shim: every bind() in this process (and in the children that inherit
 * LD_PRELOAD) to a non-loopback IP address binds to loopback instead, same port.
 *
 * Why: `pdserve serve`'s embedded Ray must not listen on the network. Ray's own
 * local-only mode (router/embedded_ray.py) keeps Ray's sockets on 127.0.0.1, but
 * torch's TCPStore binds the wildcard whatever host it is given (unless handed a
 * bound socket), and any library may bind 0.0.0.0 on its own. Rewriting the address at the
 * one call they all go through covers them all, in every process of the cluster.
 * (Outbound sockets that bind a wildcard before connecting can then reach only
 * this host: right for a single-host cluster. Servers that advertise the address
 * they asked for rather than getsockname()'s would be unreachable: Ray is why its
 * node address must be 127.0.0.1; gloo and NCCL advertise getsockname()'s.)
 *
 * AF_INET  -> 127.0.0.1.
 * AF_INET6 -> ::ffff:127.0.0.1 on a dual-stack socket (IPV6_V6ONLY off, what gRPC
 *             and TCPStore open for a wildcard), so IPv4 clients dialing 127.0.0.1
 *             still reach it; ::1 on an IPv6-only socket.
 * Loopback addresses, Unix sockets and other families pass through untouched.
 *
 * pdserve_loopback_allow(1) turns rewriting off process-wide, for the router's own
 * public port when the user asked for a non-loopback --host; (0) turns it back on.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int allow_public;  /* read and written with __atomic builtins: any thread binds */

void pdserve_loopback_allow(int on) { __atomic_store_n(&allow_public, on != 0, __ATOMIC_SEQ_CST); }

int pdserve_loopback_allowed(void) { return __atomic_load_n(&allow_public, __ATOMIC_SEQ_CST); }

static bind_fn real_bind(void) {
    static bind_fn fn;  /* a racing first call stores the same pointer: harmless */
    if (!fn)
        fn = (bind_fn)dlsym(RTLD_NEXT, "bind");
    return fn;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    bind_fn next = real_bind();
    if (!next) {
        errno = ENOSYS;
        return -1;
    }
    if (!addr || pdserve_loopback_allowed())
        return next(fd, addr, len);

    if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in in;
        memcpy(&in, addr, sizeof in);
        if ((ntohl(in.sin_addr.s_addr) >> 24) != 127) {  /* 127.0.0.0/8 is loopback */
            in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return next(fd, (const struct sockaddr *)&in, sizeof in);
        }
    } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        memcpy(&in6, addr, sizeof in6);
        const unsigned char *b = in6.sin6_addr.s6_addr;
        int mapped_loopback = IN6_IS_ADDR_V4MAPPED(&in6.sin6_addr) && b[12] == 127;
        if (!IN6_IS_ADDR_LOOPBACK(&in6.sin6_addr) && !mapped_loopback) {
            int v6only = 1;
            socklen_t optlen = sizeof v6only;
            if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &optlen) != 0)
                v6only = 1;  /* unknown: ::1 is loopback either way */
            if (v6only) {
                in6.sin6_addr = in6addr_loopback;
            } else {  /* ::ffff:127.0.0.1 */
                memset(&in6.sin6_addr, 0, sizeof in6.sin6_addr);
                in6.sin6_addr.s6_addr[10] = in6.sin6_addr.s6_addr[11] = 0xff;
                in6.sin6_addr.s6_addr[12] = 127;
                in6.sin6_addr.s6_addr[15] = 1;
            }
            in6.sin6_scope_id = 0;  /* a link-local scope does not apply to loopback */
            return next(fd, (const struct sockaddr *)&in6, sizeof in6);
        }
    }
    return next(fd, addr, len);
}
