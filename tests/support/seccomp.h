// A seccomp filter that denies io_uring as Docker's and containerd's default profiles do: the
// three io_uring system calls fail with EPERM, everything else is allowed. For the containers'
// case in tests: install it in a child (it cannot be undone), or run a program under
// moecache-deny-io-uring.
#pragma once

#include <string>

namespace moecache::test {

// Sets no_new_privs and installs the filter on the calling thread (and what it starts or execs).
// "" on success, else what failed.
std::string deny_io_uring();

}  // namespace moecache::test
