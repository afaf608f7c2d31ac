/*
 * `tvm_ext.blas.conv2d(X, W, Y, stride_h, stride_w, pad_top, pad_left, dil_h, dil_w, groups
 *                      [, X axes (n, c, h, w), W axes (f, c, kh, kw), Y axes (n, f, h, w)])`:
 *   Y[n, f, y, x] = sum_{c, ry, rx} X[n, g*C/groups + c, y*sh + ry*dh - pad_top,
 *                                     x*sw + rx*dw - pad_left] * W[f, c, ry, rx]
 * with g = f / (F/groups) and out-of-range reads zero (so bottom/right padding follows from
 * Y's shape), float32 or float64. Each tensor is compact; the optional 12 integers say which
 * of its axes holds each role (default NCHW / OIHW / NCHW), so a weight gradient, whose data
 * and output are "CNHW" ([C, N, H, W]: channels outermost), calls it as it is.
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
  // Element strides per role: X (n, c, h, w), W (f, c, kh, kw), Y (n, f, h, w).
  int64_t xs[4], ws[4], ys[4];
  int64_t fg() const { return f / groups; }
  int64_t pixels() const { return oh * ow; }
  int64_t depth() const { return cg * kh * kw; }
  // Y's pixels of one (image, filter) are one row-major run, and a group's filters rows of
  // a matrix BLAS accepts (row stride at least the row).
  bool pixels_contiguous() const {
    return ys[3] == 1 && (oh == 1 || ys[2] == ow) && (fg() == 1 || ys[1] >= pixels());
  }
  // ... and consecutive images' runs follow each other: columns (image, pixel) are one run.
  bool images_merge() const { return pixels_contiguous() && (n == 1 || ys[0] == pixels()); }
  // W_g is a row-major (F/g x depth) matrix in place (row stride ws[0]).
  bool weight_in_place() const {
    return (kw == 1 || ws[3] == 1) && (kh == 1 || ws[2] == kw) &&
           (cg == 1 || ws[1] == kh * kw) && (fg() == 1 || ws[0] >= depth());
  }
  // X's (C/g x H*W) planes are the column matrix of a 1x1, stride-1, unpadded convolution.
  bool direct() const {
    return kh == 1 && kw == 1 && sh == 1 && sw == 1 && pt == 0 && pl == 0 && oh == h &&
           ow == w && xs[3] == 1 && (h == 1 || xs[2] == w) && (cg == 1 || xs[1] == h * w);
  }
};

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

void Check(bool ok, const char* what) {
  if (!ok) TVM_FFI_THROW(ValueError) << "tvm_ext.blas.conv2d: " << what;
}

// Element strides of a compact tensor's 4 roles, from the axis holding each (a permutation).
void RoleStrides(const DLTensor* t, const int64_t* axes, const char* name, int64_t* strides,
                 int64_t* extents) {
  int64_t compact[4];
  compact[3] = 1;
  for (int i = 2; i >= 0; --i) compact[i] = compact[i + 1] * t->shape[i + 1];
  bool seen[4] = {false, false, false, false};
  for (int r = 0; r < 4; ++r) {
    if (axes[r] < 0 || axes[r] > 3 || seen[axes[r]]) {
      TVM_FFI_THROW(ValueError) << "tvm_ext.blas.conv2d: the axes of " << name
                                << " must be a permutation of 0..3";
    }
    seen[axes[r]] = true;
    strides[r] = compact[axes[r]];
    extents[r] = t->shape[axes[r]];
  }
}

}  // namespace

void CpuConv2d(tvm::ffi::PackedArgs args) {
  Check(args.size() == 10 || args.size() == 22,
        "expects (X, W, Y, stride_h, stride_w, pad_top, pad_left, dil_h, dil_w, groups"
        "[, 4 axes of X (n, c, h, w), 4 of W (f, c, kh, kw), 4 of Y (n, f, h, w)])");
  const DLTensor* x = args[0].cast<DLTensor*>();
  const DLTensor* w = args[1].cast<DLTensor*>();
  DLTensor* y = args[2].cast<DLTensor*>();
  Check(x->ndim == 4 && w->ndim == 4 && y->ndim == 4,
        "X, W and Y must be 4-D: X [N, C, H, W], W [F, C/groups, KH, KW], Y [N, F, OH, OW] "
        "(in the order their axes arguments give)");
  for (const DLTensor* t : {x, w, static_cast<const DLTensor*>(y)}) {
    Check(t->device.device_type == kDLCPU, "X, W and Y must be CPU tensors");
    Check(IsCompact(t), "X, W and Y must be compact (no strided views)");
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
  int64_t axes[12] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
  if (args.size() == 22) {
    for (int i = 0; i < 12; ++i) axes[i] = args[10 + i].cast<int64_t>();
  }
  ConvShape s{};
  int64_t xe[4], we[4], ye[4];
  RoleStrides(x, axes, "X", s.xs, xe);
  RoleStrides(w, axes + 4, "W", s.ws, we);
  RoleStrides(y, axes + 8, "Y", s.ys, ye);
  s.n = xe[0], s.c = xe[1], s.h = xe[2], s.w = xe[3];
  s.f = we[0], s.cg = we[1], s.kh = we[2], s.kw = we[3];
  s.oh = ye[2], s.ow = ye[3];
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
  Check(ye[0] == s.n, "Y's batch must be X's");
  Check(ye[1] == s.f, "Y's channels must be W's output channels (W.shape[0])");
  Check(s.fg() <= INT_MAX && s.n * s.pixels() <= INT_MAX && s.depth() <= INT_MAX &&
            s.ys[1] <= INT_MAX,
        "a per-group product is beyond the 32-bit BLAS interface");
  if (x->dtype.bits == 32) {
    Conv<float>(x, w, y, s);
  } else {
    Conv<double>(x, w, y, s);
  }
}

}  // namespace blas
}  // namespace tvm_ext
