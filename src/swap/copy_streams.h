/*!
 * \file swap/copy_streams.h
 * \brief Asynchronous tensor copies on dedicated copy streams (see copy_streams.cc for the
 * calling convention the SwapOffload pass emits).
 */
#ifndef TVM_EXT_SWAP_COPY_STREAMS_H_
#define TVM_EXT_SWAP_COPY_STREAMS_H_

#include <tvm/ffi/container/tensor.h>

#include <cstdint>
#include <string>

namespace tvm_ext {
namespace swap {

/*! \brief `wait_all` on every stream of every device. */
constexpr int64_t kAllStreams = -1;

/*!
 * \brief Enqueue `dst <- src` on copy stream `stream_id` and return at once. Shapes and dtypes are
 * checked here; a failure names the tensor (`name`) and poisons the stream.
 */
void CopyAsync(tvm::ffi::Tensor src, tvm::ffi::Tensor dst, int64_t stream_id,
               const std::string& name);

/*!
 * \brief Enqueue a copy between chunk `index` along `axis` of `whole` and `chunk` (whose shape is
 * `whole`'s with that axis cut into equal chunks), into the chunk (`to_chunk`) or out of it. The
 * chunk's bytes in `whole` are strided unless every axis before `axis` is 1: they are copied row
 * by row. Otherwise as CopyAsync.
 */
void CopyChunkAsync(tvm::ffi::Tensor whole, tvm::ffi::Tensor chunk, int64_t stream_id,
                    int64_t axis, int64_t index, bool to_chunk, const std::string& name);

/*!
 * \brief Enqueue a copy of the rows `start` .. `start + chunk.shape[axis]` along `axis` of `whole`
 * into `chunk` (whose shape is `whole`'s but along `axis`), clipped to the rows `whole` has: a
 * chunk's input range with its halo rows, of a kernel split along its windows. Chunk rows
 * outside `whole` are left as they are (the kernel never reads them). Otherwise as
 * CopyChunkAsync.
 */
void CopyWindowAsync(tvm::ffi::Tensor whole, tvm::ffi::Tensor chunk, int64_t stream_id,
                     int64_t axis, int64_t start, const std::string& name);

/*!
 * \brief Make the caller (CPU: block; CUDA: the compute stream) wait until no copy enqueued on
 * `stream_id` before this call reads or writes the memory of `tensor`. Raises if the stream failed.
 */
void Wait(tvm::ffi::Tensor tensor, int64_t stream_id);

/*! \brief Block until every copy on `stream_id` (or every stream: kAllStreams) has completed. */
void WaitAll(int64_t stream_id);

}  // namespace swap
}  // namespace tvm_ext

#endif  // TVM_EXT_SWAP_COPY_STREAMS_H_
