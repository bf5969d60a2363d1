// The files of a config: the main file, then <its directory>/moecached.toml.d/*.toml in name
// order, each read on top of the ones before (scalars replaced, [[model]] entries appended), so
// a package or an admin can drop a file in without editing the main one.
#include "moecache/daemon/config.h"
#include "moecache/file_util.h"
#include "moecache/unique_fd.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <memory>

namespace moecache::daemon {
namespace {

// Far above any real config; a bound so that a wrong path (a model, /dev/zero) fails fast.
constexpr uint64_t kMaxConfigBytes = 4 << 20;

Result<std::string> read_text_file(const std::string& path) {
    return read_whole_file(path, kMaxConfigBytes, "config file");
}

bool is_drop_in_name(std::string_view name) {
    // Hidden files are editor and package-manager leftovers (".#x.toml", ".x.toml.swp").
    constexpr std::string_view kSuffix = ".toml";
    return !name.empty() && name.front() != '.' && name.size() > kSuffix.size() &&
           name.substr(name.size() - kSuffix.size()) == kSuffix;
}

// The drop-in files of `dir`, sorted by name; none when the directory does not exist.
Result<std::vector<std::string>> list_drop_ins(const std::string& dir) {
    std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir.c_str()), &::closedir);
    if (!d) {
        if (errno == ENOENT) return std::vector<std::string>{};
        return fail_errno("{}: cannot list the drop-in directory", dir);
    }
    std::vector<std::string> names;
    errno = 0;
    while (const dirent* e = ::readdir(d.get())) {
        const std::string name = e->d_name;
        errno = 0;
        if (!is_drop_in_name(name)) continue;
        // stat follows symlinks: a drop-in linked in from elsewhere counts. Anything else named as a
        // drop-in (a dangling link, a directory, a FIFO) was meant as one: an error, not a skip.
        struct stat st {};
        const std::string path = dir + "/" + name;
        if (::stat(path.c_str(), &st) != 0)
            return fail_errno("{}: a drop-in that cannot be read (a dangling symlink?)", path);
        if (!S_ISREG(st.st_mode)) return failf("{}: a drop-in must be a regular file", path);
        names.push_back(name);
        errno = 0;
    }
    if (errno != 0) return fail_errno("{}: cannot list the drop-in directory", dir);
    std::sort(names.begin(), names.end());
    std::vector<std::string> paths;
    for (const auto& name : names) paths.push_back(dir + "/" + name);
    return paths;
}

std::string drop_in_dir(const std::string& main_path) {
    auto dir = std::filesystem::path(main_path).parent_path();
    if (dir.empty()) dir = ".";
    return (dir / "moecached.toml.d").string();
}

}  // namespace

Result<Config> load_config(const std::string& path) {
    try {
        const auto text = MC_TRY(read_text_file(path));
        auto config = MC_TRY(parse_config_text(text, path));
        const auto drop_ins = MC_TRY(list_drop_ins(drop_in_dir(path)));
        for (const auto& drop_in : drop_ins) {
            const auto drop_in_text = MC_TRY(read_text_file(drop_in));
            config = MC_TRY(parse_config_text(drop_in_text, drop_in, std::move(config)));
        }
        return config;
    } catch (const std::exception& e) {
        return failf("{}: cannot read the config: {}", path, e.what());
    }
}

}  // namespace moecache::daemon
