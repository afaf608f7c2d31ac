/*
 * `tvm_ext.cudnn.conv2d`: the convolution of blas/conv_layout.h on CUDA tensors, by cuDNN
 * loaded at run time (cudnn_library.h), enqueued on TVM's current stream of Y's device.
 *
 * Types: X, W and Y of one dtype: float32 in FMA math (no TF32: as the generated kernels and
 * PyTorch with TF32 off), float16 or bfloat16 on tensor cores with float32 accumulation.
 *
 * Layout: X and Y are described to cuDNN by their strides per role, so any axis order (a
 * weight gradient's CNHW data and output) is read and written in place; a filter must be
 * packed [F, C/groups, KH, KW], so W in another order (a weight gradient's filter) is first
 * copied so (cudnnTransformTensor) into scratch.
 *
 * Padding: cuDNN pads symmetrically, conv_layout.h reads zeros beyond X's far edge; the two
 * agree only without padding, which is what DispatchLibraryKernels passes (the padding is a
 * loop nest of its own before the call, and it dispatches only convolutions whose windows
 * stay within X). So pad_top and pad_left must be 0 and every window within X; X's extent is
 * cut to the rows and columns the windows reach, since cuDNN derives Y's from X's.
 *
 * Weight gradients: dW[f, c, ky, kx] = sum_{n, y, x} X[n, c, ...] dY[n, f, y, x] reaches
 * this call as a convolution whose images are X's channels, whose channels are the batch,
 * whose filter is dY (as large as an image) and whose output is dW, its stride the forward
 * convolution's dilation and its dilation that stride. Where the window is larger than the
 * output so (groups 1), it runs as what it is, cuDNN's backward-filter convolution on X, dY
 * and dW with the roles swapped back (the kernels cuDNN has for it, as PyTorch calls), dW
 * written through a packed scratch where it is not stored [F, C, KH, KW]; a deterministic
 * algorithm only (the generated kernels and the swapped builds' checks are bit for bit run
 * to run), and the forward formulation where none fits.
 *
 * The algorithm is the heuristics' fastest (cudnnGetConvolution{Forward,BackwardFilter}
 * Algorithm_v7) whose workspace fits kWorkspaceBytes, chosen once per geometry; the workspace
 * and the copied filter come from TVM's workspace pool (allocated in relaxed capture mode under
 * a CUDA graph capture, where cudaMalloc is otherwise refused).
 */
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/device_api.h>

#include <climits>
#include <map>
#include <optional>
#include <vector>

#include "blas/conv_layout.h"
#include "blas/cudnn_library.h"
#include "blas/gemm_layout.h"
#include "cuda/capture_mode.h"
#include "cuda/cuda_driver.h"

