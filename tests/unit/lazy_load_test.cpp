// Lazy load (MOECACHE_LOAD=lazy in libmoecache-rearm.so): a model mapped as llama.cpp maps it
// (MAP_POPULATE, WILLNEED) is not read at load, the bytes read through the mapping are the file's,
// and nothing changes for other files or without the setting.
#include "run.h"
#include "temp_dir.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <random>

namespace moecache {
namespace {

struct Probe {
    uint64_t pages = 0, resident = 0;
    bool same = false;
};

class LazyLoad : public testing::Test {
protected:
    void SetUp() override {
        std::mt19937_64 rng(7);
        std::string bytes(32u << 20, '\0');
        for (auto& c : bytes) c = static_cast<char>(rng());
        test::write_file(dir_.file("model.gguf"), bytes);
        test::write_file(dir_.file("other.bin"), bytes);
    }
    Probe probe(const std::string& file, const std::vector<std::string>& env) {
        test::drop_page_cache(file);
        const auto r = test::run({MOECACHE_MAP_PROBE_BIN, file}, env, 60);
        EXPECT_EQ(r.exit_code, 0) << r.err;
        Probe p;
        try {
            const auto j = nlohmann::json::parse(r.out);
            p = {j["pages"].get<uint64_t>(), j["resident"].get<uint64_t>(), j["same"].get<bool>()};
        } catch (const std::exception&) {
            ADD_FAILURE() << "not the probe's JSON: " << r.out << r.err;
        }
        return p;
    }
    test::TempDir dir_;
    const std::string preload_ = std::string("LD_PRELOAD=") + MOECACHE_REARM_LIB;
};

TEST_F(LazyLoad, AModelIsNotReadAtLoadAndReadsTheSameBytes) {
    const auto native = probe(dir_.file("model.gguf"), {preload_, "MOECACHE_REARM_MS=0"});
    EXPECT_EQ(native.resident, native.pages) << "MAP_POPULATE reads the whole file without lazy load";
    EXPECT_TRUE(native.same);
    const auto lazy = probe(dir_.file("model.gguf"), {preload_, "MOECACHE_REARM_MS=0", "MOECACHE_LOAD=lazy"});
    EXPECT_LT(lazy.resident, lazy.pages / 10) << "lazy load read " << lazy.resident << " of " << lazy.pages << " pages at load";
    EXPECT_TRUE(lazy.same) << "the bytes read through the mapping differ from the file's";
}

TEST_F(LazyLoad, OtherFilesAreLoadedAsAsked) {
    const auto other = probe(dir_.file("other.bin"), {preload_, "MOECACHE_REARM_MS=0", "MOECACHE_LOAD=lazy"});
    EXPECT_EQ(other.resident, other.pages);
    EXPECT_TRUE(other.same);
    const auto typo = probe(dir_.file("model.gguf"), {preload_, "MOECACHE_REARM_MS=0", "MOECACHE_LOAD=lazzy"});
    EXPECT_EQ(typo.resident, typo.pages) << "an unknown setting means native";
}

}  // namespace
}  // namespace moecache
