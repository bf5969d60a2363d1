// Lazy load (libmoecache-rearm.so; MOECACHE_LOAD=lazy, or auto while moecached's socket is there):
// a model mapped as llama.cpp maps it (MAP_POPULATE, WILLNEED) is not read at load, the bytes read
// through the mapping are the file's, and nothing changes for other files or without it.
#include "moecache/unique_fd.h"
#include "run.h"
#include "temp_dir.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/socket.h>
#include <sys/un.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <random>

namespace moecache {
namespace {

struct Probe {
    uint64_t pages = 0, resident = 0, mapped = 0;
    bool same = false;
};

class LazyLoad : public testing::Test {
protected:
    void SetUp() override {
        std::mt19937_64 rng(7);
        std::string bytes(32u << 20, '\0');
        for (auto& c : bytes) c = static_cast<char>(rng());
        test::write_file(dir_.file("other.bin"), bytes);
        test::write_file(dir_.file("named.gguf"), bytes);  // a .gguf name, but not a GGUF file
        bytes.replace(0, 4, "GGUF");                      // models are known by their magic
        test::write_file(dir_.file("model.gguf"), bytes);
        test::write_file(dir_.file("sha256-0f3a9c"), bytes);  // as ollama and Hugging Face's cache keep them
    }
    // cached_share: the share of the file (from its start) read into the page cache first.
    Probe probe(const std::string& file, const std::vector<std::string>& env, double cached_share = 0) {
        test::drop_page_cache(file);
        if (cached_share > 0) {
            UniqueFd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
            ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_RANDOM);  // that half only: no read-ahead past it
            std::string buf(static_cast<size_t>(std::filesystem::file_size(file) * cached_share), '\0');
            EXPECT_EQ(::pread(fd.get(), buf.data(), buf.size(), 0), static_cast<ssize_t>(buf.size()));
        }
        const auto r = test::run({MOECACHE_MAP_PROBE_BIN, file}, env, 60);
        EXPECT_EQ(r.exit_code, 0) << r.err;
        Probe p;
        try {
            const auto j = nlohmann::json::parse(r.out);
            p = {j["pages"].get<uint64_t>(), j["resident"].get<uint64_t>(), j["mapped"].get<uint64_t>(), j["same"].get<bool>()};
        } catch (const std::exception&) {
            ADD_FAILURE() << "not the probe's JSON: " << r.out << r.err;
        }
        return p;
    }
    test::TempDir dir_;
    const std::string preload_ = std::string("LD_PRELOAD=") + MOECACHE_REARM_LIB;
    const std::string no_daemon_ = "MOECACHE_SOCKET=" + dir_.file("no-daemon.sock");
};

TEST_F(LazyLoad, AModelIsNotReadAtLoadAndReadsTheSameBytes) {
    const auto native = probe(dir_.file("model.gguf"), {preload_, "MOECACHE_REARM_MS=0", no_daemon_});
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
    const auto typo = probe(dir_.file("model.gguf"), {preload_, "MOECACHE_REARM_MS=0", "MOECACHE_LOAD=lazzy", no_daemon_});
    EXPECT_EQ(typo.resident, typo.pages) << "an unknown setting means auto: without a daemon, native";
}

TEST_F(LazyLoad, ModelsAreKnownByTheirBytesNotTheirNames) {
    const auto blob = probe(dir_.file("sha256-0f3a9c"), {preload_, "MOECACHE_REARM_MS=0", "MOECACHE_LOAD=lazy"});
    EXPECT_LT(blob.resident, blob.pages / 10) << "a model without the .gguf suffix was read at load";
    EXPECT_TRUE(blob.same);
    const auto named = probe(dir_.file("named.gguf"), {preload_, "MOECACHE_REARM_MS=0", "MOECACHE_LOAD=lazy"});
    EXPECT_EQ(named.resident, named.pages) << "a file that is no GGUF file is loaded as asked, whatever its name";
}

// What is cached already (what a warm daemon read) is mapped at load, and nothing else is read.
TEST_F(LazyLoad, WhatIsCachedIsMappedAtLoad) {
    const auto half = probe(dir_.file("model.gguf"), {preload_, "MOECACHE_REARM_MS=0", "MOECACHE_LOAD=lazy"}, 0.5);
    EXPECT_GE(half.resident, half.pages / 2 - 1) << "the cached half stays cached";
    EXPECT_LT(half.resident, half.pages / 2 + half.pages / 20) << "lazy load read more than what was cached";
    EXPECT_GE(half.mapped, half.pages / 2 - 1) << "the cached half should be mapped at load";
    EXPECT_LE(half.mapped, half.resident);
    EXPECT_TRUE(half.same);
    const auto cold = probe(dir_.file("model.gguf"), {preload_, "MOECACHE_REARM_MS=0", "MOECACHE_LOAD=lazy"});
    EXPECT_LT(cold.mapped, cold.pages / 10) << "nothing cached, nothing mapped";
}

// auto, the default: lazy exactly when moecached's socket is there.
TEST_F(LazyLoad, AutoIsLazyWhenTheDaemonsSocketIsThere) {
    const std::string sock = dir_.file("moecached.sock");
    UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    ASSERT_TRUE(s);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, sock.c_str(), sizeof a.sun_path - 1);
    ASSERT_EQ(::bind(s.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
    const auto with = probe(dir_.file("model.gguf"), {preload_, "MOECACHE_REARM_MS=0", "MOECACHE_SOCKET=" + sock});
    EXPECT_LT(with.resident, with.pages / 10) << "a daemon's socket is there: lazy";
    EXPECT_TRUE(with.same);
    const auto native = probe(dir_.file("model.gguf"),
                              {preload_, "MOECACHE_REARM_MS=0", "MOECACHE_SOCKET=" + sock, "MOECACHE_LOAD=native"});
    EXPECT_EQ(native.resident, native.pages) << "native is native, daemon or not";
    const auto file = probe(dir_.file("model.gguf"),
                            {preload_, "MOECACHE_REARM_MS=0", "MOECACHE_SOCKET=" + dir_.file("other.bin")});
    EXPECT_EQ(file.resident, file.pages) << "a regular file is no daemon's socket";
}

// A setting the preload cannot read is said once, not once for each process a runtime starts.
TEST(RearmEnvironment, AnInvalidSettingIsSaidOnceForAProcessAndItsChildren) {
    const auto r = test::run({"/bin/sh", "-c", "for i in 1 2 3 4 5 6 7 8; do /bin/true; done"},
                             {std::string("LD_PRELOAD=") + MOECACHE_REARM_LIB, "MOECACHE_REARM_MS=banana"}, 60);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    size_t said = 0;
    for (size_t at = r.err.find("MOECACHE_REARM_MS=banana"); at != std::string::npos; at = r.err.find("MOECACHE_REARM_MS=banana", at + 1))
        ++said;
    EXPECT_EQ(said, 1u) << r.err;
}

}  // namespace
}  // namespace moecache
