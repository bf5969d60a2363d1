// The operator's controls and view (control.h): what the D-Bus service, and nothing else of it,
// reaches of the daemon. Every argument is untrusted; a refusal names what is wrong. It holds
// references to the parts it drives and owns no state of its own but the configuration's changes
// it makes (budgets), which last until reload or restart. Runs on the loop's thread.
#pragma once

#include "moecache/daemon/control.h"
#include "moecache/daemon/error_log.h"
#include "status/status_view.h"

#include <functional>
#include <span>
#include <string>
#include <vector>

namespace moecache::daemon {

class BusLink;
class ClientHub;
class DecideStep;
class ModelRegistry;
class Prefetcher;
class RouterTrace;
struct ModelEntry;

class Operator final : public Control {
public:
    // config: the daemon's, changed by set_budget; view: the daemon's status, made when asked.
    Operator(Config& config, uint64_t mem_total, ModelRegistry& models, const ClientHub& hub, DecideStep& decide,
             Prefetcher& prefetcher, BusLink& bus, RouterTrace& trace, ErrorLog& errors,
             std::function<StatusView()> view);

    Result<uint32_t> add_model(const std::string& path) override;
    Result<void> remove_model(uint32_t id) override;
    Result<void> set_budget(const std::string& name, const std::string& amount) override;
    Result<void> set_model_budget(uint32_t id, const std::string& amount) override;
    Result<uint32_t> set_pinned(uint32_t id, std::span<const std::string> specs, bool pinned) override;
    Result<uint64_t> prefetch(uint32_t id, std::span<const std::string> specs) override;
    Result<uint64_t> evict(uint32_t id, std::span<const std::string> specs) override;
    [[nodiscard]] Result<std::string> export_profile(uint32_t id) const override;
    Result<void> import_profile(uint32_t id, const std::string& text) override;
    Result<void> start_trace(UniqueFd file) override;
    Result<uint64_t> stop_trace() override;
    [[nodiscard]] DaemonStatus status(bool experts = true) const override;
    [[nodiscard]] std::optional<ModelStatus> model_status(uint32_t id, bool experts = true) const override;
    [[nodiscard]] std::vector<uint32_t> model_ids() const override;
    [[nodiscard]] const Config& config() const override { return config_; }

private:
    // The slots the pin syntax names ("12", "12:3", "12:0-7", blocks as in the file); an empty
    // list selects every expert.
    Result<std::vector<uint32_t>> select_slots(const ModelEntry& m, std::span<const std::string> specs) const;
    template <class T>
    void note(Doing doing, const Result<T>& r) {
        if (!r) errors_.note(doing, r.error().what());
    }

    Config& config_;
    const uint64_t mem_total_;
    ModelRegistry& models_;
    const ClientHub& hub_;
    DecideStep& decide_;
    Prefetcher& prefetcher_;
    BusLink& bus_;
    RouterTrace& trace_;
    ErrorLog& errors_;
    std::function<StatusView()> view_;
};

}  // namespace moecache::daemon
