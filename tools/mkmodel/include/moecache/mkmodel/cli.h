#pragma once

namespace moecache::mkmodel {
int run_cli(int argc, char** argv);
}
