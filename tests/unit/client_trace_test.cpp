// MOECACHE_TRACE: a client writes the router decisions it reports as a trace by itself, with no
// daemon, in the format moecache-sim reads; what a runtime reports wrongly is left out, so the
// trace still reads back.
#include "model_fixture.h"
#include "temp_dir.h"

#include "moecache/client.h"
#include "moecache/model.h"
#include "moecache/sim/trace.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace moecache {
namespace {

TEST(ClientTrace, ReportsBecomeATraceThatReadsBackWithoutADaemon) {
    test::TempDir dir;
    const std::string model = dir.file("m.gguf"), trace = dir.file("t.jsonl");
    test::write_model(test::small_spec(), model);
    const auto map = load_expert_map(model);
    ASSERT_TRUE(map) << map.error().what();
    ::setenv("MOECACHE_TRACE", trace.c_str(), 1);
    moecache_client* c = moecache_client_open(dir.file("no-daemon.sock").c_str(), "trace-test");
    ::unsetenv("MOECACHE_TRACE");
    ASSERT_NE(c, nullptr);
    uint32_t h = 0;
    ASSERT_EQ(moecache_client_register_model(c, model.c_str(), &h), 0);
    const uint32_t b0 = map->layers[0].index, b1 = map->layers[1].index;
    const uint32_t a[] = {3, 7}, bad_expert[] = {1, 9999}, d[] = {5};
    EXPECT_EQ(moecache_client_report(c, h, b0, a, 2, 1), 0) << "no daemon: counted as dropped";
    EXPECT_EQ(moecache_client_report(c, h, b1, bad_expert, 2, 4), 0);
    EXPECT_EQ(moecache_client_report(c, h, 60000, d, 1, 1), 0) << "not a MoE block: left out of the trace";
    EXPECT_EQ(moecache_client_report(c, h + 1, b0, d, 1, 1), -EINVAL);
    moecache_client_close(c);  // writes the rest out

    auto t = sim::read_trace(trace);
    ASSERT_TRUE(t) << t.error().what();
    ASSERT_EQ(t->models.size(), 1u);
    EXPECT_EQ(t->models[0].id, h);
    EXPECT_EQ(t->models[0].key, map->profile_key());
    EXPECT_EQ(t->models[0].path, model);
    EXPECT_EQ(t->models[0].n_experts, map->n_experts);
    ASSERT_EQ(t->models[0].blocks.size(), map->layers.size());
    EXPECT_EQ(t->models[0].bytes_per_expert[0], map->layers[0].bytes_per_expert);
    ASSERT_EQ(t->decisions.size(), 2u);
    EXPECT_EQ(t->decisions[0].layer, 0u);
    EXPECT_EQ(t->decisions[0].experts, (std::vector<uint32_t>{3, 7}));
    EXPECT_EQ(t->decisions[1].layer, 1u);
    EXPECT_EQ(t->decisions[1].tokens, 4u);
    EXPECT_EQ(t->decisions[1].experts, (std::vector<uint32_t>{1})) << "expert 9999 is out of range: left out";
    EXPECT_LE(t->decisions[0].t_us, t->decisions[1].t_us);
}

TEST(ClientTrace, ATraceThatCannotBeCreatedLeavesTheClientWorking) {
    test::TempDir dir;
    ::setenv("MOECACHE_TRACE", dir.file("no/such/dir/t.jsonl").c_str(), 1);
    moecache_client* c = moecache_client_open(dir.file("no-daemon.sock").c_str(), "trace-test");
    ::unsetenv("MOECACHE_TRACE");
    ASSERT_NE(c, nullptr) << "tracing is optional: the client opens without it";
    moecache_client_stats s{};
    moecache_client_stats_get(c, &s);
    EXPECT_EQ(s.reported, 0u);
    moecache_client_close(c);
}

}  // namespace
}  // namespace moecache
