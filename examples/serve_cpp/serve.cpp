// Serve an artifact written by `lightning-rec export CKPT OUT --format inference` from C++: libtorch and FBGEMM's
// operator libraries, no Python. Build and run (README "Serving"):
//
//   cmake -S examples/serve_cpp -B build/serve_cpp -DCMAKE_PREFIX_PATH=$(python -c "import torch; print(torch.utils.cmake_prefix_path)")
//   cmake --build build/serve_cpp
//   build/serve_cpp/serve model_int8.pt $(python -c "import fbgemm_gpu, os; print(os.path.dirname(fbgemm_gpu.__file__))") 2 2 7
//
// Arguments: the artifact, FBGEMM's library folder, then B rows, D dense features and F sparse features (see the
// spec it prints); every sample gets dense zeros and id 0 of every feature.
#include <dlfcn.h>

#include <iostream>
#include <string>
#include <unordered_map>

#include <torch/script.h>

int main(int argc, char** argv) {
  if (argc < 6) {
    std::cerr << "usage: serve ARTIFACT FBGEMM_GPU_DIR ROWS DENSE FEATURES\n";
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
  torch::NoGradGuard no_grad;
  std::vector<torch::jit::IValue> inputs;
  if (dense > 0) inputs.push_back(torch::zeros({rows, dense}));
  inputs.push_back(torch::zeros({features * rows}, torch::kLong));  // values: feature-major
  inputs.push_back(torch::ones({features * rows}, torch::kInt));    // lengths: one id per (feature, sample)
  auto out = model.forward(inputs).toTensor().contiguous();
  std::cout << "output:";
  for (int64_t i = 0; i < out.numel(); ++i) std::cout << " " << out.data_ptr<float>()[i];
  std::cout << "\n";
  return 0;
}
