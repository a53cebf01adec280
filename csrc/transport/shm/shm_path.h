// The shm path: a library-allocated window of a peer on this host, its
// POSIX shared-memory segment mapped here (see self/self_path.h for the
// mapped-memory path itself). The segment opened by name must be the file the
// peer's proven process maps at the described address (binding.h), else the
// path is refused and nothing of the file is read or written.
#pragma once

#include "transport/path.h"

namespace fxm {

std::unique_ptr<Path> make_shm_path(const PathRequest& req, const WindowDesc& d, std::string* why);

}  // namespace fxm
