// Following a publish directory (what lightning_rec's ModelPublisher writes, docs/fresh-models.md): serve.cpp's
// `--follow DIR` mode. Header-only; needs libtorch (torch::pickle_load, the AOTInductor package loader),
// json_value.h and sha256.h.
//
//   DIR/LATEST                     {"version": 7}, replaced atomically once a version is complete
//   DIR/full/v000005.pt2 (+ .json) a full package and its manifest
//   DIR/versions/v000007/          manifest.json + delta.r<rank>.pt: the rows each table changed and the dense
//                                  weights, a torch.save of a flat {str: tensor} dict
//
// The server loads the newest full f <= LATEST, then applies the deltas f+1 .. LATEST. The model's constants are
// copied once into two sets of tensors the server owns (A and B); the package runs on one (active) while the
// other (inactive) takes the next deltas, then `swap_constant_buffer` makes it active. The swap takes the package's
// run lock exclusively: a request in flight finishes on the version it started on, the next one runs on the new
// one, none sees a mix. The old set is then brought up to date with the same deltas, ready for the next version.
// A delta that is missing, damaged (its SHA-256 against its manifest) or does not fit the package's layout is
// refused, named on standard error, and the server stays on the last version it applied.
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <dirent.h>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include "json_value.h"
#include "sha256.h"

namespace lightning_rec {

// What a publish directory holds that this program will not use, naming the file (the version stays as it was).
struct PublishError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline std::string version_name(int64_t version) {
  char name[32];
  std::snprintf(name, sizeof(name), "v%06lld", static_cast<long long>(version));
  return name;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw PublishError(path + " is missing");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline Json read_json(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return Json::parse(text);
  } catch (const std::exception& err) {
    throw PublishError(path + " is not valid JSON (" + err.what() + ")");
  }
}

// The version DIR/LATEST points at.
inline int64_t latest_version(const std::string& dir) {
  const Json latest = read_json(dir + "/LATEST");
  if (latest["version"].kind != Json::Number || latest["version"].number < 1) {
    throw PublishError(dir + "/LATEST holds no version (expected {\"version\": N}, N >= 1)");
  }
  return static_cast<int64_t>(latest["version"].number);
}

// The newest full package at or below `latest` whose manifest is in place (it is written after the package), or -1.
inline int64_t newest_full(const std::string& dir, int64_t latest) {
  int64_t best = -1;
  DIR* full = opendir((dir + "/full").c_str());
  if (!full) return best;
  while (const dirent* entry = readdir(full)) {
    const std::string name = entry->d_name;
    if (name.size() < 6 || name[0] != 'v' || name.compare(name.size() - 4, 4, ".pt2") != 0) continue;
    const std::string digits = name.substr(1, name.size() - 5);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const int64_t version = std::stoll(digits);
    struct stat info {};
    if (version <= latest && version > best &&
        stat((dir + "/full/" + version_name(version) + ".json").c_str(), &info) == 0) {
      best = version;
    }
  }
  closedir(full);
  return best;
}

// Where each table's rows lie in the package's constants (the spec's "table_layout"), and which constant each
// training weight is (its "constant_sources", inverted).
struct Layout {
  struct Table {
    std::string constant;  // the package constant's FQN
    int64_t rows = 0, row_bytes = 0, offset = 0;
  };
  std::map<std::string, Table> tables;
  std::map<std::string, std::vector<std::string>> sources;  // training state_dict key -> constant FQNs
  std::string table_dtype;

  static Layout from_spec(const Json& spec, const std::string& package) {
    if (spec["table_layout"].kind != Json::Object) {
      throw PublishError(package + " records no table_layout in its spec (exported before lightning_rec wrote one): "
                         "deltas cannot be applied to it. Publish a full export from this lightning_rec.");
    }
    Layout layout;
    layout.table_dtype = spec["table_dtype"].text;
    for (const auto& [name, table] : spec["table_layout"].fields) {
      layout.tables[name] = {table["constant"].text, static_cast<int64_t>(table["rows"].number),
                             static_cast<int64_t>(table["row_bytes"].number),
                             static_cast<int64_t>(table["offset"].number)};
    }
    for (const auto& [constant, key] : spec["constant_sources"].fields) layout.sources[key.text].push_back(constant);
    return layout;
  }
};

// One version's delta, read, checked against its manifest and the package's layout, held in memory.
struct Delta {
  int64_t version = 0;
  struct Rows {
    const Layout::Table* table;
    torch::Tensor ids, rows;  // int64 [n], uint8 [n, row_bytes]
  };
  std::vector<Rows> tables;
  std::vector<std::pair<std::string, torch::Tensor>> dense;  // constant FQN -> its new value
  std::set<std::string> dense_keys;                           // the training keys they come from

