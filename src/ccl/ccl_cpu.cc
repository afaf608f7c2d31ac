/*!
 * \file ccl/ccl_cpu.cc
 * \brief The "cpu" Disco collective backend: the workers of a ThreadedSession (threads of one
 * process) exchange tensors in host memory.
 *
 * TVM's disco builtins (`runtime.disco.allreduce`, ...) dispatch to `runtime.disco.<ccl>.<op>`,
 * where <ccl> is the name `init_ccl_per_worker` stores in the worker; this file registers every
 * such op under "cpu". Usage: `SessionInitCCL(sess, "cpu", device_ids)` on a ThreadedSession;
 * worker i then allocates on cpu(device_ids[i]), so per-worker memory counters stay apart.
 *
 * Each collective is a rendezvous of its participants (all workers, or the caller's group):
 *   1. every participant posts its buffers and its own argument errors, then waits for all;
 *   2. all participants run the same checks on all posts, so they agree on success or on one error
 *      (a mismatch never leaves some workers waiting for the others);
 *   3. each participant moves (or reduces) its share of the data, and waits for all again, so no
 *      buffer is released or rewritten while another worker still reads it.
 * Allreduce splits the elements into one slice per participant; the owner of a slice reduces it
 * over all senders (ccl_reduce.h: rank order, so every run gives the same bits; half types
 * accumulate in float32) and writes the result into every receiver.
 *
 * A worker that never arrives (it failed, or runs a different program) would hang the others:
 * waits end after a timeout (TVM_EXT_CCL_TIMEOUT seconds, default 300, or
 * `tvm_ext.ccl.cpu.set_timeout`), and a failing worker aborts the communicator at once through
 * `AbortCpuCommunicatorOfThisWorker` (see disco_session.cc), which wakes every waiter with that
 * worker's error.
 *
 * Point-to-point sends are eager: the message is copied into a per-(sender, receiver) queue and
 * the sender goes on; the receiver takes messages in order.
 */
#include "ccl/ccl_cpu.h"

#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/disco/session.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ccl/ccl_reduce.h"
#include "ccl/ccl_util.h"

namespace tvm_ext {
namespace ccl {
namespace {

using tvm::ffi::Optional;
using tvm::ffi::Shape;
using tvm::ffi::Tensor;
using tvm::runtime::DRef;
using tvm::runtime::Session;

constexpr const char* kCclName = "cpu";
constexpr const char* kAbortPrefix = "collective aborted: ";

/*! \brief What one participant hands to a collective. */
struct Post {
  const char* op = "";
  const void* send = nullptr;
  void* recv = nullptr;
  int64_t send_bytes = 0;
  int64_t recv_bytes = 0;
  DLDataType dtype{0, 0, 0};
  int kind = -1;
  std::string send_desc = "None";
  std::string recv_desc = "None";
  std::string error;  // what this participant found wrong with its own arguments
};

// ---------------------------------------------------------------------------------------------
// The communicator
// ---------------------------------------------------------------------------------------------

/*! \brief The meeting point of one set of participants (all workers, or one group). */
struct Rendezvous {
  explicit Rendezvous(int size, int group) : size(size), group(group), posts(size) {}
  int size;
  int group;
  std::vector<Post> posts;
  int arrived = 0;
  uint64_t generation = 0;

  int WorkerOf(int rank) const { return group < 0 ? rank : group * size + rank; }
};

struct Message {
  std::vector<char> bytes;
  std::string desc;
};

std::atomic<double>& DefaultTimeout() {
  static std::atomic<double> timeout([] {
    const char* env = std::getenv("TVM_EXT_CCL_TIMEOUT");
    double v = env ? std::atof(env) : 0.0;
    return v > 0 ? v : 300.0;
  }());
  return timeout;
}

class CpuCommunicator {
 public:
  CpuCommunicator(int num_workers, double timeout_s)
      : num_workers_(num_workers), timeout_s_(timeout_s), world_(num_workers, -1) {}

  int num_workers() const { return num_workers_; }

