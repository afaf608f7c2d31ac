/*!
 * \file swap/link_emulation.h
 * \brief An emulated host link for the CPU stand-in (cpu:0 as the device, cpu:1 as the host).
 *
 * On the stand-in a swap copy is a memcpy within one memory, far faster relative to the kernels
 * than PCIe is relative to a GPU's, so no plan's overlap or stalls show in wall time. With a link
 * set, each copy between two different devices on a CPU copy stream takes
 * latency + bytes / bandwidth of wall time on its stream: the worker copies, then sleeps until
 * that deadline (it does not spin, so the compute keeps the cores). A copy whose memcpy alone is
 * slower than the deadline is not slowed further (counted as late). Off by default.
 *
 * Set by `tvm_ext.swap.set_link(bytes_per_s, latency_s)` (0 bytes/s: off) or, for an exported
 * module run without tvm_ext's Python, by the environment variables TVM_EXT_LINK_GBPS (GB/s,
 * 1e9 bytes/s per direction) and TVM_EXT_LINK_LATENCY_US (microseconds per copy, default 0),
 * read at the first copy. A copy is paced with the link in force when it is enqueued.
 */
#ifndef TVM_EXT_SWAP_LINK_EMULATION_H_
#define TVM_EXT_SWAP_LINK_EMULATION_H_

#include <cstdint>

namespace tvm_ext {
namespace swap {

struct EmulatedLink {
  double bandwidth = 0.0;  // bytes/s per direction; 0: no emulation
  double latency = 0.0;    // seconds per copy

  bool on() const { return bandwidth > 0.0; }
  /*! \brief Wall time a copy of `nbytes` takes on this link. */
  int64_t DurationNs(int64_t nbytes) const {
    return static_cast<int64_t>((latency + static_cast<double>(nbytes) / bandwidth) * 1e9);
  }
};

/*! \brief The link in force (the environment's until `SetLink`); raises on a malformed variable. */
EmulatedLink CurrentLink();

/*! \brief Set the link (bandwidth 0: off); raises on negative or non-finite values. */
void SetLink(double bandwidth, double latency);

}  // namespace swap
}  // namespace tvm_ext

#endif  // TVM_EXT_SWAP_LINK_EMULATION_H_
