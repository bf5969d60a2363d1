// moecached's config on bad input: one test per class of error, each fixture a TOML text written
// at run time. Every rejection must name the file, the key (a dotted path such as budget.lock or
// model[1].pin[1]) and say what is wrong. Then what must work: the annotated default config,
// drop-ins in name order, every field read, and the size and pin syntaxes.
#include "temp_dir.h"

#include "moecache/daemon/config.h"
#include "moecache/daemon/descriptors.h"

#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <initializer_list>
#include <limits>
#include <sstream>

namespace moecache::daemon {
namespace {

using test::TempDir;
using test::write_file;

constexpr uint64_t kKiB = 1ull << 10, kMiB = 1ull << 20, kGiB = 1ull << 30, kTiB = 1ull << 40;
constexpr uint64_t kMemTotal = 64 * kGiB;
constexpr uint32_t kWholeLayer = std::numeric_limits<uint32_t>::max();

void expect_mentions(const std::string& message, std::initializer_list<std::string> phrases) {
    for (const auto& p : phrases)
        EXPECT_NE(message.find(p), std::string::npos) << "no '" << p << "' in: " << message;
}

// The settings of a config as "key = value" lines, so that two configs compare with a readable
// difference. Sources, origins and models' `where` are left out: they say where, not what.
std::string describe(const Config& c) {
    std::ostringstream s;
    const auto size = [](const ByteAmount& a) {
        return a.percent ? fmt::format("{}%", *a.percent) : fmt::format("{} bytes", a.bytes);
    };
    s << "daemon.state_dir = " << c.state_dir << "\n"
      << "daemon.socket = " << c.socket_path << "\n"
      << "daemon.log_level = " << c.log_level << "\n"
      << "daemon.tick_seconds = " << c.tick_seconds << "\n"
      << "budget.lock = " << size(c.lock_budget) << "\n"
      << "budget.reserve = " << size(c.reserve) << "\n"
      << "prefetch.queue_depth = " << c.queue_depth << "\n"
      << "prefetch.read_size = " << c.read_size << "\n"
      << "prefetch.engine = " << c.prefetch_engine << "\n"
      << "daemon.fleet_profiles = " << c.fleet_profiles << "\n"
      << "prefetch.threads = " << c.prefetch_threads << "\n"
      << "prefetch.numa_node = " << c.numa_node << "\n"
      << "prefetch.on_miss = " << c.on_miss << "\n"
      << "prefetch.warm_start = " << c.warm_start << " "
      << (c.warm_limit ? size(*c.warm_limit) : std::string("no limit")) << "\n"
      << "pressure.enabled = " << c.pressure_enabled << "\n"
      << "pressure.stall_us = " << c.pressure_stall_us << "\n"
      << "pressure.window_us = " << c.pressure_window_us << "\n"
      << "pressure.release_share = " << c.pressure_release_share << "\n"
      << "pressure.recover_seconds = " << c.pressure_recover_seconds << "\n"
      << "policy.decay_half_life_tokens = " << c.decay_half_life_tokens << "\n"
      << "policy.admit_after_uses = " << c.admit_after_uses << "\n"
      << "policy.elite_share = " << c.elite_share << "\n"
      << "policy.hysteresis = " << c.hysteresis << "\n"
      << "policy.save_interval_seconds = " << c.save_interval_seconds << "\n"
      << "policy.predict = " << c.predict << "\n"
      << "telemetry.page_cache = " << c.page_cache_telemetry << "\n"
      << "telemetry.ring_buffer = " << c.page_cache_ring_bytes << "\n"
      << "clients.allow_uids = " << fmt::format("{}", fmt::join(c.client_allow_uids, ",")) << "\n"
      << "clients.allow_gids = " << fmt::format("{}", fmt::join(c.client_allow_gids, ",")) << "\n"
      << "clients.max = " << c.max_clients << "\n"
      << "clients.max_per_uid = " << c.max_clients_per_uid << "\n"
      << "clients.max_models_per_uid = " << c.max_models_per_uid << "\n"
      << "clients.max_experts_per_uid = " << c.max_experts_per_uid << "\n"
      << "clients.hello_seconds = " << c.hello_seconds << "\n"
      << "clients.idle_seconds = " << c.idle_seconds << "\n";
    for (const auto& [uid, b] : c.uid_budgets) s << "clients.uid_budgets." << uid << " = " << size(b) << "\n";
    s << "metrics.listen = " << c.metrics_listen << "\n";
    s << "metrics.paths = " << c.metrics_paths << "\n";
    s << "dbus.bus = " << c.dbus_bus << "\n";
    s << "dbus.admin_group = " << c.dbus_admin_group << "\n";
    s << "vram.pool = " << (c.vram_pool ? std::to_string(*c.vram_pool) : "unset") << "\n"
      << "vram.keep_ram_copy = " << c.keep_ram_copy << "\n"
      << "vram.directed = " << c.pool_directed << "\n"
      << "vram.fill_from_files = " << c.fill_from_files << "\n";
    for (const auto& m : c.models) {
        s << "model " << m.path << " budget " << (m.budget ? size(*m.budget) : "none")
          << " lock_dense " << m.lock_dense << " family " << m.family << " family_budget "
          << (m.family_budget ? size(*m.family_budget) : "none") << " pins";
        for (const auto& p : m.pins) s << " " << p.layer << ":" << p.first << "-" << p.last;
        s << "\n";
    }
    return s.str();
}

class ConfigTest : public ::testing::Test {
protected:
    ConfigTest() {
        // A stand-in for /sys/devices/system/node on a two-node machine, with one of the files
        // that sit beside the node directories there.
        std::filesystem::create_directories(numa_.file("node0"));
        std::filesystem::create_directories(numa_.file("node1"));
        write_file(numa_.file("online"), "0-1\n");
    }

