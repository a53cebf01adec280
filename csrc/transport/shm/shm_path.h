// The shm path: a library-allocated window of a peer on this host, its
// POSIX shared-memory segment mapped here (see self/self_path.h for the
// mapped-memory path itself).
#pragma once

#include "transport/path.h"

namespace fxm {

std::unique_ptr<Path> make_shm_path(const PathRequest& req, const WindowDesc& d, std::string* why);

}  // namespace fxm
