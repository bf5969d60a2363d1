// What moecachectl's verbs share: the D-Bus proxies, errors and exit codes, argument parsing,
// tables and JSON. Each verb has a file of its own under verbs/, as systemctl's do.
#pragma once

#include "moecache/ctl/commands.h"

#include "moecache/ctl/inspect.h"
#include "moecache/dbus/proxy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

namespace moecache::ctl {

using json = nlohmann::json;
constexpr const char* kService = "org.moecache1";
constexpr const char* kManagerPath = "/org/moecache1";

// ---- talking to the daemon --------------------------------------------------------------------

struct ManagerProxy final : sdbus::ProxyInterfaces<org::moecache1::Manager_proxy> {
    explicit ManagerProxy(sdbus::IConnection& c) : ProxyInterfaces(c, kService, kManagerPath) { registerProxy(); }
    virtual ~ManagerProxy() { unregisterProxy(); }
    void onPressureBackoff(const std::string&, const uint64_t&) override {}
    void onBudgetChanged(const std::string&, const uint64_t&) override {}
};

struct ModelProxy final : sdbus::ProxyInterfaces<org::moecache1::Model_proxy> {
    ModelProxy(sdbus::IConnection& c, const std::string& path) : ProxyInterfaces(c, kService, path) { registerProxy(); }
    virtual ~ModelProxy() { unregisterProxy(); }
};

// A failure that ends the verb with this exit code and message.
struct Failure {
    int code;
    std::string message;
};

// How long a call waits for moecached's answer. Every method returns at once (a prefetch that
// waits polls GetStatus), so sd-bus's default of 25 s only delays the message when the daemon is
// stuck or a bus policy drops its replies.
constexpr uint64_t kCallTimeoutSeconds = 10;

std::unique_ptr<sdbus::IConnection> connect(const Options& o);

int exit_code_of(const std::string& name);

std::string explain(const sdbus::Error& e);

// ---- formatting --------------------------------------------------------------------------------

std::string percent(uint64_t part, uint64_t whole);

// Columns, left-aligned text and right-aligned numbers, two spaces apart.
class Table {
public:
    explicit Table(std::vector<std::string> header, std::string right = "") : header_(std::move(header)), right_(std::move(right)) {}
    void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
    [[nodiscard]] std::string render() const {
        std::vector<size_t> w(header_.size(), 0);
        for (size_t i = 0; i < header_.size(); ++i) w[i] = header_[i].size();
        for (const auto& r : rows_)
            for (size_t i = 0; i < r.size() && i < w.size(); ++i) w[i] = std::max(w[i], r[i].size());
        std::string out;
        auto line = [&](const std::vector<std::string>& r) {
            std::string l;
            for (size_t i = 0; i < w.size(); ++i) {
                const std::string& cell = i < r.size() ? r[i] : "";
                const bool last = i + 1 == w.size();
                if (i < right_.size() && right_[i] == 'r') l += fmt::format("{:>{}}", cell, w[i]);
                else l += last ? cell : fmt::format("{:<{}}", cell, w[i]);
                if (!last) l += "  ";
            }
            while (!l.empty() && l.back() == ' ') l.pop_back();
            out += l + "\n";
        };
        line(header_);
        for (const auto& r : rows_) line(r);
        return out;
    }

private:
    std::vector<std::string> header_;
    std::string right_;  // per column: 'r' right-aligned
    std::vector<std::vector<std::string>> rows_;
};

json to_json(const sdbus::Variant& v);

json to_json(const std::map<std::string, sdbus::Variant>& d);

void print_json(const json& j);

// ---- models ------------------------------------------------------------------------------------

struct ModelRef {
    uint32_t id = 0;
    std::string object;
    std::string path;
};

// MODEL on the command line: an id, an object path, a file path (any form that resolves to the
// same file), or a file name that matches exactly one model.
ModelRef resolve_model(ManagerProxy& mgr, const std::string& arg);

// Splits arguments into options (with the names in `with_value` taking the next argument) and
// positionals; an unknown option is a usage error.
struct Args {
    std::vector<std::string> positional;
    std::map<std::string, std::string> opts;
};

Args parse_args(const std::vector<std::string>& in, const std::vector<std::string>& flags,
                const std::vector<std::string>& with_value, const char* verb);

void want_positionals(const Args& a, size_t min, size_t max, const char* verb, const char* synopsis);

// The value of a seconds option (0 to `most`), whole: "5s" or "-1" is a usage error; `fallback`
// when the option is not given.
double seconds_arg(const Args& a, const char* name, double fallback, double most = 86400);

// Runs a verb's body: sdbus errors and failures become a message and an exit code.
template <class Fn>
int guarded(const char* verb, Fn&& fn) {
    try {
        return fn();
    } catch (const Failure& f) {
        fmt::print(stderr, "moecachectl {}: {}\n", verb, f.message);
        if (f.code == kExitUsage) fmt::print(stderr, "(see 'moecachectl help {}')\n", verb);
        return f.code;
    } catch (const sdbus::Error& e) {
        fmt::print(stderr, "moecachectl {}: {}\n", verb, explain(e));
        return exit_code_of(e.getName());
    } catch (const std::exception& e) {
        fmt::print(stderr, "moecachectl {}: {}\n", verb, e.what());
        return kExitFailed;
    }
}

template <class T>
T field(const std::map<std::string, sdbus::Variant>& d, const char* key, T fallback = T{}) {
    const auto it = d.find(key);
    if (it == d.end()) return fallback;
    try {
        return it->second.get<T>();
    } catch (const sdbus::Error&) {
        return fallback;
    }
}

// The verbs (verbs/*.cpp).
int cmd_status(const Options& o, const std::vector<std::string>& args);
int cmd_models(const Options& o, const std::vector<std::string>& args);
int cmd_experts(const Options& o, const std::vector<std::string>& args);
int cmd_budget(const Options& o, const std::vector<std::string>& args);
int cmd_pin(const Options& o, const std::vector<std::string>& args);
int cmd_unpin(const Options& o, const std::vector<std::string>& args);
int cmd_prefetch(const Options& o, const std::vector<std::string>& args);
int cmd_wait(const Options& o, const std::vector<std::string>& args);
int cmd_evict(const Options& o, const std::vector<std::string>& args);
int cmd_profile(const Options& o, const std::vector<std::string>& args);
int cmd_trace(const Options& o, const std::vector<std::string>& args);
int cmd_register(const Options& o, const std::vector<std::string>& args);
int cmd_unregister(const Options& o, const std::vector<std::string>& args);
int cmd_inspect(const Options& o, const std::vector<std::string>& args);

}  // namespace moecache::ctl
