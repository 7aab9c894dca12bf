// A server, in C++ (libtorch and FBGEMM's operator libraries, no Python), for what `lightning-rec export` writes: a
// TorchScript artifact (`--format torchscript`, any name but *.pt2) or a `.pt2` package (`--format pt2`: torch.export
// + AOTInductor). Build and run from the repository root (docs/serving.md, "Load from C++"):
//
//   cmake -S examples/serve_cpp -B build/serve_cpp \
//       -DCMAKE_PREFIX_PATH="$(.venv/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)')"
//   cmake --build build/serve_cpp
//   FBGEMM_GPU_DIR="$(.venv/bin/python -c 'import fbgemm_gpu, os; print(os.path.dirname(fbgemm_gpu.__file__))')"
//   build/serve_cpp/serve model_int8.pt2 "$FBGEMM_GPU_DIR" < requests.txt
//
// At start it checks the artifact before running any of its code, and refuses it (exit 1, one line on standard
// error): a record that does not match the SHA-256 its manifest (extra/lightning_rec.sha256) records (or one added
// or missing), a package compiled under another torch, or for CPU features this CPU lacks (its spec's "cpu"). Then it prints `spec: {...}` (the features in
// the order of `lengths`, the dense width, ...) and serves: one request per line of standard input, one answer per
// line of standard output, until the input ends (exit 0):
//
//   request:  dense: 0.5 1 0 2; lengths: 1 1 2 0; values: 3 7 4 9 [; weights: 1 0.5 0.5 2]
//   answer:   output: 0.41 0.73             (the B samples' outputs, row-major)
//         or  error: feature 'item': id 60 is outside its table of 50 rows (ids run from 0 to 59)
//
// dense: B x D values, sample by sample (left out when the artifact reads none); lengths: ids per (feature,
// sample), feature-major (F x B: B follows from it); values: the ids, feature by feature; weights: one per id, for
// artifacts that read them. A request that does not fit is answered with an error line naming what is wrong, and the
// server goes on.
//
// `serve --follow DIR FBGEMM_GPU_DIR` serves what a trainer publishes into DIR (lightning_rec's ModelPublisher): the
// newest full package at or below DIR/LATEST, with the deltas after it applied, and each new version as it comes,
// without a restart and without a request ever seeing part of a version (follow.h says how). There, '#version' is
// answered with `version: N` (the version served) and '#refresh' looks at DIR/LATEST first.
//
// A .pt2 package is unpacked (into $TMPDIR or /tmp, as lightning_rec_serve.<pid>) by this program, from the records
// it has just verified, and removed on every exit: the end of the input, an error, SIGTERM, SIGINT, SIGHUP, SIGQUIT,
// SIGPIPE and a crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT). SIGKILL cannot be caught: its directory is left,
// and the next start of this program in the same temp directory removes every lightning_rec_serve.<pid> whose
// process is gone.
#include <dirent.h>
#include <dlfcn.h>
#include <ftw.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>
#include <torch/version.h>

#include "follow.h"
#include "json_value.h"
#include "sha256.h"

namespace {

using lightning_rec::Json;

const std::string kSpec = "extra/lightning_rec.json";
const std::string kManifest = "extra/lightning_rec.sha256";
const std::string kPrefix = "lightning_rec_serve.";
const std::string kUnhashed = ".data/serialization_id";  // torch's random id of each write (no content)

// A reason not to serve the artifact at all (exit 1).
struct Refusal : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- The unpacked package: its paths are fixed before any is created, so that a signal handler can remove them
// with unlink and rmdir alone (async-signal-safe); never changed while armed.
std::vector<std::string> g_files;
std::vector<std::string> g_dirs;  // deepest first
volatile sig_atomic_t g_armed = 0;

void remove_unpacked() noexcept {
  if (!g_armed) return;
  for (const auto& file : g_files) unlink(file.c_str());
  for (const auto& dir : g_dirs) rmdir(dir.c_str());
}

void on_signal(int sig) {
  remove_unpacked();
  signal(sig, SIG_DFL);  // then die of it, as the signal's default would: the exit status names it
  raise(sig);
}

void install_cleanup() {
  for (const int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGPIPE, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) {
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    sigaction(sig, &action, nullptr);
  }
  std::atexit(remove_unpacked);
  std::set_terminate([] {  // an exception nobody caught: remove, then abort as the default would
    remove_unpacked();
    std::abort();
  });
}

std::string temp_root() {
  const char* dir = std::getenv("TMPDIR");
  return dir && *dir ? dir : "/tmp";
}

void remove_tree(const std::string& path) {
  nftw(
      path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { std::remove(p); return 0; },
      16, FTW_DEPTH | FTW_PHYS);
}

// The directories of earlier runs that ended by SIGKILL (or a power cut): their process is gone.
void reclaim_stale(const std::string& root) {
  DIR* dir = opendir(root.c_str());
  if (!dir) return;
  std::vector<std::string> stale;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.rfind(kPrefix, 0) != 0) continue;
    const std::string digits = name.substr(kPrefix.size());
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid != getpid() && kill(pid, 0) == -1 && errno == ESRCH) stale.push_back(root + "/" + name);
  }
  closedir(dir);
  for (const auto& path : stale) remove_tree(path);
}

