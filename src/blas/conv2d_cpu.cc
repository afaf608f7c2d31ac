/*
 * `tvm_ext.blas.conv2d`: the convolution of blas/conv_layout.h on CPU tensors, float32 or
 * float64.
 *
 * As GEMMs per group on the BLAS blas_library.cc loads: Y_g (F/g x columns) = W_g (F/g x
 * C/g*KH*KW) * cols (C/g*KH*KW x columns), the column matrix built by im2col:
 *   - per image (NCHW output: each image's F/g x OH*OW block is a row-major matrix): columns
 *     are one image's pixels. A 1x1 convolution with stride 1 and no padding reads X's planes
 *     as the column matrix directly;
 *   - batch-merged (output [F, N, OH, OW], a weight gradient): columns are (image, pixel), as
 *     many images at a time as fit kColsBytes, so one wide GEMM replaces N narrow ones;
 *   - otherwise each image's block is computed into a buffer and scattered (rare).
 * W is packed into [F, C/g*KH*KW] when not stored so (a weight gradient's W is [C, F, KH, KW]).
 *
 * Scratch (column matrix, packed W, output block) comes from TVMBackendAllocWorkspace, not a
 * std::vector: TVM's per-thread workspace pool keeps and reuses it from call to call, it is
 * what generated kernels use for their scratch, and being per thread it is also right for the
 * parallel case: many small per-image products with enough work in all (late ResNet stages
 * over a batch, depthwise convolutions) run their images and groups over TVM's thread pool,
 * im2col included, with single-threaded GEMMs; otherwise one after another on all BLAS threads.
 */
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/runtime/c_backend_api.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>

#include "blas/blas_library.h"
#include "blas/conv_layout.h"
#include "blas/gemm_layout.h"

