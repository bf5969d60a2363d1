#include "moecache/daemon/model_registry.h"

#include "moecache/daemon/fetch.h"
#include "moecache/daemon/off_loop.h"
#include "moecache/daemon/prefetcher.h"
#include "moecache/file_util.h"
#include "moecache/log.h"
#include "moecache/model.h"
#include "moecache/ollama.h"
#include "moecache/text.h"
#include "moecache/unique_fd.h"
#include "pagecache/page_cache_watch.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <pwd.h>
#include <unistd.h>
#include <algorithm>

#include <atomic>
#include <climits>
#include <cstring>
#include <set>

namespace moecache::daemon {

namespace {

// The files a configured path names: a glob expands to its matches; the parts of one split set
// count once (by part 1). A plain path that does not exist is still returned, to be retried.
std::vector<std::string> expand(const std::string& pattern) {
    if (pattern.find_first_of("*?[") == std::string::npos) return {pattern};
    glob_t g{};
    std::vector<std::string> out;
    if (::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &g) == 0) {
        std::set<std::string> seen;
        for (size_t i = 0; i < g.gl_pathc; ++i) {
            std::string p = g.gl_pathv[i];
            if (auto s = parse_split_name(p)) p = split_path(s->prefix, 0, s->count);
            if (seen.insert(p).second) out.push_back(p);
        }
    }
    ::globfree(&g);
    std::sort(out.begin(), out.end());
    return out;
}

// What users call a model: ollama's tag where a manifest beside its blob names it (for the
// operator's models only: a client's path is its own choice, and the walk reads what it finds),
// the file name where the user chose one, general.name where the file is named by its hash.
std::string display_name(const std::string& path, const std::string& general_name, bool ollama) {
    if (ollama)
        if (auto tags = ollama_tags(path)) return shown_name(*tags);
    const std::string file = base_name(path);
    return shown_name(named_by_content_hash(file) && !general_name.empty() ? general_name : file);
}

}  // namespace

// A model only a user's clients registered is that user's: its heat and profile are scoped to the
// uid, so that a file of one's own with the same key (architecture, shape and name, all public)
// cannot join the family of a model the operator configured, steer its locks or overwrite its
// profile. The operator's models and root's clients share one scope.
std::string ModelRegistry::profile_name(const ModelEntry& m) const {
    if (!m.res) return {};
    const std::string key = m.res->model().profile_key();
    if (m.registered && !m.operator_added && m.owner_uid != 0) return fmt::format("{}@uid{}", key, m.owner_uid);
    return key;
}

std::string ModelRegistry::family_of(const ModelEntry& m) const {
    if (!m.config.family.empty()) return m.config.family;
    return profile_name(m);
}

std::string ModelRegistry::profile_path(const std::string& key) const {
    return config_.state_dir + "/profiles/" + key + ".json";
}

ModelRegistry::ModelRegistry(const Config& config, OffLoop& off_loop, Prefetcher& prefetcher,
                             PageCacheWatch& page_cache, ErrorLog& errors, RegistryEvents& events)
    : config_(config),
      off_loop_(off_loop),
      prefetcher_(prefetcher),
      page_cache_(page_cache),
      errors_(errors),
      events_(events) {}

ModelRegistry::~ModelRegistry() = default;

ModelEntry* ModelRegistry::find(uint32_t id) {
    for (auto& m : models_)
        if (m->id == id) return m.get();
    return nullptr;
}

const ModelEntry* ModelRegistry::find(uint32_t id) const {
    for (const auto& m : models_)
        if (m->id == id) return m.get();
    return nullptr;
}

ModelEntry* ModelRegistry::find_path(const std::string& path) {
    for (auto& m : models_)
        if (m->path == path) return m.get();
    return nullptr;
}

ModelEntry& ModelRegistry::add(const ModelConfig& mc, const std::string& path) {
    if (ModelEntry* known = find_path(path)) return *known;
    auto e = std::make_unique<ModelEntry>();
    e->id = next_id_++;
    e->config = mc;
    e->path = path;
    models_.push_back(std::move(e));
    return *models_.back();
}

