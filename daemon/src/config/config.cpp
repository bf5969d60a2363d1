// TOML text -> Config, the first of the two steps (validate.cpp is the second). The schema is one
// table of keys per section below: the same table reads the values, rejects unknown keys and
// suggests the closest known one, so a key cannot be readable yet missing from the suggestions.
// Every message starts "FILE:LINE:COL: KEY:" so that an editor can jump to it.
//
// toml++ is the Debian build, compiled with exceptions: its parse_error is caught here, and
// parse_config_text catches anything else (std::bad_alloc), so no exception leaves the library.
#include "moecache/daemon/config.h"
#include "moecache/device_list.h"
#include "moecache/http.h"

#include <fmt/ranges.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <limits>
#include <span>
#include <utility>

namespace moecache::daemon {
namespace {

// One TOML value being read, with what a message needs to point at it.
struct Value {
    const toml::node& node;
    std::string_view file;
    std::string key;  // dotted path: "budget.lock", "model[2].pin[1]"

    // "FILE:LINE:COL", or "FILE" when toml++ has no position.
    [[nodiscard]] std::string origin() const {
        const auto& at = node.source().begin;
        if (at.line == 0) return std::string(file);
        return fmt::format("{}:{}:{}", file, at.line, at.column);
    }

    template <typename... Args>
    [[nodiscard]] tl::unexpected<Error> fail(fmt::format_string<Args...> f, Args&&... args) const {
        return failf("{}: {}: {}", origin(), key, fmt::format(f, std::forward<Args>(args)...));
    }

