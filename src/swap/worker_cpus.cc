/*!
 * \file swap/worker_cpus.cc
 * \brief Pinning the CPU stand-in's copy workers (see worker_cpus.h) and its Python entry points.
 */
#include "swap/worker_cpus.h"

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

namespace tvm_ext {
namespace swap {

namespace {

constexpr const char* kEnvCpus = "TVM_EXT_COPY_WORKER_CPUS";

void Malformed(const std::string& text) {
  TVM_FFI_THROW(ValueError) << "tvm_ext.swap: " << kEnvCpus << "=" << text
                            << " is not a list of CPUs such as 3, 2,3 or 2-3";
}

int ParseCpu(const std::string& text, const std::string& whole) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos ||
      text.size() > 6) {
    Malformed(whole);
  }
  return std::stoi(text);
}

/*! \brief "3", "2,3", "2-3" or "0,2-3" as a list of CPUs. */
std::vector<int> ParseCpuList(const std::string& text) {
  std::vector<int> cpus;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    size_t dash = item.find('-');
    int first = ParseCpu(item.substr(0, dash), text);
    int last = dash == std::string::npos ? first : ParseCpu(item.substr(dash + 1), text);
    if (last < first) Malformed(text);
    for (int c = first; c <= last; ++c) cpus.push_back(c);
  }
  if (cpus.empty()) Malformed(text);
  return cpus;
}

std::string CpuListStr(const std::vector<int>& cpus) {
  std::ostringstream os;
  for (size_t i = 0; i < cpus.size(); ++i) os << (i ? "," : "") << cpus[i];
  return os.str();
}

class WorkerPinning {
 public:
  static WorkerPinning* Global() {
    static auto* inst = new WorkerPinning();
    return inst;
  }

  /*! \brief The CPUs the process could use when the library was loaded. */
  std::vector<int> Allowed() const {
    std::vector<int> cpus;
#ifdef __linux__
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &allowed_)) cpus.push_back(c);
    }
#endif
    return cpus;
  }

  std::vector<int> Get() {
    std::lock_guard<std::mutex> lock(mu_);
    InitLocked();
    return cpus_;
  }

  void Set(const std::vector<int>& cpus) {
    Check(cpus, "tvm_ext.swap.set_worker_cpus");
    std::lock_guard<std::mutex> lock(mu_);
    cpus_ = cpus;
    initialised_ = true;
#ifdef __linux__
    for (pthread_t worker : workers_) ApplyLocked(worker);
#endif
  }

  void Start(const char* name, std::function<void()> body) {
    std::lock_guard<std::mutex> lock(mu_);
    InitLocked();
    std::thread thread(std::move(body));
#ifdef __linux__
    pthread_setname_np(thread.native_handle(), name);
    ApplyLocked(thread.native_handle());
    // Workers run for the life of the process (their stream holds them), so the handle stays
    // valid for later `Set`s.
    workers_.push_back(thread.native_handle());
#endif
    thread.detach();
  }

 private:
  WorkerPinning() {
#ifdef __linux__
    // The CPUs the process may use, as loaded: unpinned workers get these back.
    CPU_ZERO(&allowed_);
    if (sched_getaffinity(0, sizeof(allowed_), &allowed_) != 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c) CPU_SET(c, &allowed_);
    }
#endif
  }

  void InitLocked() {
    if (initialised_) return;
    const char* text = std::getenv(kEnvCpus);
    std::vector<int> cpus;
    if (text != nullptr && *text != '\0') cpus = ParseCpuList(text);  // raises: read again next time
    Check(cpus, kEnvCpus);
    cpus_ = cpus;
    initialised_ = true;
  }

  void Check(const std::vector<int>& cpus, const char* what) const {
#ifdef __linux__
    for (int c : cpus) {
      if (c < 0 || c >= CPU_SETSIZE || !CPU_ISSET(c, &allowed_)) {
        TVM_FFI_THROW(ValueError) << what << ": CPU " << c << " (of " << CpuListStr(cpus)
                                  << ") is not one this process may run on";
      }
    }
#else
    if (!cpus.empty()) {
      TVM_FFI_THROW(RuntimeError) << what << ": pinning copy workers needs Linux";
    }
#endif
  }

#ifdef __linux__
  void ApplyLocked(pthread_t worker) const {
    cpu_set_t set;
    if (cpus_.empty()) {
      set = allowed_;
    } else {
      CPU_ZERO(&set);
      for (int c : cpus_) CPU_SET(c, &set);
    }
    // Checked against the process's CPUs: a failure means the CPU went away since, and the
    // worker then keeps the CPUs it had, which only costs time.
    pthread_setaffinity_np(worker, sizeof(set), &set);
  }

  cpu_set_t allowed_;
  std::vector<pthread_t> workers_;
#endif
  std::mutex mu_;
  bool initialised_ = false;
  std::vector<int> cpus_;
};

}  // namespace

std::vector<int> WorkerCpus() { return WorkerPinning::Global()->Get(); }

void SetWorkerCpus(const std::vector<int>& cpus) { WorkerPinning::Global()->Set(cpus); }

void StartWorker(const char* name, std::function<void()> body) {
  WorkerPinning::Global()->Start(name, std::move(body));
}

TVM_FFI_STATIC_INIT_BLOCK() {
  WorkerPinning::Global();  // takes the process's CPUs before anyone pins the caller
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("tvm_ext.swap.set_worker_cpus",
           [](tvm::ffi::Array<int64_t> cpus) {
             std::vector<int> list;
             for (int64_t c : cpus) {
               // Out of int's range counts as out of the process's CPUs.
               list.push_back(c < 0 || c > (1 << 20) ? -1 : static_cast<int>(c));
             }
             SetWorkerCpus(list);
           })
      .def("tvm_ext.swap.process_cpus", []() {
        tvm::ffi::Array<int64_t> cpus;
        for (int c : WorkerPinning::Global()->Allowed()) cpus.push_back(c);
        return cpus;
      })
      .def("tvm_ext.swap.worker_cpus", []() {
        tvm::ffi::Array<int64_t> cpus;
        for (int c : WorkerCpus()) cpus.push_back(c);
        return cpus;
      });
}

}  // namespace swap
}  // namespace tvm_ext
