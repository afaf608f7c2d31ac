/*!
 * \file swap/link_emulation.cc
 * \brief The emulated host link's setting (see link_emulation.h) and its Python entry points.
 */
#include "swap/link_emulation.h"

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>

namespace tvm_ext {
namespace swap {

namespace {

constexpr const char* kEnvGbps = "TVM_EXT_LINK_GBPS";
constexpr const char* kEnvLatencyUs = "TVM_EXT_LINK_LATENCY_US";

/*! \brief A non-negative finite number from the environment, or `fallback` when unset. */
double EnvNumber(const char* name, double fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(value) || value < 0) {
    TVM_FFI_THROW(ValueError) << "tvm_ext.swap: " << name << "=" << text
                              << " is not a number >= 0";
  }
  return value;
}

void CheckLink(double bandwidth, double latency) {
  if (!std::isfinite(bandwidth) || bandwidth < 0 || !std::isfinite(latency) || latency < 0) {
    TVM_FFI_THROW(ValueError) << "tvm_ext.swap.set_link: bandwidth (" << bandwidth
                              << " bytes/s) and latency (" << latency
                              << " s) must be finite and >= 0";
  }
}

class LinkSetting {
 public:
  static LinkSetting* Global() {
    static auto* inst = new LinkSetting();
    return inst;
  }
  EmulatedLink Get() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!initialised_) {
      // Read once; a malformed variable raises here (at the first copy) and again next time.
      EmulatedLink link;
      link.bandwidth = EnvNumber(kEnvGbps, 0.0) * 1e9;
      link.latency = EnvNumber(kEnvLatencyUs, 0.0) * 1e-6;
      link_ = link;
      initialised_ = true;
    }
    return link_;
  }
  void Set(double bandwidth, double latency) {
    CheckLink(bandwidth, latency);
    std::lock_guard<std::mutex> lock(mu_);
    link_.bandwidth = bandwidth;
    link_.latency = bandwidth > 0 ? latency : 0.0;
    initialised_ = true;
  }

 private:
  std::mutex mu_;
  bool initialised_ = false;
  EmulatedLink link_;
};

}  // namespace

EmulatedLink CurrentLink() { return LinkSetting::Global()->Get(); }

void SetLink(double bandwidth, double latency) { LinkSetting::Global()->Set(bandwidth, latency); }

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("tvm_ext.swap.set_link",
           [](double bandwidth, double latency) { SetLink(bandwidth, latency); })
      .def("tvm_ext.swap.link", []() {
        EmulatedLink link = CurrentLink();
        return tvm::ffi::Array<double>{link.bandwidth, link.latency};
      });
}

}  // namespace swap
}  // namespace tvm_ext
