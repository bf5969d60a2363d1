// What an operator may ask of the daemon, and all the D-Bus service sees of it: status as plain
// values (status.h) and the controls. The Operator implements it; the service holds a Control&, so the
// bus cannot reach the loop's state any other way. Arguments are untrusted: each is checked and a
// refusal says what is wrong (errnum EINVAL: a bad argument; ENOENT: no such model; EBUSY: not
// now).
#pragma once

#include "moecache/daemon/config.h"
#include "moecache/daemon/status.h"
#include "moecache/error.h"
#include "moecache/unique_fd.h"

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace moecache::daemon {

class Control {
public:
    virtual Result<uint32_t> add_model(const std::string& path) = 0;
    virtual Result<void> remove_model(uint32_t id) = 0;
    virtual Result<void> set_budget(const std::string& name, const std::string& amount) = 0;
    virtual Result<void> set_model_budget(uint32_t id, const std::string& amount) = 0;
    virtual Result<uint32_t> set_pinned(uint32_t id, std::span<const std::string> specs, bool pinned) = 0;
    virtual Result<uint64_t> prefetch(uint32_t id, std::span<const std::string> specs) = 0;
    virtual Result<uint64_t> evict(uint32_t id, std::span<const std::string> specs) = 0;
    [[nodiscard]] virtual Result<std::string> export_profile(uint32_t id) const = 0;
    virtual Result<void> import_profile(uint32_t id, const std::string& text) = 0;
    virtual Result<void> start_trace(UniqueFd file) = 0;
    virtual Result<uint64_t> stop_trace() = 0;
    [[nodiscard]] virtual DaemonStatus status(bool experts = true) const = 0;
    [[nodiscard]] virtual std::optional<ModelStatus> model_status(uint32_t id, bool experts = true) const = 0;
    [[nodiscard]] virtual std::vector<uint32_t> model_ids() const = 0;
    [[nodiscard]] virtual const Config& config() const = 0;

protected:
    ~Control() = default;
};

}  // namespace moecache::daemon