void ModelRegistry::remove(uint32_t id, const std::string& why) {
    ModelEntry* m = find(id);
    if (m == nullptr) return;
    if (m->res) close(*m, why);
    std::erase_if(models_, [&](const auto& o) { return o->id == id; });
}

void ModelRegistry::add_configured() {
    // Plain paths get their entry now (and are retried while missing); globs in refresh().
    for (const auto& mc : config_.models)
        if (mc.path.find_first_of("*?[") == std::string::npos) add(mc, mc.path);
}

void ModelRegistry::refresh() {
    // Globs may match new files. A model whose file changed or went away is closed and retried.
    std::set<std::string> matched;
    for (const auto& mc : config_.models)
        if (mc.path.find_first_of("*?[") != std::string::npos) {
            const auto found = expand(mc.path);
            for (const auto& p : found) {
                matched.insert(p);
                if (glob_match_is_moe(p)) add(mc, p);
            }
            if (found.empty()) say_if_closed(mc);
        }
    std::erase_if(glob_checked_, [&](const auto& v) { return !matched.count(v.first); });  // files gone
    for (auto& m : models_) {
        // One on a network or FUSE file system is looked at off the loop (look_at_remote_files).
        if (m->res && !m->res->model().on_remote_fs()) {
            auto same = m->res->model().unchanged();
            if (!same || !*same) close(*m, same ? "the file changed on disk or went away" : same.error().what());
        }
        // A model only clients registered is opened from what a client hands over, never again
        // by its name (which its owner may swap); the next registration opens it again.
        if (!m->res && (m->operator_added || !m->registered)) open(*m);  // not while it opens or is set aside
    }
    look_at_remote_files();
}

// A look at one model's files: copies of what it needs (the model may close, or open other files,
// while the look runs), and what it found.
struct ModelRegistry::FileLook {
    struct File {
        std::string path;
        FileIdentity identity;
        UniqueFd fd;
    };
    uint32_t id = 0;
    std::vector<File> files;
    Result<bool> same = true;
};

// A stat on NFS, SMB or FUSE waits for the server: a hung server (or a FUSE file system a user
// mounted with allow_other, for a model the user registered, whose server holds every lookup)
// held the loop in the tick's look at every model's files, for good: no client was answered, and
// SIGTERM did not stop the daemon. Such files are looked at on a thread; what the look is at when
// its deadline passes is the model whose file system does not answer.
void ModelRegistry::look_at_remote_files() {
    if (looking_at_files_) return;
    auto looks = std::make_shared<std::vector<FileLook>>();
    for (const auto& m : models_) {
        if (!m->res || !m->res->model().on_remote_fs()) continue;
        FileLook l;
        l.id = m->id;
        for (const auto& f : m->res->model().files()) {
            UniqueFd fd(::fcntl(f.fd.get(), F_DUPFD_CLOEXEC, 0));
            if (!fd) return;  // out of descriptors: the next tick looks again
            l.files.push_back({f.path, f.identity, std::move(fd)});
        }
        looks->push_back(std::move(l));
    }
    if (looks->empty()) return;
    auto at = std::make_shared<std::atomic<uint32_t>>(looks->front().id);
    auto job = off_loop_.run(
        "looking at the files of models on network or FUSE file systems", read_deadline(),
        [this, looks, at]() -> OffLoop::Continuation {
            for (auto& l : *looks) {
                at->store(l.id);
                for (const auto& f : l.files) {
                    l.same = file_unchanged(f.path, f.fd.get(), f.identity);
                    if (!l.same || !*l.same) break;
                }
            }
            return [this, looks] { looked_at_files(*looks); };
        },
        [this, at] {
            looking_at_files_ = false;
            if (ModelEntry* m = find(at->load()); m != nullptr && m->res)
                set_aside(*m, fmt::format("a look at its files (a stat) did not answer within {} s ([prefetch] "
                                          "read_deadline)",
                                          config_.read_deadline_seconds));
        });
    // Where every thread is taken (files that hang), the next tick tries again.
    looking_at_files_ = job.has_value();
}

