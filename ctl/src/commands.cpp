// moecachectl's verbs: D-Bus calls to moecached (through the proxy generated from
// dbus/org.moecache1.xml) and what they print.
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
namespace {

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

std::unique_ptr<sdbus::IConnection> connect(const Options& o) {
    try {
        std::unique_ptr<sdbus::IConnection> c;
        if (o.bus == "system") c = sdbus::createSystemBusConnection();
        else if (o.bus == "session") c = sdbus::createSessionBusConnection();
        else c = sdbus::createSessionBusConnectionWithAddress(o.bus);
        c->setMethodCallTimeout(kCallTimeoutSeconds * 1'000'000);
        return c;
    } catch (const sdbus::Error& e) {
        throw Failure{kExitUnreachable, fmt::format("cannot reach the {} bus: {} (is dbus running? --bus chooses another)",
                                                    o.bus, e.getMessage())};
    }
}

int exit_code_of(const std::string& name) {
    static const std::map<std::string, int> kCodes = {
        {"org.freedesktop.DBus.Error.ServiceUnknown", kExitUnreachable},
        {"org.freedesktop.DBus.Error.NameHasNoOwner", kExitUnreachable},
        {"org.freedesktop.DBus.Error.NoServer", kExitUnreachable},
        {"org.freedesktop.DBus.Error.NoReply", kExitUnreachable},
        {"org.freedesktop.DBus.Error.Disconnected", kExitUnreachable},
        {"org.freedesktop.DBus.Error.Timeout", kExitUnreachable},
        {"org.freedesktop.DBus.Error.AccessDenied", kExitDenied},
        {"org.moecache1.Error.AccessDenied", kExitDenied},
        {"org.freedesktop.DBus.Error.UnknownObject", kExitNotFound},
        {"org.moecache1.Error.NotFound", kExitNotFound},
        {"org.moecache1.Error.InvalidArgument", kExitUsage},
    };
    const auto it = kCodes.find(name);
    return it == kCodes.end() ? kExitFailed : it->second;
}

std::string explain(const sdbus::Error& e) {
    const int code = exit_code_of(e.getName());
    if (e.getName() == "org.freedesktop.DBus.Error.NoReply" || e.getName() == "org.freedesktop.DBus.Error.Timeout")
        return fmt::format("moecached did not answer within {} s ({}): is it stuck? (systemctl status moecached) A bus "
                           "policy that lets calls through but drops the replies looks the same",
                           kCallTimeoutSeconds, e.getName());
    if (code == kExitUnreachable)
        return fmt::format("moecached is not on the bus ({}): is it running? (systemctl status moecached)", e.getName());
    if (e.getName() == "org.freedesktop.DBus.Error.AccessDenied")
        return "not allowed: changes need root or membership of the group moecache (the bus refused the call)";
    return e.getMessage();
}

// ---- formatting --------------------------------------------------------------------------------

std::string percent(uint64_t part, uint64_t whole) {
    return whole == 0 ? "-" : fmt::format("{:.0f}%", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
}

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

json to_json(const sdbus::Variant& v) {
    const std::string t = v.peekValueType();
    if (t == "s") return v.get<std::string>();
    if (t == "b") return v.get<bool>();
    if (t == "u") return v.get<uint32_t>();
    if (t == "t") return v.get<uint64_t>();
    if (t == "i") return v.get<int32_t>();
    if (t == "x") return v.get<int64_t>();
    if (t == "d") return v.get<double>();
    return nullptr;
}

json to_json(const std::map<std::string, sdbus::Variant>& d) {
    json j = json::object();
    for (const auto& [k, v] : d) j[k] = to_json(v);
    return j;
}

void print_json(const json& j) {
    fmt::print("{}\n", j.dump(2, ' ', false, json::error_handler_t::replace));
}

// ---- models ------------------------------------------------------------------------------------

struct ModelRef {
    uint32_t id = 0;
    std::string object;
    std::string path;
};

// MODEL on the command line: an id, an object path, a file path (any form that resolves to the
// same file), or a file name that matches exactly one model.
ModelRef resolve_model(ManagerProxy& mgr, const std::string& arg) {
    const auto models = mgr.ListModels();
    std::vector<ModelRef> all;
    for (const auto& m : models) all.push_back({m.get<1>(), m.get<0>(), m.get<2>()});
    const bool digits = !arg.empty() && arg.size() < 10 && std::all_of(arg.begin(), arg.end(), [](char c) { return c >= '0' && c <= '9'; });
    std::vector<ModelRef> hits;
    char real[PATH_MAX];
    const std::string resolved = ::realpath(arg.c_str(), real) ? std::string(real) : arg;
    for (const auto& m : all) {
        const std::string base = m.path.substr(m.path.rfind('/') + 1);
        if ((digits && m.id == std::stoul(arg)) || m.object == arg || m.path == arg || m.path == resolved || base == arg)
            hits.push_back(m);
    }
    if (hits.size() == 1) return hits[0];
    if (hits.empty()) {
        std::string known;
        for (const auto& m : all) known += fmt::format("\n  {}  {}", m.id, m.path);
        throw Failure{kExitNotFound, fmt::format("no model '{}' in moecached{}", arg,
                                                 all.empty() ? " (it manages none)" : "; it manages:" + known)};
    }
    throw Failure{kExitUsage, fmt::format("'{}' matches {} models: name one by its id (moecachectl models)", arg, hits.size())};
}

// Splits arguments into options (with the names in `with_value` taking the next argument) and
// positionals; an unknown option is a usage error.
struct Args {
    std::vector<std::string> positional;
    std::map<std::string, std::string> opts;
};

Args parse_args(const std::vector<std::string>& in, const std::vector<std::string>& flags,
                const std::vector<std::string>& with_value, const char* verb) {
    Args a;
    for (size_t i = 0; i < in.size(); ++i) {
        const std::string& s = in[i];
        if (s == "--") {
            a.positional.insert(a.positional.end(), in.begin() + static_cast<long>(i) + 1, in.end());
            break;
        }
        if (s.size() > 1 && s[0] == '-' && !(s.size() > 1 && std::isdigit(static_cast<unsigned char>(s[1])))) {
            if (std::find(flags.begin(), flags.end(), s) != flags.end()) a.opts[s] = "1";
            else if (std::find(with_value.begin(), with_value.end(), s) != with_value.end()) {
                if (i + 1 >= in.size()) throw Failure{kExitUsage, fmt::format("{}: {} needs a value", verb, s)};
                a.opts[s] = in[++i];
            } else {
                throw Failure{kExitUsage, fmt::format("{}: unknown option '{}'", verb, s)};
            }
        } else {
            a.positional.push_back(s);
        }
    }
    return a;
}

void want_positionals(const Args& a, size_t min, size_t max, const char* verb, const char* synopsis) {
    if (a.positional.size() < min || a.positional.size() > max)
        throw Failure{kExitUsage, fmt::format("usage: moecachectl {} {}", verb, synopsis)};
}

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

// ---- verbs -------------------------------------------------------------------------------------

int cmd_status(const Options& o, const std::vector<std::string>& args) {
    return guarded("status", [&] {
        want_positionals(parse_args(args, {}, {}, "status"), 0, 0, "status", "");
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto s = mgr.GetStatus();
        if (o.json) {
            print_json(to_json(s));
            return kExitOk;
        }
        const auto locked = field<uint64_t>(s, "locked_bytes"), cap = field<uint64_t>(s, "lock_cap_bytes");
        fmt::print("moecached {} (pid {}) on the {} bus\n", field<std::string>(s, "version"), field<uint32_t>(s, "pid"),
                   field<std::string>(s, "bus"));
        fmt::print("  locked       {} of {} allowed now ({}); budget {}, reserve {}, RAM {}\n", format_bytes(locked),
                   format_bytes(cap), percent(locked, cap), format_bytes(field<uint64_t>(s, "lock_budget_bytes")),
                   format_bytes(field<uint64_t>(s, "reserve_bytes")), format_bytes(field<uint64_t>(s, "mem_total_bytes")));
        fmt::print("  pressure     {}, {} back-off(s) so far\n",
                   field<bool>(s, "under_pressure") ? "backing off now" : "none now", field<uint64_t>(s, "pressure_events"));
        fmt::print("  prefetch     {} read, {} queued; {} experts read whole after a miss ({}), {} at warm starts\n",
                   format_bytes(field<uint64_t>(s, "prefetch_done_bytes")),
                   format_bytes(field<uint64_t>(s, "prefetch_queued_bytes")), field<uint64_t>(s, "miss_fetches"),
                   format_bytes(field<uint64_t>(s, "miss_fetch_bytes")), format_bytes(field<uint64_t>(s, "warm_fetch_bytes")));
        if (const auto cg = field<uint64_t>(s, "cgroup_limit_bytes"); cg > 0)
            fmt::print("  cgroup       its memory cgroup allows {}: locks stay below that less the reserve\n", format_bytes(cg));
        fmt::print("  models       {} (moecachectl models)\n", field<uint32_t>(s, "models"));
        fmt::print("  clients      {} connected at {}\n", field<uint32_t>(s, "clients"), field<std::string>(s, "socket"));
        if (field<bool>(s, "page_cache_telemetry"))
            fmt::print("  page cache   watched by eBPF{}, {} events\n", field<bool>(s, "page_cache_faults") ? " (with faults)" : "",
                       field<uint64_t>(s, "page_cache_events"));
        else
            fmt::print("  page cache   not watched: {}\n", field<std::string>(s, "page_cache_off_reason"));
        const auto metrics = field<std::string>(s, "metrics");
        fmt::print("  metrics      {}\n", metrics.empty() ? "off" : "http://" + metrics + "/metrics");
        if (field<bool>(s, "tracing")) fmt::print("  trace        recording: {} router decisions\n", field<uint64_t>(s, "trace_records"));
        return kExitOk;
    });
}

int cmd_models(const Options& o, const std::vector<std::string>& args) {
    return guarded("models", [&] {
        want_positionals(parse_args(args, {}, {}, "models"), 0, 0, "models", "");
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto models = mgr.ListModels();
        if (o.json) {
            json j = json::array();
            for (const auto& m : models)
                j.push_back({{"id", m.get<1>()}, {"object", std::string(m.get<0>())}, {"path", m.get<2>()}, {"loaded", m.get<3>()},
                             {"error", m.get<4>()}, {"expert_bytes", m.get<5>()}, {"expert_cached_bytes", m.get<6>()},
                             {"expert_locked_bytes", m.get<7>()}, {"experts_in_vram", m.get<8>()}});
            print_json(j);
            return kExitOk;
        }
        if (models.empty()) {
            fmt::print("moecached manages no models: add [[model]] to its configuration, run a client, or 'moecachectl register PATH'\n");
            return kExitOk;
        }
        Table t({"ID", "EXPERTS", "CACHED", "LOCKED", "IN VRAM", "PATH"}, "rrrrr");
        for (const auto& m : models) {
            if (!m.get<3>()) {
                t.add({std::to_string(m.get<1>()), "-", "-", "-", "-", m.get<2>() + "  (not loaded: " + m.get<4>() + ")"});
                continue;
            }
            t.add({std::to_string(m.get<1>()), format_bytes(m.get<5>()), percent(m.get<6>(), m.get<5>()), percent(m.get<7>(), m.get<5>()),
                   std::to_string(m.get<8>()), m.get<2>()});
        }
        fmt::print("{}", t.render());
        return kExitOk;
    });
}

int cmd_experts(const Options& o, const std::vector<std::string>& args) {
    return guarded("experts", [&] {
        const auto a = parse_args(args, {}, {"--top"}, "experts");
        want_positionals(a, 1, 1, "experts", "MODEL [--top N]");
        uint32_t top = 20;
        if (a.opts.count("--top")) {
            const std::string& v = a.opts.at("--top");
            if (v.empty() || v.size() > 9 || !std::all_of(v.begin(), v.end(), ::isdigit))
                throw Failure{kExitUsage, fmt::format("--top '{}': a count (0: all)", v)};
            top = static_cast<uint32_t>(std::stoul(v));
        }
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto ref = resolve_model(mgr, a.positional[0]);
        ModelProxy model(*conn, ref.object);
        const auto experts = model.Experts(top);
        if (o.json) {
            json j = json::array();
            for (const auto& e : experts)
                j.push_back({{"block", e.get<0>()}, {"expert", e.get<1>()}, {"tier", e.get<2>()}, {"heat", e.get<3>()},
                             {"uses", e.get<4>()}, {"bytes", e.get<5>()}, {"cached_bytes", e.get<6>()},
                             {"locked_bytes", e.get<7>()}, {"pinned", e.get<8>()}, {"vram_pools", e.get<9>()}});
            print_json(j);
            return kExitOk;
        }
        Table t({"BLOCK", "EXPERT", "TIER", "HEAT", "USES", "SIZE", "CACHED", "PINNED", "VRAM"}, "rr rrrr r");
        for (const auto& e : experts)
            t.add({std::to_string(e.get<0>()), std::to_string(e.get<1>()), e.get<2>(), fmt::format("{:.2f}", e.get<3>()),
                   std::to_string(e.get<4>()), format_bytes(e.get<5>()), percent(e.get<6>(), e.get<5>()), e.get<8>() ? "yes" : "",
                   e.get<9>() ? std::to_string(e.get<9>()) : ""});
        fmt::print("{}", t.render());
        return kExitOk;
    });
}

int cmd_budget(const Options& o, const std::vector<std::string>& args) {
    return guarded("budget", [&] {
        const auto a = parse_args(args, {}, {}, "budget");
        want_positionals(a, 0, 2, "budget", "[lock|reserve|MODEL AMOUNT]");
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        if (a.positional.size() == 1) throw Failure{kExitUsage, "budget NAME needs an AMOUNT (\"48GiB\", \"60%\"; for a model also \"none\")"};
        if (a.positional.size() == 2) {
            const auto& name = a.positional[0];
            const auto& amount = a.positional[1];
            if (name == "lock" || name == "reserve") {
                mgr.SetBudget(name, amount);
            } else {
                const auto ref = resolve_model(mgr, name);
                ModelProxy(*conn, ref.object).SetBudget(amount == "none" ? "" : amount);
            }
            if (!o.json) fmt::print("budget {} set to {}\n", name, amount);
            else print_json({{"budget", name}, {"amount", amount}});
            return kExitOk;
        }
        const auto budgets = mgr.GetBudgets();
        json j = json::array();
        Table t({"BUDGET", "BYTES", "AS WRITTEN"}, " r");
        for (const auto& b : budgets) {
            j.push_back({{"name", b.get<0>()}, {"bytes", b.get<1>()}, {"as_written", b.get<2>()}});
            t.add({b.get<0>(), format_bytes(b.get<1>()), b.get<2>()});
        }
        for (const auto& m : mgr.ListModels()) {
            const auto s = ModelProxy(*conn, m.get<0>()).GetStatus();
            const auto bytes = field<uint64_t>(s, "budget_bytes");
            if (bytes == 0) continue;
            j.push_back({{"name", fmt::format("model:{}", m.get<1>())}, {"bytes", bytes}, {"path", m.get<2>()}});
            t.add({fmt::format("model {}", m.get<1>()), format_bytes(bytes), m.get<2>()});
        }
        if (o.json) print_json(j);
        else fmt::print("{}", t.render());
        return kExitOk;
    });
}

int pin_common(const Options& o, const std::vector<std::string>& args, bool pin) {
    const char* verb = pin ? "pin" : "unpin";
    return guarded(verb, [&] {
        const auto a = parse_args(args, {}, {}, verb);
        if (a.positional.size() < 2) throw Failure{kExitUsage, fmt::format("usage: moecachectl {} MODEL EXPERTS...", verb)};
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto ref = resolve_model(mgr, a.positional[0]);
        ModelProxy model(*conn, ref.object);
        const std::vector<std::string> specs(a.positional.begin() + 1, a.positional.end());
        const uint32_t n = pin ? model.Pin(specs) : model.Unpin(specs);
        if (o.json) print_json({{"model", ref.id}, {pin ? "pinned" : "unpinned", n}});
        else fmt::print("{} expert(s) {} in {}\n", n, pin ? "pinned" : "unpinned", ref.path);
        return kExitOk;
    });
}

int cmd_pin(const Options& o, const std::vector<std::string>& a) { return pin_common(o, a, true); }
int cmd_unpin(const Options& o, const std::vector<std::string>& a) { return pin_common(o, a, false); }

void draw_progress(uint64_t done, uint64_t total, double seconds) {
    const int width = 30;
    const double f = total ? std::min(1.0, static_cast<double>(done) / static_cast<double>(total)) : 1.0;
    const int fill = static_cast<int>(f * width);
    const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0;
    fmt::print(stderr, "\r[{}{}] {:3.0f}%  {} of {}  {}/s   ", std::string(static_cast<size_t>(fill), '#'),
               std::string(static_cast<size_t>(width - fill), '.'), f * 100, format_bytes(done), format_bytes(total),
               format_bytes(static_cast<uint64_t>(rate)));
    std::fflush(stderr);
}

int cmd_prefetch(const Options& o, const std::vector<std::string>& args) {
    return guarded("prefetch", [&] {
        const auto a = parse_args(args, {"--no-wait"}, {"--timeout"}, "prefetch");
        if (a.positional.empty()) throw Failure{kExitUsage, "usage: moecachectl prefetch MODEL [EXPERTS...] [--no-wait]"};
        double timeout = 3600;
        if (a.opts.count("--timeout")) {
            try {
                timeout = std::stod(a.opts.at("--timeout"));
            } catch (const std::exception&) {
                throw Failure{kExitUsage, "--timeout takes seconds"};
            }
        }
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto ref = resolve_model(mgr, a.positional[0]);
        ModelProxy model(*conn, ref.object);
        const std::vector<std::string> specs(a.positional.begin() + 1, a.positional.end());
        const auto start = std::chrono::steady_clock::now();
        const uint64_t queued = model.Prefetch(specs);
        const bool wait = !a.opts.count("--no-wait");
        const bool bar = wait && o.progress && !o.json && ::isatty(STDERR_FILENO);
        uint64_t pending = queued;
        double seconds = 0;
        while (wait && pending > 0) {
            const auto s = model.GetStatus();
            pending = field<uint32_t>(s, "prefetching_experts") == 0 ? 0 : std::min(queued, field<uint64_t>(s, "prefetch_pending_bytes"));
            seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (bar) draw_progress(queued - pending, queued, seconds);
            if (pending == 0) break;
            if (seconds > timeout) {
                if (bar) fmt::print(stderr, "\n");
                throw Failure{kExitFailed, fmt::format("still reading after {:.0f} s: {} of {} to go (it goes on in the daemon)",
                                                       seconds, format_bytes(pending), format_bytes(queued))};
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        if (bar) fmt::print(stderr, "\n");
        if (o.json) {
            print_json({{"model", ref.id}, {"queued_bytes", queued}, {"waited", wait}, {"seconds", seconds}});
        } else if (queued == 0) {
            fmt::print("nothing to read: those experts are in RAM already\n");
        } else if (wait) {
            fmt::print("{} read into the page cache in {:.1f} s ({}/s)\n", format_bytes(queued), seconds,
                       format_bytes(seconds > 0 ? static_cast<uint64_t>(static_cast<double>(queued) / seconds) : 0));
        } else {
            fmt::print("{} queued for reading\n", format_bytes(queued));
        }
        return kExitOk;
    });
}

int cmd_evict(const Options& o, const std::vector<std::string>& args) {
    return guarded("evict", [&] {
        const auto a = parse_args(args, {"--all"}, {}, "evict");
        if (a.positional.empty()) throw Failure{kExitUsage, "usage: moecachectl evict MODEL (EXPERTS...|--all)"};
        const std::vector<std::string> specs(a.positional.begin() + 1, a.positional.end());
        if (specs.empty() != (a.opts.count("--all") != 0))
            throw Failure{kExitUsage, "name the experts to evict, or --all for every expert not pinned (not both)"};
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto ref = resolve_model(mgr, a.positional[0]);
        const uint64_t bytes = ModelProxy(*conn, ref.object).Evict(specs);
        if (o.json) print_json({{"model", ref.id}, {"released_bytes", bytes}});
        else fmt::print("{} released from RAM ({}); the policy brings back what stays hot\n", format_bytes(bytes), ref.path);
        return kExitOk;
    });
}

std::string read_input(const std::string& file) {
    std::stringstream ss;
    if (file == "-") {
        ss << std::cin.rdbuf();
        return ss.str();
    }
    std::ifstream f(file, std::ios::binary);
    if (!f) throw Failure{kExitFailed, fmt::format("cannot read {}: {}", file, std::strerror(errno))};
    ss << f.rdbuf();
    return ss.str();
}

int cmd_profile(const Options& o, const std::vector<std::string>& args) {
    return guarded("profile", [&] {
        const auto a = parse_args(args, {}, {}, "profile");
        if (a.positional.size() < 2 || (a.positional[0] != "export" && a.positional[0] != "import"))
            throw Failure{kExitUsage, "usage: moecachectl profile export MODEL [FILE] | profile import MODEL FILE"};
        const bool exp = a.positional[0] == "export";
        if ((exp && a.positional.size() > 3) || (!exp && a.positional.size() != 3))
            throw Failure{kExitUsage, "usage: moecachectl profile export MODEL [FILE] | profile import MODEL FILE"};
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto ref = resolve_model(mgr, a.positional[1]);
        ModelProxy model(*conn, ref.object);
        if (exp) {
            const std::string text = model.ExportProfile();
            if (a.positional.size() == 2 || a.positional[2] == "-") {
                fmt::print("{}\n", text);
                return kExitOk;
            }
            const std::string& path = a.positional[2];
            std::ofstream f(path, std::ios::binary | std::ios::trunc);
            if (!(f << text << "\n") || !f.flush())
                throw Failure{kExitFailed, fmt::format("cannot write {}: {}", path, std::strerror(errno))};
            if (o.json) print_json({{"model", ref.id}, {"file", path}, {"bytes", text.size() + 1}});
            else fmt::print("heat profile of {} written to {}\n", ref.path, path);
            return kExitOk;
        }
        const std::string text = read_input(a.positional[2]);
        model.ImportProfile(text);
        if (o.json) print_json({{"model", ref.id}, {"imported", a.positional[2]}});
        else fmt::print("heat profile {} imported into {}\n", a.positional[2], ref.path);
        return kExitOk;
    });
}

int cmd_trace(const Options& o, const std::vector<std::string>& args) {
    return guarded("trace", [&] {
        const auto a = parse_args(args, {}, {}, "trace");
        const bool start = !a.positional.empty() && a.positional[0] == "start";
        const bool stop = !a.positional.empty() && a.positional[0] == "stop";
        if ((!start && !stop) || (start && a.positional.size() != 2) || (stop && a.positional.size() != 1))
            throw Failure{kExitUsage, "usage: moecachectl trace start FILE | trace stop"};
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        if (start) {
            // Opened here, as the caller: the daemon writes to what the caller may write, nothing else.
            // Not truncated here: the daemon empties it once it has accepted the trace.
            const std::string& path = a.positional[1];
            const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
            if (fd < 0) throw Failure{kExitFailed, fmt::format("cannot create {}: {}", path, std::strerror(errno))};
            sdbus::UnixFd file(fd, sdbus::adopt_fd);
            mgr.StartTrace(file);
            if (o.json) print_json({{"tracing", true}, {"file", path}});
            else fmt::print("recording router decisions to {}; 'moecachectl trace stop' ends it\n", path);
            return kExitOk;
        }
        const uint64_t n = mgr.StopTrace();
        if (o.json) print_json({{"tracing", false}, {"records", n}});
        else fmt::print("trace stopped: {} router decisions recorded\n", n);
        return kExitOk;
    });
}

int cmd_register(const Options& o, const std::vector<std::string>& args) {
    return guarded("register", [&] {
        const auto a = parse_args(args, {}, {}, "register");
        want_positionals(a, 1, 1, "register", "PATH");
        char real[PATH_MAX];
        if (!::realpath(a.positional[0].c_str(), real))
            throw Failure{kExitNotFound, fmt::format("{}: {}", a.positional[0], std::strerror(errno))};
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto obj = mgr.RegisterModel(real);
        if (o.json) print_json({{"object", std::string(obj)}, {"path", real}});
        else fmt::print("{} registered as {}\n", real, std::string(obj));
        return kExitOk;
    });
}

int cmd_unregister(const Options& o, const std::vector<std::string>& args) {
    return guarded("unregister", [&] {
        const auto a = parse_args(args, {}, {}, "unregister");
        want_positionals(a, 1, 1, "unregister", "MODEL");
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto ref = resolve_model(mgr, a.positional[0]);
        mgr.UnregisterModel(ref.object);
        if (o.json) print_json({{"unregistered", ref.id}, {"path", ref.path}});
        else fmt::print("{} is no longer managed\n", ref.path);
        return kExitOk;
    });
}

int cmd_inspect(const Options& o, const std::vector<std::string>& args) {
    return guarded("inspect", [&] {
        const auto a = parse_args(args, {}, {}, "inspect");
        want_positionals(a, 1, 1, "inspect", "MODEL.gguf");
        auto report = inspect_model(a.positional[0]);
        if (!report) throw Failure{kExitFailed, report.error().what()};
        if (o.json) fmt::print("{}\n", inspect_json(*report).dump(2));
        else fmt::print("{}", inspect_table(*report));
        return kExitOk;
    });
}

int cmd_completion(const Options&, const std::vector<std::string>& args) {
    if (args.size() != 1 || args[0] != "bash") return usage_error("usage: moecachectl completion bash");
    fmt::print("{}", bash_completion());
    return kExitOk;
}

int cmd_help(const Options&, const std::vector<std::string>& args);

const std::vector<Command> kCommands = {
    {"status", "", "the daemon at a glance: budgets, what is locked, pressure, prefetch, clients",
     "Reads org.moecache1.Manager.GetStatus. --json prints every key (docs/dbus.md).", cmd_status},
    {"models", "", "the models moecached manages, with how much of their experts is cached and locked",
     "CACHED and LOCKED are shares of the routed experts' bytes; IN VRAM counts experts a CUDA hook's pool holds.",
     cmd_models},
    {"inspect", "MODEL.gguf", "what a GGUF file holds: MoE layers, experts, bytes, what is cached now (no daemon needed)",
     "MODEL may be any part of a split model (NAME-00002-of-00005.gguf): all parts are opened as one.\n"
     "--json prints the stable form scripts read (docs/inspect-json.md).",
     cmd_inspect},
    {"experts", "MODEL [--top N]", "the hottest experts of a model and where each one lives",
     "TIER: ram (locked by moecached), vram (held by a CUDA hook's pool), fetching, ssd (neither).\n"
     "HEAT is decayed use; --top 0 lists every expert.",
     cmd_experts},
    {"budget", "[lock|reserve|MODEL AMOUNT]", "show the budgets, or set one (until restart or reload)",
     "AMOUNT: \"48GiB\", \"512MiB\", \"60%\" (of RAM). lock bounds all locked bytes; reserve is RAM never\n"
     "locked; a model's own budget bounds that model (\"none\" removes it). To keep a change, write it\n"
     "in /etc/moecache/moecached.toml.",
     cmd_budget},
    {"pin", "MODEL EXPERTS...", "always keep these experts in RAM (within budgets)",
     "EXPERTS: \"12\" (every expert of block 12), \"12:3\" (expert 3), \"12:0-7\" (experts 0 to 7), as\n"
     "[[model]] pin in the configuration, which is where a pin survives a restart.",
     cmd_pin},
    {"unpin", "MODEL EXPERTS...", "let the policy decide for these experts again", "EXPERTS as for pin.", cmd_unpin},
    {"prefetch", "MODEL [EXPERTS...] [--no-wait]", "read experts from storage into RAM now, hottest first",
     "Without EXPERTS: every expert of the model. Waits until read, with a progress bar on a terminal;\n"
     "--no-wait returns once queued, --timeout S bounds the wait. Prefetched pages are cached, not\n"
     "locked: the policy locks what is hot.",
     cmd_prefetch},
    {"evict", "MODEL (EXPERTS...|--all)", "unlock experts and drop them from RAM",
     "Pinned experts are refused (unpin first); with --all they are skipped. The policy brings back\n"
     "what stays hot.",
     cmd_evict},
    {"profile", "export MODEL [FILE] | import MODEL FILE", "save or load a model's heat (which experts are hot)",
     "A profile is JSON; '-' is standard output or input. moecached saves profiles itself in\n"
     "/var/lib/moecache/profiles and starts warm from them; export and import move heat between\n"
     "machines or keep a known-good one.",
     cmd_profile},
    {"trace", "start FILE | stop", "record every router decision moecached receives, for replay",
     "FILE is created by moecachectl (as you) and handed to the daemon, which appends JSON lines to it\n"
     "(docs/trace.md) until 'trace stop'. One trace at a time.",
     cmd_trace},
    {"register", "PATH", "start managing a GGUF file (until unregister or restart)",
     "For good, add a [[model]] table to the configuration instead.", cmd_register},
    {"unregister", "MODEL", "stop managing a model registered with 'register'",
     "Configured models go by removing them from the configuration (and systemctl reload moecached);\n"
     "models a runtime registered go with the runtime.",
     cmd_unregister},
    {"completion", "bash", "print the bash completion script",
     "Installed as /usr/share/bash-completion/completions/moecachectl; or: source <(moecachectl completion bash)",
     cmd_completion},
    {"help", "[COMMAND]", "this text, or more about one command", "", cmd_help},
};

int cmd_help(const Options&, const std::vector<std::string>& args) {
    if (!args.empty()) {
        const Command* c = find_command(args[0]);
        if (!c) return usage_error(fmt::format("no command '{}'", args[0]));
        fmt::print("usage: moecachectl {} {}\n\n{}.\n", c->name, c->args, c->summary);
        if (*c->help) fmt::print("\n{}\n", c->help);
        return kExitOk;
    }
    fmt::print("usage: moecachectl [--json] [--bus BUS] COMMAND [ARGS]\n\n"
               "Controls moecached, which keeps the hot experts of Mixture-of-Experts models in RAM and VRAM.\n"
               "Reading is open to everyone; changes need root or the group moecache.\n\nCommands:\n");
    for (const auto& c : kCommands) fmt::print("  {:<12} {}\n", c.name, c.summary);
    fmt::print("\nOptions:\n"
               "  --json        print JSON for scripts instead of tables\n"
               "  --bus BUS     system (default), session, or a D-Bus address (unix:path=...); also $MOECACHE_BUS\n"
               "  --no-progress no progress bar\n\n"
               "'moecachectl help COMMAND' tells more about one. Exit codes: 0 done, 1 failed (the message says\n"
               "why), 2 bad usage or argument, 3 moecached not reachable, 4 not allowed, 5 no such model.\n");
    return kExitOk;
}

}  // namespace

int usage_error(const std::string& message) {
    fmt::print(stderr, "moecachectl: {}\n(see 'moecachectl help')\n", message);
    return kExitUsage;
}

const std::vector<Command>& commands() { return kCommands; }

const Command* find_command(const std::string& name) {
    for (const auto& c : kCommands)
        if (name == c.name) return &c;
    return nullptr;
}

std::string bash_completion() {
    std::string verbs;
    for (const auto& c : kCommands) verbs += std::string(verbs.empty() ? "" : " ") + c.name;
    return fmt::format(R"BASH(# bash completion for moecachectl
_moecachectl_models() {{
    moecachectl --json models 2>/dev/null | sed -n 's/^ *"path": "\(.*\)",*$/\1/p'
}}
_moecachectl() {{
    local cur prev words cword
    _init_completion 2>/dev/null || {{ cur=${{COMP_WORDS[COMP_CWORD]}}; prev=${{COMP_WORDS[COMP_CWORD-1]}}; words=("${{COMP_WORDS[@]}}"); cword=$COMP_CWORD; }}
    local verbs="{}"
    local i verb="" n=0
    for ((i = 1; i < cword; i++)); do
        case "${{words[i]}}" in
            --bus) ((i++)) ;;
            -*) ;;
            *) if [[ -z $verb ]]; then verb=${{words[i]}}; else ((n++)); fi ;;
        esac
    done
    if [[ $prev == --bus ]]; then COMPREPLY=($(compgen -W "system session" -- "$cur")); return; fi
    if [[ -z $verb ]]; then COMPREPLY=($(compgen -W "$verbs --json --bus --no-progress" -- "$cur")); return; fi
    case $verb in
        inspect|register) COMPREPLY=($(compgen -f -X '!*.gguf' -- "$cur") $(compgen -d -- "$cur")) ;;
        experts|pin|unpin|prefetch|evict|unregister)
            if ((n == 0)); then COMPREPLY=($(compgen -W "$(_moecachectl_models)" -- "$cur"));
            else case $verb in
                experts) COMPREPLY=($(compgen -W "--top" -- "$cur")) ;;
                evict) COMPREPLY=($(compgen -W "--all" -- "$cur")) ;;
                prefetch) COMPREPLY=($(compgen -W "--no-wait --timeout" -- "$cur")) ;;
            esac; fi ;;
        budget) if ((n == 0)); then COMPREPLY=($(compgen -W "lock reserve $(_moecachectl_models)" -- "$cur")); fi ;;
        profile)
            if ((n == 0)); then COMPREPLY=($(compgen -W "export import" -- "$cur"));
            elif ((n == 1)); then COMPREPLY=($(compgen -W "$(_moecachectl_models)" -- "$cur"));
            else COMPREPLY=($(compgen -f -- "$cur")); fi ;;
        trace) if ((n == 0)); then COMPREPLY=($(compgen -W "start stop" -- "$cur")); else COMPREPLY=($(compgen -f -- "$cur")); fi ;;
        completion) COMPREPLY=($(compgen -W "bash" -- "$cur")) ;;
        help) COMPREPLY=($(compgen -W "$verbs" -- "$cur")) ;;
    esac
}}
complete -F _moecachectl moecachectl
)BASH",
                       verbs);
}

}  // namespace moecache::ctl
