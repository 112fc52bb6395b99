// The Python module flatgrad._C. Loading it registers the ops (csrc/flatgrad.cpp
// declares them; the CPU and CUDA kernels implement them). It also holds the
// plans' per-call check, refresh_table (see [Note: plans] in
// docs/design.md): one C loop over a Python list of tensors, so that
// a plan's call costs no per-tensor Python work.

#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <string>

#include "flatgrad/runs.h"

namespace {

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "torch.float32";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kHalf:
      return "torch.float16";
    default:
      return c10::toString(t);
  }
}

// Raises `kind` with "<name>[<index>] <what>" and returns nullptr.
PyObject* fail(PyObject* kind, const char* name, Py_ssize_t index, const std::string& what) {
  PyErr_Format(kind, "%s[%zd] %s", name, index, what.c_str());
  return nullptr;
}

// refresh_table(tensors, name, meta, table, guard, guard_name, allow_none) -> int
//
// Checks every entry of `tensors` (a list or tuple) against the plan's `meta`
// (int64 [T, 2]: numel, dtype code or -1 for "any supported dtype") and the
// device of `guard`: a tensor (or, with allow_none, None), strided,
// contiguous, of that numel, dtype and device, not overlapping `guard`'s
// memory. Writes each entry's (address, dtype code) row into `table` (int64
// [T, 2], CPU; None is (0, -1)) and returns how many rows changed. Raises
// TypeError / ValueError naming `name[i]`.
PyObject* refresh_table(PyObject* /*self*/, PyObject* args) {
  PyObject* tensors = nullptr;
  const char* name = nullptr;
  PyObject* meta_obj = nullptr;
  PyObject* table_obj = nullptr;
  PyObject* guard_obj = nullptr;
  const char* guard_name = nullptr;
  int allow_none = 0;
  if (!PyArg_ParseTuple(args, "OsOOOsp", &tensors, &name, &meta_obj, &table_obj, &guard_obj, &guard_name,
                        &allow_none)) {
    return nullptr;
  }
  if (!THPVariable_Check(meta_obj) || !THPVariable_Check(table_obj) || !THPVariable_Check(guard_obj)) {
    PyErr_SetString(PyExc_TypeError, "refresh_table: meta, table and guard must be tensors");
    return nullptr;
  }
  if (!PyList_Check(tensors) && !PyTuple_Check(tensors)) {
    PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of tensors, got %s", name, Py_TYPE(tensors)->tp_name);
    return nullptr;
  }
  const at::Tensor& meta = THPVariable_Unpack(meta_obj);
  const at::Tensor& table = THPVariable_Unpack(table_obj);
  const at::Tensor& guard = THPVariable_Unpack(guard_obj);
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(tensors);
  const int64_t expected = meta.size(0);
  if (count != expected) {
    PyErr_Format(PyExc_ValueError, "got %zd %s, the plan has %lld", count, name, static_cast<long long>(expected));
    return nullptr;
  }
  const int64_t* want = meta.const_data_ptr<int64_t>();
  int64_t* rows = table.data_ptr<int64_t>();
  const at::Device device = guard.device();
  const auto guard_begin = reinterpret_cast<uintptr_t>(guard.const_data_ptr());
  const uintptr_t guard_end = guard_begin + static_cast<uintptr_t>(guard.numel() * guard.element_size());
  PyObject** items = PySequence_Fast_ITEMS(tensors);
  int64_t changed = 0;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = items[i];
    int64_t address = 0;
    int64_t code = flatgrad::kCodeNone;
    if (item == Py_None) {
      if (!allow_none) {
        return fail(PyExc_TypeError, name, i, "is None; only pack takes None (a missing tensor packs as zeros)");
      }
    } else {
      if (!THPVariable_Check(item)) {
        return fail(PyExc_TypeError, name, i, std::string("must be a torch.Tensor or None, got ") +
                                                  Py_TYPE(item)->tp_name);
      }
      const at::Tensor& t = THPVariable_Unpack(item);
      const int64_t numel = want[2 * i];
      const int64_t dtype = want[2 * i + 1];
      if (t.layout() != at::kStrided) {
        return fail(PyExc_ValueError, name, i, "must be a dense (strided) tensor");
      }
      if (t.device() != device) {
        return fail(PyExc_ValueError, name, i, "is on " + t.device().str() + ", the plan's device is " + device.str());
      }
      code = flatgrad::dtype_code(t.scalar_type());
      if (code == flatgrad::kCodeNone || (dtype != flatgrad::kCodeNone && code != dtype)) {
        return fail(PyExc_ValueError, name, i,
                    std::string("has dtype ") + dtype_name(t.scalar_type()) +
                        (dtype == flatgrad::kCodeNone
                             ? std::string("; supported: torch.float32, torch.bfloat16, torch.float16")
                             : std::string(", the plan was made for ") + dtype_name(flatgrad::code_dtype(dtype)) +
                                   "; make a new plan for other dtypes"));
      }
      if (t.numel() != numel) {
        return fail(PyExc_ValueError, name, i,
                    "has " + std::to_string(t.numel()) + " elements, the layout expects " + std::to_string(numel) +
                        " (was it resized?)");
      }
      if (!t.is_contiguous()) {
        return fail(PyExc_ValueError, name, i, "is not contiguous; pass it .contiguous()");
      }
      if (numel > 0) {
        address = reinterpret_cast<int64_t>(t.const_data_ptr());
        const auto begin = static_cast<uintptr_t>(address);
        const uintptr_t end = begin + static_cast<uintptr_t>(numel * t.element_size());
        if (begin < guard_end && guard_begin < end && guard.numel() > 0) {
          return fail(PyExc_ValueError, name, i, std::string("overlaps ") + guard_name + "; it cannot run in place");
        }
      } else {
        code = flatgrad::kCodeNone;  // nothing to read: an empty tensor is a missing one
      }
    }
    int64_t* row = rows + flatgrad::table_col::kWidth * i;
    if (row[flatgrad::table_col::kAddress] != address || row[flatgrad::table_col::kCode] != code) {
      row[flatgrad::table_col::kAddress] = address;
      row[flatgrad::table_col::kCode] = code;
      ++changed;
    }
  }
  return PyLong_FromLongLong(changed);
}

PyMethodDef methods[] = {
    {"refresh_table", refresh_table, METH_VARARGS,
     "refresh_table(tensors, name, meta, table, guard, guard_name, allow_none) -> rows changed"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

// `from flatgrad import _C` loads this library, which registers the ops.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                                      "flatgrad's compiled ops (torch.ops.flatgrad) and the plans' per-call check", -1,
                                      methods};
  return PyModule_Create(&module);
}
