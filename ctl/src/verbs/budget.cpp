// moecachectl budget
#include "../verbs.h"
#include "moecache/dbus/keys.h"

namespace moecache::ctl {

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
            const auto bytes = field<uint64_t>(s, dbus_keys::kBudgetBytes);
            if (bytes == 0) continue;
            j.push_back({{"name", fmt::format("model:{}", m.get<1>())}, {"bytes", bytes}, {"path", m.get<2>()}});
            t.add({fmt::format("model {}", m.get<1>()), format_bytes(bytes), m.get<2>()});
        }
        if (o.json) print_json(j);
        else fmt::print("{}", t.render());
        return kExitOk;
    });
}

}  // namespace moecache::ctl