std::string record_text(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  auto [data, size] = reader.getRecord(name);
  return std::string(static_cast<const char*>(data.get()), size);
}

// Where torch's own package loader puts a record when it unpacks (its model folder; custom objects beside the
// code), or "" for a record it does not need.
std::string unpacked_path(const std::string& dir, const std::string& record) {
  const std::string model = "data/aotinductor/model/", constants = "data/constants/";
  if (record.rfind(model, 0) == 0) return dir + "/" + record;
  if (record.rfind(constants, 0) == 0) return dir + "/" + model + record.substr(constants.size());
  return "";
}

// Check every record of the artifact against its manifest (as `sha256sum -c` would), reading each once; for a
// package (`dir` not empty), write the records the loader needs under `dir` from the bytes checked.
void verify_and_unpack(const std::string& path, caffe2::serialize::PyTorchStreamReader& reader,
                       const std::string& dir) {
  if (!reader.hasRecord(kManifest)) {
    throw Refusal(path + " carries no content hash (" + kManifest +
                  "): it was written before lightning_rec recorded one, or by another tool. Export it again.");
  }
  std::map<std::string, std::string> expected;
  std::istringstream manifest(record_text(reader, kManifest));
  for (std::string line; std::getline(manifest, line);) {
    const auto gap = line.find("  ");
    if (gap != 64) throw Refusal(path + ": its manifest " + kManifest + " is damaged");
    expected[line.substr(gap + 2)] = line.substr(0, 64);
  }
  for (const auto& record : reader.getAllRecords()) {
    if (record != kManifest && record != kUnhashed && !expected.count(record)) {
      throw Refusal(path + " was modified after export: it holds a record '" + record +
                    "' its manifest does not list. Copy it again from where export wrote it, or export again.");
    }
  }
  if (!dir.empty()) {  // every path first (see g_files), then the files
    std::set<std::string> dirs{dir + "/data/aotinductor/model", dir + "/data/aotinductor", dir + "/data", dir};
    for (const auto& [record, sha] : expected) {
      const std::string target = unpacked_path(dir, record);
      if (!target.empty()) g_files.push_back(target);
    }
    g_dirs.assign(dirs.rbegin(), dirs.rend());  // longest (deepest) first
    g_armed = 1;
    for (auto it = dirs.begin(); it != dirs.end(); ++it) {
      if (mkdir(it->c_str(), 0700) != 0) throw Refusal("cannot create " + *it + ": " + std::strerror(errno));
    }
  }
  const size_t chunk = 1 << 20;
  std::vector<char> buffer(chunk);
  for (const auto& [record, sha] : expected) {
    if (!reader.hasRecord(record)) {
      throw Refusal(path + " was modified after export: its record '" + record + "' is missing.");
    }
    const std::string target = dir.empty() ? "" : unpacked_path(dir, record);
    std::ofstream out;
    if (!target.empty()) out.open(target, std::ios::binary);
    lightning_rec::Sha256 digest;
    auto chunks = reader.createChunkReaderIter(record, reader.getRecordSize(record), chunk);
    while (const size_t n = chunks.next(buffer.data())) {
      digest.update(buffer.data(), n);
      if (out.is_open()) out.write(buffer.data(), static_cast<std::streamsize>(n));
    }
    const std::string found = digest.hex();
    if (found != sha) {
      throw Refusal(path + " was modified after export: its record '" + record + "' has SHA-256 " +
                    found.substr(0, 16) + "..., its manifest records " + sha.substr(0, 16) +
                    "...; refusing to serve it. Copy it again from where export wrote it, or export again.");
    }
    if (out.is_open() && !out.good()) throw Refusal("cannot write " + target);
  }
}

