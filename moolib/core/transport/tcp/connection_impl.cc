#include "transport/tcp/connection_impl.h"

#include <netinet/in.h>
#include <netinet/tcp.h>

namespace moolib {

ConnectionPtr TcpConnection::create(Fd fd) {
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd.get(), SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 10, interval = 5, count = 3;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  SockAddr local, remote;
  local.length = remote.length = sizeof(sockaddr_storage);
  ::getsockname(fd.get(), local.get(), &local.length);
  ::getpeername(fd.get(), remote.get(), &remote.length);
  return std::make_shared<TcpConnection>(std::move(fd), formatTcpAddress(local),
                                         formatTcpAddress(remote));
}

}  // namespace moolib
