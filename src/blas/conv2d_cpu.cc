/*
 * `tvm_ext.blas.conv2d(X, W, Y, stride_h, stride_w, pad_top, pad_left, dil_h, dil_w, groups)`:
 * X [N, C, H, W], W [F, C/groups, KH, KW], Y [N, F, OH, OW], float32 or float64,
 *   Y[n, f, y, x] = sum_{c, ry, rx} X[n, g*C/groups + c, y*sh + ry*dh - pad_top,
 *                                     x*sw + rx*dw - pad_left] * W[f, c, ry, rx]
 * with g = f / (F/groups) and out-of-range reads zero (so bottom/right padding follows from
 * Y's shape). As im2col + GEMM per image and group, on the BLAS blas_library.cc loads:
 * Y[n, group g] (F/g x OH*OW) = W[group g] (F/g x C/g*KH*KW) * cols (C/g*KH*KW x OH*OW). A 1x1
 * convolution with stride 1 and no padding reads X as the column matrix directly.
 *
 * The column matrix (one image and group at a time) comes from TVMBackendAllocWorkspace, not a
 * std::vector: TVM's per-thread workspace pool keeps and reuses it from call to call (a vector
 * would malloc and zero-fill up to KH*KW times the input on every call), it is what generated
 * kernels use for their scratch, and being per thread it is also right for the parallel case:
 * many small products with enough work in all (late ResNet stages over a batch, depthwise
 * convolutions) run their images and groups over TVM's thread pool, im2col included, with
 * single-threaded GEMMs; otherwise one image and group after another on all BLAS threads.
 */
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/runtime/c_backend_api.h>

#include <atomic>
#include <climits>
#include <cstdint>

#include "blas/blas_library.h"
#include "blas/gemm_layout.h"

namespace tvm_ext {
namespace blas {
namespace {

// As gemm_cpu.cc: OpenBLAS runs a product this small on one thread; below this much work in
// all, TVM's thread pool costs more than it saves.
constexpr int64_t kSingleThreadedGemm = int64_t(65536) * 4;
constexpr int64_t kPoolWork = int64_t(1) << 20;

struct ConvShape {
  int64_t n, c, h, w, f, cg, kh, kw, oh, ow, groups;
  int64_t sh, sw, pt, pl, dh, dw;
  int64_t fg() const { return f / groups; }
  int64_t pixels() const { return oh * ow; }
  int64_t depth() const { return cg * kh * kw; }
  bool direct() const {  // X's (C/g x H*W) planes are the column matrix
    return kh == 1 && kw == 1 && sh == 1 && sw == 1 && pt == 0 && pl == 0 && oh == h && ow == w;
  }
};

// cols[(c*KH + ky)*KW + kx][oy*OW + ox] = X[c, oy*sh + ky*dh - pt, ox*sw + kx*dw - pl] or 0.
template <typename T>
void Im2Col(const T* x, const ConvShape& s, T* col) {
  int64_t pixels = s.pixels();
  for (int64_t c = 0; c < s.cg; ++c) {
    const T* plane = x + c * s.h * s.w;
    for (int64_t ky = 0; ky < s.kh; ++ky) {
      for (int64_t kx = 0; kx < s.kw; ++kx) {
        T* row = col + ((c * s.kh + ky) * s.kw + kx) * pixels;
        for (int64_t oy = 0; oy < s.oh; ++oy) {
          int64_t iy = oy * s.sh + ky * s.dh - s.pt;
          T* out = row + oy * s.ow;
          if (iy < 0 || iy >= s.h) {
            for (int64_t ox = 0; ox < s.ow; ++ox) out[ox] = T(0);
            continue;
          }
          const T* in = plane + iy * s.w;
          for (int64_t ox = 0; ox < s.ow; ++ox) {
            int64_t ix = ox * s.sw + kx * s.dw - s.pl;
            out[ox] = (ix >= 0 && ix < s.w) ? in[ix] : T(0);
          }
        }
      }
    }
  }
}

template <typename T>
struct ConvTasks {
  const BlasLibrary* lib;
  const ConvShape* s;
  const T* x;
  const T* w;
  T* y;
  bool single_threaded;
  std::atomic<bool>* failed;  // out of workspace memory in some task