  /*! \brief The first worker to join fixes the grouping; the others must agree. */
  void JoinGroups(int num_groups) {
    std::lock_guard<std::mutex> lock(mu_);
    if (num_groups < 1 || num_workers_ % num_groups != 0) {
      TVM_FFI_THROW(ValueError) << "cpu collectives: " << num_workers_ << " workers cannot form "
                                << num_groups << " equal groups";
    }
    if (groups_.empty()) {
      int size = num_workers_ / num_groups;
      for (int g = 0; g < num_groups; ++g) groups_.emplace_back(new Rendezvous(size, g));
    } else if (static_cast<int>(groups_.size()) != num_groups) {
      TVM_FFI_THROW(ValueError) << "cpu collectives: workers disagree on the number of groups ("
                                << groups_.size() << " vs " << num_groups << ")";
    }
  }

  /*!
   * \brief Post this participant's buffers, wait for all, and run `check` (the same on every
   * participant) on all posts. On an error all participants throw it together.
   */
  template <typename Check>
  const std::vector<Post>& Exchange(const Participants& p, int worker_id, Post mine, Check check) {
    Rendezvous& rv = Select(p);
    {
      std::lock_guard<std::mutex> lock(mu_);
      rv.posts[p.rank] = std::move(mine);
    }
    Barrier(rv, worker_id, rv.posts[p.rank].op);
    std::string error = CommonCheck(rv);
    if (error.empty()) error = check(rv);
    if (!error.empty()) {
      Barrier(rv, worker_id, rv.posts[p.rank].op);  // nobody reposts before all have read
      TVM_FFI_THROW(ValueError) << error;
    }
    return rv.posts;
  }

  /*! \brief Wait until every participant has finished moving data. */
  void Finish(const Participants& p, int worker_id, const char* op) {
    Barrier(Select(p), worker_id, op);
  }

  void Send(int src, int dst, const void* data, int64_t nbytes, std::string desc) {
    std::lock_guard<std::mutex> lock(mu_);
    ThrowIfAborted();
    Message msg;
    msg.bytes.assign(static_cast<const char*>(data), static_cast<const char*>(data) + nbytes);
    msg.desc = std::move(desc);
    mail_[{src, dst}].push_back(std::move(msg));
    cv_.notify_all();
  }

  void Recv(int src, int dst, void* data, int64_t nbytes, const std::string& desc,
            const char* op) {
    std::unique_lock<std::mutex> lock(mu_);
    auto& queue = mail_[{src, dst}];
    auto deadline = Deadline();
    while (queue.empty()) {
      ThrowIfAborted();
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && queue.empty()) {
        std::ostringstream os;
        os << op << ": worker " << dst << " waited " << timeout_s_ << " s for a message from worker "
           << src << " that never came (the workers run different programs)";
        AbortLocked(os.str());
        TVM_FFI_THROW(RuntimeError) << os.str();
      }
    }
    Message msg = std::move(queue.front());
    queue.pop_front();
    if (static_cast<int64_t>(msg.bytes.size()) != nbytes) {
      TVM_FFI_THROW(ValueError) << op << ": worker " << dst << " receives into " << desc
                                << " but worker " << src << " sent " << msg.desc
                                << "; sender and receiver buffers must have the same size";
    }
    std::memcpy(data, msg.bytes.data(), nbytes);
  }

  void Abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    AbortLocked(reason);
  }

 private:
  Rendezvous& Select(const Participants& p) { return p.group < 0 ? world_ : *groups_[p.group]; }

  std::chrono::steady_clock::time_point Deadline() const {
    return std::chrono::steady_clock::now() +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(
               std::chrono::duration<double>(timeout_s_));
  }

  void AbortLocked(const std::string& reason) {
    if (!aborted_) {
      aborted_ = true;
      abort_reason_ = reason;
    }
    cv_.notify_all();
  }

  void ThrowIfAborted() {
    if (aborted_) TVM_FFI_THROW(RuntimeError) << kAbortPrefix << abort_reason_;
  }

  void Barrier(Rendezvous& rv, int worker_id, const char* op) {
    std::unique_lock<std::mutex> lock(mu_);
    ThrowIfAborted();
    uint64_t generation = rv.generation;
    if (++rv.arrived == rv.size) {
      rv.arrived = 0;
      ++rv.generation;
      cv_.notify_all();
      return;
    }
    auto deadline = Deadline();
    while (rv.generation == generation) {
      ThrowIfAborted();
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout &&
          rv.generation == generation && !aborted_) {
        std::ostringstream os;
        os << op << ": worker " << worker_id << " waited " << timeout_s_
           << " s for the other workers, which never called it (the workers run different "
              "programs, or one is stuck; TVM_EXT_CCL_TIMEOUT sets the limit)";
        AbortLocked(os.str());
        TVM_FFI_THROW(RuntimeError) << os.str();
      }
    }
  }

