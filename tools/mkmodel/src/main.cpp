// moecache-mkmodel: writes synthetic MoE GGUF models that llama.cpp runs.
#include "moecache/mkmodel/cli.h"

int main(int argc, char** argv) { return moecache::mkmodel::run_cli(argc, argv); }
