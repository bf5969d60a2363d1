// A file system whose reads stop answering: what a hung NFS or SMB server, or a FUSE file system
// a user mounted with allow_other, does to whoever reads it. Root only (it mounts).
//
// A FUSE server of its own, in a thread of the test, speaking the kernel's protocol on /dev/fuse
// (linux/fuse.h) with no library: one read-only file, the bytes of a real one. Reads that touch
// bytes at or past `hang_from` get no answer until release() (or the destructor); the rest are
// answered at once. The kernel caches attributes for an hour, so only reads reach the server once
// the file is open; unless `attr_seconds` says otherwise, and then hang_metadata() holds what a
// stat asks (lookups, attributes), as a hung NFS server or a hostile FUSE server does.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace moecache::test {

class SlowFs {
public:
    // Mounts at `mountpoint` (a folder that exists) a file system holding one file, `name`, with the
    // bytes of `source`. Returns null with `why` set where it cannot.
    static std::unique_ptr<SlowFs> mount(const std::string& mountpoint, const std::string& name,
                                         const std::string& source, uint64_t hang_from, std::string& why,
                                         uint64_t attr_seconds = 3600);
    // Why this machine cannot mount one at all ("" where it can): no /dev/fuse, or mounts refused
    // (a container without CAP_SYS_ADMIN). For a GTEST_SKIP with its reason.
    static std::string unavailable(const std::string& scratch_dir);
    ~SlowFs();  // answers what it holds, unmounts, stops the server
    SlowFs(const SlowFs&) = delete;
    SlowFs& operator=(const SlowFs&) = delete;

    // Every request held is answered now, and every later one at once.
    void release();
    // From now on lookups and attribute requests get no answer until release(): a stat of the file
    // waits (with attributes cached for less than `attr_seconds`).
    void hang_metadata() { hang_metadata_ = true; }
    // Reads that were held (answered or not).
    [[nodiscard]] uint64_t held() const { return held_.load(); }
    // Lookups and attribute requests that were held.
    [[nodiscard]] uint64_t held_metadata() const { return held_metadata_.load(); }
    [[nodiscard]] std::string path() const { return mountpoint_ + "/" + name_; }

private:
    SlowFs() = default;
    void serve();
    void answer(uint64_t unique, int error, const void* data, size_t size);
    void answer_read(uint64_t unique, uint64_t offset, uint32_t size);
    void answer_metadata(uint64_t unique, uint32_t opcode, uint64_t node, const std::string& name);

    std::string mountpoint_, name_;
    int fuse_ = -1, stop_ = -1, source_ = -1;
    uint64_t size_ = 0;
    std::atomic<uint64_t> hang_from_{0};
    std::atomic<uint64_t> held_{0}, held_metadata_{0};
    std::atomic<bool> hang_metadata_{false};
    uint64_t attr_seconds_ = 3600;
    std::mutex mu_;  // the device's writes and the reads held
    struct Held {
        uint64_t unique, offset;
        uint32_t size;
    };
    std::vector<Held> holding_;
    struct HeldMetadata {
        uint64_t unique;
        uint32_t opcode;
        uint64_t node;
        std::string name;
    };
    std::vector<HeldMetadata> holding_metadata_;
    std::thread server_;
};

}  // namespace moecache::test
