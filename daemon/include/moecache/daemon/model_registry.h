// The models the daemon manages: configured paths and globs become entries (a glob's match only
// once its header says it is an MoE GGUF file), clients and the operator add more; each is opened
// off the loop (its header read and its setup made within [prefetch] read_deadline) and closed
// (its reads cancelled, its heat saved, its locks released, its files no longer watched); a model
// whose file stops answering is set aside for a while; families share heat; heat profiles are
// loaded at open and saved. Runs on the loop's thread; what follows an open is the daemon's
// (RegistryEvents).
#pragma once

#include "moecache/daemon/config.h"
#include "moecache/daemon/error_log.h"
#include "moecache/daemon/model_residency.h"
#include "moecache/daemon/predictor.h"

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace moecache::daemon {

class OffLoop;
class Prefetcher;
class PageCacheWatch;

// One model the daemon manages, and what the daemon knows of its use.
struct ModelEntry {
    uint32_t id = 0;
    ModelConfig config;
    std::string path;
    // What users call it, fixed at its first load: ollama's tag for one of its blobs, else the file
    // name (general.name for a file named by its hash). The metrics' model label: stable across loads.
    std::string name;
    std::unique_ptr<ModelResidency> res;
    std::string error;     // the last reason it could not be loaded, logged once
    bool opening = false;  // its header is being read and its setup made, off the loop (OffLoop)
    // Its file did not answer a read within [prefetch] read_deadline (a hung network or FUSE file
    // system): not opened again before this (ModelRegistry::set_aside).
    std::chrono::steady_clock::time_point set_aside_until{};
    std::vector<uint32_t> file_ids;  // page-cache telemetry ids of its files, while watched
    bool registered = false;         // added by a client at run time (not configured): closed with its last client
    uint32_t owner_uid = 0;          // of the client that registered it (registered models only)
    bool operator_added = false;     // registered over D-Bus: stays until unregistered or restart
    // When a runtime last used it (a page fault or read in it, a routing report): a model that no
    // client registered is on standby (planner.h) once nothing used it for kStandbyAfter, or at once
    // while a live client uses another model of its family (the prompt-model swap).
    std::chrono::steady_clock::time_point last_used{};
    // When a client last reported its router's routing (telemetry). While they arrive they are
    // its heat: a page fault or read of one of its experts is then a copy the routing already
    // counted (the CUDA hook copying a pool's miss from RAM), and as one more use it would favour
    // what the pool misses, and as a one-expert routing event tell the pool's split learner that
    // recency pays (each miss follows its own routing). Page-cache uses count again
    // kPageCacheUsesAfterRouting after the last report (a CPU runtime without the hook has no other signal).
    std::optional<std::chrono::steady_clock::time_point> last_routed;
    // Who reported its routing, and when: by uid, and the last report of a client that steers it
    // (steers, clients/access.h). While clients report it, the routing's temporal locality cuts its lock cap
    // (DecideStep) only if one that steers it reports, or several users do: one user's fabricated
    // routing, however well formed, cannot release an operator's locks.
    std::map<uint32_t, std::chrono::steady_clock::time_point> routed_by;
    std::optional<std::chrono::steady_clock::time_point> steered_routing;
    // When the last client holding it went (unset while one holds it, or none ever did): of two
    // members of a family that no client holds, the one left last waits for the other (DecideStep).
    std::optional<std::chrono::steady_clock::time_point> runtime_left;
    RoutingOutcome outcome;  // its routing reports counted by where the experts were (Intake)
    // A warm start under way: the bytes it had to read when it began, and the last quarter logged
    // (DecideStep::warm_progress; moecachectl wait shows it).
    struct WarmStart {
        uint64_t total = 0;  // 0: none under way
        int said = 0;        // quarters logged, 0..4
        std::chrono::steady_clock::time_point since{};
    } warm_start;
    bool warm_pending = false;  // a profile was loaded: read its hot experts beyond the locks at the next placement
    // One place for its experts in VRAM pools: while the lock cap cannot hold its experts (and
    // those of the other models in use) anyway (one_place_needed; DecideStep).
    bool one_place = true;
    bool one_place_decided = false;  // one_place was decided once (before: the default, true)
    // [policy] predict: the model's route predictor, how right it has been, and per layer what it
    // expects the next token to use there.
    struct Prediction {
        RoutePredictor predictor;
        PredictionTrust trust;
        std::vector<std::vector<uint32_t>> next;  // [layer]
    };
    std::unique_ptr<Prediction> prediction;
};

// What the registry tells the daemon.
class RegistryEvents {
public:
    virtual ~RegistryEvents() = default;
    // A model's open ended, loaded (m.res) or not (m.error says why): the registrations waiting for
    // it are answered; a loaded model's pools and placement are settled again.
    virtual void open_ended(uint32_t id, bool loaded) = 0;
};

class ModelRegistry {
public:
    ModelRegistry(const Config& config, OffLoop& off_loop, Prefetcher& prefetcher, PageCacheWatch& page_cache,
                  ErrorLog& errors, RegistryEvents& events);
    ~ModelRegistry();
    ModelRegistry(const ModelRegistry&) = delete;
    ModelRegistry& operator=(const ModelRegistry&) = delete;

    [[nodiscard]] const std::vector<std::unique_ptr<ModelEntry>>& all() const { return models_; }
    [[nodiscard]] ModelEntry* find(uint32_t id);
    [[nodiscard]] const ModelEntry* find(uint32_t id) const;
    [[nodiscard]] ModelEntry* find_path(const std::string& path);
    // By its path, or the configured path it came from (a glob's).
    [[nodiscard]] std::optional<uint32_t> id_of(const std::string& path) const;
    [[nodiscard]] std::vector<uint32_t> ids() const;
    // The next id and how many there are: changes whenever the set does.
    [[nodiscard]] std::pair<uint32_t, size_t> shape() const { return {next_id_, models_.size()}; }

    // An entry for `path` (the existing one if there is one).
    ModelEntry& add(const ModelConfig& mc, const std::string& path);
    // Closed (with why) if open, and forgotten.
    void remove(uint32_t id, const std::string& why);
    // Forgets every entry `keep` refuses, closing it with why.
    template <class Keep>
    void retain(Keep&& keep, const std::string& why) {
        std::vector<uint32_t> gone;
        for (const auto& m : models_)
            if (!keep(*m)) gone.push_back(m->id);
        for (uint32_t id : gone) remove(id, why);
    }
    // The configured plain paths get their entries (retried while missing); globs in refresh().
    void add_configured();
    // Globs may match new files; a model whose file changed or went away is closed and retried;
    // the operator's and configured models that are not open are opened.
    void refresh();
    // Opens a model off the loop (OffLoop): ended in a later turn (RegistryEvents::open_ended).
    // handed: a client's descriptors of it. wait: block until it is open or past the deadline.
    void open(ModelEntry& m, const std::vector<int>* handed = nullptr, bool wait = false);
    void close(ModelEntry& m, const std::string& why);
    // Whether the open models on file systems without a block device (NFS, SMB, FUSE) still have
    // the files they opened, looked at off the loop: a stat there waits on the server, which may
    // never answer. One look at a time; a model whose look passes [prefetch] read_deadline is set
    // aside. A model that changed is closed (and a configured one opened again) when it ends.
    // refresh() starts one each tick; others may ask sooner (a lock that failed).
    void look_at_remote_files();
    // The models whose reads passed [prefetch] read_deadline: closed, their reads given up, not
    // opened again for kSetAsideFor, said and counted. So that other models are read and locked.
    void set_aside_hung_reads();
    // Every model's profile, each on its own: the first failure is returned.
    Result<void> save_profiles();

    // A model's profile file name: its key, or key@uidN for a model only a user's clients registered.
    [[nodiscard]] std::string profile_name(const ModelEntry& m) const;
    // Its family (ModelConfig::family, else its profile name): members share heat.
    [[nodiscard]] std::string family_of(const ModelEntry& m) const;
    [[nodiscard]] uint64_t set_aside_count() const { return set_aside_; }
    // A glob's new match whose header is being looked at (OffLoop).
    // Or models' files on a network or FUSE file system (look_at_remote_files).
    [[nodiscard]] bool looking() const { return !glob_looking_.empty() || looking_at_files_; }

private:
    struct GlobVerdict {
        uint64_t dev = 0, ino = 0, size = 0;
        int64_t mtime_ns = 0;
        bool moe = false;
        bool definite = false;  // the content's answer, kept for this version of the file
        std::string why;        // why not, as logged (logged again only when it changes)
    };
    // Whether a file a [[model]] glob matched is an MoE GGUF model (said once per file version when
    // it is not: an ollama blob directory also holds manifests' layers, dense models, projectors).
    bool glob_match_is_moe(const std::string& path);
    // A glob that matches nothing because a folder on its way is closed to the daemon: logged once.
    void say_if_closed(const ModelConfig& mc);
    void glob_looked_at(const std::string& path, const GlobVerdict& now);
    struct FileLook;  // a look_at_remote_files() of one model
    void looked_at_files(std::vector<FileLook>& looks);
    void opened(uint32_t id, Result<std::unique_ptr<ModelResidency>> res);
    void open_late(uint32_t id);
    void set_aside(ModelEntry& m, const std::string& why);
    void load_heat(ModelEntry& m);  // its family's heat, or its profile
    [[nodiscard]] std::string profile_path(const std::string& name) const;
    [[nodiscard]] std::chrono::milliseconds read_deadline() const;
    template <class T>
    void note(Doing doing, const Result<T>& r) {
        if (!r) errors_.note(doing, r.error().what());
    }

    const Config& config_;
    OffLoop& off_loop_;
    Prefetcher& prefetcher_;
    PageCacheWatch& page_cache_;
    ErrorLog& errors_;
    RegistryEvents& events_;
    std::vector<std::unique_ptr<ModelEntry>> models_;
    uint32_t next_id_ = 0;
    uint64_t set_aside_ = 0;                           // times a model's file stopped answering
    std::map<std::string, GlobVerdict> glob_checked_;  // by path: what glob_match_is_moe found
    std::set<std::string> glob_looking_;               // paths whose header is being looked at (OffLoop)
    std::set<std::string> glob_closed_told_;           // globs whose closed directory was logged
    bool looking_at_files_ = false;                    // a look_at_remote_files() runs
};

}  // namespace moecache::daemon