  // Images and groups [first, last) in (n, g) order.
  void Run(int64_t first, int64_t last) {
    if (first >= last) return;
    const ConvShape& sh = *s;
    int64_t fg = sh.fg(), pixels = sh.pixels(), depth = sh.depth();
    T* col = nullptr;
    if (!sh.direct() && depth * pixels > 0) {
      col = static_cast<T*>(TVMBackendAllocWorkspace(kDLCPU, 0, depth * pixels * sizeof(T),
                                                     kDLFloat, sizeof(T) * 8));
      if (col == nullptr) {
        failed->store(true);
        return;
      }
    }
    int before = single_threaded && lib->set_threads_local ? lib->set_threads_local(1) : 0;
    for (int64_t i = first; i < last; ++i) {
      int64_t n = i / sh.groups, g = i % sh.groups;
      const T* cols = x + (n * sh.c + g * sh.cg) * sh.h * sh.w;
      if (col != nullptr) Im2Col(cols, sh, col), cols = col;
      const T* wg = w + g * fg * depth;
      T* yg = y + (n * sh.f + g * fg) * pixels;
      if (depth == 0) {  // an empty sum
        for (int64_t j = 0; j < fg * pixels; ++j) yg[j] = T(0);
      } else if constexpr (sizeof(T) == 4) {
        lib->sgemm(kRowMajor, kNoTrans, kNoTrans, fg, pixels, depth, 1.0f, wg, depth, cols,
                   pixels, 0.0f, yg, pixels);
      } else {
        lib->dgemm(kRowMajor, kNoTrans, kNoTrans, fg, pixels, depth, 1.0, wg, depth, cols,
                   pixels, 0.0, yg, pixels);
      }
    }
    if (single_threaded && lib->set_threads_local) lib->set_threads_local(before);
    if (col != nullptr) TVMBackendFreeWorkspace(kDLCPU, 0, col);
  }
};

template <typename T>
int RunTask(int task_id, TVMParallelGroupEnv* env, void* cdata) {
  ConvTasks<T> part = *static_cast<const ConvTasks<T>*>(cdata);
  int64_t count = part.s->n * part.s->groups, tasks = env->num_task;
  part.Run(count * task_id / tasks, count * (task_id + 1) / tasks);
  return 0;
}

template <typename T>
void Conv(const DLTensor* xt, const DLTensor* wt, DLTensor* yt, const ConvShape& s) {
  if (s.n * s.f * s.pixels() == 0) return;
  auto data = [](const DLTensor* t) {
    return reinterpret_cast<T*>(static_cast<char*>(t->data) + t->byte_offset);
  };
  std::atomic<bool> failed{false};
  ConvTasks<T> all{&Library(), &s, data(xt), data(wt), data(yt), false, &failed};
  int64_t count = s.n * s.groups, mnk = s.fg() * s.pixels() * s.depth();
  Strategy how = ForcedStrategy();
  if (how == Strategy::kAuto || how == Strategy::kStrided) {
    how = count > 1 && mnk <= kSingleThreadedGemm && count * mnk >= kPoolWork ? Strategy::kPool
                                                                            : Strategy::kLoop;
  }
  if (count > 1 && how == Strategy::kPool) {
    all.single_threaded = true;
    if (TVMBackendParallelLaunch(RunTask<T>, &all, 0) != 0) {
      TVM_FFI_THROW(RuntimeError) << "tvm_ext.blas.conv2d: TVM's thread pool failed";
    }
  } else {
    all.Run(0, count);
  }
  if (failed.load()) {
    TVM_FFI_THROW(RuntimeError) << "tvm_ext.blas.conv2d: out of memory for the "
                                << s.depth() * s.pixels() * sizeof(T) << "-byte column matrix";
  }
}

void Check(bool ok, const char* what) {
  if (!ok) TVM_FFI_THROW(ValueError) << "tvm_ext.blas.conv2d: " << what;
}

}  // namespace

void CpuConv2d(tvm::ffi::PackedArgs args) {
  Check(args.size() == 10, "expects (X, W, Y, stride_h, stride_w, pad_top, pad_left, dil_h, "
                           "dil_w, groups)");
  const DLTensor* x = args[0].cast<DLTensor*>();
  const DLTensor* w = args[1].cast<DLTensor*>();
  DLTensor* y = args[2].cast<DLTensor*>();
  Check(x->ndim == 4 && w->ndim == 4 && y->ndim == 4,
        "X, W and Y must be 4-D: X [N, C, H, W], W [F, C/groups, KH, KW], Y [N, F, OH, OW]");
  for (const DLTensor* t : {x, w, static_cast<const DLTensor*>(y)}) {
    Check(t->device.device_type == kDLCPU, "X, W and Y must be CPU tensors");
    Check(IsCompact(t), "X, W and Y must be compact (NCHW / OIHW, no strided views)");
    if (t->dtype.code != x->dtype.code || t->dtype.bits != x->dtype.bits ||
        t->dtype.lanes != x->dtype.lanes) {
      TVM_FFI_THROW(TypeError) << "tvm_ext.blas.conv2d: X, W and Y must have one dtype ("
                               << DTypeName(x->dtype) << ", " << DTypeName(w->dtype) << ", "
                               << DTypeName(y->dtype) << " given)";
    }
  }
  if (x->dtype.code != kDLFloat || (x->dtype.bits != 32 && x->dtype.bits != 64) ||
      x->dtype.lanes != 1) {
    TVM_FFI_THROW(TypeError) << "tvm_ext.blas.conv2d: float32 or float64 only ("
                             << DTypeName(x->dtype) << " given)";
  }
  ConvShape s{x->shape[0], x->shape[1], x->shape[2], x->shape[3], w->shape[0], w->shape[1],
              w->shape[2], w->shape[3], y->shape[2], y->shape[3], 0, 0, 0, 0, 0, 0, 0};
  s.sh = args[3].cast<int64_t>(), s.sw = args[4].cast<int64_t>();
  s.pt = args[5].cast<int64_t>(), s.pl = args[6].cast<int64_t>();
  s.dh = args[7].cast<int64_t>(), s.dw = args[8].cast<int64_t>();
  s.groups = args[9].cast<int64_t>();
  Check(s.sh > 0 && s.sw > 0 && s.dh > 0 && s.dw > 0 && s.groups > 0,
        "strides, dilations and groups must be positive");
  Check(s.pt >= 0 && s.pl >= 0, "padding must not be negative");
  Check(s.c == s.cg * s.groups,
        "X's channels must be W's input channels (W.shape[1]) times groups");
  Check(s.f % s.groups == 0, "W's output channels (W.shape[0]) must divide by groups");
  Check(y->shape[0] == s.n, "Y's batch must be X's");
  Check(y->shape[1] == s.f, "Y's channels must be W's output channels (W.shape[0])");
  Check(s.fg() <= INT_MAX && s.pixels() <= INT_MAX && s.depth() <= INT_MAX,
        "a per-group product is beyond the 32-bit BLAS interface");
  if (x->dtype.bits == 32) {
    Conv<float>(x, w, y, s);
  } else {
    Conv<double>(x, w, y, s);
  }
}

}  // namespace blas
}  // namespace tvm_ext