    [[nodiscard]] Value child(const toml::node& n, std::string_view name) const {
        return Value{n, file, key.empty() ? std::string(name) : fmt::format("{}.{}", key, name)};
    }
    [[nodiscard]] Value element(const toml::node& n, size_t index) const {
        return Value{n, file, fmt::format("{}[{}]", key, index)};
    }
};

// ---- Messages --------------------------------------------------------------------------------

std::string_view type_name(toml::node_type t) {
    switch (t) {
        case toml::node_type::none: return "nothing";
        case toml::node_type::table: return "a table";
        case toml::node_type::array: return "an array";
        case toml::node_type::string: return "a string";
        case toml::node_type::integer: return "an integer";
        case toml::node_type::floating_point: return "a floating-point number";
        case toml::node_type::boolean: return "a boolean";
        case toml::node_type::date: return "a date";
        case toml::node_type::time: return "a time";
        case toml::node_type::date_time: return "a date-time";
    }
    return "an unknown type";
}

// The value itself where it is short to show: a user who wrote "32" for 32 sees the quotes.
std::string show(const toml::node& n) {
    if (const auto* s = n.as_string()) return fmt::format(" (\"{}\")", s->get());
    if (const auto* i = n.as_integer()) return fmt::format(" ({})", i->get());
    if (const auto* d = n.as_floating_point()) return fmt::format(" ({})", d->get());
    if (const auto* b = n.as_boolean()) return b->get() ? " (true)" : " (false)";
    return "";
}

tl::unexpected<Error> wrong_type(const Value& v, std::string_view expected) {
    return v.fail("wrong type: expected {}, got {}{}", expected, type_name(v.node.type()),
                  show(v.node));
}

size_t edit_distance(std::string_view a, std::string_view b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
        size_t diagonal = row[0];
        row[0] = i;
        for (size_t j = 1; j <= b.size(); ++j) {
            const size_t up = row[j];
            row[j] =
                std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
            diagonal = up;
        }
    }
    return row[b.size()];
}

// " (did you mean 'x'?)" when a candidate is close enough to be a typo of `name`, or `name` is
// the start of it ("warn" for "warning"), else "".
template <class Names>
std::string did_you_mean(std::string_view name, const Names& candidates) {
    if (name.size() > 64) return "";  // not a typo of any key, and costly to compare
    std::string_view best;
    size_t best_distance = std::numeric_limits<size_t>::max();
    for (std::string_view c : candidates) {
        const bool abbreviation = name.size() >= 3 && c.starts_with(name);
        const size_t d = edit_distance(name, c);
        if (d > std::max<size_t>(2, name.size() / 3) && !abbreviation) continue;
        if (d < best_distance) {
            best = c;
            best_distance = d;
        }
    }
    if (best.empty()) return "";
    return fmt::format(" (did you mean '{}'?)", best);
}

// ---- Typed reads -----------------------------------------------------------------------------

Result<std::string> read_string(const Value& v) {
    const auto* s = v.node.as_string();
    if (!s) return wrong_type(v, "a string");
    return s->get();
}

// A family name: 1..128 printable ASCII characters (it appears in logs, metrics and D-Bus).
Result<std::string> read_family(const Value& v) {
    auto s = MC_TRY(read_string(v));
    if (s.empty() || s.size() > 128 ||
        !std::all_of(s.begin(), s.end(), [](char c) { return c > ' ' && c < 127; }))
        return v.fail("a family is 1 to 128 printable characters without spaces");
    return s;
}

Result<bool> read_bool(const Value& v) {
    const auto* b = v.node.as_boolean();
    if (!b) return wrong_type(v, "a boolean (true or false)");
    return b->get();
}

// The daemon's working directory is "/", so a relative path would not mean what the user meant.
Result<std::string> read_absolute_path(const Value& v) {
    auto path = MC_TRY(read_string(v));
    if (path.empty()) return v.fail("the path is empty");
    if (path.find('\0') != std::string::npos) return v.fail("the path contains a NUL character");
    if (path.front() != '/')
        return v.fail("'{}' is a relative path: write an absolute path, starting with '/'", path);
    return path;
}

// An absolute path, or "" for none.
Result<std::string> read_path_or_none(const Value& v) {
    if (const auto* s = v.node.as_string(); s && s->get().empty()) return std::string();
    return read_absolute_path(v);
}

// A Unix socket's path fits sockaddr_un::sun_path (108 bytes with its NUL).
Result<std::string> read_socket_path(const Value& v) {
    auto path = MC_TRY(read_absolute_path(v));
    if (path.size() > 107) return v.fail("'{}' is {} bytes long; a Unix socket path has at most 107", path, path.size());
    return path;
}

Result<int64_t> read_int(const Value& v, int64_t lo, int64_t hi) {
    const auto* i = v.node.as_integer();
    if (!i) return wrong_type(v, "an integer");
    const int64_t x = i->get();
    if (x < lo || x > hi)
        return v.fail("{} is out of range: it must be at least {} and at most {}", x, lo, hi);
    return x;
}

// A bound of a floating-point range; an infinite value means none.
struct Bound {
    double value;
    bool inclusive;
};
constexpr Bound kNoUpperBound{std::numeric_limits<double>::infinity(), true};

std::string describe_range(Bound lo, Bound hi) {
    auto text = fmt::format("{} {}", lo.inclusive ? "at least" : "greater than", lo.value);
    if (!std::isinf(hi.value))
        text += fmt::format(" and {} {}", hi.inclusive ? "at most" : "less than", hi.value);
    return text;
}

// Integers are welcome where a float is expected: "tick_seconds = 1" means what it says.
Result<double> read_number(const Value& v, Bound lo, Bound hi) {
    double x = 0;
    if (const auto* d = v.node.as_floating_point())
        x = d->get();
    else if (const auto* i = v.node.as_integer())
        x = static_cast<double>(i->get());
    else
        return wrong_type(v, "a number");
    if (!std::isfinite(x))
        return v.fail("{} is out of range: it must be a finite number, {}", x,
                      describe_range(lo, hi));
    const bool above = lo.inclusive ? x >= lo.value : x > lo.value;
    const bool below = hi.inclusive ? x <= hi.value : x < hi.value;
    if (!above || !below)
        return v.fail("{} is out of range: it must be {}", x, describe_range(lo, hi));
    return x;
}

Result<ByteAmount> read_byte_amount(const Value& v) {
    if (const auto* i = v.node.as_integer()) {
        if (i->get() < 0) return v.fail("{} is negative: a size is at least 0 bytes", i->get());
        return ByteAmount{static_cast<uint64_t>(i->get()), std::nullopt};
    }
    const auto* s = v.node.as_string();
    if (!s) return wrong_type(v, "an integer (bytes) or a string such as \"48GiB\" or \"60%\"");
    auto amount = parse_byte_amount(s->get());
    if (!amount) return v.fail("{}", amount.error().message);
    return *amount;
}

Result<std::string> read_log_level(const Value& v) {
    static constexpr std::string_view kLevels[] = {"error", "warning", "info", "debug"};
    auto level = MC_TRY(read_string(v));
    if (std::find(std::begin(kLevels), std::end(kLevels), level) == std::end(kLevels))
        return v.fail("'{}' is not a log level: use error, warning, info or debug{}", level,
                      did_you_mean(level, kLevels));
    return level;
}

Result<std::string> read_prefetch_engine(const Value& v) {
    static constexpr std::string_view kEngines[] = {"auto", "io_uring", "threads"};
    auto engine = MC_TRY(read_string(v));
    if (std::find(std::begin(kEngines), std::end(kEngines), engine) == std::end(kEngines))
        return v.fail("'{}' is not a prefetch engine: use auto, io_uring or threads{}", engine, did_you_mean(engine, kEngines));
    return engine;
}

// "auto" (as far as free memory goes), "off", or a size ("4GiB", "25%").
Result<void> read_warm_start(const Value& v, Config& c) {
    if (const auto* b = v.node.as_boolean()) {
        c.warm_start = b->get();
        c.warm_limit.reset();
        return {};
    }
    const auto* s = v.node.as_string();
    if (!s) return wrong_type(v, "\"auto\", \"off\" or a size such as \"4GiB\" or \"25%\"");
    if (s->get() == "auto" || s->get() == "off") {
        c.warm_start = s->get() == "auto";
        c.warm_limit.reset();
        return {};
    }
    auto amount = parse_byte_amount(s->get());
    if (!amount) return v.fail("'{}' is neither \"auto\", \"off\" nor a size: {}", s->get(), amount.error().message);
    c.warm_start = true;
    c.warm_limit = *amount;
    return {};
}

// Bytes, never a share of RAM: a read request's size has nothing to do with how much RAM there is.
Result<uint32_t> read_read_size(const Value& v) {
    constexpr uint64_t kMin = 4ull << 10, kMax = 64ull << 20, kPage = 4096;
    const auto amount = MC_TRY(read_byte_amount(v));
    if (amount.percent) return v.fail("a read size is in bytes, not a percentage of RAM");
    if (amount.bytes < kMin || amount.bytes > kMax)
        return v.fail("{} is out of range: it must be at least 4 KiB and at most 64 MiB",
                      format_bytes(amount.bytes));
    if (amount.bytes % kPage != 0)
        return v.fail("{} is not a multiple of 4096 (reads are whole pages)",
                      format_bytes(amount.bytes));
    return static_cast<uint32_t>(amount.bytes);
}

Result<std::string> read_page_cache_mode(const Value& v) {
    static constexpr std::string_view kModes[] = {"auto", "on", "off"};
    auto mode = MC_TRY(read_string(v));
    if (std::find(std::begin(kModes), std::end(kModes), mode) == std::end(kModes))
        return v.fail("'{}' is not a mode: use auto (on where the kernel allows), on (the daemon does not "
                      "start without it) or off{}",
                      mode, did_you_mean(mode, kModes));
    return mode;
}

// The kernel takes a BPF ring buffer of a power-of-two number of pages.
Result<uint32_t> read_ring_size(const Value& v) {
    constexpr uint64_t kMin = 4ull << 10, kMax = 1ull << 30;
    const auto amount = MC_TRY(read_byte_amount(v));
    if (amount.percent) return v.fail("a ring buffer size is in bytes, not a percentage of RAM");
    if (amount.bytes < kMin || amount.bytes > kMax)
        return v.fail("{} is out of range: it must be at least 4 KiB and at most 1 GiB", format_bytes(amount.bytes));
    if ((amount.bytes & (amount.bytes - 1)) != 0)
        return v.fail("{} is not a power of two (the kernel's ring buffers are)", format_bytes(amount.bytes));
    return static_cast<uint32_t>(amount.bytes);
}

// A list of user or group ids: integers 0 .. 2^32-2 (-1 is no id).
Result<std::vector<uint32_t>> read_id_list(const Value& v) {
    const auto* array = v.node.as_array();
    if (!array) return wrong_type(v, "an array of numeric ids, such as [0, 1000]");
    std::vector<uint32_t> ids;
    for (size_t i = 0; i < array->size(); ++i) {
        const Value e = v.element(*array->get(i), i);
        const auto* n = e.node.as_integer();
        if (!n) return wrong_type(e, "a numeric id (names are not looked up: write the number)");
        if (n->get() < 0 || n->get() > 0xfffffffe) return e.fail("{} is not a user or group id", n->get());
        ids.push_back(static_cast<uint32_t>(n->get()));
    }
    return ids;
}

// { "1000" = "8GiB", "1001" = "20%" }: uids as keys (TOML keys are strings), sizes as values.
Result<std::map<uint32_t, ByteAmount>> read_uid_budgets(const Value& v) {
    const auto* table = v.node.as_table();
    if (!table) return wrong_type(v, "a table of uid = size, such as { \"1000\" = \"8GiB\" }");
    std::map<uint32_t, ByteAmount> out;
    for (const auto& [k, node] : *table) {
        const Value e = v.child(node, k.str());
        const std::string key(k.str());
        char* end = nullptr;
        const unsigned long long uid = std::strtoull(key.c_str(), &end, 10);
        if (key.empty() || *end != '\0' || !std::isdigit(static_cast<unsigned char>(key[0])) || uid > 0xfffffffe)
            return e.fail("'{}' is not a numeric uid", key);
        out[static_cast<uint32_t>(uid)] = MC_TRY(read_byte_amount(e));
    }
    return out;
}

Result<std::vector<ExpertPin>> read_pins(const Value& v) {
    constexpr std::string_view kExpected = "a string such as \"12\", \"12:3\" or \"12:0-7\"";
    const auto* array = v.node.as_array();
    if (!array) return wrong_type(v, fmt::format("an array of pins, each {}", kExpected));
    std::vector<ExpertPin> pins;
    for (size_t i = 0; i < array->size(); ++i) {
        const Value e = v.element(*array->get(i), i);
        const auto* s = e.node.as_string();
        if (!s) return wrong_type(e, kExpected);
        auto pin = parse_expert_pin(s->get());
        if (!pin) return e.fail("{}", pin.error().message);
        pins.push_back(*pin);
    }
    return pins;
}

// ---- The schema ------------------------------------------------------------------------------

template <class Target>
struct Key {
    std::string_view name;
    Result<void> (*read)(const Value&, Target&);
};

// Readers are captureless lambdas so that each key's type and range sit on the key's own line.
#define MC_KEY(name, Target, statement)                       \
    Key<Target> {                                             \
        name, [](const Value& v, Target& t) -> Result<void> { \
            statement;                                        \
            return {};                                        \
        }                                                     \
    }

using U32 = uint32_t;
constexpr int64_t kU32Max = std::numeric_limits<uint32_t>::max();

const Key<Config> kDaemonKeys[] = {
    MC_KEY("state_dir", Config, t.state_dir = MC_TRY(read_absolute_path(v))),
    MC_KEY("fleet_profiles", Config, t.fleet_profiles = MC_TRY(read_path_or_none(v))),
    MC_KEY("socket", Config, t.socket_path = MC_TRY(read_socket_path(v))),
    MC_KEY("log_level", Config, t.log_level = MC_TRY(read_log_level(v))),
    MC_KEY("tick_seconds", Config,
           t.tick_seconds = MC_TRY(read_number(v, {0.05, true}, {60, true}))),
    MC_KEY("oom_score_adj", Config, t.oom_score_adj = static_cast<int>(MC_TRY(read_int(v, -1000, 1000)))),
};

const Key<Config> kBudgetKeys[] = {
    MC_KEY("lock", Config, t.lock_budget = MC_TRY(read_byte_amount(v))),
    MC_KEY("reserve", Config, t.reserve = MC_TRY(read_byte_amount(v))),
};

const Key<Config> kPrefetchKeys[] = {
    MC_KEY("queue_depth", Config, t.queue_depth = static_cast<U32>(MC_TRY(read_int(v, 1, 4096)))),
    MC_KEY("engine", Config, t.prefetch_engine = MC_TRY(read_prefetch_engine(v))),
    MC_KEY("threads", Config, t.prefetch_threads = static_cast<U32>(MC_TRY(read_int(v, 0, 64)))),
    MC_KEY("read_size", Config, t.read_size = MC_TRY(read_read_size(v))),
    MC_KEY("numa_node", Config, t.numa_node = static_cast<int>(MC_TRY(read_int(v, -1, 1023)))),
    MC_KEY("read_deadline", Config, t.read_deadline_seconds = MC_TRY(read_number(v, {0.1, true}, {3600, true}))),
    MC_KEY("on_miss", Config, t.on_miss = MC_TRY(read_bool(v))),
    MC_KEY("warm_start", Config, MC_TRY_VOID(read_warm_start(v, t))),
};

// The kernel takes PSI trigger windows of 0.5 s to 10 s; stall <= window is checked in
// validate_config, since the two may come from different files.
const Key<Config> kPressureKeys[] = {
    MC_KEY("enabled", Config, t.pressure_enabled = MC_TRY(read_bool(v))),
    MC_KEY("stall_us", Config,
           t.pressure_stall_us = static_cast<U32>(MC_TRY(read_int(v, 1, 10'000'000)))),
    MC_KEY("window_us", Config,
           t.pressure_window_us = static_cast<U32>(MC_TRY(read_int(v, 500'000, 10'000'000)))),
    MC_KEY("release_share", Config,
           t.pressure_release_share = MC_TRY(read_number(v, {0, false}, {1, true}))),
    MC_KEY("recover_seconds", Config,
           t.pressure_recover_seconds = MC_TRY(read_number(v, {0, true}, kNoUpperBound))),
};

const Key<Config> kPolicyKeys[] = {
    MC_KEY("decay_half_life_tokens", Config,
           t.decay_half_life_tokens = MC_TRY(read_number(v, {0, false}, kNoUpperBound))),
    MC_KEY("admit_after_uses", Config,
           t.admit_after_uses = static_cast<U32>(MC_TRY(read_int(v, 1, kU32Max)))),
    MC_KEY("elite_share", Config, t.elite_share = MC_TRY(read_number(v, {0, true}, {1, true}))),
    MC_KEY("hysteresis", Config, t.hysteresis = MC_TRY(read_number(v, {0, true}, kNoUpperBound))),
    MC_KEY("predict", Config, t.predict = MC_TRY(read_bool(v))),
    MC_KEY("save_interval_seconds", Config,
           t.save_interval_seconds = MC_TRY(read_number(v, {1, true}, kNoUpperBound))),
};

const Key<Config> kTelemetryKeys[] = {
    MC_KEY("page_cache", Config, t.page_cache_telemetry = MC_TRY(read_page_cache_mode(v))),
    MC_KEY("ring_buffer", Config, t.page_cache_ring_bytes = MC_TRY(read_ring_size(v))),
};

const Key<Config> kClientKeys[] = {
    MC_KEY("allow_uids", Config, t.client_allow_uids = MC_TRY(read_id_list(v))),
    MC_KEY("allow_gids", Config, t.client_allow_gids = MC_TRY(read_id_list(v))),
    MC_KEY("max", Config, t.max_clients = static_cast<U32>(MC_TRY(read_int(v, 1, 65536)))),
    MC_KEY("max_per_uid", Config, t.max_clients_per_uid = static_cast<U32>(MC_TRY(read_int(v, 1, 65536)))),
    MC_KEY("max_models_per_uid", Config, t.max_models_per_uid = static_cast<U32>(MC_TRY(read_int(v, 1, 65536)))),
    MC_KEY("max_experts_per_uid", Config, t.max_experts_per_uid = static_cast<U32>(MC_TRY(read_int(v, 1, 1 << 24)))),
    MC_KEY("hello_seconds", Config, t.hello_seconds = MC_TRY(read_number(v, {0.05, true}, {3600, true}))),
    MC_KEY("idle_seconds", Config, t.idle_seconds = MC_TRY(read_number(v, {0, true}, {86400, true}))),
    MC_KEY("uid_budgets", Config, t.uid_budgets = MC_TRY(read_uid_budgets(v))),
};

// "8GiB" for every device, or a list of "DEVICE:SIZE" items with at most one plain size (every
// other device): "0:12GiB,1:6GiB", "8GiB,1:4GiB".
Result<void> read_vram_pool(const Value& v, Config& t) {
    const auto* s = v.node.as_string();
    if (s == nullptr || s->get().find(':') == std::string::npos) {
        const auto amount = MC_TRY(read_byte_amount(v));
        if (amount.percent) return v.fail("a VRAM pool is a size (\"8GiB\"), not a share of RAM");
        t.vram_pool = amount.bytes;
        return {};
    }
    auto items = parse_device_list(s->get(), 64);
    if (!items) return v.fail("{}", items.error().what());
    std::optional<uint64_t> all;
    std::map<uint32_t, uint64_t> devices;
    for (const auto& item : *items) {
        auto size = parse_byte_amount(item.value);
        if (!size) return v.fail("'{}': {}", item.text, size.error().what());
        if (size->percent) return v.fail("'{}': a VRAM pool is a size (\"8GiB\"), not a share of RAM", item.text);
        if (item.device) devices.emplace(*item.device, size->bytes);
        else all = size->bytes;
    }
    t.vram_pool = all;
    t.vram_pool_device = std::move(devices);
    return {};
}

Result<std::string> read_listen(const Value& v) {
    const auto* s = v.node.as_string();
    if (!s) return wrong_type(v, "a string");
    const std::string text = s->get();
    if (text.empty()) return text;
    if (auto r = parse_listen_address(text); !r) return v.fail("{}", r.error().what());
    return text;
}

const Key<Config> kMetricsKeys[] = {
    MC_KEY("listen", Config, t.metrics_listen = MC_TRY(read_listen(v))),
    MC_KEY("paths", Config, t.metrics_paths = MC_TRY(read_bool(v))),
};

Result<std::string> read_bus(const Value& v) {
    const auto* s = v.node.as_string();
    if (!s) return wrong_type(v, "a string");
    const std::string text = s->get();
    if (text == "system" || text == "session" || text == "off") return text;
    if (text.rfind("unix:", 0) == 0 && text.size() <= 1024 && text.find('\0') == std::string::npos) return text;
    return v.fail("'{}' is not a bus: \"system\", \"session\", \"off\" or a D-Bus address (\"unix:path=...\")", text);
}

Result<std::string> read_group_name(const Value& v) {
    const auto* s = v.node.as_string();
    if (!s) return wrong_type(v, "a string");
    const std::string text = s->get();
    const bool ok = text.size() <= 32 && std::all_of(text.begin(), text.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '.';
    });
    if (!ok) return v.fail("'{}' is not a group name (letters, digits, '_', '-', '.'; at most 32)", text);
    return text;
}

const Key<Config> kDbusKeys[] = {
    MC_KEY("bus", Config, t.dbus_bus = MC_TRY(read_bus(v))),
    MC_KEY("admin_group", Config, t.dbus_admin_group = MC_TRY(read_group_name(v))),
};

const Key<Config> kVramKeys[] = {
    MC_KEY("pool", Config, MC_TRY_VOID(read_vram_pool(v, t))),
    MC_KEY("keep_ram_copy", Config, t.keep_ram_copy = MC_TRY(read_bool(v))),
    MC_KEY("directed", Config, t.pool_directed = MC_TRY(read_number(v, {0, true}, {1, true}))),
    MC_KEY("fill_from_files", Config, t.fill_from_files = MC_TRY(read_bool(v))),
};

const Key<ModelConfig> kModelKeys[] = {
    MC_KEY("path", ModelConfig, t.path = MC_TRY(read_absolute_path(v))),
    MC_KEY("budget", ModelConfig, t.budget = MC_TRY(read_byte_amount(v))),
    MC_KEY("pin", ModelConfig, t.pins = MC_TRY(read_pins(v))),
    MC_KEY("lock_dense", ModelConfig, t.lock_dense = MC_TRY(read_bool(v))),
    MC_KEY("family", ModelConfig, t.family = MC_TRY(read_family(v))),
    MC_KEY("family_budget", ModelConfig, t.family_budget = MC_TRY(read_byte_amount(v))),
    MC_KEY("keep", ModelConfig, t.keep = MC_TRY(read_bool(v))),
};

#undef MC_KEY

struct Section {
    std::string_view name;
    std::span<const Key<Config>> keys;
};

const Section kSections[] = {
    {"daemon", kDaemonKeys},     {"budget", kBudgetKeys}, {"prefetch", kPrefetchKeys},
    {"pressure", kPressureKeys}, {"policy", kPolicyKeys}, {"telemetry", kTelemetryKeys},
    {"clients", kClientKeys},    {"metrics", kMetricsKeys}, {"vram", kVramKeys},
    {"dbus", kDbusKeys},
};
constexpr std::string_view kModelSection = "model";

std::vector<std::string_view> table_names() {
    std::vector<std::string_view> names;
    for (const auto& s : kSections) names.push_back(s.name);
    names.push_back(kModelSection);
    return names;
}

// ---- Walking the document --------------------------------------------------------------------

// The key path already says which table; the message offers the likely key, or all of them.
template <class Target>
tl::unexpected<Error> unknown_key(const Value& v, std::string_view name,
                                  std::span<const Key<Target>> keys) {
    std::vector<std::string_view> known;
    for (const auto& k : keys) known.push_back(k.name);
    if (auto hint = did_you_mean(name, known); !hint.empty())
        return v.fail("unknown key '{}'{}", name, hint);
    return v.fail("unknown key '{}'; the keys here are {}", name, fmt::join(known, ", "));
}

// Reads every key of `table` into `target`; `origins`, when given, learns where each came from.
template <class Target>
Result<void> read_keys(const Value& at, const toml::table& table, std::span<const Key<Target>> keys,
                       Target& target, std::map<std::string, std::string>* origins) {
    for (auto&& entry : table) {
        // Plain locals, not a structured binding: clang 14 cannot capture bindings in lambdas.
        const std::string_view name = entry.first.str();
        const Value v = at.child(entry.second, name);
        const auto key = std::find_if(keys.begin(), keys.end(),
                                      [&](const Key<Target>& k) { return k.name == name; });
        if (key == keys.end()) return unknown_key(v, name, keys);
        MC_TRY_VOID(key->read(v, target));
        if (origins) (*origins)[v.key] = v.origin();
    }
    return {};
}

Result<void> check_not_duplicate(const std::vector<ModelConfig>& models, const ModelConfig& m,
                                 const Value& v) {
    // "/m//a.gguf" and "/m/a.gguf" are one file; the daemon must not register it twice.
    const auto normal = std::filesystem::path(m.path).lexically_normal();
    for (const auto& other : models)
        if (std::filesystem::path(other.path).lexically_normal() == normal)
            return v.fail(
                "duplicate model path '{}': it is already configured at {}; drop-ins add "
                "models, so each model may be named once",
                m.path, other.where);
    return {};
}

Result<ModelConfig> read_model(const Value& v) {
    const auto* table = v.node.as_table();
    if (!table) return wrong_type(v, "a table");
    ModelConfig m;
    MC_TRY_VOID(read_keys<ModelConfig>(v, *table, kModelKeys, m, nullptr));
    if (m.path.empty())
        return v.fail(
            "this [[model]] has no 'path': every model needs path = \"/absolute/path.gguf\" "
            "(or a glob such as \"/models/kimi/*.gguf\")");
    m.where = fmt::format("{}: {}", v.origin(), v.key);
    return m;
}

// [[model]] entries are appended, so a drop-in adds models to those of the files before it.
Result<void> read_models(const Value& v, Config& c) {
    const auto* array = v.node.as_array();
    if (!array || (!array->empty() && !array->is_array_of_tables()))
        return wrong_type(v, "an array of tables (write [[model]], with two brackets)");
    for (size_t i = 0; i < array->size(); ++i) {
        const Value mv = v.element(*array->get(i), i);
        auto m = MC_TRY(read_model(mv));
        MC_TRY_VOID(check_not_duplicate(c.models, m, mv));
        c.models.push_back(std::move(m));
    }
    return {};
}

// A name at the top level that is not one of the sections: a mistyped table, or a key written
// above the first table header (TOML puts a key below a header into that header's table).
tl::unexpected<Error> unknown_top_level(const Value& v, std::string_view name) {
    if (v.node.is_table() || v.node.is_array_of_tables())
        return v.fail("unknown table [{}]{}", name, did_you_mean(name, table_names()));
    for (const auto& s : kSections)
        for (const auto& k : s.keys)
            if (k.name == name)
                return v.fail("unknown key '{}' at the top level: it belongs in [{}]", name,
                              s.name);
    return v.fail(
        "unknown key '{}' at the top level: settings belong in the tables [daemon], "
        "[budget], [prefetch], [pressure], [policy] and [[model]]",
        name);
}

Result<void> read_document(const toml::table& root, std::string_view file, Config& c) {
    for (auto&& entry : root) {
        const std::string_view name = entry.first.str();
        const Value v{entry.second, file, std::string(name)};
        if (name == kModelSection) {
            MC_TRY_VOID(read_models(v, c));
            continue;
        }
        const auto section = std::find_if(std::begin(kSections), std::end(kSections),
                                          [&](const Section& s) { return s.name == name; });
        if (section == std::end(kSections)) return unknown_top_level(v, name);
        const auto* table = v.node.as_table();
        if (!table) return wrong_type(v, fmt::format("a table ([{}])", name));
        MC_TRY_VOID(read_keys<Config>(v, *table, section->keys, c, &c.origins));
    }
    return {};
}

Result<toml::table> parse_toml(const std::string& text, const std::string& name) {
    try {
        return toml::parse(text, std::string(name));
    } catch (const toml::parse_error& e) {
        const auto& at = e.source().begin;
        return failf("{}:{}:{}: TOML syntax error: {}", name, at.line, at.column, e.description());
    }
}

}  // namespace

Result<Config> parse_config_text(const std::string& text, const std::string& name, Config base) {
    try {
        const auto root = MC_TRY(parse_toml(text, name));
        base.sources.push_back(name);
        MC_TRY_VOID(read_document(root, name, base));
        return base;
    } catch (const std::exception& e) {
        return failf("{}: cannot read the config: {}", name, e.what());
    }
}

}  // namespace moecache::daemon
