// Names the calling thread (at most 15 characters) so that `top -H`, `ps -L`,
// /proc/<pid>/task/*/comm and debuggers tell the library's threads from the
// application's: every thread the library starts calls this first.
#pragma once

#include <pthread.h>

namespace fxm {

inline void name_this_thread(const char* name) { pthread_setname_np(pthread_self(), name); }

}  // namespace fxm
