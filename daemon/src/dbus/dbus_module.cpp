// Finds and loads libmoecache-dbus.so (dbus_service.h), once: MOECACHE_DBUS_MODULE where it is
// set, else lib/moecache/ beside the program's directory (the build tree, the bundle), else where
// the install put it relative to the program (MOECACHE_MODULE_RELDIR: /usr/sbin/moecached,
// /usr/lib/moecache/). It stays loaded for the process's life.
#include "dbus/dbus_service.h"

#include "moecache/log.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <unistd.h>

#include <climits>
#include <filesystem>
#include <vector>

namespace moecache::daemon {
namespace {

constexpr const char* kModuleName = "libmoecache-dbus.so";

struct Loaded {
    DbusModuleOpen open = nullptr;
    Error error;
};

std::vector<std::string> candidates() {
    std::vector<std::string> out;
    if (const char* env = std::getenv("MOECACHE_DBUS_MODULE"); env != nullptr && *env != '\0') {
        out.emplace_back(env);
        return out;
    }
    char exe[PATH_MAX];
    if (const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1); n > 0) {
        exe[n] = '\0';
        const std::filesystem::path dir = std::filesystem::path(exe).parent_path();
        out.push_back((dir.parent_path() / "lib" / "moecache" / kModuleName).string());
#ifdef MOECACHE_MODULE_RELDIR
        const std::string installed = (dir / MOECACHE_MODULE_RELDIR / kModuleName).lexically_normal().string();
        if (installed != out.back()) out.push_back(installed);
#endif
    }
    return out;
}

Loaded load() {
    Loaded l;
    std::string tried;
    for (const auto& path : candidates()) {
        std::error_code ec;
        if (!std::filesystem::exists(path, ec)) {
            tried += fmt::format("{}{}", tried.empty() ? "" : ", ", path);
            continue;
        }
        void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (h == nullptr) {
            const char* why = ::dlerror();
            l.error = Error{ELIBACC, fmt::format("{} does not load: {}", path, why != nullptr ? why : "?")};
            return l;
        }
        l.open = reinterpret_cast<DbusModuleOpen>(::dlsym(h, kDbusModuleEntry));
        if (l.open == nullptr) l.error = Error{ELIBACC, fmt::format("{} has no {}", path, kDbusModuleEntry)};
        return l;
    }
    l.error = Error{ELIBACC, fmt::format("no {} (looked at {})", kModuleName, tried.empty() ? "nothing" : tried)};
    return l;
}

}  // namespace

Result<std::unique_ptr<DbusService>> DbusService::open(Control& daemon, const std::string& bus,
                                                       const std::string& admin_group) {
    static const Loaded module = load();
    if (module.open == nullptr) return tl::unexpected(module.error);
    const DbusModuleArgs args{kDbusModuleAbi, &daemon, &bus, &admin_group, log::max_priority()};
    std::unique_ptr<DbusService> out;
    Error error;
    if (module.open(&args, &out, &error) != 0 || !out) return tl::unexpected(error);
    return out;
}

}  // namespace moecache::daemon
