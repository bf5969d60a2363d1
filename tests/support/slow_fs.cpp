#include "slow_fs.h"

#include <fcntl.h>
#include <linux/fuse.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

namespace moecache::test {

namespace {

constexpr uint64_t kFileNode = 2;

fuse_attr attr_of(uint64_t node, uint64_t size) {
    fuse_attr a{};
    a.ino = node;
    a.nlink = node == FUSE_ROOT_ID ? 2 : 1;
    a.mode = node == FUSE_ROOT_ID ? (S_IFDIR | 0755) : (S_IFREG | 0444);
    a.size = node == FUSE_ROOT_ID ? 0 : size;
    a.blocks = (a.size + 511) / 512;
    a.blksize = 4096;
    return a;
}

}  // namespace

std::unique_ptr<SlowFs> SlowFs::mount(const std::string& mountpoint, const std::string& name, const std::string& source,
                                      uint64_t hang_from, std::string& why, uint64_t attr_seconds) {
    std::unique_ptr<SlowFs> fs(new SlowFs());
    fs->attr_seconds_ = attr_seconds;
    fs->mountpoint_ = mountpoint;
    fs->name_ = name;
    fs->hang_from_ = hang_from;
    fs->source_ = ::open(source.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st {};
    if (fs->source_ < 0 || ::fstat(fs->source_, &st) != 0) {
        why = source + ": " + std::strerror(errno);
        return nullptr;
    }
    fs->size_ = static_cast<uint64_t>(st.st_size);
    fs->fuse_ = ::open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fs->fuse_ < 0) {
        why = std::string("/dev/fuse: ") + std::strerror(errno);
        return nullptr;
    }
    fs->stop_ = ::eventfd(0, EFD_CLOEXEC);
    const std::string options =
        "fd=" + std::to_string(fs->fuse_) + ",rootmode=40000,user_id=0,group_id=0,allow_other";
    if (::mount("moecache-slowfs", mountpoint.c_str(), "fuse.moecache-slowfs", MS_NOSUID | MS_NODEV, options.c_str()) != 0) {
        why = "mount of a FUSE file system at " + mountpoint + ": " + std::strerror(errno);
        return nullptr;
    }
    fs->server_ = std::thread([raw = fs.get()] { raw->serve(); });
    return fs;
}

std::string SlowFs::unavailable(const std::string& scratch_dir) {
    if (::access("/dev/fuse", R_OK | W_OK) != 0) return std::string("/dev/fuse: ") + std::strerror(errno);
    const std::string source = scratch_dir + "/slowfs-probe", mnt = scratch_dir + "/slowfs-probe-mnt";
    const int fd = ::open(source.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) ::close(fd);
    (void)::mkdir(mnt.c_str(), 0755);
    std::string why;
    const bool ok = mount(mnt, "probe", source, 0, why) != nullptr;
    (void)::rmdir(mnt.c_str());
    (void)::unlink(source.c_str());
    return ok ? std::string() : why;
}

SlowFs::~SlowFs() {
    if (server_.joinable()) {
        release();
        (void)::umount2(mountpoint_.c_str(), MNT_DETACH);
        const uint64_t one = 1;
        (void)!::write(stop_, &one, sizeof one);
        server_.join();
    }
    for (int fd : {fuse_, stop_, source_})
        if (fd >= 0) ::close(fd);
}

void SlowFs::release() {
    std::vector<Held> held;
    std::vector<HeldMetadata> held_metadata;
    {
        std::lock_guard lock(mu_);
        hang_from_ = std::numeric_limits<uint64_t>::max();
        hang_metadata_ = false;
        held.swap(holding_);
        held_metadata.swap(holding_metadata_);
    }
    for (const Held& h : held) answer_read(h.unique, h.offset, h.size);
    for (const HeldMetadata& h : held_metadata) answer_metadata(h.unique, h.opcode, h.node, h.name);
}

void SlowFs::answer_metadata(uint64_t unique, uint32_t opcode, uint64_t node, const std::string& name) {
    if (opcode == FUSE_LOOKUP) {
        if (node != FUSE_ROOT_ID || name_ != name) return answer(unique, ENOENT, nullptr, 0);
        fuse_entry_out out{};
        out.nodeid = kFileNode;
        out.generation = 1;
        out.entry_valid = out.attr_valid = attr_seconds_;
        out.attr = attr_of(kFileNode, size_);
        return answer(unique, 0, &out, sizeof out);
    }
    fuse_attr_out out{};
    out.attr_valid = attr_seconds_;
    out.attr = attr_of(node, size_);
    answer(unique, 0, &out, sizeof out);
}

void SlowFs::answer(uint64_t unique, int error, const void* data, size_t size) {
    fuse_out_header out{};
    out.len = static_cast<uint32_t>(sizeof out + size);
    out.error = -error;
    out.unique = unique;
    std::vector<char> buf(sizeof out + size);
    std::memcpy(buf.data(), &out, sizeof out);
    if (size > 0) std::memcpy(buf.data() + sizeof out, data, size);
    std::lock_guard lock(mu_);
    // ENOENT: the request was interrupted and is gone; nothing to do about it.
    (void)!::write(fuse_, buf.data(), buf.size());
}

void SlowFs::answer_read(uint64_t unique, uint64_t offset, uint32_t size) {
    const uint64_t n = offset >= size_ ? 0 : std::min<uint64_t>(size, size_ - offset);
    std::vector<char> data(n);
    const ssize_t got = n == 0 ? 0 : ::pread(source_, data.data(), n, static_cast<off_t>(offset));
    if (got < 0) return answer(unique, EIO, nullptr, 0);
    answer(unique, 0, data.data(), static_cast<size_t>(got));
}

void SlowFs::serve() {
    std::vector<char> buf(1u << 20);
    for (;;) {
        pollfd p[2] = {{fuse_, POLLIN, 0}, {stop_, POLLIN, 0}};
        if (::poll(p, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return;
        }
        if (p[1].revents != 0) return;
        const ssize_t n = ::read(fuse_, buf.data(), buf.size());
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT) continue;
            return;  // ENODEV: unmounted
        }
        if (static_cast<size_t>(n) < sizeof(fuse_in_header)) continue;
        fuse_in_header in{};
        std::memcpy(&in, buf.data(), sizeof in);
        const char* arg = buf.data() + sizeof in;
        switch (in.opcode) {
            case FUSE_INIT: {
                fuse_init_in init{};
                std::memcpy(&init, arg, std::min<size_t>(sizeof init, n - sizeof in));
                fuse_init_out out{};
                out.major = FUSE_KERNEL_VERSION;
                out.minor = std::min<uint32_t>(init.minor, FUSE_KERNEL_MINOR_VERSION);
                out.max_readahead = init.max_readahead;
                out.flags = init.flags & FUSE_ASYNC_READ;  // reads of one file answered out of order
                out.max_background = 64;
                out.congestion_threshold = 48;
                out.max_write = 4096;
                out.time_gran = 1;
                answer(in.unique, 0, &out, sizeof out);
                break;
            }
            case FUSE_LOOKUP:
            case FUSE_GETATTR: {
                const std::string name = in.opcode == FUSE_LOOKUP ? std::string(arg) : std::string();
                bool hold = false;
                {
                    std::lock_guard lock(mu_);
                    if (hang_metadata_) {
                        holding_metadata_.push_back({in.unique, in.opcode, in.nodeid, name});
                        ++held_metadata_;
                        hold = true;
                    }
                }
                if (!hold) answer_metadata(in.unique, in.opcode, in.nodeid, name);
                break;
            }
            case FUSE_OPEN: {
                fuse_open_out out{};
                out.fh = 1;
                out.open_flags = FOPEN_KEEP_CACHE;
                answer(in.unique, 0, &out, sizeof out);
                break;
            }
            case FUSE_READ: {
                fuse_read_in rd{};
                std::memcpy(&rd, arg, std::min<size_t>(sizeof rd, n - sizeof in));
                bool hold = false;
                {
                    std::lock_guard lock(mu_);
                    if (rd.offset + rd.size > hang_from_.load()) {
                        holding_.push_back({in.unique, rd.offset, rd.size});
                        ++held_;
                        hold = true;
                    }
                }
                if (!hold) answer_read(in.unique, rd.offset, rd.size);
                break;
            }
            case FUSE_STATFS: {
                fuse_statfs_out out{};
                out.st.bsize = out.st.frsize = 4096;
                out.st.namelen = 255;
                answer(in.unique, 0, &out, sizeof out);
                break;
            }
            case FUSE_RELEASE:
            case FUSE_FLUSH:
            case FUSE_ACCESS:
                answer(in.unique, 0, nullptr, 0);
                break;
            case FUSE_FORGET:
            case FUSE_BATCH_FORGET:
            case FUSE_INTERRUPT:  // a dead server answers nothing, interrupts included
                break;
            case FUSE_DESTROY:
                answer(in.unique, 0, nullptr, 0);
                return;
            default:
                answer(in.unique, ENOSYS, nullptr, 0);
                break;
        }
    }
}

}  // namespace moecache::test