namespace tvm_ext {
namespace blas {
namespace {

namespace cd = cudnn;
constexpr int kAlgorithms = 8;  // CUDNN_CONVOLUTION_FWD_ALGO_COUNT (BWD_FILTER: 7)

struct Choice {
  int algo;
  int math;
  size_t workspace;
};

// Descriptors of one call, destroyed with it.
struct Descriptors {
  const cd::Api& api;
  cd::Desc x = nullptr, y = nullptr, w = nullptr, conv = nullptr, w_strided = nullptr,
           w_packed = nullptr;
  explicit Descriptors(const cd::Api& a) : api(a) {}
  ~Descriptors() {
    for (cd::Desc t : {x, y, w_strided, w_packed}) {
      if (t != nullptr) api.destroy_tensor(t);
    }
    if (w != nullptr) api.destroy_filter(w);
    if (conv != nullptr) api.destroy_conv(conv);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
};

int DataType(DLDataType t, const char* api) {
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 32) return cd::kFloat;
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 16) return cd::kHalf;
  if (t.lanes == 1 && t.code == kDLBfloat && t.bits == 16) return cd::kBFloat16;
  TVM_FFI_THROW(TypeError) << api << ": float32, float16 or bfloat16 only (" << DTypeName(t)
                           << " given)";
}

int Int(int64_t v, const char* api) {
  if (v > INT_MAX) {
    TVM_FFI_THROW(ValueError) << api << ": a dimension or stride of " << v
                              << " is beyond cuDNN's 32-bit interface";
  }
  return static_cast<int>(v);
}

void SetTensor(const cd::Api& lib, cd::Desc* d, int dtype, const int64_t* extents,
               const int64_t* strides, const char* api) {
  cd::Check(lib.create_tensor(d), "cudnnCreateTensorDescriptor");
  int e[4], s[4];
  for (int i = 0; i < 4; ++i) e[i] = Int(extents[i], api), s[i] = Int(strides[i], api);
  cd::Check(lib.set_tensor(*d, dtype, 4, e, s), "cudnnSetTensorNdDescriptor");
}

const char* Base(const DLTensor* t) {
  return static_cast<const char*>(t->data) + t->byte_offset;
}

// Scratch from TVM's workspace pool on `dev`, in relaxed capture mode under a capture.
void* Scratch(DLDevice dev, cd::Stream stream, size_t bytes) {
  const CudaDriver* cu = CudaDriver::Get();
  RelaxedCapture relaxed(Capturing(cu, stream) ? cu : nullptr);
  return tvm::runtime::DeviceAPI::Get(dev)->AllocWorkspace(dev, bytes);
}

// Per geometry, the algorithm chosen, or none (nullopt: none fits).
std::map<std::vector<int64_t>, std::optional<Choice>>& Chosen() {
  static auto* chosen =
      new std::map<std::vector<int64_t>, std::optional<Choice>>();  // under cd::Mutex()
  return *chosen;
}

// The heuristics' fastest algorithm whose workspace fits (deterministic ones only where
// `deterministic`), from `query(requested, returned, results)`; cached under `key`.
template <typename Query>
std::optional<Choice> Choose(int dtype, const std::vector<int64_t>& key, bool deterministic,
                             Query query) {
  auto it = Chosen().find(key);
  if (it != Chosen().end()) return it->second;
  cd::AlgoPerf perf[kAlgorithms];
  int returned = 0;
  query(kAlgorithms, &returned, perf);
  for (int i = 0; i < returned; ++i) {
    if (perf[i].status != 0 || perf[i].memory > cd::kWorkspaceBytes) continue;
    if (deterministic && perf[i].determinism != cd::kDeterministic) continue;
    Choice c{perf[i].algo, dtype == cd::kFloat ? cd::kFmaMath : perf[i].math_type,
             perf[i].memory};
    Chosen()[key] = c;
    return c;
  }
  Chosen()[key] = std::nullopt;
  return std::nullopt;
}

// A convolution descriptor without padding, its math for `dtype`.
void SetConv(const cd::Api& lib, Descriptors* d, int dtype, int64_t stride_h, int64_t stride_w,
             int64_t dil_h, int64_t dil_w, int64_t groups, const char* api) {
  cd::Check(lib.create_conv(&d->conv), "cudnnCreateConvolutionDescriptor");
  cd::Check(lib.set_conv(d->conv, 0, 0, Int(stride_h, api), Int(stride_w, api), Int(dil_h, api),
                         Int(dil_w, api), cd::kCrossCorrelation, cd::kFloat),
            "cudnnSetConvolution2dDescriptor");
  cd::Check(lib.set_groups(d->conv, Int(groups, api)), "cudnnSetConvolutionGroupCount");
  cd::Check(lib.set_math(d->conv, dtype == cd::kFloat ? cd::kFmaMath : cd::kTensorOpMath),
            "cudnnSetConvolutionMathType");
}

// A packed filter descriptor [k, c, h, w]; `strided` says whether `strides` (the tensor's,
// per those roles) differ from packed ones.
void SetFilter(const cd::Api& lib, Descriptors* d, int dtype, const int64_t* extents,
               const int64_t* strides, bool* strided, const char* api) {
  int64_t packed[4] = {extents[1] * extents[2] * extents[3], extents[2] * extents[3],
                       extents[3], 1};
  *strided = false;
  for (int i = 0; i < 4; ++i) *strided |= extents[i] > 1 && strides[i] != packed[i];
  cd::Check(lib.create_filter(&d->w), "cudnnCreateFilterDescriptor");
  cd::Check(lib.set_filter(d->w, dtype, cd::kNCHW, Int(extents[0], api), Int(extents[1], api),
                           Int(extents[2], api), Int(extents[3], api)),
            "cudnnSetFilter4dDescriptor");
  if (*strided) {  // copied between the tensor and a packed scratch (cudnnTransformTensor)
    SetTensor(lib, &d->w_strided, dtype, extents, strides, api);
    SetTensor(lib, &d->w_packed, dtype, extents, packed, api);
  }
}

std::vector<int64_t> GeometryKey(int kind, int dtype, const ConvShape& s, int64_t rows,
                                 int64_t cols, DLDevice dev) {
  std::vector<int64_t> key = {kind, dtype, s.n, s.c, rows, cols, s.f, s.cg, s.kh, s.kw, s.oh,
                              s.ow, s.sh, s.sw, s.dh, s.dw, s.groups, dev.device_id};
  key.insert(key.end(), s.xs, s.xs + 4);
  key.insert(key.end(), s.ws, s.ws + 4);
  key.insert(key.end(), s.ys, s.ys + 4);
  return key;
}

// Runs the call as cuDNN's backward-filter convolution (see the top of the file); false,
// having done nothing, where cuDNN has no deterministic algorithm for it within the
// workspace.
bool BackwardFilter(const cd::Api& lib, cd::Handle h, DLDevice dev, cd::Stream stream,
                    const ConvArgs& a, int dtype, int64_t rows, int64_t cols, const char* api) {
  const ConvShape& s = a.s;
  Descriptors d(lib);  // d.x: X, d.y: dY (W's tensor), d.w: dW (Y's tensor)
  int64_t x_ext[4] = {s.c, s.n, rows, cols}, x_str[4] = {s.xs[1], s.xs[0], s.xs[2], s.xs[3]};
  int64_t dy_ext[4] = {s.c, s.f, s.kh, s.kw}, dy_str[4] = {s.ws[1], s.ws[0], s.ws[2], s.ws[3]};
  int64_t dw_ext[4] = {s.f, s.n, s.oh, s.ow}, dw_str[4] = {s.ys[1], s.ys[0], s.ys[2], s.ys[3]};
  SetTensor(lib, &d.x, dtype, x_ext, x_str, api);
  SetTensor(lib, &d.y, dtype, dy_ext, dy_str, api);
  bool strided = false;
  SetFilter(lib, &d, dtype, dw_ext, dw_str, &strided, api);
  SetConv(lib, &d, dtype, s.dh, s.dw, s.sh, s.sw, 1, api);
  std::optional<Choice> c =
      Choose(dtype, GeometryKey(1, dtype, s, rows, cols, dev), true,
             [&](int requested, int* returned, cd::AlgoPerf* perf) {
               cd::Check(lib.filter_algorithms(h, d.x, d.y, d.conv, d.w, requested, returned,
                                               perf),
                         "cudnnGetConvolutionBackwardFilterAlgorithm_v7");
             });
  if (!c) return false;
  cd::Check(lib.set_math(d.conv, c->math), "cudnnSetConvolutionMathType");
  size_t dw_bytes = strided ? size_t(s.f * s.n * s.oh * s.ow) * (a.x->dtype.bits / 8) : 0;
  size_t dw_room = (dw_bytes + 255) / 256 * 256;
  char* scratch = nullptr;
  if (dw_room + c->workspace > 0) {
    scratch = static_cast<char*>(Scratch(dev, stream, dw_room + c->workspace));
  }
  float one = 1.0f, zero = 0.0f;
  char* dw = strided ? scratch : const_cast<char*>(Base(a.y));
  cd::Status status = lib.backward_filter(h, &one, d.x, Base(a.x), d.y, Base(a.w), d.conv,
                                          c->algo, c->workspace ? scratch + dw_room : nullptr,
                                          c->workspace, &zero, d.w, dw);
  const char* step = "cudnnConvolutionBackwardFilter";
  if (status == 0 && strided) {
    status = lib.transform(h, &one, d.w_packed, scratch, &zero, d.w_strided,
                           const_cast<char*>(Base(a.y)));
    step = "cudnnTransformTensor";
  }
  if (scratch != nullptr) tvm::runtime::DeviceAPI::Get(dev)->FreeWorkspace(dev, scratch);
  cd::Check(status, step);
  return true;
}

}  // namespace

void CudnnConv2d(tvm::ffi::PackedArgs args) {
  const char* api = "tvm_ext.cudnn.conv2d";
  ConvArgs a = ReadConvArgs(args, api);
  const ConvShape& s = a.s;
  DLDevice dev = a.y->device;
  for (const DLTensor* t : {a.x, a.w, static_cast<const DLTensor*>(a.y)}) {
    if (t->device.device_type != kDLCUDA || t->device.device_id != dev.device_id) {
      TVM_FFI_THROW(ValueError) << api << ": X, W and Y must be on one CUDA device";
    }
    if (t->dtype.code != a.x->dtype.code || t->dtype.bits != a.x->dtype.bits ||
        t->dtype.lanes != a.x->dtype.lanes) {
      TVM_FFI_THROW(TypeError) << api << ": X, W and Y must have one dtype ("
                               << DTypeName(a.x->dtype) << ", " << DTypeName(a.w->dtype)
                               << ", " << DTypeName(a.y->dtype) << " given)";
    }
  }
  int dtype = DataType(a.x->dtype, api);
  if (s.pt != 0 || s.pl != 0) {
    TVM_FFI_THROW(ValueError) << api << ": padding must be 0 (cuDNN pads symmetrically; pad X "
                                        "before the call)";
  }
  // The rows and columns the windows reach: all of them must be X's.
  int64_t rows = (s.oh - 1) * s.sh + (s.kh - 1) * s.dh + 1;
  int64_t cols = (s.ow - 1) * s.sw + (s.kw - 1) * s.dw + 1;
  if (rows > s.h || cols > s.w) {
    TVM_FFI_THROW(ValueError) << api << ": the windows of a " << s.oh << "x" << s.ow
                              << " output reach " << rows << "x" << cols << " of a " << s.h
                              << "x" << s.w << " input: cuDNN reads no zeros past X's edge";
  }
  if (s.n == 0 || s.f == 0 || s.oh <= 0 || s.ow <= 0) return;
  if (s.cg == 0 || s.kh == 0 || s.kw == 0) {
    TVM_FFI_THROW(ValueError) << api << ": an empty window (no channels or taps)";
  }

  std::lock_guard<std::mutex> lock(cd::Mutex());
  const cd::Api& lib = cd::LoadLocked();
  cd::Stream stream = TVMFFIEnvGetStream(kDLCUDA, dev.device_id);
  cd::Handle h = cd::HandleLocked(dev, stream);
  // A weight gradient (its window, dY, larger than its output, dW): backward-filter.
  if (s.groups == 1 && s.kh * s.kw > s.oh * s.ow &&
      BackwardFilter(lib, h, dev, stream, a, dtype, rows, cols, api)) {
    return;
  }
  Descriptors d(lib);
  int64_t x_ext[4] = {s.n, s.c, rows, cols}, y_ext[4] = {s.n, s.f, s.oh, s.ow};
  SetTensor(lib, &d.x, dtype, x_ext, s.xs, api);
  SetTensor(lib, &d.y, dtype, y_ext, s.ys, api);
  int64_t w_ext[4] = {s.f, s.cg, s.kh, s.kw};
  bool repack = false;  // W in another axis order: packed into the scratch first (below)
  SetFilter(lib, &d, dtype, w_ext, s.ws, &repack, api);
  SetConv(lib, &d, dtype, s.sh, s.sw, s.dh, s.dw, s.groups, api);
  std::optional<Choice> c =
      Choose(dtype, GeometryKey(0, dtype, s, rows, cols, dev), false,
             [&](int requested, int* returned, cd::AlgoPerf* perf) {
               cd::Check(lib.algorithms(h, d.x, d.w, d.conv, d.y, requested, returned, perf),
                         "cudnnGetConvolutionForwardAlgorithm_v7");
             });
  if (!c) {
    TVM_FFI_THROW(RuntimeError) << api << ": cuDNN offers no algorithm for this convolution "
                                << "(unsupported for its geometry, storage order and dtype, or "
                                << "over " << (cd::kWorkspaceBytes >> 20) << " MiB of "
                                << "workspace); build with --no-library to use the generated "
                                << "kernel";
  }
  cd::Check(lib.set_math(d.conv, c->math), "cudnnSetConvolutionMathType");

  size_t esize = a.x->dtype.bits / 8;
  size_t w_bytes = repack ? size_t(s.f * s.cg * s.kh * s.kw) * esize : 0;
  size_t w_room = (w_bytes + 255) / 256 * 256;
  char* scratch = nullptr;
  if (w_room + c->workspace > 0) {
    scratch = static_cast<char*>(Scratch(dev, stream, w_room + c->workspace));
  }
  float one = 1.0f, zero = 0.0f;
  const void* w_data = Base(a.w);
  cd::Status status = 0;
  const char* step = "cudnnConvolutionForward";
  if (repack) {
    status = lib.transform(h, &one, d.w_strided, w_data, &zero, d.w_packed, scratch);
    step = status != 0 ? "cudnnTransformTensor" : step;
    w_data = scratch;
  }
  if (status == 0) {
    status = lib.forward(h, &one, d.x, Base(a.x), d.w, w_data, d.conv, c->algo,
                         c->workspace ? scratch + w_room : nullptr, c->workspace, &zero, d.y,
                         const_cast<char*>(Base(a.y)));
  }
  if (scratch != nullptr) tvm::runtime::DeviceAPI::Get(dev)->FreeWorkspace(dev, scratch);
  cd::Check(status, step);
}

}  // namespace blas
}  // namespace tvm_ext

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  namespace blas = tvm_ext::blas;
  refl::GlobalDef()
      .def_packed("tvm_ext.cudnn.conv2d",
                  [](tvm::ffi::PackedArgs args, tvm::ffi::Any*) { blas::CudnnConv2d(args); })
      .def("tvm_ext.cudnn.set_library",
           [](tvm::ffi::String path) { blas::cudnn::SetLibraryPath(std::string(path)); })
      .def("tvm_ext.cudnn.available",
           []() { return tvm::ffi::String(blas::cudnn::AvailablePath()); })
      .def("tvm_ext.cudnn.workspace_bytes",
           []() { return static_cast<int64_t>(blas::cudnn::kWorkspaceBytes); });
}