void ModelRegistry::looked_at_files(std::vector<FileLook>& looks) {
    looking_at_files_ = false;
    for (auto& l : looks) {
        ModelEntry* m = find(l.id);
        if (m == nullptr || !m->res) continue;
        // The files looked at, not others it opened since.
        const auto& files = m->res->model().files();
        if (files.size() != l.files.size() ||
            !std::equal(files.begin(), files.end(), l.files.begin(),
                        [](const ModelFile& a, const FileLook::File& b) { return a.identity == b.identity; }))
            continue;
        if (l.same && *l.same) continue;
        close(*m, l.same ? "the file changed on disk or went away" : l.same.error().what());
        if (m->operator_added || !m->registered) open(*m);
    }
}

void ModelRegistry::say_if_closed(const ModelConfig& mc) {
    // A glob over a folder the daemon's user cannot enter matches nothing, silently: ollama's home
    // (/usr/share/ollama) is 0750 on many systems, and moecached runs as its own user.
    const std::string dir =
        first_closed_directory(mc.path, [](const std::string& d) { return ::access(d.c_str(), R_OK | X_OK) == 0; });
    if (dir.empty() || !glob_closed_told_.insert(mc.path).second) return;
    const auto* pw = ::getpwuid(::geteuid());
    const std::string user = pw ? pw->pw_name : std::to_string(::geteuid());
    MC_LOG(LOG_WARNING,
           "{}: [[model]] path \"{}\" matches nothing: moecached (user {}) cannot enter {}. Give it that: `setfacl -m "
           "u:{}:rx {}` (and the same for any folder below it that is closed), or the runtime's own descriptors only "
           "(no keep)",
           mc.where, mc.path, user, dir, user, dir);
}

bool ModelRegistry::glob_match_is_moe(const std::string& path) {
    // A download in progress (ollama writes sha256-HEX-partial and -partial-N beside the blob): its
    // header may already parse, the rest is not there. The finished blob is matched when it lands.
    if (base_name(path).find("-partial") != std::string::npos) return false;
    // Already an entry (matched before, or configured as a plain path too): no second look.
    if (std::any_of(models_.begin(), models_.end(), [&](const auto& m) { return m->path == path; })) return true;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;  // gone, or a directory
    GlobVerdict now{static_cast<uint64_t>(st.st_dev),
                    static_cast<uint64_t>(st.st_ino),
                    static_cast<uint64_t>(st.st_size),
                    st.st_mtim.tv_sec * 1'000'000'000LL + st.st_mtim.tv_nsec,
                    false,
                    false,
                    {}};
    const auto it = glob_checked_.find(path);
    if (it != glob_checked_.end() && it->second.definite && it->second.dev == now.dev && it->second.ino == now.ino &&
        it->second.size == now.size && it->second.mtime_ns == now.mtime_ns)
        return it->second.moe;
    // Its header is looked at off the loop (a file system may not answer): false until then.
    if (!glob_looking_.insert(path).second) return false;
    auto job = off_loop_.run(
        fmt::format("looking at {}", path), read_deadline(),
        [this, path, now]() mutable -> OffLoop::Continuation {
            // What the content says is remembered for this version of the file; what may pass (a
            // part of a split set not there yet, a descriptor limit, an I/O error) is looked at
            // again next time.
            char magic[4] = {};
            const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
            if (!fd) {
                now.why = fmt::format("cannot open it: {}", std::strerror(errno));
            } else if (::pread(fd.get(), magic, sizeof magic, 0) != static_cast<ssize_t>(sizeof magic) ||
                       std::memcmp(magic, "GGUF", 4) != 0) {
                now.why = "not a GGUF file";
                now.definite = true;
            } else if (auto map = load_expert_map(path); !map) {
                now.why = map.error().what();
                now.definite = map.error().errnum == 0 || map.error().errnum == EINVAL;  // the content, not the system
            } else if (map->layers.empty()) {
                now.why = "a GGUF file without routed experts (a dense model, a vision projector)";
                now.definite = true;
            } else {
                now.moe = now.definite = true;
            }
            return [this, path, now] { glob_looked_at(path, now); };
        },
        [this, path, now]() mutable {
            // Not again for this version of the file: each look would leave a thread behind.
            now.why = fmt::format("its header did not read within {} s ([prefetch] read_deadline)",
                                  config_.read_deadline_seconds);
            now.definite = true;
            glob_looked_at(path, now);
        });
    if (!job) {
        glob_looking_.erase(path);
        errors_.note(Doing::LookingAtGlobMatch, job.error().what());
    }
    return false;
}

