// The Python module flatgrad._census: a counting CPU allocator, the bytes of tensor
// memory a process holds, now and at the peak.
//
// torch keeps allocator statistics for CUDA (torch.cuda.memory_allocated /
// max_memory_allocated) but none for the CPU, and the profiler's memory events
// miss every free made on another thread (gloo frees its reduce_scatter
// scratch tensors on its worker threads). So flatgrad's memory figures on the
// CPU come from this allocator: once installed it wraps torch's CPU allocator,
// and every allocation and free, on any thread, updates two atomics.
// Memory allocated before installation is freed through its original deleter
// and never counted. It is a measuring tool, so it is its own extension and
// not part of flatgrad._C.
//
// Functions (import torch first: this module links against c10):
//   install() -> None                idempotent
//   stats() -> (allocated, peak)     bytes
//   reset_peak() -> None             peak := allocated
//   blocks() -> [(address, nbytes)]  every counted block live now (a diagnostic: one lock, one pass)

#include <Python.h>

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace flatgrad {
namespace {

std::atomic<int64_t> g_allocated{0};
std::atomic<int64_t> g_peak{0};

void note_peak(int64_t now) {
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// Live counted blocks: address -> (the inner allocator's DataPtr, size). A DataPtr
// handed out is "simple" (its context is its address), as code that calls
// raw_allocate / raw_deleter (oneDNN, for one) requires; the map finds the rest.
struct Block {
  c10::DataPtr inner;
  int64_t nbytes;
};
std::mutex g_mutex;
std::unordered_map<void*, Block> g_live;

// The inner allocator's raw deleter: some callers cache the allocator they allocate
// with (possibly torch's own, before installation) but look up the current one's
// raw_deleter() to free; such a block is not ours and goes back where it came from.
c10::DeleterFnPtr g_inner_raw_deleter = nullptr;

void free_counted(void* data) {
  Block block;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_live.find(data);
    if (it == g_live.end()) {
      if (g_inner_raw_deleter != nullptr) {
        g_inner_raw_deleter(data);
      }
      return;
    }
    block = std::move(it->second);
    g_live.erase(it);
  }
  g_allocated.fetch_sub(block.nbytes, std::memory_order_relaxed);
}  // block.inner frees the memory through the inner allocator's own deleter

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr inner = inner_->allocate(nbytes);
    void* data = inner.get();
    if (data == nullptr) {
      return inner;  // nothing allocated (zero bytes): nothing to count
    }
    c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_live.emplace(data, Block{std::move(inner), static_cast<int64_t>(nbytes)});
    }
    const int64_t size = static_cast<int64_t>(nbytes);
    note_peak(g_allocated.fetch_add(size, std::memory_order_relaxed) + size);
    return {data, data, &free_counted, device};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &free_counted;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* inner_;
};

std::once_flag g_installed;

void install() {
  std::call_once(g_installed, [] {
    c10::Allocator* inner = c10::GetCPUAllocator();
    g_inner_raw_deleter = inner->raw_deleter();
    static CountingAllocator allocator(inner);
    // Above the default priority (0), so that it stays in force.
    c10::SetCPUAllocator(&allocator, /*priority=*/1);
  });
}

void reset_peak() {
  g_peak.store(g_allocated.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

PyObject* py_install(PyObject* /*self*/, PyObject* /*args*/) {
  install();
  Py_RETURN_NONE;
}

PyObject* py_stats(PyObject* /*self*/, PyObject* /*args*/) {
  return Py_BuildValue("(LL)", static_cast<long long>(g_allocated.load(std::memory_order_relaxed)),
                       static_cast<long long>(g_peak.load(std::memory_order_relaxed)));
}

PyObject* py_reset_peak(PyObject* /*self*/, PyObject* /*args*/) {
  reset_peak();
  Py_RETURN_NONE;
}

PyObject* py_blocks(PyObject* /*self*/, PyObject* /*args*/) {
  std::vector<std::pair<uintptr_t, int64_t>> found;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    found.reserve(g_live.size());
    for (const auto& [address, block] : g_live) {
      found.emplace_back(reinterpret_cast<uintptr_t>(address), block.nbytes);
    }
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(found.size()));
  if (list == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < found.size(); ++i) {
    PyObject* item = Py_BuildValue("(KL)", static_cast<unsigned long long>(found[i].first),
                                   static_cast<long long>(found[i].second));
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

PyMethodDef methods[] = {
    {"install", py_install, METH_NOARGS, "install() -> None: count every CPU allocation from now on (idempotent)"},
    {"stats", py_stats, METH_NOARGS, "stats() -> (allocated, peak): bytes live now and at the peak"},
    {"reset_peak", py_reset_peak, METH_NOARGS, "reset_peak() -> None: the peak starts again from what is live"},
    {"blocks", py_blocks, METH_NOARGS, "blocks() -> [(address, nbytes)]: every counted block live now"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace
}  // namespace flatgrad

extern "C" PyMODINIT_FUNC PyInit__census(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_census",
                                      "flatgrad's counting CPU allocator (flatgrad.testing.census)", -1,
                                      flatgrad::methods};
  return PyModule_Create(&module);
}
