// Runs a program and captures what it prints, for tests of the command-line tools.
#pragma once

#include <string>
#include <vector>

namespace moecache::test {

struct RunResult {
    int exit_code = -1;  // -1: did not exit normally
    std::string out;
    std::string err;
    long max_rss_kib = 0;  // peak resident set of the child
    double seconds = 0;
};

// argv[0] is the program path; no shell is involved. Environment entries "K=V" are added.
RunResult run(const std::vector<std::string>& argv, const std::vector<std::string>& env = {},
              int timeout_seconds = 300);

}  // namespace moecache::test

namespace moecache::test {

// A program running in the background, its stdout and stderr captured together; killed when the
// object goes away.
class Background {
public:
    explicit Background(const std::vector<std::string>& argv);
    ~Background();
    Background(const Background&) = delete;
    Background& operator=(const Background&) = delete;

    // Waits until the output contains `text` (true) or the time is up or the program ended (false).
    bool wait_for(const std::string& text, double seconds);
    void signal(int sig);
    // Waits for the exit; returns the exit code, or -1 (signalled, or still running at the end).
    int wait(double seconds);
    [[nodiscard]] const std::string& output() const { return out_; }
    [[nodiscard]] int pid() const { return pid_; }

private:
    void pump(int timeout_ms);
    int pid_ = -1;
    int fd_ = -1;
    std::string out_;
    int exit_code_ = -2;
};

}  // namespace moecache::test
