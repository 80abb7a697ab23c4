// Linked into every plugin's <package>._C so that `import <package>._C` loads the shared library,
// whose static TORCH_LIBRARY blocks register the ops. The module itself exposes nothing.
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
