// moecache-deny-io-uring PROGRAM [ARGS...]: runs PROGRAM with io_uring denied by a seccomp filter,
// as in a container under Docker's or containerd's default profile.
#include "seccomp.h"

#include <unistd.h>

#include <cstdio>

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: moecache-deny-io-uring PROGRAM [ARGS...]\n");
        return 2;
    }
    if (const auto err = moecache::test::deny_io_uring(); !err.empty()) {
        std::fprintf(stderr, "moecache-deny-io-uring: %s\n", err.c_str());
        return 1;
    }
    ::execvp(argv[1], argv + 1);
    std::perror(argv[1]);
    return 127;
}