  /*! \brief Checks every collective shares: same op everywhere, no participant-local error. */
  static std::string CommonCheck(const Rendezvous& rv) {
    const std::vector<Post>& posts = rv.posts;
    for (int r = 1; r < rv.size; ++r) {
      if (std::strcmp(posts[r].op, posts[0].op) != 0) {
        std::ostringstream os;
        os << "worker " << rv.WorkerOf(r) << " called " << posts[r].op << " while worker "
           << rv.WorkerOf(0) << " called " << posts[0].op
           << ": all workers must issue the same collectives in the same order";
        return os.str();
      }
    }
    for (int r = 0; r < rv.size; ++r) {
      if (!posts[r].error.empty()) {
        return std::string(posts[r].op) + " on worker " + std::to_string(rv.WorkerOf(r)) + ": " +
               posts[r].error;
      }
    }
    return "";
  }

  int num_workers_;
  double timeout_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  Rendezvous world_;
  std::vector<std::unique_ptr<Rendezvous>> groups_;
  std::map<std::pair<int, int>, std::deque<Message>> mail_;
  bool aborted_ = false;
  std::string abort_reason_;
};

/*! \brief Communicators created by init_ccl, until each of their workers has taken its share. */
class PendingCommunicators {
 public:
  static PendingCommunicators* Global() {
    static auto* inst = new PendingCommunicators();
    return inst;
  }

  int64_t Add(std::shared_ptr<CpuCommunicator> comm) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t id = next_id_++;
    int n = comm->num_workers();
    table_[id] = {std::move(comm), n};
    return id;
  }

  std::shared_ptr<CpuCommunicator> Take(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table_.find(id);
    if (it == table_.end()) return nullptr;
    std::shared_ptr<CpuCommunicator> comm = it->second.first;
    if (--it->second.second == 0) table_.erase(it);
    return comm;
  }

 private:
  std::mutex mu_;
  int64_t next_id_ = 1;
  std::unordered_map<int64_t, std::pair<std::shared_ptr<CpuCommunicator>, int>> table_;
};

struct WorkerContext {
  DiscoWorker* worker = nullptr;
  std::shared_ptr<CpuCommunicator> comm;
};

WorkerContext& ThisWorker() {
  thread_local WorkerContext ctx;
  return ctx;
}

WorkerContext& Ctx(const char* fn) {
  DiscoWorker* worker = CurrentWorker(fn);
  WorkerContext& ctx = ThisWorker();
  if (!ctx.comm || ctx.worker != worker) {
    TVM_FFI_THROW(ValueError) << fn << ": the \"cpu\" collective backend is not initialised on "
                              << "worker " << worker->worker_id
                              << "; call SessionInitCCL(session, \"cpu\", device_ids) first "
                                 "(tvm_ext.runtime.distributed.Session does)";
  }
  return ctx;
}

// ---------------------------------------------------------------------------------------------
// The collectives
// ---------------------------------------------------------------------------------------------

/*! \brief Local checks on one buffer; returns "" or what is wrong. */
std::string CheckBuffer(const Tensor& t, const char* what) {
  int type = t.device().device_type;
  if (type != kDLCPU && type != kDLCUDAHost && type != kDLROCMHost) {
    return std::string("buffer `") + what + "` (" + Describe(t) + ") is on device type " +
           std::to_string(type) +
           "; the cpu backend moves host memory only: use the nccl backend for GPU tensors";
  }
  if (!t.IsContiguous()) {
    return std::string("buffer `") + what + "` (" + Describe(t) + ") is not contiguous";
  }
  return "";
}

Post MakePost(const char* op, const Optional<Tensor>& send, const Optional<Tensor>& recv) {
  Post post;
  post.op = op;
  if (send.has_value()) {
    const Tensor& s = send.value();
    post.send = DataPtr(s);
    post.send_bytes = NumBytes(s);
    post.dtype = s.dtype();
    post.send_desc = Describe(s);
    post.error = CheckBuffer(s, "send");
  }
  if (recv.has_value()) {
    const Tensor& r = recv.value();
    post.recv = DataPtr(r);
    post.recv_bytes = NumBytes(r);
    if (!send.has_value()) post.dtype = r.dtype();
    post.recv_desc = Describe(r);
    if (post.error.empty()) post.error = CheckBuffer(r, "recv");
    if (post.error.empty() && send.has_value() && !SameDType(r.dtype(), send.value().dtype())) {
      post.error = "send " + post.send_desc + " and recv " + post.recv_desc + " differ in dtype";
    }
  }
  return post;
}