// The CPU features a package's compiled code uses (its spec's "cpu") against this CPU's /proc/cpuinfo flags.
void check_cpu(const std::string& path, const Json& cpu) {
  if (cpu.is_null()) return;  // TorchScript, or a package written before it was recorded
  struct utsname host {};
  uname(&host);
  const std::string machine = cpu["machine"].text;
  if (!machine.empty() && machine != host.machine) {
    throw Refusal(path + " was compiled for " + machine + " CPUs and this machine is " + host.machine +
                  ". Export it again on this kind of machine.");
  }
  std::ifstream info("/proc/cpuinfo");
  std::set<std::string> flags;
  for (std::string line; std::getline(info, line);) {
    const std::string key = line.substr(0, line.find(':'));
    if (key.rfind("flags", 0) == 0 || key.rfind("Features", 0) == 0) {
      std::istringstream words(line.substr(line.find(':') + 1));
      for (std::string word; words >> word;) flags.insert(word);
      break;
    }
  }
  if (flags.empty()) return;  // no /proc/cpuinfo: nothing to check against
  std::string missing;
  for (const auto& feature : cpu["features"].items) {
    if (!flags.count(feature.text)) missing += (missing.empty() ? "" : ", ") + feature.text;
  }
  if (!missing.empty()) {
    throw Refusal(path + " was compiled for " + cpu["target"].text + " CPUs, and this CPU lacks " + missing +
                  " (its /proc/cpuinfo flags): it would stop on an illegal instruction. Export it with the default "
                  "--cpu portable, or on a machine like this one.");
  }
}

// ---- Requests

// What the server knows of the artifact's inputs, from its spec.
struct Inputs {
  std::vector<std::string> features;
  int64_t dense = 0;
  bool weighted = false;
  std::vector<int64_t> rows;         // ids each feature takes (empty: not checked)
  std::vector<bool> raw_ids;         // a managed-collision feature: raw ids, remapped inside the artifact
  std::vector<int64_t> max_lengths;  // per feature (-1: no limit)
  std::vector<torch::ScalarType> dtypes;  // of each argument, in order
};

Inputs read_inputs(const Json& spec) {
  Inputs in;
  for (const auto& f : spec["features"].items) in.features.push_back(f.text);
  in.dense = static_cast<int64_t>(spec["num_dense_features"].number);
  in.weighted = spec["weighted"].boolean;
  if (spec["bounds_check"].text == "error") {
    for (const auto& r : spec["feature_rows"].items) in.rows.push_back(static_cast<int64_t>(r.number));
  }
  std::set<std::string> raw;
  for (const auto& f : spec["raw_id_features"].items) raw.insert(f.text);
  for (const auto& f : in.features) {
    in.raw_ids.push_back(raw.count(f) > 0);
    const Json& limit = spec["max_lengths"][f];
    in.max_lengths.push_back(limit.is_null() ? -1 : static_cast<int64_t>(limit.number));
  }
  const std::map<std::string, torch::ScalarType> dtypes{
      {"float32", torch::kFloat}, {"int64", torch::kLong}, {"int32", torch::kInt}};
  for (const auto& arg : spec["inputs"].items) {
    const auto at = dtypes.find(arg["dtype"].text);
    in.dtypes.push_back(at == dtypes.end() ? torch::kFloat : at->second);
  }
  if (in.dtypes.empty()) {  // specs written before "inputs" was recorded: the package's export dtypes
    if (in.dense) in.dtypes.push_back(torch::kFloat);
    in.dtypes.insert(in.dtypes.end(), {torch::kLong, torch::kInt});
    if (in.weighted) in.dtypes.push_back(torch::kFloat);
  }
  return in;
}

// The numbers of one section ("0.5 1 2"); a token that is not a finite number is an error naming it.
std::vector<double> numbers(const std::string& section, const std::string& text) {
  std::vector<double> out;
  std::istringstream words(text);
  for (std::string word; words >> word;) {
    char* end = nullptr;
    errno = 0;
    const double value = std::strtod(word.c_str(), &end);
    if (end == word.c_str() || *end != '\0' || errno == ERANGE || !std::isfinite(value)) {
      throw std::invalid_argument(section + ": '" + word + "' is not a finite number");
    }
    out.push_back(value);
  }
  return out;
}

