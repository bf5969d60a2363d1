#include "memory_cgroup.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

namespace moecache::test {
namespace {

std::string read_text(const std::string& path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

Result<void> write_text(const std::string& path, const std::string& text) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return fail_errno("{}: cannot open for writing", path);
    const ssize_t n = ::write(fd, text.data(), text.size());
    const int e = errno;
    ::close(fd);
    if (n != static_cast<ssize_t>(text.size())) return fail(n < 0 ? e : EIO, fmt::format("{}: writing '{}'", path, text));
    return {};
}

bool has_word(const std::string& list, const std::string& word) {
    std::istringstream ss(list);
    std::string w;
    while (ss >> w)
        if (w == word) return true;
    return false;
}

// Left behind by a run that crashed: its process is gone (a live run's cgroup is not touched).
void remove_stale(const std::string& parent, const std::string& prefix) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(parent, ec)) {
        const std::string name = entry.path().filename().string();
        if (name.rfind(prefix, 0) != 0) continue;
        const auto pid = static_cast<pid_t>(std::strtol(name.c_str() + prefix.size(), nullptr, 10));
        if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) ::rmdir(entry.path().c_str());
    }
}

}  // namespace

Result<std::unique_ptr<MemoryCgroup>> MemoryCgroup::create(const std::string& prefix, uint64_t limit) {
    std::string v1, v2;
    std::ifstream mounts("/proc/self/mounts");
    std::string dev, dir, type, opts;
    while (mounts >> dev >> dir >> type >> opts) {
        mounts.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
        if (type == "cgroup2" && v2.empty() && has_word(read_text(dir + "/cgroup.controllers"), "memory")) v2 = dir;
        if (type == "cgroup" && v1.empty() && ("," + opts + ",").find(",memory,") != std::string::npos) v1 = dir;
    }
    std::unique_ptr<MemoryCgroup> cg(new MemoryCgroup());
    if (!v2.empty()) {
        cg->v2_ = true;
        cg->parent_ = v2;
        if (!has_word(read_text(v2 + "/cgroup.subtree_control"), "memory")) {
            MC_TRY_VOID(write_text(v2 + "/cgroup.subtree_control", "+memory"));
            cg->enabled_memory_ = true;
        }
    } else if (!v1.empty()) {
        cg->parent_ = v1;
    } else {
        return failf("no cgroup hierarchy has the memory controller (see /proc/self/mounts)");
    }
    remove_stale(cg->parent_, prefix);
    cg->dir_ = cg->parent_ + "/" + prefix + std::to_string(::getpid());
    if (::mkdir(cg->dir_.c_str(), 0755) != 0) {
        const int e = errno;
        cg->dir_.clear();
        errno = e;
        return fail_errno("mkdir {}/{}{}", cg->parent_, prefix, ::getpid());
    }
    MC_TRY_VOID(cg->set_limit(limit));
    return cg;
}

MemoryCgroup::~MemoryCgroup() { remove(); }

Result<void> MemoryCgroup::add(pid_t pid) const { return write_text(dir_ + "/cgroup.procs", std::to_string(pid)); }

Result<void> MemoryCgroup::set_limit(uint64_t bytes) const {
    const std::string value = bytes != kNoLimit ? std::to_string(bytes) : v2_ ? "max" : "-1";
    MC_TRY_VOID(write_text(dir_ + (v2_ ? "/memory.max" : "/memory.limit_in_bytes"), value));
    if (v2_ && std::filesystem::exists(dir_ + "/memory.swap.max")) MC_TRY_VOID(write_text(dir_ + "/memory.swap.max", "0"));
    return {};
}

std::vector<std::string> MemoryCgroup::inside(std::vector<std::string> argv) const {
    argv.insert(argv.begin(), {"/bin/sh", "-c", "echo $$ > \"$0/cgroup.procs\" && exec \"$@\"", dir_});
    return argv;
}

uint64_t MemoryCgroup::oom_kills() const {
    std::ifstream f(dir_ + (v2_ ? "/memory.events" : "/memory.oom_control"));
    std::string key;
    uint64_t v = 0;
    while (f >> key >> v)
        if (key == "oom_kill") return v;
    return 0;
}

uint64_t MemoryCgroup::usage() const {
    std::ifstream f(dir_ + (v2_ ? "/memory.current" : "/memory.usage_in_bytes"));
    uint64_t v = 0;
    f >> v;
    return v;
}

uint64_t MemoryCgroup::stat(const std::string& key) const {
    std::ifstream f(dir_ + "/memory.stat");
    const std::string want = v2_ ? key : "total_" + key;
    std::string k;
    uint64_t v = 0;
    while (f >> k >> v)
        if (k == want) return v;
    return 0;
}

void MemoryCgroup::remove() {
    if (!dir_.empty()) {
        // A dead task can linger in the cgroup for a moment after it was reaped.
        for (int i = 0; i < 200; ++i) {
            std::ifstream procs(dir_ + "/cgroup.procs");
            for (pid_t pid; procs >> pid;) ::kill(pid, SIGKILL);
            if (::rmdir(dir_.c_str()) == 0 || errno != EBUSY) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        dir_.clear();
    }
    if (enabled_memory_) (void)write_text(parent_ + "/cgroup.subtree_control", "-memory");
    enabled_memory_ = false;
}

}  // namespace moecache::test