std::string Mismatch(const Rendezvous& rv, int r, const char* what, const std::string& mine,
                     const std::string& root) {
  std::ostringstream os;
  os << rv.posts[r].op << ": worker " << rv.WorkerOf(r) << " " << what << " " << mine
     << " but worker " << rv.WorkerOf(0) << " " << what << " " << root
     << "; all workers must pass buffers of the same shape and dtype";
  return os.str();
}

// Agreement checks run once all posts are in: every worker must send (or receive into) buffers
// of the root's dtype and size.
std::string SendsAgree(const Rendezvous& rv) {
  const auto& ps = rv.posts;
  for (int r = 1; r < rv.size; ++r) {
    if (!SameDType(ps[r].dtype, ps[0].dtype) || ps[r].send_bytes != ps[0].send_bytes) {
      return Mismatch(rv, r, "sends", ps[r].send_desc, ps[0].send_desc);
    }
  }
  return std::string();
}

std::string ReceivesAgree(const Rendezvous& rv) {
  const auto& ps = rv.posts;
  for (int r = 1; r < rv.size; ++r) {
    if (!SameDType(ps[r].dtype, ps[0].dtype) || ps[r].recv_bytes != ps[0].recv_bytes) {
      return Mismatch(rv, r, "receives into", ps[r].recv_desc, ps[0].recv_desc);
    }
  }
  return std::string();
}

void AllReduce(Tensor send, int kind, bool in_group, Tensor recv) {
  const char* fn = "runtime.disco.cpu.allreduce";
  WorkerContext& ctx = Ctx(fn);
  Participants p = Locate(ctx.worker, in_group);
  Post mine = MakePost("allreduce", send, recv);
  mine.kind = kind;
  std::string why;
  ReduceFn reduce = FindReduce(send.dtype(), kind, &why);
  if (mine.error.empty() && mine.send_bytes != mine.recv_bytes) {
    mine.error = "recv " + mine.recv_desc + " must have as many elements as send " + mine.send_desc;
  }
  if (mine.error.empty() && reduce == nullptr) mine.error = why;
  const auto& posts =
      ctx.comm->Exchange(p, ctx.worker->worker_id, std::move(mine), [](const Rendezvous& rv) {
        const auto& ps = rv.posts;
        for (int r = 1; r < rv.size; ++r) {
          if (ps[r].kind != ps[0].kind) {
            return Mismatch(rv, r, "reduces with", ReduceKindName(ps[r].kind),
                            ReduceKindName(ps[0].kind));
          }
        }
        return SendsAgree(rv);
      });
  int64_t numel = NumElements(send);
  int64_t lo = numel * p.rank / p.size;
  int64_t hi = numel * (p.rank + 1) / p.size;
  std::vector<const void*> sends(p.size);
  std::vector<void*> recvs(p.size);
  for (int r = 0; r < p.size; ++r) {
    sends[r] = posts[r].send;
    recvs[r] = posts[r].recv;
  }
  reduce(sends.data(), recvs.data(), p.size, lo, hi);
  ctx.comm->Finish(p, ctx.worker->worker_id, "allreduce");
}

void AllGather(Tensor send, bool in_group, Tensor recv) {
  const char* fn = "runtime.disco.cpu.allgather";
  WorkerContext& ctx = Ctx(fn);
  Participants p = Locate(ctx.worker, in_group);
  Post mine = MakePost("allgather", send, recv);
  if (mine.error.empty() && mine.recv_bytes != mine.send_bytes * p.size) {
    mine.error = "recv " + mine.recv_desc + " must hold " + std::to_string(p.size) +
                 " times the elements of send " + mine.send_desc;
  }
  const auto& posts =
      ctx.comm->Exchange(p, ctx.worker->worker_id, std::move(mine), SendsAgree);
  int64_t nbytes = posts[p.rank].send_bytes;
  const char* src = static_cast<const char*>(posts[p.rank].send);
  for (int r = 0; r < p.size; ++r) {
    char* dst = static_cast<char*>(posts[r].recv) + nbytes * p.rank;
    if (dst != src) std::memmove(dst, src, nbytes);
  }
  ctx.comm->Finish(p, ctx.worker->worker_id, "allgather");
}