    Result<Config> load(const std::string& text) {
        write_file(main_, text);
        return load_config(main_);
    }

    std::string drop_in(const std::string& name, const std::string& text) {
        std::filesystem::create_directories(dir_.file("moecached.toml.d"));
        const auto path = dir_.file("moecached.toml.d/" + name);
        write_file(path, text);
        return path;
    }

    // Fails the test unless loading `text` as the main file fails with a message that names the
    // file and holds every phrase.
    void expect_rejected(const std::string& text, std::initializer_list<std::string> phrases) {
        const auto c = load(text);
        ASSERT_FALSE(c) << "accepted:\n" << text;
        expect_mentions(c.error().what(), {main_});
        expect_mentions(c.error().what(), phrases);
    }

    // Fails the test unless `text` loads but does not validate, with every phrase in the message.
    void expect_invalid(const std::string& text, std::initializer_list<std::string> phrases,
                        uint64_t mem_total = kMemTotal) {
        const auto c = load(text);
        ASSERT_TRUE(c) << c.error().what();
        const auto v = validate_config(*c, mem_total, numa_.path());
        ASSERT_FALSE(v) << "validated:\n" << text;
        expect_mentions(v.error().what(), phrases);
    }

    TempDir dir_;
    TempDir numa_;
    const std::string main_ = dir_.file("moecached.toml");
};

// ---- TOML itself -----------------------------------------------------------------------------

TEST_F(ConfigTest, SyntaxErrorGivesLineAndColumn) {
    expect_rejected("[daemon]\nlog_level = \"info\"\ntick_seconds = = 2\n",
                    {main_ + ":3:", "TOML syntax error"});
}

TEST_F(ConfigTest, MissingMainFileIsAnError) {
    const auto path = dir_.file("absent.toml");
    const auto c = load_config(path);
    ASSERT_FALSE(c);
    expect_mentions(c.error().what(), {path, "cannot open the config file", "No such file"});
}

TEST_F(ConfigTest, MetricsListenIsAnIpAddressAndAPort) {
    for (const char* ok : {"127.0.0.1:8474", "0.0.0.0:0", "[::1]:8474", ""}) {
        const auto c = load(std::string("[metrics]\nlisten = \"") + ok + "\"\n");
        ASSERT_TRUE(c) << ok << ": " << c.error().what();
        EXPECT_EQ(c->metrics_listen, ok);
    }
    expect_rejected("[metrics]\nlisten = \"localhost:8474\"\n", {main_ + ":2:", "metrics.listen", "an IP address"});
    expect_rejected("[metrics]\nlisten = \"127.0.0.1:99999\"\n", {"metrics.listen", "0 to 65535"});
    expect_rejected("[metrics]\nlisten = \"127.0.0.1\"\n", {"metrics.listen", "HOST:PORT"});
    expect_rejected("[metrics]\nlisten = 8474\n", {"metrics.listen", "a string"});
}

TEST_F(ConfigTest, DbusBusAndAdminGroup) {
    for (const char* ok : {"system", "session", "off", "unix:path=/run/test/bus"}) {
        const auto c = load(std::string("[dbus]\nbus = \"") + ok + "\"\nadmin_group = \"ops-team\"\n");
        ASSERT_TRUE(c) << ok << ": " << c.error().what();
        EXPECT_EQ(c->dbus_bus, ok);
        EXPECT_EQ(c->dbus_admin_group, "ops-team");
    }
    EXPECT_EQ(load("[dbus]\nadmin_group = \"\"\n")->dbus_admin_group, "");
    expect_rejected("[dbus]\nbus = \"tcp:host=example.org,port=1\"\n", {main_ + ":2:", "dbus.bus", "not a bus"});
    expect_rejected("[dbus]\nbus = \"System\"\n", {"dbus.bus", "not a bus"});
    expect_rejected("[dbus]\nbus = 1\n", {"dbus.bus", "a string"});
    expect_rejected("[dbus]\nadmin_group = \"wheel; rm -rf /\"\n", {"dbus.admin_group", "not a group name"});
    expect_rejected("[dbus]\nadmin_grup = \"x\"\n", {"admin_grup"});
}

TEST_F(ConfigTest, VramPoolIsASizeAndKeepRamCopyABool) {
    const auto c = load("[vram]\npool = \"8GiB\"\nkeep_ram_copy = true\n");
    ASSERT_TRUE(c) << c.error().what();
    ASSERT_TRUE(c->vram_pool);
    EXPECT_EQ(*c->vram_pool, 8ull << 30);
    EXPECT_TRUE(c->keep_ram_copy);
    const auto d = load("");
    ASSERT_TRUE(d);
    EXPECT_FALSE(d->vram_pool) << "unset: the hook decides";
    EXPECT_FALSE(d->keep_ram_copy);
    expect_rejected("[vram]\npool = \"25%\"\n", {main_ + ":2:", "vram.pool", "not a share of RAM"});
    expect_rejected("[vram]\nkeep_ram_copy = \"yes\"\n", {"vram.keep_ram_copy", "expected"});
}

TEST_F(ConfigTest, VramPoolMayBeGivenPerDevice) {
    const auto c = load("[vram]\npool = \"0:12GiB,1:6GiB\"\n");
    ASSERT_TRUE(c) << c.error().what();
    EXPECT_FALSE(c->vram_pool) << "devices not named: the hook decides";
    EXPECT_EQ(c->vram_pool_device, (std::map<uint32_t, uint64_t>{{0, 12ull << 30}, {1, 6ull << 30}}));
    const auto d = load("[vram]\npool = \"8GiB,3:2GiB\"\n");
    ASSERT_TRUE(d) << d.error().what();
    EXPECT_EQ(d->vram_pool, 8ull << 30);
    EXPECT_EQ(d->vram_pool_device, (std::map<uint32_t, uint64_t>{{3, 2ull << 30}}));
    expect_rejected("[vram]\npool = \"0:12GiB,0:1GiB\"\n", {main_ + ":2:", "vram.pool", "device 0 is given twice"});
    expect_rejected("[vram]\npool = \"64:1GiB\"\n", {"vram.pool", "'64:1GiB'", "0 to 63"});
    expect_rejected("[vram]\npool = \"x:1GiB\"\n", {"vram.pool", "a device is a number"});
    expect_rejected("[vram]\npool = \"1:10%\"\n", {"vram.pool", "not a share of RAM"});
    expect_rejected("[vram]\npool = \"1:lots\"\n", {"vram.pool", "'1:lots'"});
    expect_rejected("[vram]\npool = \"1GiB,2GiB,0:1GiB\"\n", {"vram.pool", "given twice"});
}

TEST_F(ConfigTest, AModelsFamilyIsANameAndItsBudgetASize) {
    const auto c = load("[[model]]\npath = \"/m/q4.gguf\"\nfamily = \"ds-v4\"\nfamily_budget = \"40%\"\n");
    ASSERT_TRUE(c) << c.error().what();
    ASSERT_EQ(c->models.size(), 1u);
    EXPECT_EQ(c->models[0].family, "ds-v4");
    ASSERT_TRUE(c->models[0].family_budget);
    EXPECT_EQ(c->models[0].family_budget->percent, 40.0);
    const auto d = load("[[model]]\npath = \"/m/q4.gguf\"\n");
    ASSERT_TRUE(d);
    EXPECT_TRUE(d->models[0].family.empty()) << "unset: the heat profile key decides";
    EXPECT_FALSE(d->models[0].family_budget);
    expect_rejected("[[model]]\npath = \"/m/a.gguf\"\nfamily = \"two words\"\n", {main_ + ":3:", "family", "printable"});
    expect_rejected("[[model]]\npath = \"/m/a.gguf\"\nfamily = \"\"\n", {"family", "1 to 128"});
    expect_rejected("[[model]]\npath = \"/m/a.gguf\"\nfamily_budget = \"lots\"\n", {"family_budget"});
}

TEST_F(ConfigTest, OnMissIsABoolAndWarmStartAutoOffOrASize) {
    const auto d = load("");
    ASSERT_TRUE(d);
    EXPECT_TRUE(d->on_miss);
    EXPECT_TRUE(d->warm_start);
    EXPECT_FALSE(d->warm_limit) << "auto: as far as free memory goes";
    const auto c = load("[prefetch]\non_miss = false\nwarm_start = \"4GiB\"\n");
    ASSERT_TRUE(c) << c.error().what();
    EXPECT_FALSE(c->on_miss);
    EXPECT_TRUE(c->warm_start);
    ASSERT_TRUE(c->warm_limit);
    EXPECT_EQ(c->warm_limit->resolve(kMemTotal), 4ull << 30);
    const auto pct = load("[prefetch]\nwarm_start = \"25%\"\n");
    ASSERT_TRUE(pct) << pct.error().what();
    EXPECT_EQ(pct->warm_limit->resolve(kMemTotal), kMemTotal / 4);
    const auto off = load("[prefetch]\nwarm_start = \"off\"\n");
    ASSERT_TRUE(off) << off.error().what();
    EXPECT_FALSE(off->warm_start);
    const auto f = load("[prefetch]\nwarm_start = false\n");
    ASSERT_TRUE(f) << f.error().what();
    EXPECT_FALSE(f->warm_start);
    // A drop-in's "auto" undoes an earlier limit.
    const auto a = parse_config_text("[prefetch]\nwarm_start = \"auto\"\n", "drop-in", *c);
    ASSERT_TRUE(a) << a.error().what();
    EXPECT_TRUE(a->warm_start);
    EXPECT_FALSE(a->warm_limit);
    expect_rejected("[prefetch]\nwarm_start = \"lots\"\n", {main_ + ":2:", "prefetch.warm_start", "'lots'", "\"auto\""});
    expect_rejected("[prefetch]\nwarm_start = 3\n", {"prefetch.warm_start", "\"auto\", \"off\" or a size"});
    expect_rejected("[prefetch]\non_miss = \"yes\"\n", {"prefetch.on_miss", "a boolean"});
}

// ---- Names -----------------------------------------------------------------------------------

TEST_F(ConfigTest, UnknownTableSuggestsTheClosest) {
    expect_rejected("[budgte]\nlock = \"8GiB\"\n",
                    {"budgte", "unknown table", "did you mean 'budget'?"});
}

TEST_F(ConfigTest, UnknownKeySuggestsTheClosest) {
    expect_rejected("[prefetch]\nqueue_dept = 8\n", {main_ + ":2:", "prefetch.queue_dept",
                                                     "unknown key", "did you mean 'queue_depth'?"});
}

TEST_F(ConfigTest, UnknownKeyFarFromEveryKnownKeyHasNoSuggestion) {
    const auto c = load("[policy]\ncolour = \"blue\"\n");
    ASSERT_FALSE(c);
    expect_mentions(c.error().what(),
                    {main_, "policy.colour", "unknown key",
                     "the keys here are decay_half_life_tokens, admit_after_uses"});
    EXPECT_EQ(c.error().what().find("did you mean"), std::string::npos) << c.error().what();
}

TEST_F(ConfigTest, UnknownKeyOfAModelSuggestsTheClosest) {
    expect_rejected("[[model]]\npath = \"/m/a.gguf\"\npins = [\"1\"]\n",
                    {"model[0].pins", "unknown key", "did you mean 'pin'?"});
}

TEST_F(ConfigTest, KeyAboveItsTableSaysWhereItBelongs) {
    expect_rejected("tick_seconds = 2\n[daemon]\n",
                    {"tick_seconds", "unknown key", "belongs in [daemon]"});
}

// ---- Types -----------------------------------------------------------------------------------

TEST_F(ConfigTest, WrongTypeSaysExpectedAndActual) {
    expect_rejected("[prefetch]\nqueue_depth = \"32\"\n",
                    {"prefetch.queue_depth", "expected an integer", "got a string (\"32\")"});
}

TEST_F(ConfigTest, SectionThatIsNotATable) {
    expect_rejected("daemon = 3\n", {"daemon", "expected a table", "got an integer"});
}

TEST_F(ConfigTest, ModelWrittenAsAPlainTable) {
    expect_rejected("[model]\npath = \"/m/a.gguf\"\n",
                    {"model", "expected an array of tables", "[[model]]", "got a table"});
}

TEST_F(ConfigTest, SizeOfWrongType) {
    expect_rejected(
        "[budget]\nlock = 1.5\n",
        {"budget.lock", "expected an integer (bytes) or a string", "got a floating-point number"});
}

// ---- Ranges ----------------------------------------------------------------------------------

TEST_F(ConfigTest, IntegerOutOfRange) {
    expect_rejected("[prefetch]\nqueue_depth = 0\n",
                    {"prefetch.queue_depth", "out of range", "at least 1 and at most 4096"});
}

TEST_F(ConfigTest, PsiWindowOutsideWhatTheKernelAccepts) {
    expect_rejected("[pressure]\nwindow_us = 100000\n",
                    {"pressure.window_us", "out of range", "at least 500000 and at most 10000000"});
}

TEST_F(ConfigTest, NumberOutOfAnOpenRange) {
    expect_rejected("[pressure]\nrelease_share = 0.0\n",
                    {"pressure.release_share", "out of range", "greater than 0 and at most 1"});
}

TEST_F(ConfigTest, NumberThatIsNotFinite) {
    expect_rejected("[daemon]\ntick_seconds = inf\n",
                    {"daemon.tick_seconds", "out of range", "finite"});
}

TEST_F(ConfigTest, NumaNodeBelowMinusOne) {
    expect_rejected("[prefetch]\nnuma_node = -2\n",
                    {"prefetch.numa_node", "out of range", "at least -1"});
}

TEST_F(ConfigTest, LogLevelThatDoesNotExist) {
    expect_rejected("[daemon]\nlog_level = \"warn\"\n",
                    {"daemon.log_level", "not a log level", "did you mean 'warning'?"});
}

TEST_F(ConfigTest, PrefetchEngineThatDoesNotExist) {
    expect_rejected("[prefetch]\nengine = \"iouring\"\n",
                    {"prefetch.engine", "not a prefetch engine", "did you mean 'io_uring'?"});
    expect_rejected("[prefetch]\nthreads = 65\n", {"prefetch.threads", "out of range"});
}

TEST_F(ConfigTest, RelativeDaemonPath) {
    expect_rejected("[daemon]\nstate_dir = \"var/lib/moecache\"\n",
                    {"daemon.state_dir", "relative path"});
}

// ---- Sizes -----------------------------------------------------------------------------------

TEST_F(ConfigTest, SizeWithUnknownUnit) {
    expect_rejected("[budget]\nlock = \"12 parsecs\"\n",
                    {"budget.lock", "'12 parsecs'", "unknown unit 'parsecs'"});
}

TEST_F(ConfigTest, NegativeSize) {
    expect_rejected("[budget]\nreserve = \"-1GiB\"\n", {"budget.reserve", "'-1GiB'", "negative"});
    expect_rejected("[budget]\nreserve = -5\n", {"budget.reserve", "-5", "negative"});
}

TEST_F(ConfigTest, PercentOutOfRange) {
    expect_rejected("[budget]\nlock = \"150%\"\n",
                    {"budget.lock", "'150%'", "more than 0% and at most 100%"});
    expect_rejected("[budget]\nlock = \"0%\"\n",
                    {"budget.lock", "'0%'", "more than 0% and at most 100%"});
}

TEST_F(ConfigTest, SizeThatOverflows) {
    expect_rejected("[budget]\nlock = \"99999999999TiB\"\n",
                    {"budget.lock", "too large", "64 bits"});
}

TEST_F(ConfigTest, ReadSizeIsWholePagesInBytes) {
    expect_rejected("[prefetch]\nread_size = \"50%\"\n",
                    {"prefetch.read_size", "not a percentage"});
    expect_rejected("[prefetch]\nread_size = 5000\n",
                    {"prefetch.read_size", "not a multiple of 4096"});
    expect_rejected("[prefetch]\nread_size = \"128MiB\"\n",
                    {"prefetch.read_size", "out of range", "at least 4 KiB and at most 64 MiB"});
}

TEST_F(ConfigTest, ClientIdsAreNumbers) {
    expect_rejected("[clients]\nallow_uids = [\"alice\"]\n", {"clients.allow_uids[0]", "numeric id"});
    expect_rejected("[clients]\nallow_gids = [-1]\n", {"clients.allow_gids[0]", "-1 is not a user or group id"});
    expect_rejected("[clients]\nallow_uids = 1000\n", {"clients.allow_uids", "an array of numeric ids"});
    expect_rejected("[clients]\nmax = 0\n", {"clients.max"});
    expect_rejected("[clients]\nuid_budgets = { alice = \"1GiB\" }\n", {"clients.uid_budgets.alice", "not a numeric uid"});
    expect_rejected("[clients]\nuid_budgets = { \"1000\" = \"lots\" }\n", {"clients.uid_budgets.1000"});
    expect_rejected("[clients]\nuid_budgets = [1]\n", {"clients.uid_budgets", "a table of uid = size"});
}

TEST_F(ConfigTest, TelemetryModeAndRingSize) {
    expect_rejected("[telemetry]\npage_cache = \"yes\"\n",
                    {"telemetry.page_cache", "'yes' is not a mode", "auto", "off"});
    expect_rejected("[telemetry]\npage_cache = true\n", {"telemetry.page_cache", "wrong type"});
    expect_rejected("[telemetry]\nring_buffer = \"3MiB\"\n", {"telemetry.ring_buffer", "not a power of two"});
    expect_rejected("[telemetry]\nring_buffer = \"10%\"\n", {"telemetry.ring_buffer", "not a percentage"});
    expect_rejected("[telemetry]\nring_buffer = 1024\n", {"telemetry.ring_buffer", "out of range"});
    expect_rejected("[telemetry]\nring = \"4MiB\"\n", {"telemetry.ring", "ring_buffer"});
}

// ---- Models ----------------------------------------------------------------------------------

TEST_F(ConfigTest, ModelWithoutPath) {
    expect_rejected("[[model]]\npath = \"/m/a.gguf\"\n\n[[model]]\nbudget = \"1GiB\"\n",
                    {main_ + ":4:", "model[1]", "has no 'path'"});
}

TEST_F(ConfigTest, ModelWithRelativePath) {
    expect_rejected("[[model]]\npath = \"models/a.gguf\"\n",
                    {"model[0].path", "'models/a.gguf'", "relative path"});
}

TEST_F(ConfigTest, ModelWithEmptyPath) {
    expect_rejected("[[model]]\npath = \"\"\n", {"model[0].path", "the path is empty"});
}

TEST_F(ConfigTest, PinThatDoesNotParse) {
    expect_rejected(
        "[[model]]\npath = \"/m/a.gguf\"\n[[model]]\npath = \"/m/b.gguf\"\npin = [\"3\", "
        "\"12:x\"]\n",
        {"model[1].pin[1]", "'12:x' is not a pin", "\"12:0-7\""});
}

TEST_F(ConfigTest, PinWithBackwardsRange) {
    expect_rejected("[[model]]\npath = \"/m/a.gguf\"\npin = [\"12:7-0\"]\n",
                    {"model[0].pin[0]", "first > last", "12:0-7"});
}

TEST_F(ConfigTest, PinOfWrongType) {
    expect_rejected("[[model]]\npath = \"/m/a.gguf\"\npin = [12]\n",
                    {"model[0].pin[0]", "expected a string", "got an integer (12)"});
}

TEST_F(ConfigTest, DuplicateModelPathAcrossFiles) {
    const auto second = drop_in("10-more.toml", "[[model]]\npath = \"/m//a.gguf\"\n");
    const auto c = load("[[model]]\npath = \"/m/a.gguf\"\n");
    ASSERT_FALSE(c);
    // Names the file and entry that repeats the path, and where it was first configured.
    expect_mentions(c.error().what(),
                    {second + ":1:", "model[0]", "duplicate model path", main_ + ":1:"});
}

// ---- Validation: what only the whole config and the machine can say --------------------------

TEST_F(ConfigTest, ReserveNotLessThanMemory) {
    expect_invalid("[budget]\nreserve = \"64GiB\"\n",
                   {main_ + ":2:", "budget.reserve", "not less than", "MemTotal 64 GiB",
                    "nothing could be locked"});
}

TEST_F(ConfigTest, DefaultThatDoesNotFitIsNamedAsDefault) {
    // 2 GiB of default reserve on a 1 GiB machine.
    expect_invalid("", {main_, "budget.reserve (default)", "nothing could be locked"}, kGiB);
}

TEST_F(ConfigTest, LockBudgetThatResolvesToZero) {
    expect_invalid("[budget]\nlock = 0\n", {main_ + ":2:", "budget.lock", "resolves to 0 bytes"});
    expect_invalid("[budget]\nlock = \"0.000000001%\"\n",
                   {main_, "budget.lock", "resolves to 0 bytes"});
}

TEST_F(ConfigTest, ModelBudgetAboveTheLockBudget) {
    expect_invalid(
        "[budget]\nlock = \"25%\"\n[[model]]\npath = \"/m/a.gguf\"\nbudget = \"20GiB\"\n",
        {main_ + ":3:", "model[0].budget", "20 GiB", "larger than the global lock budget",
         "25% of MemTotal 64 GiB = 16 GiB", "budget.lock"});
}

TEST_F(ConfigTest, StallLongerThanWindowNamesBothFiles) {
    const auto psi = drop_in("50-psi.toml", "[pressure]\nstall_us = 700000\n");
    expect_invalid("[pressure]\nwindow_us = 600000\n",
                   {psi + ":2:", "pressure.stall_us", "700000", "longer than the window",
                    main_ + ":2:", "pressure.window_us = 600000"});
}

TEST_F(ConfigTest, NumaNodeThatDoesNotExist) {
    expect_invalid("[prefetch]\nnuma_node = 5\n", {main_ + ":2:", "prefetch.numa_node",
                                                   "NUMA node 5 does not exist", "has nodes 0, 1"});
}

TEST_F(ConfigTest, NumaNodeThatExists) {
    const auto c = load("[prefetch]\nnuma_node = 1\n");
    ASSERT_TRUE(c) << c.error().what();
    const auto v = validate_config(*c, kMemTotal, numa_.path());
    EXPECT_TRUE(v) << v.error().what();
}

TEST_F(ConfigTest, NumaNodeIsCheckedAgainstThisMachine) {
    if (std::filesystem::exists("/sys/devices/system/node/node1023"))
        GTEST_SKIP() << "this machine has a NUMA node 1023";
    const auto c = load("[prefetch]\nnuma_node = 1023\n");
    ASSERT_TRUE(c) << c.error().what();
    const auto v = validate_config(*c, kMemTotal);
    ASSERT_FALSE(v);
    expect_mentions(v.error().what(),
                    {main_, "prefetch.numa_node", "NUMA node 1023 does not exist"});
}

// ---- What must work --------------------------------------------------------------------------

TEST_F(ConfigTest, EmptyFileGivesTheDefaults) {
    const auto c = load("");
    ASSERT_TRUE(c) << c.error().what();
    EXPECT_EQ(describe(*c), describe(Config{}));
    EXPECT_EQ(c->sources, std::vector<std::string>{main_});  // no drop-in directory: fine
    EXPECT_TRUE(validate_config(*c, kMemTotal, numa_.path()));
}

TEST_F(ConfigTest, EveryFieldIsRead) {
    const auto c = load(R"([daemon]
state_dir = "/srv/moecache/state"
socket = "/srv/moecache/sock"
log_level = "debug"
tick_seconds = 2          # an integer where a float is expected

[budget]
lock = "96GiB"
reserve = "12.5%"

[prefetch]
queue_depth = 128
read_size = "256KiB"
numa_node = 1

[pressure]
enabled = false
stall_us = 150000
window_us = 2000000
release_share = 0.5
recover_seconds = 0

[policy]
decay_half_life_tokens = 1000.5
admit_after_uses = 3
elite_share = 0.25
hysteresis = 0
save_interval_seconds = 300
predict = true

[[model]]
path = "/models/kimi/Kimi-K2-*.gguf"
budget = "80G"
pin = ["0", "12:3", "13:0-7"]
lock_dense = false

[[model]]
path = "/models/qwen.gguf"

[telemetry]
page_cache = "off"
ring_buffer = "1MiB"

[clients]
allow_uids = [0, 1000]
allow_gids = [44]
max = 16
max_per_uid = 4
max_models_per_uid = 3
max_experts_per_uid = 30000
hello_seconds = 2.5
uid_budgets = { "1000" = "8GiB", "1001" = "5%" }
)");
    ASSERT_TRUE(c) << c.error().what();
    EXPECT_EQ(c->state_dir, "/srv/moecache/state");
    EXPECT_EQ(c->socket_path, "/srv/moecache/sock");
    EXPECT_EQ(c->log_level, "debug");
    EXPECT_EQ(c->tick_seconds, 2.0);
    EXPECT_EQ(c->lock_budget.bytes, 96 * kGiB);
    EXPECT_FALSE(c->lock_budget.percent);
    EXPECT_EQ(c->reserve.percent, 12.5);
    EXPECT_EQ(c->queue_depth, 128u);
    EXPECT_EQ(c->read_size, 256 * kKiB);
    EXPECT_EQ(c->numa_node, 1);
    EXPECT_FALSE(c->pressure_enabled);
    EXPECT_EQ(c->pressure_stall_us, 150000u);
    EXPECT_EQ(c->pressure_window_us, 2000000u);
    EXPECT_EQ(c->pressure_release_share, 0.5);
    EXPECT_EQ(c->pressure_recover_seconds, 0.0);
    EXPECT_EQ(c->decay_half_life_tokens, 1000.5);
    EXPECT_EQ(c->admit_after_uses, 3u);
    EXPECT_EQ(c->elite_share, 0.25);
    EXPECT_EQ(c->hysteresis, 0.0);
    EXPECT_EQ(c->save_interval_seconds, 300.0);
    EXPECT_TRUE(c->predict);
    EXPECT_EQ(c->page_cache_telemetry, "off");
    EXPECT_EQ(c->page_cache_ring_bytes, 1u << 20);
    EXPECT_EQ(c->client_allow_uids, (std::vector<uint32_t>{0, 1000}));
    EXPECT_EQ(c->client_allow_gids, (std::vector<uint32_t>{44}));
    EXPECT_EQ(c->max_clients, 16u);
    EXPECT_EQ(c->max_clients_per_uid, 4u);
    EXPECT_EQ(c->max_models_per_uid, 3u);
    EXPECT_EQ(c->max_experts_per_uid, 30000u);
    EXPECT_EQ(c->hello_seconds, 2.5);
    ASSERT_EQ(c->uid_budgets.size(), 2u);
    EXPECT_EQ(c->uid_budgets.at(1000).bytes, 8 * kGiB);
    EXPECT_EQ(c->uid_budgets.at(1001).percent, 5.0);

    ASSERT_EQ(c->models.size(), 2u);
    const auto& kimi = c->models[0];
    EXPECT_EQ(kimi.path, "/models/kimi/Kimi-K2-*.gguf");
    ASSERT_TRUE(kimi.budget);
    EXPECT_EQ(kimi.budget->bytes, 80 * kGiB);
    EXPECT_FALSE(kimi.lock_dense);
    ASSERT_EQ(kimi.pins.size(), 3u);
    EXPECT_EQ(kimi.pins[0].layer, 0u);
    EXPECT_EQ(kimi.pins[0].first, 0u);
    EXPECT_EQ(kimi.pins[0].last, kWholeLayer);
    EXPECT_EQ(kimi.pins[1].layer, 12u);
    EXPECT_EQ(kimi.pins[1].first, 3u);
    EXPECT_EQ(kimi.pins[1].last, 3u);
    EXPECT_EQ(kimi.pins[2].layer, 13u);
    EXPECT_EQ(kimi.pins[2].first, 0u);
    EXPECT_EQ(kimi.pins[2].last, 7u);
    EXPECT_EQ(kimi.where, main_ + ":31:1: model[0]");
    const auto& qwen = c->models[1];
    EXPECT_EQ(qwen.path, "/models/qwen.gguf");
    EXPECT_FALSE(qwen.budget);
    EXPECT_TRUE(qwen.lock_dense);
    EXPECT_TRUE(qwen.pins.empty());

    EXPECT_EQ(c->origins.size(), 30u) << "every key set above has an origin";
    EXPECT_EQ(c->origins.at("budget.lock"), main_ + ":8:8");
    const auto v = validate_config(*c, 256 * kGiB, numa_.path());
    EXPECT_TRUE(v) << v.error().what();
}

TEST_F(ConfigTest, DropInsOverrideInNameOrderAndAddModels) {
    // Written out of order, to show that the order is the names', not the directory's.
    const auto b =
        drop_in("20-b.toml", "[prefetch]\nqueue_depth = 20\n[[model]]\npath = \"/m/b.gguf\"\n");
    const auto a =
        drop_in("10-a.toml",
                "[prefetch]\nqueue_depth = 10\nnuma_node = 0\n[[model]]\npath = \"/m/a.gguf\"\n");
    drop_in("30-c.toml.disabled", "this is not TOML and is not read\n");
    drop_in("README", "neither is this\n");
    drop_in(".05-hidden.toml", "[prefetch]\nqueue_depth = 5\n");

    const auto c =
        load("[prefetch]\nqueue_depth = 1\nread_size = 8192\n[[model]]\npath = \"/m/main.gguf\"\n");
    ASSERT_TRUE(c) << c.error().what();
    EXPECT_EQ(c->sources, (std::vector<std::string>{main_, a, b}));
    EXPECT_EQ(c->queue_depth, 20u) << "the last file wins";
    EXPECT_EQ(c->numa_node, 0) << "a key only 10-a.toml sets";
    EXPECT_EQ(c->read_size, 8192u) << "a key only the main file sets";
    EXPECT_EQ(c->origins.at("prefetch.queue_depth"), b + ":2:15");
    ASSERT_EQ(c->models.size(), 3u);
    EXPECT_EQ(c->models[0].path, "/m/main.gguf");
    EXPECT_EQ(c->models[1].path, "/m/a.gguf");
    EXPECT_EQ(c->models[2].path, "/m/b.gguf");
    EXPECT_EQ(c->models[2].where, b + ":3:1: model[0]") << "indices count within each file";
}

// Something named as a drop-in that is not a file (a directory, a link to nothing) was meant as one:
// an error that names it, not a drop-in skipped without a word.
TEST_F(ConfigTest, ADropInThatIsNoFileIsAnError) {
    drop_in("10-a.toml", "[prefetch]\nqueue_depth = 10\n");
    const std::string dir = dir_.file("moecached.toml.d/40-dir.toml");
    std::filesystem::create_directories(dir);
    auto c = load("");
    ASSERT_FALSE(c);
    expect_mentions(c.error().what(), {dir, "regular file"});
    std::filesystem::remove(dir);
    const std::string dangling = dir_.file("moecached.toml.d/50-gone.toml");
    std::filesystem::create_symlink(dir_.file("nowhere.toml"), dangling);
    c = load("");
    ASSERT_FALSE(c);
    expect_mentions(c.error().what(), {dangling, "dangling symlink"});
}

TEST_F(ConfigTest, ErrorInADropInNamesTheDropIn) {
    const auto bad = drop_in("10-bad.toml", "[policy]\nelite_share = 2\n");
    const auto c = load("");
    ASSERT_FALSE(c);
    expect_mentions(c.error().what(), {bad + ":2:", "policy.elite_share", "out of range"});
}

// ---- The annotated default config ------------------------------------------------------------

const std::string kAnnotatedConfig = MOECACHE_SOURCE_DIR "/config/moecached.toml";

TEST(AnnotatedConfig, ParsesAndValidates) {
    const auto c = parse_config_text(test::read_file(kAnnotatedConfig), kAnnotatedConfig);
    ASSERT_TRUE(c) << c.error().what();
    EXPECT_EQ(describe(*c), describe(Config{})) << "the shipped file must change nothing";
    const auto v = validate_config(*c, kMemTotal);
    EXPECT_TRUE(v) << v.error().what();
}

// The file shows each setting as "#key = default" and each example model line as "#[[model]]" or
// "#key = value"; prose comments start with "# ". Uncommented, it must list every key with the
// daemon's real default, and the example models must be valid.
TEST(AnnotatedConfig, ShowsEveryKeyWithItsDefault) {
    std::istringstream in(test::read_file(kAnnotatedConfig));
    std::string uncommented, line;
    while (std::getline(in, line)) {
        const bool setting = line.size() > 1 && line[0] == '#' && line[1] != ' ' && line[1] != '#';
        uncommented += (setting ? line.substr(1) : line) + "\n";
    }
    const auto c = parse_config_text(uncommented, kAnnotatedConfig + " (uncommented)");
    ASSERT_TRUE(c) << c.error().what();
    EXPECT_EQ(c->origins.size(), 45u) << "a key is missing from the annotated config";
    ASSERT_EQ(c->models.size(), 2u) << "the example models";
    Config without_models = *c;
    without_models.models.clear();
    EXPECT_EQ(describe(without_models), describe(Config{}));
    const auto v = validate_config(*c, 128 * kGiB);
    EXPECT_TRUE(v) << v.error().what();
}

// ---- Value syntaxes --------------------------------------------------------------------------

TEST(ByteAmountSyntax, Accepted) {
    struct Case {
        std::string text;
        uint64_t bytes;
    };
    const Case cases[] = {
        {"0", 0},
        {"4096", 4096},
        {"4096B", 4096},
        {"1KiB", kKiB},
        {"1k", kKiB},
        {"512MiB", 512 * kMiB},
        {"512 mib", 512 * kMiB},
        {"48GiB", 48 * kGiB},
        {"48G", 48 * kGiB},
        {"48gib", 48 * kGiB},
        {"1.5GiB", 3 * kGiB / 2},
        {"2TiB", 2 * kTiB},
        {"  3 T  ", 3 * kTiB},
        {"0.5K", 512},
        {"0.3KiB", 307},  // 307.2: the fraction of a byte is dropped
        {"16777215TiB", 16777215 * kTiB},
        {"18446744073709551615", std::numeric_limits<uint64_t>::max()},
    };
    for (const auto& [text, bytes] : cases) {
        const auto a = parse_byte_amount(text);
        ASSERT_TRUE(a) << text << ": " << a.error().what();
        EXPECT_EQ(a->bytes, bytes) << text;
        EXPECT_FALSE(a->percent) << text;
    }
}

TEST(ByteAmountSyntax, Percent) {
    struct Case {
        std::string text;
        double percent;
        uint64_t of_64_gib;
    };
    const Case cases[] = {
        {"50%", 50, 32 * kGiB},
        {"100%", 100, 64 * kGiB},
        {"12.5%", 12.5, 8 * kGiB},
        {"0.001 %", 0.001, 687194},  // 687194.76736 bytes, rounded down
    };
    for (const auto& [text, percent, of_64_gib] : cases) {
        const auto a = parse_byte_amount(text);
        ASSERT_TRUE(a) << text << ": " << a.error().what();
        EXPECT_EQ(a->percent, percent) << text;
        EXPECT_EQ(a->resolve(64 * kGiB), of_64_gib) << text;
    }
    EXPECT_EQ((ByteAmount{1234, std::nullopt}.resolve(64 * kGiB)), 1234u) << "bytes do not scale";
    const uint64_t odd = std::numeric_limits<uint64_t>::max() - 3;
    EXPECT_EQ((ByteAmount{0, 100.0}.resolve(odd)), odd) << "100% is all of it, to the byte";
}

TEST(ByteAmountSyntax, Rejected) {
    struct Case {
        std::string text;
        std::string phrase;
    };
    const Case cases[] = {
        {"", "empty"},
        {"   ", "empty"},
        {"12 parsecs", "unknown unit 'parsecs'"},
        {"12KB", "unknown unit 'KB'"},  // decimal or binary? Not guessed.
        {"1.", "unknown unit '.'"},
        {"1e9", "unknown unit 'e9'"},
        {"-1GiB", "negative"},
        {"GiB", "does not start with a number"},
        {".5GiB", "does not start with a number"},
        {"+5", "does not start with a number"},
        {"150%", "at most 100%"},
        {"0%", "more than 0%"},
        {"0.0%", "more than 0%"},
        {"99999999999TiB", "too large"},
        {"16777216TiB", "too large"},
        {"18446744073709551616", "too large"},
        {"17179869184G", "too large"},  // 2^64
    };
    for (const auto& [text, phrase] : cases) {
        const auto a = parse_byte_amount(text);
        ASSERT_FALSE(a) << "'" << text << "' was accepted";
        expect_mentions(a.error().what(), {phrase});
    }
}

TEST(ExpertPinSyntax, AcceptedAndRejected) {
    const auto pin = [](std::string_view text) {
        const auto p = parse_expert_pin(text);
        return p ? fmt::format("{}:{}-{}", p->layer, p->first, p->last)
                 : "error: " + p.error().what();
    };
    EXPECT_EQ(pin("12"), fmt::format("12:0-{}", kWholeLayer));
    EXPECT_EQ(pin("12:3"), "12:3-3");
    EXPECT_EQ(pin("12:0-7"), "12:0-7");
    EXPECT_EQ(pin(" 0:5-5 "), "0:5-5");
    for (const std::string_view bad : {"", "x", "12:", "12:x", "12:3-", "12:-3", "-1", "1:2-3-4",
                                       "12 :3", "4294967296", "1:4294967296"})
        EXPECT_EQ(pin(bad).rfind("error: ", 0), 0u) << "'" << bad << "' was accepted: " << pin(bad);
    expect_mentions(pin("12:7-0"), {"first > last", "12:0-7"});
    expect_mentions(pin("4294967296"), {"too large"});
}

TEST(FormatBytes, ExactUnitsAndOthers) {
    EXPECT_EQ(format_bytes(0), "0 bytes");
    EXPECT_EQ(format_bytes(1000), "1000 bytes");
    EXPECT_EQ(format_bytes(4 * kKiB), "4 KiB");
    EXPECT_EQ(format_bytes(48 * kGiB), "48 GiB");
    EXPECT_EQ(format_bytes(48 * kGiB + 1), "51539607553 bytes (48.0 GiB)");
}

// [clients] max against RLIMIT_NOFILE: systemd's soft limit of 1024 holds a few hundred clients,
// not [clients] max = 65536; the daemon serves what fits and --check says so.
TEST(DescriptorBudget, ClientsFitWhatTheLimitLeaves) {
    Config c;
    c.max_clients = 256;
    const DescriptorBudget fits = descriptor_budget(c, 1024);
    EXPECT_TRUE(fits.fits());
    EXPECT_EQ(fits.clients, 256u);
    EXPECT_LE(fits.needed(256), 1024u);
    EXPECT_NE(describe(fits).find("max = 256"), std::string::npos) << describe(fits);

    c.max_clients = 65536;
    const DescriptorBudget over = descriptor_budget(c, 1024);
    EXPECT_FALSE(over.fits());
    EXPECT_GT(over.clients, 100u);
    EXPECT_LT(over.clients, 400u);
    EXPECT_LE(over.needed(over.clients), 1024u);
    EXPECT_GT(over.needed(over.clients + 1), 1024u);
    EXPECT_NE(describe(over).find("LimitNOFILE"), std::string::npos) << describe(over);

    // Without /metrics its connections leave room for more clients; each model entry takes some.
    c.metrics_listen.clear();
    EXPECT_GT(descriptor_budget(c, 1024).clients, over.clients);
    c.models.resize(100);
    EXPECT_LT(descriptor_budget(c, 1024).clients, over.clients);
    // A limit that holds nothing but the fixed part: no client fits.
    EXPECT_EQ(descriptor_budget(c, 16).clients, 0u);
}

}  // namespace
}  // namespace moecache::daemon
