// moecachectl pin
#include "../verbs.h"

namespace moecache::ctl {

namespace {

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

}  // namespace

int cmd_pin(const Options& o, const std::vector<std::string>& a) { return pin_common(o, a, true); }
int cmd_unpin(const Options& o, const std::vector<std::string>& a) { return pin_common(o, a, false); }

}  // namespace moecache::ctl