void BroadcastFromWorker0(Optional<Tensor> send, bool in_group, Tensor recv) {
  const char* fn = "runtime.disco.cpu.broadcast_from_worker0";
  WorkerContext& ctx = Ctx(fn);
  Participants p = Locate(ctx.worker, in_group);
  bool root = p.rank == 0;
  Post mine = MakePost("broadcast_from_worker0", root ? send : Optional<Tensor>(), recv);
  if (mine.error.empty() && root && !send.has_value()) {
    mine.error = "the root worker must provide `send`";
  } else if (mine.error.empty() && root && mine.send_bytes != mine.recv_bytes) {
    mine.error = "send " + mine.send_desc + " and recv " + mine.recv_desc + " differ in size";
  }
  const auto& posts =
      ctx.comm->Exchange(p, ctx.worker->worker_id, std::move(mine), ReceivesAgree);
  const void* src = posts[0].send;
  void* dst = posts[p.rank].recv;
  if (dst != src) std::memmove(dst, src, posts[p.rank].recv_bytes);
  ctx.comm->Finish(p, ctx.worker->worker_id, "broadcast_from_worker0");
}

void ScatterFromWorker0(Optional<Tensor> send, bool in_group, Tensor recv) {
  const char* fn = "runtime.disco.cpu.scatter_from_worker0";
  WorkerContext& ctx = Ctx(fn);
  Participants p = Locate(ctx.worker, in_group);
  bool root = p.rank == 0;
  // Non-root workers may pass a `send` (the lowered code does); it is ignored, as with NCCL.
  Post mine = MakePost("scatter_from_worker0", root ? send : Optional<Tensor>(), recv);
  if (mine.error.empty() && root && !send.has_value()) {
    mine.error = "the root worker must provide `send`";
  } else if (mine.error.empty() && root && mine.send_bytes != mine.recv_bytes * p.size) {
    mine.error = "send " + mine.send_desc + " must hold " + std::to_string(p.size) +
                 " times the elements of recv " + mine.recv_desc +
                 " (scattering splits evenly over the workers)";
  }
  const auto& posts =
      ctx.comm->Exchange(p, ctx.worker->worker_id, std::move(mine), ReceivesAgree);
  int64_t nbytes = posts[p.rank].recv_bytes;
  std::memcpy(posts[p.rank].recv, static_cast<const char*>(posts[0].send) + nbytes * p.rank,
              nbytes);
  ctx.comm->Finish(p, ctx.worker->worker_id, "scatter_from_worker0");
}

void GatherToWorker0(Tensor send, bool in_group, Optional<Tensor> recv) {
  const char* fn = "runtime.disco.cpu.gather_to_worker0";
  WorkerContext& ctx = Ctx(fn);
  Participants p = Locate(ctx.worker, in_group);
  bool root = p.rank == 0;
  Post mine = MakePost("gather_to_worker0", send, root ? recv : Optional<Tensor>());
  if (mine.error.empty() && root && !recv.has_value()) {
    mine.error = "the root worker must provide `recv`";
  } else if (mine.error.empty() && root && mine.recv_bytes != mine.send_bytes * p.size) {
    mine.error = "recv " + mine.recv_desc + " must hold " + std::to_string(p.size) +
                 " times the elements of send " + mine.send_desc;
  }
  const auto& posts =
      ctx.comm->Exchange(p, ctx.worker->worker_id, std::move(mine), SendsAgree);
  int64_t nbytes = posts[p.rank].send_bytes;
  char* dst = static_cast<char*>(posts[0].recv) + nbytes * p.rank;
  if (dst != posts[p.rank].send) std::memmove(dst, posts[p.rank].send, nbytes);
  ctx.comm->Finish(p, ctx.worker->worker_id, "gather_to_worker0");
}

void CheckPeer(const WorkerContext& ctx, int peer, const char* fn, const char* role) {
  int n = ctx.worker->num_workers;
  if (peer < 0 || peer >= n) {
    TVM_FFI_THROW(ValueError) << fn << ": worker " << ctx.worker->worker_id << " names " << role
                              << " " << peer << ", but the session has workers 0.." << n - 1;
  }
  if (peer == ctx.worker->worker_id) {
    TVM_FFI_THROW(ValueError) << fn << ": worker " << peer << " cannot be its own " << role;
  }
}

