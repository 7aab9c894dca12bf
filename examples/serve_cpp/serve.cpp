// Serve an artifact written by `lightning-rec export CKPT OUT --format inference` from C++: libtorch and FBGEMM's
// operator libraries, no Python. Build and run (README "Serving"):
//
//   cmake -S examples/serve_cpp -B build/serve_cpp -DCMAKE_PREFIX_PATH=$(python -c "import torch; print(torch.utils.cmake_prefix_path)")
//   cmake --build build/serve_cpp
//   build/serve_cpp/serve model_int8.pt $(python -c "import fbgemm_gpu, os; print(os.path.dirname(fbgemm_gpu.__file__))") 2 2 7 [inputs.txt]
//
// Arguments: the artifact, FBGEMM's library folder, then B rows, D dense features and F sparse features (see the
// spec it prints), and optionally a text file of the inputs, three lines of numbers: the B x D dense values (sample
// by sample; an empty line if D is 0), the F x B lengths (ids per (feature, sample), feature-major) and the ids
// (feature by feature), as the artifact takes them. Without it every sample gets dense zeros and id 0 of every
// feature.
#include <dlfcn.h>

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/script.h>

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
  std::unordered_map<std::string, std::string> extra{{"lightning_rec.json", ""}};
  torch::jit::Module model = torch::jit::load(argv[1], torch::kCPU, extra);
  std::cout << "spec: " << extra["lightning_rec.json"] << "\n";  // features (the order of `lengths`), ...

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
  std::vector<torch::jit::IValue> inputs;
  if (dense > 0) inputs.push_back(dense_features);
  inputs.push_back(values);
  inputs.push_back(lengths);
  auto out = model.forward(inputs).toTensor().contiguous();
  std::cout.precision(9);  // every float32 exactly
  std::cout << "output:";
  for (int64_t i = 0; i < out.numel(); ++i) std::cout << " " << out.data_ptr<float>()[i];
  std::cout << "\n";
  return 0;
}
