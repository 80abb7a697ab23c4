// Linked into every plugin's <package>._C so that `import <package>._C` loads the shared library,
// whose static TORCH_LIBRARY blocks register the ops. The module itself exposes nothing.
// torch's build defines TORCH_EXTENSION_NAME as the last part of the extension's name (manifest.EXTENSION_MODULE),
// so the module's name is written in one place only.
#include <Python.h>

#define PK_JOIN_(a, b) a##b
#define PK_JOIN(a, b) PK_JOIN_(a, b)
#define PK_STRING_(x) #x
#define PK_STRING(x) PK_STRING_(x)

extern "C" PyMODINIT_FUNC PK_JOIN(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, PK_STRING(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