void SendTo(Tensor buffer, int receiver, const char* fn) {
  WorkerContext& ctx = Ctx(fn);
  CheckPeer(ctx, receiver, fn, "receiver");
  std::string bad = CheckBuffer(buffer, "buffer");
  if (!bad.empty()) TVM_FFI_THROW(ValueError) << fn << ": " << bad;
  ctx.comm->Send(ctx.worker->worker_id, receiver, DataPtr(buffer), NumBytes(buffer),
                 Describe(buffer));
}

void RecvFrom(Tensor buffer, int sender, const char* fn) {
  WorkerContext& ctx = Ctx(fn);
  CheckPeer(ctx, sender, fn, "sender");
  std::string bad = CheckBuffer(buffer, "buffer");
  if (!bad.empty()) TVM_FFI_THROW(ValueError) << fn << ": " << bad;
  ctx.comm->Recv(sender, ctx.worker->worker_id, DataPtr(buffer), NumBytes(buffer),
                 Describe(buffer), fn);
}

int GroupSize(const WorkerContext& ctx) {
  return ctx.worker->num_workers / std::max(1, ctx.worker->num_groups);
}

// ---------------------------------------------------------------------------------------------
// Set-up
// ---------------------------------------------------------------------------------------------

void InitCCL(Session sess, Shape device_ids) {
  std::string type = sess->GetTypeKey();
  if (type != "runtime.disco.ThreadedSession") {
    TVM_FFI_THROW(ValueError)
        << "the \"cpu\" collective backend connects the worker threads of one process, but this "
        << "session is a " << type
        << ": create a ThreadedSession (tvm_ext.runtime.distributed.Session does)";
  }
  int64_t n = sess->GetNumWorkers();
  if (static_cast<int64_t>(device_ids.size()) != n) {
    TVM_FFI_THROW(ValueError) << "init_ccl(\"cpu\"): " << device_ids.size()
                              << " device ids for " << n << " workers; give one per worker";
  }
  for (int64_t id : device_ids) {
    if (id < 0) TVM_FFI_THROW(ValueError) << "init_ccl(\"cpu\"): negative device id " << id;
  }
  auto comm = std::make_shared<CpuCommunicator>(static_cast<int>(n), DefaultTimeout().load());
  int64_t comm_id = PendingCommunicators::Global()->Add(comm);
  DRef func = sess->GetGlobalFunc("runtime.disco.cpu.init_ccl_per_worker");
  sess->CallPacked(func, comm_id, device_ids);
}

void InitCCLPerWorker(int64_t comm_id, Shape device_ids) {
  DiscoWorker* worker = CurrentWorker("runtime.disco.cpu.init_ccl_per_worker");
  std::shared_ptr<CpuCommunicator> comm = PendingCommunicators::Global()->Take(comm_id);
  if (comm == nullptr) {
    TVM_FFI_THROW(ValueError) << "init_ccl(\"cpu\"): communicator " << comm_id
                              << " is unknown on worker " << worker->worker_id
                              << "; the cpu backend works only with workers that are threads of "
                                 "the controller's process (ThreadedSession)";
  }
  if (comm->num_workers() != worker->num_workers) {
    TVM_FFI_THROW(ValueError) << "init_ccl(\"cpu\"): the communicator has "
                              << comm->num_workers() << " workers, the session "
                              << worker->num_workers;
  }
  comm->JoinGroups(worker->num_groups);
  int index = worker->local_worker_id;
  if (index < 0 || index >= static_cast<int>(device_ids.size())) {
    TVM_FFI_THROW(ValueError) << "init_ccl(\"cpu\"): no device id for worker " << index;
  }
  worker->ccl = kCclName;
  worker->default_device = DLDevice{kDLCPU, static_cast<int32_t>(device_ids[index])};
  WorkerContext& ctx = ThisWorker();
  ctx.worker = worker;
  ctx.comm = std::move(comm);  // a re-initialisation replaces (and releases) the old one
}

}  // namespace

