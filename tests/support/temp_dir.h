// A private directory for one test, removed with everything in it when the test ends.
#pragma once

#include <string>

namespace moecache::test {

class TempDir {
public:
    TempDir();
    ~TempDir();
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;

    [[nodiscard]] const std::string& path() const { return path_; }
    [[nodiscard]] std::string file(const std::string& name) const { return path_ + "/" + name; }

private:
    std::string path_;
};

// Writes bytes to a file (for fixtures built at run time).
void write_file(const std::string& path, const std::string& bytes);
std::string read_file(const std::string& path);
// Writes back and drops a file's pages from the page cache, so that it starts cold.
void drop_page_cache(const std::string& path);

}  // namespace moecache::test