// The integers of one section; a token that is not one is an error naming it.
std::vector<int64_t> integers(const std::string& section, const std::string& text) {
  std::vector<int64_t> out;
  std::istringstream words(text);
  for (std::string word; words >> word;) {
    char* end = nullptr;
    errno = 0;
    const long long value = std::strtoll(word.c_str(), &end, 10);
    if (end == word.c_str() || *end != '\0' || errno == ERANGE) {
      throw std::invalid_argument(section + ": '" + word + "' is not an integer");
    }
    out.push_back(value);
  }
  return out;
}

// One request line -> the artifact's arguments, checked as the artifact's own input check does (by name).
std::vector<torch::Tensor> parse_request(const std::string& line, const Inputs& in) {
  std::map<std::string, std::string> sections;
  std::istringstream parts(line);
  for (std::string part; std::getline(parts, part, ';');) {
    if (part.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto colon = part.find(':');
    std::string name = colon == std::string::npos ? part : part.substr(0, colon);
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (colon == std::string::npos || (name != "dense" && name != "lengths" && name != "values" && name != "weights")) {
      throw std::invalid_argument("'" + name + "' is not a section: a request is 'dense: ...; lengths: ...; values: " +
                                  "...[; weights: ...]'");
    }
    if (sections.count(name)) throw std::invalid_argument("section '" + name + "' given twice");
    sections[name] = part.substr(colon + 1);
  }
  const int64_t F = static_cast<int64_t>(in.features.size());
  if (!sections.count("lengths") || !sections.count("values")) {
    throw std::invalid_argument("a request needs 'lengths: ...' and 'values: ...'");
  }
  const auto lengths = integers("lengths", sections["lengths"]);
  const auto values = integers("values", sections["values"]);
  if (static_cast<int64_t>(lengths.size()) % F != 0) {
    throw std::invalid_argument("lengths has " + std::to_string(lengths.size()) + " entries; the artifact reads " +
                                std::to_string(F) + " features and takes one length per (feature, sample), " +
                                "feature-major");
  }
  const int64_t B = static_cast<int64_t>(lengths.size()) / F;
  int64_t total = 0;
  for (int64_t f = 0; f < F; ++f) {
    for (int64_t s = 0; s < B; ++s) {
      const int64_t n = lengths[f * B + s];
      if (n < 0) throw std::invalid_argument("lengths holds a negative length");
      if (in.max_lengths[f] >= 0 && n > in.max_lengths[f]) {
        throw std::invalid_argument("feature '" + in.features[f] + "': sample " + std::to_string(s) + " has " +
                                    std::to_string(n) + " ids, more than the " + std::to_string(in.max_lengths[f]) +
                                    " it may bring (the spec's max_lengths)");
      }
      total += n;
    }
  }
  if (total != static_cast<int64_t>(values.size())) {
    throw std::invalid_argument("lengths add up to " + std::to_string(total) + " ids, but values holds " +
                                std::to_string(values.size()));
  }
  if (!in.rows.empty()) {
    size_t i = 0;
    for (int64_t f = 0; f < F; ++f) {
      for (int64_t s = 0; s < B; ++s) {
        for (int64_t k = 0; k < lengths[f * B + s]; ++k, ++i) {
          if ((values[i] < 0 || values[i] >= in.rows[f]) && in.raw_ids[f]) {
            throw std::invalid_argument("feature '" + in.features[f] + "': raw id " + std::to_string(values[i]) +
                                        " is outside its managed-collision id space of " + std::to_string(in.rows[f]) +
                                        " ids (input_hash_size: raw ids run from 0 to " +
                                        std::to_string(in.rows[f] - 1) + ")");
          }
          if (values[i] < 0 || values[i] >= in.rows[f]) {
            throw std::invalid_argument("feature '" + in.features[f] + "': id " + std::to_string(values[i]) +
                                        " is outside its table of " + std::to_string(in.rows[f]) +
                                        " rows (ids run from 0 to " + std::to_string(in.rows[f] - 1) + ")");
          }
        }
      }
    }
  }
  std::vector<torch::Tensor> args;
  if (in.dense > 0) {
    const auto dense = numbers("dense", sections.count("dense") ? sections["dense"] : "");
    if (static_cast<int64_t>(dense.size()) != B * in.dense) {
      throw std::invalid_argument("dense has " + std::to_string(dense.size()) + " values; lengths holds " +
                                  std::to_string(B) + " samples and the artifact reads " + std::to_string(in.dense) +
                                  " dense features, so it expects " + std::to_string(B * in.dense));
    }
    args.push_back(torch::tensor(dense, torch::kDouble).reshape({B, in.dense}));
  } else if (sections.count("dense") && !numbers("dense", sections["dense"]).empty()) {
    throw std::invalid_argument("the artifact reads no dense features: leave 'dense' out");
  }
  args.push_back(torch::tensor(values, torch::kLong));
  args.push_back(torch::tensor(lengths, torch::kLong));
  if (in.weighted) {
    if (!sections.count("weights")) throw std::invalid_argument("the artifact reads per-id weights: add 'weights: ...'");
    const auto weights = numbers("weights", sections["weights"]);
    if (weights.size() != values.size()) {
      throw std::invalid_argument("weights has " + std::to_string(weights.size()) + " entries, values " +
                                  std::to_string(values.size()) + ": one weight per id");
    }
    args.push_back(torch::tensor(weights, torch::kDouble));
  } else if (sections.count("weights")) {
    throw std::invalid_argument("the artifact reads no weights: leave 'weights' out");
  }
  for (size_t i = 0; i < args.size() && i < in.dtypes.size(); ++i) args[i] = args[i].to(in.dtypes[i]);
  return args;
}

// An exception's message on one line (c10's without its C++ backtrace).
std::string one_line(const std::exception& err) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&err);
  std::string text = c10 ? c10->what_without_backtrace() : err.what();
  for (char& c : text) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return text;
}