void AbortCpuCommunicatorOfThisWorker(const std::string& reason) {
  WorkerContext& ctx = ThisWorker();
  if (ctx.comm) ctx.comm->Abort(reason);
}

void CpuWorldExchange(const char* op, WorldPost mine,
                      const std::function<void(const std::vector<WorldPost>&)>& work) {
  WorkerContext& ctx = Ctx(op);
  Participants p = Locate(ctx.worker, /*in_group=*/false);
  Post post;
  post.op = op;
  post.send = mine.send;
  post.recv = mine.recv;
  post.send_desc = mine.signature;
  post.error = mine.error;
  const auto& posts =
      ctx.comm->Exchange(p, ctx.worker->worker_id, std::move(post), [](const Rendezvous& rv) {
        const auto& ps = rv.posts;
        for (int r = 1; r < rv.size; ++r) {
          if (ps[r].send_desc != ps[0].send_desc) {
            return Mismatch(rv, r, "calls", ps[r].send_desc, ps[0].send_desc);
          }
        }
        return std::string();
      });
  std::vector<WorldPost> all(posts.size());
  for (size_t r = 0; r < posts.size(); ++r) {
    all[r].send = posts[r].send;
    all[r].recv = posts[r].recv;
    all[r].signature = posts[r].send_desc;
  }
  work(all);
  ctx.comm->Finish(p, ctx.worker->worker_id, op);
}

bool IsAbortEcho(const std::string& message) {
  return message.rfind(kAbortPrefix, 0) == 0;
}

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("runtime.disco.cpu.init_ccl", InitCCL)
      .def("runtime.disco.cpu.init_ccl_per_worker", InitCCLPerWorker)
      .def("runtime.disco.cpu.allreduce", AllReduce)
      .def("runtime.disco.cpu.allgather", AllGather)
      .def("runtime.disco.cpu.broadcast_from_worker0", BroadcastFromWorker0)
      .def("runtime.disco.cpu.scatter_from_worker0", ScatterFromWorker0)
      .def("runtime.disco.cpu.gather_to_worker0", GatherToWorker0)
      .def("runtime.disco.cpu.recv_from_worker0",
           [](Tensor buffer) {
             const char* fn = "runtime.disco.cpu.recv_from_worker0";
             RecvFrom(buffer, 0, fn);
           })
      .def("runtime.disco.cpu.send_to_next_group",
           [](Tensor buffer) {
             const char* fn = "runtime.disco.cpu.send_to_next_group";
             WorkerContext& ctx = Ctx(fn);
             int receiver = ctx.worker->worker_id + GroupSize(ctx);
             if (receiver >= ctx.worker->num_workers) {
               TVM_FFI_THROW(ValueError) << fn << ": worker " << ctx.worker->worker_id
                                         << " is in the last group; there is no next group";
             }
             SendTo(buffer, receiver, fn);
           })
      .def("runtime.disco.cpu.recv_from_prev_group",
           [](Tensor buffer) {
             const char* fn = "runtime.disco.cpu.recv_from_prev_group";
             WorkerContext& ctx = Ctx(fn);
             int sender = ctx.worker->worker_id - GroupSize(ctx);
             if (sender < 0) {
               TVM_FFI_THROW(ValueError) << fn << ": worker " << ctx.worker->worker_id
                                         << " is in the first group; there is no previous group";
             }
             RecvFrom(buffer, sender, fn);
           })
      .def("runtime.disco.cpu.send_to_worker",
           [](Tensor buffer, int receiver) {
             SendTo(buffer, receiver, "runtime.disco.cpu.send_to_worker");
           })
      .def("runtime.disco.cpu.recv_from_worker",
           [](Tensor buffer, int sender) {
             RecvFrom(buffer, sender, "runtime.disco.cpu.recv_from_worker");
           })
      // Host memory is written synchronously: there is nothing to wait for. (TVM calls this on
      // worker 0 alone, so it must not be a collective.)
      .def("runtime.disco.cpu.sync_worker", []() {})
      .def("tvm_ext.ccl.cpu.set_timeout",
           [](double seconds) {
             if (!(seconds > 0)) {
               TVM_FFI_THROW(ValueError) << "the collective timeout must be positive seconds";
             }
             DefaultTimeout().store(seconds);
           })
      .def("tvm_ext.ccl.cpu.timeout", []() { return DefaultTimeout().load(); });
}

}  // namespace ccl
}  // namespace tvm_ext
