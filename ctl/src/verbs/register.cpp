// moecachectl register
#include "../verbs.h"

namespace moecache::ctl {

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

}  // namespace moecache::ctl
