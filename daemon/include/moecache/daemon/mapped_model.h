// A model as the daemon holds it: every file opened read-only (never written), mapped read-only
// and shared (so what the daemon locks is the page cache every other mapper sees), the expert map,
// and each file's identity so that a replaced or truncated file is noticed.
#pragma once

#include "moecache/error.h"
#include "moecache/model.h"
#include "moecache/unique_fd.h"

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

namespace moecache::daemon {

struct FileIdentity {
    dev_t dev = 0;
    ino_t ino = 0;
    uint64_t size = 0;
    int64_t mtime_ns = 0;
    bool operator==(const FileIdentity&) const = default;
};

// Move-only owner of one read-only shared mapping of a whole file.
class Mapping {
public:
    Mapping() = default;
    Mapping(void* addr, uint64_t length) : addr_(addr), length_(length) {}
    Mapping(Mapping&& o) noexcept;
    Mapping& operator=(Mapping&& o) noexcept;
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping();
    [[nodiscard]] uint8_t* data() const { return static_cast<uint8_t*>(addr_); }
    [[nodiscard]] uint64_t length() const { return length_; }

private:
    void* addr_ = nullptr;
    uint64_t length_ = 0;
};

struct ModelFile {
    std::string path;
    UniqueFd fd;
    FileIdentity identity;
    Mapping mapping;
};

class MappedModel {
public:
    // Opens every part of the model `path` names (any part of a split set) and maps it. With
    // `handed` (descriptors of every part, part 1 first, that a client handed over), the files are
    // those very inodes, re-opened through /proc/self/fd: nothing is opened by a name that could
    // be swapped meanwhile; `path` names them in messages.
    static Result<std::unique_ptr<MappedModel>> open(const std::string& path, const std::vector<int>* handed = nullptr);

    [[nodiscard]] const ExpertMap& map() const { return map_; }
    [[nodiscard]] const std::vector<ModelFile>& files() const { return files_; }
    [[nodiscard]] const std::string& path() const { return path_; }
    // Byte ranges of the model that are not routed experts: dense tensors and shared experts.
    [[nodiscard]] const std::vector<ByteRange>& dense_ranges() const { return dense_ranges_; }
    // The key its heat profile is saved under: architecture, shape and name, not file offsets,
    // so another quantization of the same model finds the same profile.
    [[nodiscard]] const std::string& profile_key() const { return profile_key_; }

    // Whether every file on disk is still the one that was mapped (same inode, size, mtime).
    [[nodiscard]] Result<bool> unchanged() const;
    // Whether a file of it lies on a file system without a block device (NFS, SMB, FUSE, and tmpfs
    // or overlayfs alike): one whose stat may wait on a server that does not answer.
    [[nodiscard]] bool on_remote_fs() const;

private:
    std::string path_;
    ExpertMap map_;
    std::vector<ModelFile> files_;
    std::vector<ByteRange> dense_ranges_;
    std::string profile_key_;
};

Result<FileIdentity> identity_of(int fd, const std::string& path);
Result<FileIdentity> identity_of_path(const std::string& path);
// The same, as the kernel has them cached, asking no file system's server (which on NFS, SMB or
// FUSE a plain stat does once attributes are stale, and a hung server or a user's FUSE file system
// never answers): statx with AT_STATX_DONT_SYNC, for a path after openat2 with RESOLVE_CACHED,
// which fails with EAGAIN where a part of the path would have to be looked up or revalidated (or
// the kernel has no RESOLVE_CACHED). For the loop. `mode`: the file's type and mode, if wanted.
Result<FileIdentity> cached_identity_of(int fd, const std::string& what, mode_t* mode = nullptr);
Result<FileIdentity> cached_identity_of_path(const std::string& path);
// Whether `path` still names the file `fd` is, and both are still as `was` (MappedModel::unchanged
// for one file): false where the name leads elsewhere or nowhere, or the file was truncated.
Result<bool> file_unchanged(const std::string& path, int fd, const FileIdentity& was);

}  // namespace moecache::daemon