// How often the --follow mode looks at DIR/LATEST (a stat: cheap).
constexpr auto kPoll = std::chrono::milliseconds(100);

// `serve ARTIFACT FBGEMM_GPU_DIR` or `serve --follow DIR FBGEMM_GPU_DIR`.
int serve(const std::string& artifact, const std::string& fbgemm_dir, const std::string& follow_dir) {
  // FBGEMM's operators and classes: the libraries `import fbgemm_gpu` loads, in its order (fbgemm_gpu/__init__.py).
  for (const char* lib : {"fbgemm_gpu_config.so", "fbgemm_gpu_tbe_utils.so", "fbgemm_gpu_tbe_index_select.so",
                          "fbgemm_gpu_tbe_cache.so", "fbgemm_gpu_tbe_optimizers.so", "fbgemm_gpu_tbe_inference.so",
                          "fbgemm_gpu_tbe_training_forward.so", "fbgemm_gpu_py.so"}) {
    if (!dlopen((fbgemm_dir + "/" + lib).c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      throw Refusal(dlerror());
    }
  }
  std::string path = artifact;
  int64_t full = 0;
  if (!follow_dir.empty()) {  // the newest full package at or below LATEST
    try {
      const int64_t latest = lightning_rec::latest_version(follow_dir);
      full = lightning_rec::newest_full(follow_dir, latest);
      if (full < 0) {
        throw Refusal(follow_dir + "/full holds no complete package (v*.pt2 with its .json) at or below version " +
                      std::to_string(latest) + " (" + follow_dir + "/LATEST)");
      }
    } catch (const lightning_rec::PublishError& err) {
      throw Refusal(std::string(err.what()) + ": " + follow_dir + " is not a publish directory with a version yet");
    }
    path = follow_dir + "/full/" + lightning_rec::version_name(full) + ".pt2";
  }
  const bool pt2 = path.size() > 4 && path.compare(path.size() - 4, 4, ".pt2") == 0;
  std::string spec_text;
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
    spec_text = record_text(*reader, kSpec);
  } catch (const std::exception& err) {
    throw Refusal(path + " is not a lightning_rec artifact (a zip archive with " + kSpec + "): " + one_line(err));
  }
  std::string dir;
  if (pt2) {
    const std::string root = temp_root();
    reclaim_stale(root);
    dir = root + "/" + kPrefix + std::to_string(getpid());
    remove_tree(dir);  // a directory of an earlier process that had this pid
  }
  verify_and_unpack(path, *reader, dir);  // first: nothing in the file is trusted before (its spec included)
  reader.reset();
  const Json spec = Json::parse(spec_text);
  if (spec["artifact_version"].number > 1) {  // the spec's layout this program reads
    throw Refusal(path + " is an artifact of version " + std::to_string(int(spec["artifact_version"].number)) +
                  ", written by a newer lightning_rec; this program reads versions up to 1.");
  }
  if (pt2) {
    // The compiled code calls into the libtorch that compiled it: the version its spec records, without its local
    // part ("+cpu"), as TORCH_VERSION spells it.
    std::string written = spec["versions"]["torch"].text;
    written = written.substr(0, written.find('+'));
    if (written != TORCH_VERSION) {
      throw Refusal(path + " was compiled under torch " + (written.empty() ? "(not recorded)" : written) +
                    " and this program runs under libtorch " + TORCH_VERSION +
                    ": a .pt2 package runs only under the torch that compiled it. Export it again with this torch, "
                    "or build this program against the libtorch that wrote it.");
    }
    check_cpu(path, spec["cpu"]);
  }

  torch::jit::Module script;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> package;
  if (pt2) {
    package = std::make_unique<torch::inductor::AOTIModelPackageLoader>(dir);  // the verified files, unpacked
  } else {
    script = torch::jit::load(path, torch::kCPU);
  }
  std::unique_ptr<lightning_rec::Follower> follower;
  if (!follow_dir.empty()) {
    try {
      follower = std::make_unique<lightning_rec::Follower>(follow_dir, *package, spec, path, full);
    } catch (const lightning_rec::PublishError& err) {
      throw Refusal(err.what());
    }
    follower->latest_changed();  // seen now: the watcher acts on the next change
    follower->refresh();         // the deltas after the full one, before serving
  }
  // The watcher: applies new versions while requests are served (see follow.h for why none sees a mix).
  std::mutex stop_mutex;
  std::condition_variable stop_signal;
  bool stopping = false;
  std::thread watcher;
  if (follower) {
    watcher = std::thread([&] {
      std::unique_lock<std::mutex> lock(stop_mutex);
      while (!stop_signal.wait_for(lock, kPoll, [&] { return stopping; })) {
        try {
          if (follower->latest_changed()) follower->refresh();
        } catch (const std::exception& err) {  // not expected: refresh names what it refuses itself
          std::cerr << "error: " << one_line(err) << "; serving version " << follower->version() << std::endl;
        }
      }
    });
  }
  std::cout << "spec: " << spec_text << std::endl;  // ready
  const Inputs inputs = read_inputs(spec);
  torch::NoGradGuard no_grad;
  std::cout.precision(9);  // every float32 exactly
  for (std::string line; std::getline(std::cin, line);) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::ostringstream answer;
    answer.precision(9);
    if (follower && (line.rfind("#version", 0) == 0 || line.rfind("#refresh", 0) == 0)) {
      try {
        const int64_t version = line[1] == 'r' ? follower->refresh() : follower->version();
        std::cout << "version: " << version << std::endl;
      } catch (const std::exception& err) {  // not expected: refresh names what it refuses itself
        std::cout << "error: " << one_line(err) << "; serving version " << follower->version() << std::endl;
      }
      continue;
    }
    try {
      const auto args = parse_request(line, inputs);
      torch::Tensor out;
      if (args[inputs.dense > 0 ? 2 : 1].numel() == 0) {  // no samples: nothing to compute
        out = torch::empty({0});
      } else if (pt2) {
        out = package->run(args).at(0);
      } else {
        out = script.forward(std::vector<torch::jit::IValue>(args.begin(), args.end())).toTensor();
      }
      out = out.to(torch::kFloat).contiguous();
      answer << "output:";
      for (int64_t i = 0; i < out.numel(); ++i) answer << " " << out.data_ptr<float>()[i];
    } catch (const std::exception& err) {  // c10::Error (the artifact's own checks), std::invalid_argument, ...
      answer.str("");
      answer << "error: " << one_line(err);
    }
    std::cout << answer.str() << std::endl;
  }
  if (watcher.joinable()) {
    {
      std::lock_guard<std::mutex> lock(stop_mutex);
      stopping = true;
    }
    stop_signal.notify_all();
    watcher.join();
  }
  follower.reset();
  package.reset();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool follow = argc == 4 && std::string(argv[1]) == "--follow";
  if (argc != 3 && !follow) {
    std::cerr << "usage: serve ARTIFACT FBGEMM_GPU_DIR < requests (one per line: 'dense: ...; lengths: ...; values: "
                 "...[; weights: ...]')\n"
                 "   or: serve --follow PUBLISH_DIR FBGEMM_GPU_DIR < requests (and '#version', '#refresh' lines)\n";
    return 2;
  }
  install_cleanup();
  int status = 1;
  try {
    status = follow ? serve("", argv[3], argv[2]) : serve(argv[1], argv[2], "");
  } catch (const std::exception& err) {
    std::cerr << one_line(err) << "\n";
  }
  remove_unpacked();
  g_armed = 0;
  if (!g_dirs.empty()) remove_tree(g_dirs.back());  // and anything the loader wrote beside the files
  return status;
}
