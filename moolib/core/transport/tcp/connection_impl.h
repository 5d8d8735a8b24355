// A TCP connection: the stream framing with every segment inline.
#pragma once

#include "transport/stream_connection.h"

namespace moolib {

class TcpConnection : public StreamConnection {
 public:
  // Takes a connected socket; sets TCP_NODELAY and keepalive probes.
  static ConnectionPtr create(Fd fd);
  TcpConnection(Fd fd, std::string local, std::string remote)
      : StreamConnection(std::move(fd), std::move(local), std::move(remote)) {
    tunesLowWater_ = true;
  }
  const char* transport() const override { return "tcp"; }
};

}  // namespace moolib
