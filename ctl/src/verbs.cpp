// What the verbs share (verbs.h).
#include "verbs.h"

namespace moecache::ctl {

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
    if (e.getName() == "org.freedesktop.DBus.Error.LimitsExceeded")
        return fmt::format("the bus refused a message this large ({}): {}", e.getName(), e.getMessage());
    if (code == kExitUnreachable)
        return fmt::format("moecached is not on the bus ({}): is it running? (systemctl status moecached)", e.getName());
    if (e.getName() == "org.freedesktop.DBus.Error.AccessDenied")
        return "not allowed: changes need root or membership of the group moecache (the bus refused the call)";
    return e.getMessage();
}

std::string percent(uint64_t part, uint64_t whole) {
    return whole == 0 ? "-" : fmt::format("{:.0f}%", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
}

json to_json(const sdbus::Variant& v) {
    const std::string t = v.peekValueType();
    if (t == "s") return v.get<std::string>();
    if (t == "b") return v.get<bool>();
    if (t == "u") return v.get<uint32_t>();
    if (t == "t") return v.get<uint64_t>();
    if (t == "i") return v.get<int32_t>();
    if (t == "x") return v.get<int64_t>();
    if (t == "d") return v.get<double>();
    if (t == "as") return v.get<std::vector<std::string>>();
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

double seconds_arg(const Args& a, const char* name, double fallback, double most) {
    if (!a.opts.count(name)) return fallback;
    const std::string& text = a.opts.at(name);
    try {
        size_t used = 0;
        const double v = std::stod(text, &used);
        if (used != text.size() || !(v >= 0) || v > most) throw std::invalid_argument(name);
        return v;
    } catch (const std::exception&) {
        throw Failure{kExitUsage, fmt::format("{} takes seconds (0 to {}), not \"{}\"", name, most, text)};
    }
}

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
            if (std::find(flags.begin(), flags.end(), s) != flags.end()) a.opts.insert_or_assign(s, std::string(1, '1'));  // not = "1": GCC 12 warns falsely (-Wrestrict)
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

}  // namespace moecache::ctl
