#include "moecache/daemon/mapped_model.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <utility>

namespace moecache::daemon {

Mapping::Mapping(Mapping&& o) noexcept
    : addr_(std::exchange(o.addr_, nullptr)), length_(std::exchange(o.length_, 0)) {}

Mapping& Mapping::operator=(Mapping&& o) noexcept {
    if (this != &o) {
        if (addr_) ::munmap(addr_, length_);
        addr_ = std::exchange(o.addr_, nullptr);
        length_ = std::exchange(o.length_, 0);
    }
    return *this;
}

Mapping::~Mapping() {
    if (addr_) ::munmap(addr_, length_);
}

Result<FileIdentity> identity_of(int fd, const std::string& path) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return fail_errno("{}: fstat", path);
    return FileIdentity{st.st_dev, st.st_ino, static_cast<uint64_t>(st.st_size),
                        int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec};
}

Result<FileIdentity> identity_of_path(const std::string& path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return fail_errno("{}: stat", path);
    return FileIdentity{st.st_dev, st.st_ino, static_cast<uint64_t>(st.st_size),
                        int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec};
}


Result<std::unique_ptr<MappedModel>> MappedModel::open(const std::string& path, const std::vector<int>* handed) {
    auto m = std::make_unique<MappedModel>();
    m->path_ = path;
    // O_NONBLOCK: a FIFO put in a model's place opens at once and is refused below, instead of
    // blocking the daemon until a writer comes. Handed descriptors are re-opened through
    // /proc/self/fd (a file description of our own: our advice stays ours), never by name.
    std::vector<UniqueFd> reopened;
    std::vector<std::string> names;
    auto open_part = [](const std::string& p) {
        UniqueFd fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOATIME));
        if (!fd && errno == EPERM) fd.reset(::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
        return fd;
    };
    if (handed != nullptr) {
        for (size_t i = 0; i < handed->size(); ++i) {
            const std::string via = fmt::format("/proc/self/fd/{}", (*handed)[i]);
            reopened.push_back(open_part(via));
            if (!reopened.back()) return fail_errno("{}: part {}: cannot open the descriptor the client handed over", path, i + 1);
            char target[4096];
            const ssize_t n = ::readlink(via.c_str(), target, sizeof target - 1);
            names.push_back(i == 0 || n <= 0 ? path : std::string(target, static_cast<size_t>(n)));
        }
    }
    std::vector<int> raw;
    for (const auto& fd : reopened) raw.push_back(fd.get());
    const auto parts = MC_TRY(handed != nullptr ? open_gguf_model(raw, names) : open_gguf_model(path));
    m->map_ = MC_TRY(ExpertMap::build(parts));
    for (size_t i = 0; i < parts.size(); ++i) {
        const auto& part = parts[i];
        ModelFile f;
        f.path = part.path;
        // O_RDONLY only: the daemon never writes a model file.
        f.fd = handed != nullptr ? std::move(reopened[i]) : open_part(part.path);
        if (!f.fd) return fail_errno("{}: cannot open", part.path);
        struct stat st {};
        if (::fstat(f.fd.get(), &st) != 0) return fail_errno("{}: fstat", part.path);
        if (!S_ISREG(st.st_mode)) return failf("{}: not a regular file", part.path);
        // Its reads (the prefetcher's, on this descriptor) bring in what it asked for and no
        // neighbours: read-ahead would drag cold experts in and build page-cache folios across
        // expert edges (drop_file_pages then takes such a folio whole). The kernel still starts
        // its asynchronous read-ahead when a read meets the mark another reader's read-ahead
        // left (a runtime reading the header, say): FMODE_RANDOM stops only the synchronous kind.
        (void)::posix_fadvise(f.fd.get(), 0, 0, POSIX_FADV_RANDOM);
        f.identity = MC_TRY(identity_of(f.fd.get(), part.path));
        if (f.identity.size != part.file_size)
            return failf("{}: changed while it was being opened ({} bytes, now {})", part.path, part.file_size,
                         f.identity.size);
        if (f.identity.size > 0) {
            void* addr = ::mmap(nullptr, f.identity.size, PROT_READ, MAP_SHARED, f.fd.get(), 0);
            if (addr == MAP_FAILED) return fail_errno("{}: mmap of {} bytes", part.path, f.identity.size);
            f.mapping = Mapping(addr, f.identity.size);
            // The daemon decides what is read: no read-ahead around its own faults.
            ::madvise(addr, f.identity.size, MADV_RANDOM);
        }
        m->files_.push_back(std::move(f));
    }
    m->dense_ranges_ = m->map_.dense_ranges();
    m->profile_key_ = m->map_.profile_key();
    return m;
}

Result<FileIdentity> cached_identity_of(int fd, const std::string& what, mode_t* mode) {
    struct statx stx {};
    if (::statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC,
                STATX_TYPE | STATX_MODE | STATX_INO | STATX_SIZE | STATX_MTIME, &stx) != 0)
        return fail_errno("{}: statx", what);
    if (mode != nullptr) *mode = stx.stx_mode;
    return FileIdentity{makedev(stx.stx_dev_major, stx.stx_dev_minor), stx.stx_ino, stx.stx_size,
                        int64_t{stx.stx_mtime.tv_sec} * 1000000000 + stx.stx_mtime.tv_nsec};
}

Result<FileIdentity> cached_identity_of_path(const std::string& path) {
    open_how how{};
    how.flags = O_PATH | O_CLOEXEC;
    how.resolve = RESOLVE_CACHED;
    const UniqueFd fd(static_cast<int>(::syscall(SYS_openat2, AT_FDCWD, path.c_str(), &how, sizeof how)));
    if (!fd) {
        // No openat2 (before 5.6) or no RESOLVE_CACHED (before 5.12): it cannot say without waiting.
        if (errno == ENOSYS || errno == EINVAL || errno == E2BIG) errno = EAGAIN;
        return fail_errno("{}: open by the cached path", path);
    }
    return cached_identity_of(fd.get(), path);
}

Result<bool> file_unchanged(const std::string& path, int fd, const FileIdentity& was) {
    auto now = identity_of_path(path);
    if (!now) {
        if (now.error().errnum == ENOENT) return false;
        return tl::unexpected(now.error());
    }
    if (!(*now == was)) return false;
    // Truncated in place keeps the inode: compare the open file's size as well.
    const auto open_now = MC_TRY(identity_of(fd, path));
    return open_now == was;
}

Result<bool> MappedModel::unchanged() const {
    for (const auto& f : files_)
        if (!MC_TRY(file_unchanged(f.path, f.fd.get(), f.identity))) return false;
    return true;
}

bool MappedModel::on_remote_fs() const {
    return std::any_of(files_.begin(), files_.end(), [](const ModelFile& f) { return ::major(f.identity.dev) == 0; });
}

}  // namespace moecache::daemon
