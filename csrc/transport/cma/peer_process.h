// Which process is a peer: a pid published in a window description is only a
// claim (any rank can publish any pid, its own or another rank's). The kernel
// can tell whether the process behind a pid holds the peer's end of this
// rank's authenticated mesh connection to that peer: then it is that peer's
// process (or a process sharing its file table), whatever the peer published.
#pragma once

#include <sys/types.h>

#include <string>

namespace fxm::cma {

// "" when process `pid` (in this PID namespace) holds the other end of the TCP
// connection `fd` of this process, else why that is not so or cannot be seen.
std::string holds_other_end(pid_t pid, int fd);

}  // namespace fxm::cma
