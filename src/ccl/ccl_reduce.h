/*!
 * \file ccl/ccl_reduce.h
 * \brief Element-wise reductions of the cpu collective backend (ccl_reduce.cc).
 *
 * A reduction combines the buffers of n workers in rank order (so every run gives the same
 * bits): float16 and bfloat16 accumulate in float32 and round once (to nearest even); integers
 * wrap around as on GPUs, and their avg truncates toward zero; min/max propagate NaN; bool reads
 * sum/max as "any" and prod/min as "all".
 */
#ifndef TVM_EXT_CCL_CCL_REDUCE_H_
#define TVM_EXT_CCL_CCL_REDUCE_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <string>

namespace tvm_ext {
namespace ccl {

/*! \brief Reduce kinds, as TVM numbers them (tvm::runtime::ReduceKind). */
enum : int { kSum = 0, kProd = 1, kMin = 2, kMax = 3, kAvg = 4 };

const char* ReduceKindName(int kind);

/*!
 * \brief Reduce elements [lo, hi) of sends[0..n) and write the result into every recvs[r]. Each
 * block is read from all senders before it is written, so a recv may be its own send.
 */
using ReduceFn = void (*)(const void* const* sends, void* const* recvs, int n, int64_t lo,
                          int64_t hi);

/*! \brief The reduction for a dtype and kind, or nullptr with the reason in `why`. */
ReduceFn FindReduce(DLDataType dtype, int kind, std::string* why);

float HalfToFloat(uint16_t h);
/*! \brief float -> IEEE half, rounding to nearest even. */
uint16_t FloatToHalf(float f);
float BFloatToFloat(uint16_t b);
/*! \brief float -> bfloat16, rounding to nearest even. */
uint16_t FloatToBFloat(float f);

}  // namespace ccl
}  // namespace tvm_ext

#endif  // TVM_EXT_CCL_CCL_REDUCE_H_
