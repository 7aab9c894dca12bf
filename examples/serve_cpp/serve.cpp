// Serve, from C++ (libtorch and FBGEMM's operator libraries, no Python), what `lightning-rec export` writes: a
// TorchScript artifact (`--format inference`, any name but *.pt2) or a `.pt2` package (`--format pt2`: torch.export
// + AOTInductor). Build and run from the repository root (README "Serving"):
//
//   cmake -S examples/serve_cpp -B build/serve_cpp \
//       -DCMAKE_PREFIX_PATH="$(.venv/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)')"
//   cmake --build build/serve_cpp
//   FBGEMM_GPU_DIR="$(.venv/bin/python -c 'import fbgemm_gpu, os; print(os.path.dirname(fbgemm_gpu.__file__))')"
//   build/serve_cpp/serve model_int8.pt "$FBGEMM_GPU_DIR" 2 2 7 [inputs.txt]     # or model_int8.pt2
//
// Arguments: the artifact, FBGEMM's library folder, then B rows, D dense features and F sparse features (see the
// spec it prints), and optionally a text file of the inputs, three lines of numbers: the B x D dense values (sample
// by sample; an empty line if D is 0), the F x B lengths (ids per (feature, sample), feature-major) and the ids
// (feature by feature), as the artifact takes them. Without it every sample gets dense zeros and id 0 of every
// feature.
#include <dlfcn.h>

#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>
#include <torch/version.h>

// The numbers on the next line of `in`.
template <typename T>
std::vector<T> read_line(std::istream& in) {
  std::string line;
  std::getline(in, line);
  std::istringstream fields(line);
  std::vector<T> numbers;
  for (T v; fields >> v;) numbers.push_back(v);
  return numbers;
}

// The torch version a package's spec records ("versions": {"torch": "2.13.0+cpu", ...}) without its local part
// ("+cpu"), as TORCH_VERSION spells it; "" if the spec has none.
std::string spec_torch_version(const std::string& spec) {
  const std::string key = "\"torch\": \"";
  const auto versions = spec.find("\"versions\"");
  const auto at = versions == std::string::npos ? versions : spec.find(key, versions);
  if (at == std::string::npos) return "";
  const auto start = at + key.size();
  return spec.substr(start, spec.find_first_of("+\"", start) - start);
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::cerr << "usage: serve ARTIFACT FBGEMM_GPU_DIR ROWS DENSE FEATURES [INPUTS]\n";
    return 2;
  }
  // FBGEMM's operators and classes: the libraries `import fbgemm_gpu` loads, in its order (fbgemm_gpu/__init__.py).
  for (const char* lib : {"fbgemm_gpu_config.so", "fbgemm_gpu_tbe_utils.so", "fbgemm_gpu_tbe_index_select.so",
                          "fbgemm_gpu_tbe_cache.so", "fbgemm_gpu_tbe_optimizers.so", "fbgemm_gpu_tbe_inference.so",
                          "fbgemm_gpu_tbe_training_forward.so", "fbgemm_gpu_py.so"}) {
    if (!dlopen((std::string(argv[2]) + "/" + lib).c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      std::cerr << dlerror() << "\n";
      return 1;
    }
  }
  const std::string path = argv[1];
  const bool pt2 = path.size() > 4 && path.compare(path.size() - 4, 4, ".pt2") == 0;
  torch::jit::Module script;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> package;
  if (pt2) {
    // The package's compiled code calls into the libtorch that compiled it: check the version its spec records
    // before loading that code.
    auto metadata = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(path, "model");
    const std::string spec = metadata["lightning_rec"];
    std::cout << "spec: " << spec << "\n";  // features (the order of `lengths`), ..., versions
    const std::string written = spec_torch_version(spec);
    if (written != TORCH_VERSION) {
      std::cerr << path << " was compiled under torch " << (written.empty() ? "(not recorded)" : written)
                << " and this program runs under libtorch " << TORCH_VERSION
                << ": a .pt2 package runs only under the torch that compiled it. Export it again with this torch, "
                   "or build this program against the libtorch that wrote it.\n";
      return 1;
    }
    package = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path);
  } else {
    std::unordered_map<std::string, std::string> extra{{"lightning_rec.json", ""}};
    script = torch::jit::load(path, torch::kCPU, extra);
    std::cout << "spec: " << extra["lightning_rec.json"] << "\n";  // features (the order of `lengths`), ...
  }

  const int64_t rows = std::stoll(argv[3]), dense = std::stoll(argv[4]), features = std::stoll(argv[5]);
  torch::Tensor dense_features = torch::zeros({rows, dense});
  torch::Tensor values = torch::zeros({features * rows}, torch::kLong);  // ids: feature-major
  torch::Tensor lengths = torch::ones({features * rows}, torch::kInt);   // ids per (feature, sample)
  if (argc > 6) {
    std::ifstream in(argv[6]);
    if (!in) {
      std::cerr << "cannot read " << argv[6] << "\n";
      return 2;
    }
    const auto d = read_line<float>(in);
    const auto l = read_line<int32_t>(in);
    const auto v = read_line<int64_t>(in);
    if (int64_t(d.size()) != rows * dense || int64_t(l.size()) != features * rows) {
      std::cerr << argv[6] << ": expected a line of " << rows * dense << " dense values and one of "
                << features * rows << " lengths, then the ids\n";
      return 2;
    }
    dense_features = torch::tensor(d).reshape({rows, dense});
    lengths = torch::tensor(l, torch::kInt);
    values = torch::tensor(v, torch::kLong);
  }
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> inputs;
  if (dense > 0) inputs.push_back(dense_features);
  inputs.push_back(values);
  inputs.push_back(lengths);
  torch::Tensor out = pt2 ? package->run(inputs).at(0)
                          : script.forward(std::vector<torch::jit::IValue>(inputs.begin(), inputs.end())).toTensor();
  out = out.contiguous();
  std::cout.precision(9);  // every float32 exactly
  std::cout << "output:";
  for (int64_t i = 0; i < out.numel(); ++i) std::cout << " " << out.data_ptr<float>()[i];
  std::cout << "\n";
  return 0;
}