  // Reads DIR/versions/v<version>/ (manifest.json and every file it lists); throws PublishError naming the file.
  static Delta read(const std::string& dir, int64_t version, const Layout& layout,
                    const std::unordered_map<std::string, torch::Tensor>& constants) {
    const std::string where = dir + "/versions/" + version_name(version);
    const Json manifest = read_json(where + "/manifest.json");
    const std::string at = where + "/manifest.json";
    if (manifest["format"].text != "lightning_rec.publish/1") {
      throw PublishError(at + " is of format '" + manifest["format"].text + "', this program reads "
                         "'lightning_rec.publish/1'");
    }
    if (static_cast<int64_t>(manifest["version"].number) != version) {
      throw PublishError(at + " records version " + std::to_string(int64_t(manifest["version"].number)) +
                         ", expected " + std::to_string(version));
    }
    if (manifest["kind"].text != "delta") {
      throw PublishError(at + " is of kind '" + manifest["kind"].text + "', expected 'delta'");
    }
    if (manifest["previous"].kind != Json::Number || static_cast<int64_t>(manifest["previous"].number) != version - 1) {
      throw PublishError(at + " does not apply on version " + std::to_string(version - 1) + " (its 'previous')");
    }
    if (manifest["table_dtype"].text != layout.table_dtype) {
      throw PublishError(at + ": its rows are " + manifest["table_dtype"].text + ", the package's tables are " +
                         layout.table_dtype);
    }
    if (manifest["files"].kind != Json::Object) throw PublishError(at + " lists no files");
    bool parts = false;
    for (const auto& [name, record] : manifest["files"].fields) parts = parts || is_part(name);
    if (!parts) throw PublishError(at + " lists no delta part (delta.r<rank>.pt)");
    Delta delta;
    delta.version = version;
    for (const auto& [name, record] : manifest["files"].fields) {  // each checked; the parts read
      const std::string path = where + "/" + name;
      const std::string bytes = read_file(path);
      if (static_cast<double>(bytes.size()) != record["bytes"].number) {
        throw PublishError(path + " holds " + std::to_string(bytes.size()) + " bytes, its manifest records " +
                           std::to_string(int64_t(record["bytes"].number)));
      }
      Sha256 digest;
      digest.update(bytes.data(), bytes.size());
      const std::string found = digest.hex();
      if (found != record["sha256"].text) {
        throw PublishError(path + " has SHA-256 " + found.substr(0, 16) + "..., its manifest records " +
                           record["sha256"].text.substr(0, 16) + "...: it is damaged");
      }
      if (is_part(name)) delta.add(path, bytes, layout, constants);
    }
    for (const auto& [key, targets] : layout.sources) {  // every dense weight the package reads, in some part
      if (!delta.dense_keys.count(key)) {
        throw PublishError(at + ": its parts lack the dense weight '" + key + "' the package reads (" +
                           targets.front() + ")");
      }
    }
    return delta;
  }

 private:
  // delta.r<rank>.pt: one writing rank's part (the manifest may list other files: checked, not read)
  static bool is_part(const std::string& name) {
    const std::string head = "delta.r", tail = ".pt";
    if (name.size() <= head.size() + tail.size() || name.rfind(head, 0) != 0 ||
        name.compare(name.size() - tail.size(), tail.size(), tail) != 0) {
      return false;
    }
    const std::string rank = name.substr(head.size(), name.size() - head.size() - tail.size());
    return rank.find_first_not_of("0123456789") == std::string::npos;
  }

