// Python's bindings of cpu_kernels.cpp's functions (what each does: there), apart from the
// kernels so that the two compile side by side. pybind11 and torch's tensor casters only:
// torch/extension.h (torch's whole C++ API) made this file a 31 s compile, now 9 s. Each call
// wrapped as load_inline wrapped it: a C++ error (TORCH_CHECK) raised as a RuntimeError.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

at::Tensor decode_attention(at::Tensor q, at::Tensor keys, at::Tensor values, at::Tensor visible,
                            double scale, c10::optional<at::Tensor> prefix_keys,
                            c10::optional<at::Tensor> prefix_values,
                            c10::optional<at::Tensor> prefix_lens);
at::Tensor rope_attend(at::Tensor mixed, at::Tensor cos, at::Tensor sin, at::Tensor keys,
                       at::Tensor values, at::Tensor slots, at::Tensor visible, int64_t heads,
                       double scale, c10::optional<at::Tensor> prefix_keys,
                       c10::optional<at::Tensor> prefix_values,
                       c10::optional<at::Tensor> prefix_lens);
std::vector<at::Tensor> add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta,
                                     at::Tensor weight, double eps);
at::Tensor row_argmax(at::Tensor x);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor screened_argmax(at::Tensor hidden, at::Tensor screen, at::Tensor weight,
                           at::Tensor norms, double coeff, double rel);
at::Tensor rows_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                       int64_t N);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", torch::wrap_pybind_function(decode_attention));
  m.def("rope_attend", torch::wrap_pybind_function(rope_attend));
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm));
  m.def("row_argmax", torch::wrap_pybind_function(row_argmax));
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul));
  m.def("screened_argmax", torch::wrap_pybind_function(screened_argmax));
  m.def("rows_linear", torch::wrap_pybind_function(rows_linear));
}
