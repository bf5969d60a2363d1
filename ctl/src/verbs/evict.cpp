// moecachectl evict
#include "../verbs.h"

namespace moecache::ctl {

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

}  // namespace moecache::ctl