  void add(const std::string& path, const std::string& bytes, const Layout& layout,
           const std::unordered_map<std::string, torch::Tensor>& constants) {
    std::map<std::string, torch::Tensor> parts;
    try {
      const auto dict = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end())).toGenericDict();
      for (const auto& item : dict) parts[item.key().toStringRef()] = item.value().toTensor();
    } catch (const std::exception&) {  // c10::Error: not a pickle, not a dict, a key or value of another type
      throw PublishError(path + " is not a torch.save of a flat {name: tensor} dict");
    }
    for (const auto& [key, value] : parts) {
      if (key.rfind("table/", 0) == 0) {
        const auto slash = key.rfind('/');
        const std::string table = key.substr(6, slash - 6), part = key.substr(slash + 1);
        const auto found = layout.tables.find(table);
        if (found == layout.tables.end()) {
          throw PublishError(path + ": table '" + table + "' is not one of the package's tables");
        }
        if (part == "rows") continue;  // with its ids
        if (part != "ids") throw PublishError(path + ": '" + key + "' is neither ids nor rows");
        const auto rows_at = parts.find("table/" + table + "/rows");
        if (rows_at == parts.end()) throw PublishError(path + ": table '" + table + "' has ids and no rows");
        const auto& ids = value;
        const auto& rows = rows_at->second;
        const int64_t row_bytes = found->second.row_bytes;
        if (ids.scalar_type() != torch::kLong || ids.dim() != 1) {
          throw PublishError(path + ": '" + key + "' is not an int64 vector");
        }
        if (rows.scalar_type() != torch::kByte || rows.dim() != 2 || rows.size(0) != ids.size(0) ||
            rows.size(1) != row_bytes) {
          throw PublishError(path + ": table '" + table + "' rows are not uint8 [" + std::to_string(ids.size(0)) +
                             ", " + std::to_string(row_bytes) + "] (the package's row_bytes)");
        }
        if (ids.numel() && (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= found->second.rows)) {
          throw PublishError(path + ": table '" + table + "' has an id outside its " +
                             std::to_string(found->second.rows) + " rows");
        }
        if (std::get<0>(at::_unique(ids)).numel() != ids.numel()) {
          throw PublishError(path + ": table '" + table + "' has an id twice");
        }
        tables.push_back({&found->second, ids.contiguous(), rows.contiguous()});
      } else if (key.rfind("dense/", 0) == 0) {
        const auto targets = layout.sources.find(key.substr(6));
        if (targets == layout.sources.end()) continue;  // a weight the package does not hold (another tower's)
        dense_keys.insert(targets->first);
        for (const auto& constant : targets->second) {
          const auto have = constants.find(constant);
          if (have == constants.end()) continue;
          if (have->second.sizes() != value.sizes() || have->second.scalar_type() != value.scalar_type()) {
            std::ostringstream shapes;
            shapes << value.sizes() << " " << value.scalar_type() << ", the package's is " << have->second.sizes()
                   << " " << have->second.scalar_type();
            throw PublishError(path + ": '" + key + "' does not fit the package's " + constant + " (" +
                               shapes.str() + ")");
          }
          dense.emplace_back(constant, value);
        }
      } else {
        throw PublishError(path + ": '" + key + "' is neither table/... nor dense/...");
      }
    }
  }
};

// The package's constants in two sets of tensors this program owns, and the version it serves; see the top.
class Follower {
 public:
  // Copies the package's constants twice (once per set), makes the first set active and frees the package's own.
  Follower(std::string dir, torch::inductor::AOTIModelPackageLoader& package, const Json& spec,
           const std::string& package_path, int64_t version)
      : dir_(std::move(dir)), runner_(package.get_runner()), layout_(Layout::from_spec(spec, package_path)),
        version_(version) {
    // For tests: hold each delta's application this long between its tables and its dense weights, as a large
    // delta would take, so that a test can show that no request sees a version in part (requests keep running
    // on the other set meanwhile).
    if (const char* slow = std::getenv("LIGHTNING_REC_SERVE_SLOW_APPLY_MS")) {
      slow_ = std::chrono::milliseconds(std::atol(slow));
    }
    const auto names = runner_->getConstantNamesToOriginalFQNs();
    const auto constants = runner_->extract_constants_map(/*use_inactive=*/false);  // by FQN
    for (const auto& [name, fqn] : names) {
      const auto found = constants.find(fqn);
      if (found == constants.end()) continue;  // folded at run time: derived, not loaded
      const auto& tensor = found->second;
      for (auto& set : sets_) {
        set[name] = torch::empty_strided(tensor.sizes(), tensor.strides(), tensor.options()).copy_(tensor);
      }
      by_fqn_[fqn] = name;
    }
    for (const auto& [table, where] : layout_.tables) {
      const auto name = by_fqn_.find(where.constant);
      const torch::Tensor* buffer = name == by_fqn_.end() ? nullptr : &sets_[0][name->second];
      if (!buffer || buffer->scalar_type() != torch::kByte || !buffer->is_contiguous() ||
          buffer->numel() < where.offset + where.rows * where.row_bytes) {
        throw PublishError(package_path + ": its table_layout places table '" + table + "' in constant '" +
                           where.constant + "', which does not hold it");
      }
    }
    for (auto& [fqn, name] : by_fqn_) constants_[fqn] = sets_[0][name];  // for the checks of a delta's shapes
    // user_managed: the package keeps pointers to these tensors (not copies); sets_ is never resized after this.
    runner_->update_constant_buffer(sets_[0], /*use_inactive=*/true, /*validate_full_updates=*/false,
                                    /*user_managed=*/true);
    runner_->swap_constant_buffer();
    runner_->free_inactive_constant_buffer();  // the package's own copy: not used again
  }