void ModelRegistry::glob_looked_at(const std::string& path, const GlobVerdict& now) {
    glob_looking_.erase(path);
    const auto it = glob_checked_.find(path);
    if (!now.moe && (it == glob_checked_.end() || it->second.why != now.why))
        MC_LOG(LOG_INFO, "{}: skipped, matched by a [[model]] glob but {}", path, now.why);
    glob_checked_[path] = now;  // the next refresh() (a tick, the start's second round) adds it
}

std::chrono::milliseconds ModelRegistry::read_deadline() const {
    return std::chrono::milliseconds(static_cast<int64_t>(config_.read_deadline_seconds * 1000));
}

void ModelRegistry::open(ModelEntry& m, const std::vector<int>* handed, bool wait) {
    if (m.opening || m.res) return;
    if (std::chrono::steady_clock::now() < m.set_aside_until) return;  // m.error says why
    // The work gets copies of what it needs: the entry may go, or change, while it runs.
    auto fds = std::make_shared<std::vector<UniqueFd>>();
    if (handed != nullptr)
        for (int fd : *handed) {
            fds->emplace_back(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
            if (!fds->back()) {
                m.error = fmt::format("cannot hold the client's descriptor of {}: {}", m.path, std::strerror(errno));
                return;
            }
        }
    const uint32_t id = m.id;
    const double half_life = config_.decay_half_life_tokens;
    auto job = off_loop_.run(
        fmt::format("opening model {}", m.path), read_deadline(),
        [this, id, path = m.path, cfg = m.config, half_life, fds,
         with_fds = handed != nullptr]() -> OffLoop::Continuation {
            std::vector<int> raw;
            for (const auto& fd : *fds) raw.push_back(fd.get());
            auto res = std::make_shared<Result<std::unique_ptr<ModelResidency>>>(
                ModelResidency::open(path, cfg, half_life, with_fds ? &raw : nullptr));
            // The name the kernel gives for a client's first descriptor must lead to that very file
            // (ClientSessions looks on the loop where the dentry cache can say; here in any case).
            if (with_fds && *res) {
                const FileIdentity& first = (**res)->model().files().front().identity;
                const auto at = identity_of_path(path);
                if (!at || at->dev != first.dev || at->ino != first.ino)
                    *res = fail(ESTALE, fmt::format("{}: the model file has no path the daemon can open that leads to "
                                                    "it (deleted, replaced, a memfd, or in another mount namespace)",
                                                    path));
            }
            return [this, id, res] { opened(id, std::move(*res)); };
        },
        [this, id] { open_late(id); });
    if (!job) {
        const std::string why = job.error().what();
        if (why != m.error) MC_LOG(LOG_WARNING, "model {} is not loaded (retrying): {}", m.path, why);
        m.error = why;
        return;
    }
    m.opening = true;
    if (!wait) return;
    off_loop_.wait(*job);
    prefetcher_.restart_deadlines();  // the loop was held: reads of other models waited on it, not on their files
}

// Its header did not read within the deadline: the thread that reads it is left to its file, and
// the model is set aside (not opened again for a while), so that one hung file cannot take every
// thread; registrations waiting for it hear why.
void ModelRegistry::open_late(uint32_t id) {
    ModelEntry* m = find(id);
    if (m == nullptr) return;
    m->opening = false;
    set_aside(*m, fmt::format("its header did not read within {} s ([prefetch] read_deadline)",
                              config_.read_deadline_seconds));
    events_.open_ended(id, false);
}

void ModelRegistry::opened(uint32_t id, Result<std::unique_ptr<ModelResidency>> res) {
    ModelEntry* found = find(id);
    if (found == nullptr) return;  // removed meanwhile: what was opened closes here
    ModelEntry& m = *found;
    m.opening = false;
    if (!res) {
        const std::string why = res.error().what();
        if (why != m.error) MC_LOG(LOG_WARNING, "model {} is not loaded (retrying): {}", m.path, why);
        m.error = why;
        events_.open_ended(id, false);
        return;
    }
    m.res = std::move(*res);
    m.res->set_keep_ram_copy(config_.keep_ram_copy || !m.one_place);
    m.error.clear();
    m.file_ids = page_cache_.watch(m.id, *m.res, m.path);
    const auto& map = m.res->model().map();
    if (m.name.empty()) m.name = display_name(m.path, map.name, /*ollama=*/!m.registered || m.operator_added);
    MC_LOG(LOG_INFO, "model {} loaded: {} MoE layers x {} experts, {} files", m.path, map.layers.size(), map.n_experts,
           map.files.size());
    if (!map.unknown_type_tensors.empty()) {
        const auto& u = map.unknown_type_tensors.front();
        const auto experts = std::count_if(map.unknown_type_tensors.begin(), map.unknown_type_tensors.end(),
                                           [](const auto& t) { return t.expert; });
        MC_LOG(LOG_WARNING,
               "model {}: {} tensors ({} of routed experts) are of ggml types this moecached does not know "
               "(a newer ggml's: type {} of '{}' first): they are managed with the dense part, not as experts",
               m.path, map.unknown_type_tensors.size(), experts, u.type_id, u.name);
    }
    load_heat(m);
    note(Doing::ReadingResidency, m.res->refresh_cached());
    events_.open_ended(id, true);
}

// A family member already loaded: the model shares its heat (which has its profile already).
// Else its own profile, or the fleet's; a profile loaded starts it warm.
void ModelRegistry::load_heat(ModelEntry& m) {
    const std::string family = family_of(m);
    for (const auto& o : models_) {
        if (o.get() == &m || !o->res || family_of(*o) != family) continue;
        const auto& h = o->res->heat();
        if (h.n_layers() != m.res->heat().n_layers() || h.n_experts() != m.res->heat().n_experts()) {
            MC_LOG(LOG_WARNING, "model {}: family {}: its shape differs from {}'s: heat not shared", m.path, family,
                   o->path);
            continue;
        }
        m.res->share_heat(o->res->shared_heat());
        MC_LOG(LOG_INFO, "model {}: family {}: shares heat with {}", m.path, family, o->path);
        m.warm_pending = config_.warm_start && h.clock() > 0;
        return;
    }
    std::string pp = profile_path(profile_name(m));
    // None of its own yet: the fleet's, when one is shared (read only: its own is saved here). Only
    // a file that is in the folder (a ConfigMap's links inside it are; a link out of it is not).
    if (::access(pp.c_str(), F_OK) != 0 && !config_.fleet_profiles.empty() && !m.registered) {
        const std::string fleet = config_.fleet_profiles + "/" + profile_name(m) + ".json";
        char folder[PATH_MAX], file[PATH_MAX];
        if (::realpath(config_.fleet_profiles.c_str(), folder) && ::realpath(fleet.c_str(), file)) {
            const std::string inside = std::string(folder) + "/";
            if (std::string_view(file).rfind(inside, 0) == 0)
                pp = file;
            else
                MC_LOG(LOG_WARNING, "model {}: fleet profile {} leads out of {}: not read", m.path, fleet,
                       config_.fleet_profiles);
        }
    }
    if (::access(pp.c_str(), F_OK) == 0) {
        // What a profile of this model's shape can take (its entries, generously): a larger file is
        // refused unread (a 190 MiB one of valid entries held the start 30 s and 2.6 GiB).
        const uint64_t most = 64u * 1024 + 256u * m.res->heat().n_layers() * m.res->heat().n_experts();
        auto text = read_whole_file(pp, most, "heat profile");
        auto ok = text ? m.res->heat().load_profile(*text, m.res->model().profile_key(), pp)
                       : Result<void>(tl::unexpected(text.error()));
        if (ok)
            MC_LOG(LOG_INFO, "model {}: heat profile {} loaded: starting warm", m.path, pp);
        else
            MC_LOG(LOG_WARNING, "model {}: heat profile ignored: {}", m.path, ok.error().what());
        m.warm_pending = ok && config_.warm_start;
    }
}

void ModelRegistry::close(ModelEntry& m, const std::string& why) {
    if (!m.res) return;
    for (const auto& [s, f] : m.res->cache_reads()) prefetcher_.cancel(fetch_tag(m.id, s, true));
    MC_LOG(LOG_WARNING, "model {} closed: {}", m.path, why);
    const std::string key = m.res->model().profile_key();
    if (auto r = write_file_atomic(profile_path(profile_name(m)), m.res->heat().to_profile(key)); !r)
        MC_LOG(LOG_WARNING, "model {}: heat not saved: {}", m.path, r.error().what());
    for (uint32_t s = 0; s < m.res->n_slots(); ++s) {
        if (m.res->state(s).tier() == Tier::Fetching) prefetcher_.cancel(fetch_tag(m.id, s));
        note(Doing::UnlockingClosedModel, m.res->release(s, false));
    }
    if (m.res->state(kDenseSlot).tier() == Tier::Fetching) prefetcher_.cancel(fetch_tag(m.id, kDenseSlot));
    note(Doing::UnlockingClosedModel, m.res->release(kDenseSlot, false));
    const auto shared = [&](const FileIdentity& f) {
        return std::any_of(models_.begin(), models_.end(), [&](const auto& o) {
            if (o.get() == &m || !o->res) return false;
            const auto& of = o->res->model().files();
            return std::any_of(of.begin(), of.end(),
                               [&](const ModelFile& x) { return x.identity.dev == f.dev && x.identity.ino == f.ino; });
        });
    };
    note(Doing::UnwatchingFile, page_cache_.unwatch(m.file_ids, *m.res, shared));
    m.file_ids.clear();
    m.res.reset();
}

void ModelRegistry::set_aside(ModelEntry& m, const std::string& why) {
    constexpr auto kSetAsideFor = std::chrono::minutes(10);
    ++set_aside_;
    if (m.res) {
        // Its reads stop holding the prefetcher's slots before the model closes (which cancels).
        for (uint32_t s = 0; s < m.res->n_slots(); ++s) {
            prefetcher_.abandon(fetch_tag(m.id, s));
            prefetcher_.abandon(fetch_tag(m.id, s, true));
        }
        prefetcher_.abandon(fetch_tag(m.id, kDenseSlot));
        prefetcher_.abandon(fetch_tag(m.id, kDenseSlot, true));
        close(m, "set aside: " + why);
    }
    m.set_aside_until = std::chrono::steady_clock::now() + kSetAsideFor;
    m.error = fmt::format("set aside for {} minutes: {}", kSetAsideFor.count(), why);
    MC_LOG(LOG_ERR, "model {}: {} (a hung network or FUSE file system?); other models are read meanwhile", m.path,
           m.error);
}

void ModelRegistry::set_aside_hung_reads() {
    for (const uint64_t tag : prefetcher_.overdue(read_deadline())) {
        ModelEntry* m = find(fetch_tag_model(tag));
        if (m == nullptr || !m->res) {
            prefetcher_.abandon(tag);
            continue;
        }
        set_aside(*m, fmt::format("a read of its file did not complete within {} s ([prefetch] read_deadline)",
                                  config_.read_deadline_seconds));
    }
}

// Every model's profile, each on its own: one that cannot be written does not stop the others.
// The first failure is returned (and counted and logged by the tick).
Result<void> ModelRegistry::save_profiles() {
    Result<void> first;
    for (auto& m : models_) {
        if (!m->res) continue;
        const std::string key = m->res->model().profile_key();
        if (auto r = write_file_atomic(profile_path(profile_name(*m)), m->res->heat().to_profile(key)); !r && first)
            first = r;
    }
    return first;
}

std::vector<uint32_t> ModelRegistry::ids() const {
    std::vector<uint32_t> ids;
    for (const auto& m : models_) ids.push_back(m->id);
    return ids;
}

std::optional<uint32_t> ModelRegistry::id_of(const std::string& path) const {
    for (const auto& m : models_)
        if (m->path == path || m->config.path == path) return m->id;
    return std::nullopt;
}

}  // namespace moecache::daemon
