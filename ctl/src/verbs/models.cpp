// moecachectl models
#include "../verbs.h"

namespace moecache::ctl {

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

}  // namespace moecache::ctl