  int64_t version() const { return version_.load(); }

  // Reads DIR/LATEST and applies the deltas up to it that are complete and sound; a bad one is named on standard
  // error (once) and the server stays on the version before it. Returns the version served afterwards.
  int64_t refresh() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Delta> deltas;
    std::string error;
    int64_t latest = version_;
    try {
      latest = latest_version(dir_);
      for (int64_t v = version_ + 1; v <= latest; ++v) deltas.push_back(Delta::read(dir_, v, layout_, constants_));
    } catch (const std::exception& err) {
      const int64_t good = version_ + static_cast<int64_t>(deltas.size());
      const auto* c10 = dynamic_cast<const c10::Error*>(&err);  // its message without its C++ backtrace
      std::string what = c10 ? c10->what_without_backtrace() : err.what();
      for (char& c : what) c = c == '\n' ? ' ' : c;
      error = "error: " + (latest > good ? "version " + std::to_string(good + 1) + " refused: " : std::string()) +
              what + "; serving version " + std::to_string(good);
    }
    if (!error.empty() && error != last_error_) std::cerr << error << std::endl;
    last_error_ = error;
    if (deltas.empty()) return version_;
    const int inactive = 1 - active_;
    for (const auto& delta : deltas) apply(sets_[inactive], delta);
    runner_->update_constant_buffer(sets_[inactive], /*use_inactive=*/true, /*validate_full_updates=*/false,
                                    /*user_managed=*/true);
    runner_->swap_constant_buffer();  // waits for the requests in flight (on the old set), then switches
    active_ = inactive;
    version_ = deltas.back().version;
    for (const auto& delta : deltas) apply(sets_[1 - active_], delta);  // nobody runs on it now
    return version_;
  }

  // True once DIR/LATEST was replaced since the last call (its inode, size or time changed).
  bool latest_changed() {
    struct stat info {};
    std::string seen;
    if (stat((dir_ + "/LATEST").c_str(), &info) == 0) {
      seen = std::to_string(info.st_ino) + ":" + std::to_string(info.st_size) + ":" +
             std::to_string(info.st_mtim.tv_sec) + "." + std::to_string(info.st_mtim.tv_nsec);
    }
    const bool changed = seen != latest_seen_;
    latest_seen_ = seen;
    return changed;
  }

 private:
  void apply(std::unordered_map<std::string, torch::Tensor>& set, const Delta& delta) {
    for (const auto& part : delta.tables) {
      auto* base = set.at(by_fqn_.at(part.table->constant)).data_ptr<uint8_t>() + part.table->offset;
      const auto* ids = part.ids.data_ptr<int64_t>();
      const auto* rows = part.rows.data_ptr<uint8_t>();
      const int64_t width = part.table->row_bytes;
      for (int64_t i = 0; i < part.ids.numel(); ++i) std::memcpy(base + ids[i] * width, rows + i * width, width);
    }
    if (slow_.count()) std::this_thread::sleep_for(slow_);  // LIGHTNING_REC_SERVE_SLOW_APPLY_MS: see the constructor
    for (const auto& [fqn, value] : delta.dense) set.at(by_fqn_.at(fqn)).copy_(value);
  }

  std::string dir_;
  torch::inductor::AOTIModelContainerRunner* runner_;
  Layout layout_;
  std::unordered_map<std::string, torch::Tensor> sets_[2];     // by the package's constant names
  std::unordered_map<std::string, std::string> by_fqn_;         // constant FQN -> name
  std::unordered_map<std::string, torch::Tensor> constants_;    // by FQN, for checks only
  int active_ = 0;
  std::atomic<int64_t> version_;
  std::chrono::milliseconds slow_{0};
  std::mutex mutex_;
  std::string last_error_, latest_seen_;
};

}  // namespace lightning_rec
