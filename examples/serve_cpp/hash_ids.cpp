// Raw ids -> the rows an `ids: hash` feature of num_embeddings rows takes (hash_ids.h), as training hashed them:
//
//   build/serve_cpp/hash_ids 1000000 < ids.txt
//
// One id per line of standard input: "int <decimal>" (an integer id, e.g. from an int64 column) or "text <utf-8>"
// (a text id, the rest of the line); one row per line on standard output.
#include <cstdint>
#include <iostream>
#include <string>

#include "hash_ids.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: hash_ids NUM_EMBEDDINGS < ids.txt (lines: 'int <decimal>' or 'text <utf-8>')\n";
    return 2;
  }
  const int64_t num_embeddings = std::stoll(argv[1]);
  if (num_embeddings < 1) {
    std::cerr << "NUM_EMBEDDINGS must be >= 1, got " << num_embeddings << "\n";
    return 2;
  }
  std::string line;
  for (int64_t n = 1; std::getline(std::cin, line); ++n) {
    if (line.rfind("int ", 0) == 0) {
      std::cout << lightning_rec::hashed_row(static_cast<int64_t>(std::stoll(line.substr(4))), num_embeddings) << "\n";
    } else if (line.rfind("text ", 0) == 0) {
      std::cout << lightning_rec::hashed_row(std::string_view(line).substr(5), num_embeddings) << "\n";
    } else {
      std::cerr << "line " << n << ": expected 'int <decimal>' or 'text <utf-8>', got '" << line << "'\n";
      return 2;
    }
  }
  return 0;
}
