/*
 * kvtier.transfer._address: the start address of a buffer, for io_uring's iovecs
 * and the O_DIRECT alignment checks.
 *
 * Why C: every block stored or loaded through the file tier needs the
 * addresses of its header page and its row, four to five times over. Through
 * ctypes (c_char.from_buffer) one costs about 0.9 us, through NumPy for a
 * read-only buffer about 3.9 us; here it is one buffer export and release.
 * kvtier.transfer.io_engine.buffer_address falls back to ctypes / NumPy when
 * this module is not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* address(buffer) -> int: the address of the first byte of a C-contiguous buffer. */
static PyObject *
address(PyObject *Py_UNUSED(module), PyObject *obj)
{
    Py_buffer view;
    /* PyBUF_SIMPLE: no writability asked (read-only exports are fine), and an
       exporter that cannot give one contiguous block refuses with BufferError. */
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"address", address, METH_O,
     "address(buffer) -> int: start address of a C-contiguous buffer (read-only ones included)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier.transfer._address",
    .m_doc = "Buffer addresses without ctypes (see kvtier.transfer.io_engine.buffer_address).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__address(void)
{
    return PyModule_Create(&module_def);
}