namespace tvm_ext {
namespace blas {
namespace {

// As gemm_cpu.cc: OpenBLAS runs a product this small on one thread; below this much work in
// all, TVM's thread pool costs more than it saves.
constexpr int64_t kSingleThreadedGemm = int64_t(65536) * 4;
constexpr int64_t kPoolWork = int64_t(1) << 20;

// Columns [col0, col0 + images * OH*OW) of the column matrix (row length `ld`), for images
// [n0, n0 + images) of group g: cols[(c*KH + ky)*KW + kx][col0 + i*P + oy*OW + ox] =
// X[n0 + i, g*C/g + c, oy*sh + ky*dh - pt, ox*sw + kx*dw - pl], or 0 out of range.
template <typename T>
void Im2Col(const T* x, const ConvShape& s, int64_t g, int64_t n0, int64_t images, T* col,
            int64_t ld, int64_t col0) {
  int64_t pixels = s.pixels();
  for (int64_t c = 0; c < s.cg; ++c) {
    for (int64_t ky = 0; ky < s.kh; ++ky) {
      for (int64_t kx = 0; kx < s.kw; ++kx) {
        T* row = col + ((c * s.kh + ky) * s.kw + kx) * ld + col0;
        for (int64_t i = 0; i < images; ++i) {
          const T* plane = x + (n0 + i) * s.xs[0] + (g * s.cg + c) * s.xs[1];
          for (int64_t oy = 0; oy < s.oh; ++oy) {
            int64_t iy = oy * s.sh + ky * s.dh - s.pt;
            T* out = row + i * pixels + oy * s.ow;
            if (iy < 0 || iy >= s.h) {
              for (int64_t ox = 0; ox < s.ow; ++ox) out[ox] = T(0);
              continue;
            }
            const T* in = plane + iy * s.xs[2];
            for (int64_t ox = 0; ox < s.ow; ++ox) {
              int64_t ix = ox * s.sw + kx * s.dw - s.pl;
              out[ox] = (ix >= 0 && ix < s.w) ? in[ix * s.xs[3]] : T(0);
            }
          }
        }
      }
    }
  }
}

// W packed into [F, C/g*KH*KW] row-major.
template <typename T>
void PackWeight(const T* w, const ConvShape& s, T* out) {
  for (int64_t f = 0; f < s.f; ++f) {
    for (int64_t c = 0; c < s.cg; ++c) {
      for (int64_t ky = 0; ky < s.kh; ++ky) {
        for (int64_t kx = 0; kx < s.kw; ++kx) {
          *out++ = w[f * s.ws[0] + c * s.ws[1] + ky * s.ws[2] + kx * s.ws[3]];
        }
      }
    }
  }
}

template <typename T>
void Gemm(const BlasLibrary& lib, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda,
          const T* b, int64_t ldb, T* c, int64_t ldc) {
  // BLAS wants ld >= the stored row length even where one row leaves it unused (a group of one
  // filter: a chunk of one output channel), and skips the product otherwise (as gemm_layout's
  // RowMajor).
  if (m == 1) lda = std::max(lda, k), ldc = std::max(ldc, n);
  if (k == 1) ldb = std::max(ldb, n);
  if constexpr (sizeof(T) == 4) {
    lib.sgemm(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
  } else {
    lib.dgemm(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.0, a, lda, b, ldb, 0.0, c, ldc);
  }
}

// Workspace that frees itself (TVM's per-thread pool); null data when out of memory.
struct Scratch {
  void* data = nullptr;
  explicit Scratch(int64_t bytes) {
    if (bytes > 0) data = TVMBackendAllocWorkspace(kDLCPU, 0, bytes, kDLFloat, 32);
  }
  ~Scratch() {
    if (data != nullptr) TVMBackendFreeWorkspace(kDLCPU, 0, data);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// Column matrices of the batch-merged mode are built this many bytes at a time at most.
constexpr int64_t kColsBytes = int64_t(64) << 20;

template <typename T>
struct ConvTasks {
  const BlasLibrary* lib;
  const ConvShape* s;
  const T* x;
  const T* w;  // [F, depth] row-major with row stride w_ld
  int64_t w_ld;
  T* y;
  bool single_threaded;
  std::atomic<bool>* failed;  // out of workspace memory in some task

  // Per image: (image, group) pairs [first, last) in (n, g) order.
  void RunImages(int64_t first, int64_t last) const {
    if (first >= last) return;
    const ConvShape& sh = *s;
    int64_t fg = sh.fg(), pixels = sh.pixels(), depth = sh.depth();
    bool direct = sh.direct();
    Scratch col(direct ? 0 : depth * pixels * int64_t(sizeof(T)));
    Scratch block(sh.pixels_contiguous() ? 0 : fg * pixels * int64_t(sizeof(T)));
    if ((!direct && depth * pixels > 0 && col.data == nullptr) ||
        (!sh.pixels_contiguous() && fg * pixels > 0 && block.data == nullptr)) {
      failed->store(true);
      return;
    }
    int before = single_threaded && lib->set_threads_local ? lib->set_threads_local(1) : 0;
    for (int64_t i = first; i < last; ++i) {
      int64_t n = i / sh.groups, g = i % sh.groups;
      const T* cols = x + n * sh.xs[0] + g * sh.cg * sh.xs[1];
      if (!direct) {
        Im2Col(x, sh, g, n, 1, static_cast<T*>(col.data), pixels, 0);
        cols = static_cast<const T*>(col.data);
      }
      T* yg = y + n * sh.ys[0] + g * fg * sh.ys[1];
      T* out = sh.pixels_contiguous() ? yg : static_cast<T*>(block.data);
      int64_t ldc = sh.pixels_contiguous() ? sh.ys[1] : pixels;
      Product(fg, pixels, g, cols, pixels, out, ldc);
      if (!sh.pixels_contiguous()) Scatter(out, yg);
    }
    if (single_threaded && lib->set_threads_local) lib->set_threads_local(before);
  }

  // Batch-merged: per group, images in chunks whose column matrix fits kColsBytes.
  void RunMerged() const {
    const ConvShape& sh = *s;
    int64_t fg = sh.fg(), pixels = sh.pixels(), depth = sh.depth();
    int64_t per_image = std::max<int64_t>(depth * pixels * int64_t(sizeof(T)), 1);
    int64_t chunk = std::clamp<int64_t>(kColsBytes / per_image, 1, sh.n);
    Scratch col(depth * chunk * pixels * int64_t(sizeof(T)));
    if (depth * pixels > 0 && col.data == nullptr) {
      failed->store(true);
      return;
    }
    for (int64_t g = 0; g < sh.groups; ++g) {
      for (int64_t n0 = 0; n0 < sh.n; n0 += chunk) {
        int64_t images = std::min(chunk, sh.n - n0), cols = images * pixels;
        Im2Col(x, sh, g, n0, images, static_cast<T*>(col.data), cols, 0);
        Product(fg, cols, g, static_cast<const T*>(col.data), cols,
                y + n0 * sh.ys[0] + g * fg * sh.ys[1], sh.ys[1]);
      }
    }
  }

  // Y block (fg x cols, row stride ldc) = W_g (fg x depth) * cols (depth x cols, ldb).
  void Product(int64_t fg, int64_t cols, int64_t g, const T* b, int64_t ldb, T* c,
               int64_t ldc) const {
    int64_t depth = s->depth();
    if (depth == 0) {  // an empty sum
      for (int64_t r = 0; r < fg; ++r) {
        for (int64_t j = 0; j < cols; ++j) c[r * ldc + j] = T(0);
      }
      return;
    }
    Gemm(*lib, fg, cols, depth, w + g * fg * w_ld, w_ld, b, ldb, c, ldc);
  }

  // One image-and-group block computed in a buffer, written where Y's strides say.
  void Scatter(const T* block, T* yg) const {
    const ConvShape& sh = *s;
    for (int64_t f = 0; f < sh.fg(); ++f) {
      for (int64_t oy = 0; oy < sh.oh; ++oy) {
        for (int64_t ox = 0; ox < sh.ow; ++ox) {
          yg[f * sh.ys[1] + oy * sh.ys[2] + ox * sh.ys[3]] =
              block[f * sh.pixels() + oy * sh.ow + ox];
        }
      }
    }
  }
};

template <typename T>
int RunTask(int task_id, TVMParallelGroupEnv* env, void* cdata) {
  const auto* all = static_cast<const ConvTasks<T>*>(cdata);
  int64_t count = all->s->n * all->s->groups, tasks = env->num_task;
  all->RunImages(count * task_id / tasks, count * (task_id + 1) / tasks);
  return 0;
}

template <typename T>
void Conv(const DLTensor* xt, const DLTensor* wt, DLTensor* yt, const ConvShape& s) {
  if (s.n * s.f * s.pixels() == 0) return;
  auto data = [](const DLTensor* t) {
    return reinterpret_cast<T*>(static_cast<char*>(t->data) + t->byte_offset);
  };
  std::atomic<bool> failed{false};
  const T* w = data(wt);
  int64_t w_ld = s.ws[0];
  Scratch packed(s.weight_in_place() ? 0 : s.f * s.depth() * int64_t(sizeof(T)));
  if (!s.weight_in_place()) {
    if (s.f * s.depth() > 0 && packed.data == nullptr) failed.store(true);
    if (packed.data != nullptr) PackWeight(w, s, static_cast<T*>(packed.data));
    w = static_cast<const T*>(packed.data), w_ld = s.depth();
  }
  ConvTasks<T> all{&Library(), &s, data(xt), w, w_ld, data(yt), false, &failed};
  int64_t count = s.n * s.groups, mnk = s.fg() * s.pixels() * s.depth();
  Strategy how = ForcedStrategy();
  if (how == Strategy::kAuto || how == Strategy::kStrided) {
    how = count > 1 && mnk <= kSingleThreadedGemm && count * mnk >= kPoolWork ? Strategy::kPool
                                                                            : Strategy::kLoop;
  }
  // One wide product per group rather than one per image wherever Y allows it (a weight
  // gradient's few pixels per image make each per-image product narrow).
  bool merge = s.n > 1 && s.images_merge() && !s.direct();
  if (failed.load()) {
    // The packed weight did not fit: nothing ran.
  } else if (merge) {
    all.RunMerged();
  } else if (count > 1 && how == Strategy::kPool) {
    all.single_threaded = true;
    if (TVMBackendParallelLaunch(RunTask<T>, &all, 0) != 0) {
      TVM_FFI_THROW(RuntimeError) << "tvm_ext.blas.conv2d: TVM's thread pool failed";
    }
  } else {
    all.RunImages(0, count);
  }
  if (failed.load()) {
    TVM_FFI_THROW(RuntimeError) << "tvm_ext.blas.conv2d: out of memory for its scratch (column "
                                << "matrix of " << s.depth() * s.pixels() * sizeof(T)
                                << " bytes per image)";
  }
}

}  // namespace

void CpuConv2d(tvm::ffi::PackedArgs args) {
  const char* api = "tvm_ext.blas.conv2d";
  ConvArgs a = ReadConvArgs(args, api);
  const DLTensor* x = a.x;
  const ConvShape& s = a.s;
  for (const DLTensor* t : {a.x, a.w, static_cast<const DLTensor*>(a.y)}) {
    if (t->device.device_type != kDLCPU) {
      TVM_FFI_THROW(ValueError) << api << ": X, W and Y must be CPU tensors";
    }
    if (t->dtype.code != x->dtype.code || t->dtype.bits != x->dtype.bits ||
        t->dtype.lanes != x->dtype.lanes) {
      TVM_FFI_THROW(TypeError) << api << ": X, W and Y must have one dtype ("
                               << DTypeName(x->dtype) << ", " << DTypeName(a.w->dtype) << ", "
                               << DTypeName(a.y->dtype) << " given)";
    }
  }
  if (x->dtype.code != kDLFloat || (x->dtype.bits != 32 && x->dtype.bits != 64) ||
      x->dtype.lanes != 1) {
    TVM_FFI_THROW(TypeError) << api << ": float32 or float64 only (" << DTypeName(x->dtype)
                             << " given)";
  }
  if (!(s.fg() <= INT_MAX && s.n * s.pixels() <= INT_MAX && s.depth() <= INT_MAX &&
        s.ys[1] <= INT_MAX)) {
    TVM_FFI_THROW(ValueError) << api << ": a per-group product is beyond the 32-bit BLAS "
                                        "interface";
  }
  if (x->dtype.bits == 32) {
    Conv<float>(a.x, a.w, a.y, s);
  } else {
    Conv<double>(a.x, a.w, a.y, s);
  }
}

}  // namespace blas
}  // namespace tvm_ext
