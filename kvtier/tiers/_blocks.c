/*
 * kvtier.tiers._blocks: the per-block work of kvtier.tiers.block_format in C (the
 * file tier's slots, the cluster tier's values): XXH3 of payloads, and a block
 * header sealed or checked in one call.
 *
 * Why C: at 64 KiB a block, the Python of one header (struct packing, a
 * padding copy, two XXH3 calls through the xxhash module, the field checks)
 * cost more CPU than the kernel's whole read of the block. Here a header is a
 * few stores and one XXH3 of 72 bytes, and payloads are hashed with the GIL
 * released (the event loop runs meanwhile). The bytes written are exactly
 * those of kvtier/tiers/block_format.py (format version 1), which keeps the pure
 * Python equivalents used when this module is not built.
 *
 * XXH3 comes from the vendored single-header xxHash 0.8.3 (kvtier/third_party/xxhash/, BSD-2),
 * the same algorithm as the xxhash Python package's xxh3_64_intdigest.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "../third_party/xxhash/xxhash.h"

#ifdef KVTIER_XXH_DISPATCH
/* x86-64: third_party/xxhash/xxh_x86dispatch.c, built beside this file, picks the SSE2,
   AVX2 or AVX-512 loop at run time (the default x86-64 target allows SSE2
   only: AVX2 hashes payloads about 1.5 times as fast here). */
XXH64_hash_t XXH3_64bits_dispatch(XXH_NOESCAPE const void *input, size_t len);
#define payload_xxh3 XXH3_64bits_dispatch
#else
#define payload_xxh3 XXH3_64bits
#endif

#define HEADER_BYTES 4096
#define CHECKED 72 /* bytes covered by the header checksum */
#define KEY_BYTES 16
#define FORMAT_VERSION 1
#define CHECKSUM_XXH3_64 1
/* Below this, releasing and taking back the GIL costs more than it lets run. */
#define RELEASE_GIL_BYTES (256 * 1024)

static const unsigned char MAGIC[8] = {'K', 'V', 'T', 'B', 'L', 'K', 0, 1};

/* verify() outcomes; the same numbers as kvtier.tiers.block_format.VERIFY_*. */
enum { V_OK = 0, V_HEADER = 1, V_NAMESPACE = 2, V_KEY = 3, V_SIZE = 4, V_CHECKSUM = 5, V_TRANSFER = 6 };

static void put16(unsigned char *p, uint16_t v) { p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8); }
static void put32(unsigned char *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i)); }
static void put64(unsigned char *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i)); }
static uint16_t get16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t get32(const unsigned char *p) { uint32_t v = 0; for (int i = 3; i >= 0; i--) v = (v << 8) | p[i]; return v; }
static uint64_t get64(const unsigned char *p) { uint64_t v = 0; for (int i = 7; i >= 0; i--) v = (v << 8) | p[i]; return v; }

static uint64_t
hash_buffer(const void *buf, Py_ssize_t len)
{
    uint64_t h;
    if (len >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        h = payload_xxh3(buf, (size_t)len);
        Py_END_ALLOW_THREADS
    } else {
        h = payload_xxh3(buf, (size_t)len);
    }
    return h;
}

/* A 16-byte bytes object's data, or NULL with ValueError / TypeError set. */
static const unsigned char *
key_bytes(PyObject *obj, const char *what)
{
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be bytes", what);
        return NULL;
    }
    if (PyBytes_GET_SIZE(obj) != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "%s must be %d bytes, got %zd", what, KEY_BYTES,
                     PyBytes_GET_SIZE(obj));
        return NULL;
    }
    return (const unsigned char *)PyBytes_AS_STRING(obj);
}

/* checksum(buffer) -> int: XXH3-64 of a contiguous buffer. */
static PyObject *
checksum(PyObject *Py_UNUSED(module), PyObject *obj)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t h = hash_buffer(view.buf, view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

/* checksums(buffers) -> list[int]: XXH3-64 of each, the GIL released once for all. */
static PyObject *
checksums(PyObject *Py_UNUSED(module), PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "checksums() takes a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    uint64_t *sums = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    PyObject *out = NULL;
    Py_ssize_t got = 0;
    if (views == NULL || sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++)
        if (PyObject_GetBuffer(items[got], &views[got], PyBUF_SIMPLE) < 0)
            goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        sums[i] = payload_xxh3(views[i].buf, (size_t)views[i].len);
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(sums);
    Py_DECREF(seq);
    return out;
}

/* seal(page, key, namespace, payload_bytes, payload_checksum, stored_at, version=1):
   write a whole header (fields, header checksum, zero padding) into page[:4096]. */
static PyObject *
seal(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "seal() takes 6 or 7 arguments");
        return NULL;
    }
    const unsigned char *key = key_bytes(args[1], "key");
    const unsigned char *ns = key ? key_bytes(args[2], "namespace") : NULL;
    if (ns == NULL)
        return NULL;
    unsigned long long payload_bytes = PyLong_AsUnsignedLongLong(args[3]);
    if (payload_bytes == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    unsigned long long pcheck = PyLong_AsUnsignedLongLong(args[4]);
    if (pcheck == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    /* Like the Python encoder: the time is kept modulo 2**32. */
    unsigned long long stored_at = PyLong_AsUnsignedLongLongMask(args[5]);
    if (stored_at == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    long version = FORMAT_VERSION;
    if (nargs == 7) {
        version = PyLong_AsLong(args[6]);
        if (version == -1 && PyErr_Occurred())
            return NULL;
        if (version < 0 || version > 0xFFFF) {
            PyErr_Format(PyExc_ValueError, "version %ld does not fit 16 bits", version);
            return NULL;
        }
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (view.len < HEADER_BYTES) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "a header needs %d bytes, the buffer has %zd",
                     HEADER_BYTES, view.len);
        return NULL;
    }
    unsigned char *p = view.buf;
    memcpy(p, MAGIC, 8);
    put16(p + 8, (uint16_t)version);
    put16(p + 10, HEADER_BYTES);
    put32(p + 12, 0);
    put64(p + 16, payload_bytes);
    memcpy(p + 24, key, KEY_BYTES);
    memcpy(p + 40, ns, KEY_BYTES);
    put32(p + 56, CHECKSUM_XXH3_64);
    put32(p + 60, (uint32_t)(stored_at & 0xFFFFFFFFu));
    put64(p + 64, pcheck);
    put64(p + CHECKED, XXH3_64bits(p, CHECKED));
    memset(p + CHECKED + 8, 0, HEADER_BYTES - CHECKED - 8);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* The checks of _format.decode_header_fields and of the pipeline, in its order. */
static int
check(const unsigned char *h, const unsigned char *key, const unsigned char *ns,
      const void *payload, Py_ssize_t payload_len)
{
    if (memcmp(h, MAGIC, 8) != 0 || get16(h + 8) != FORMAT_VERSION)
        return V_HEADER;
    if (get64(h + CHECKED) != XXH3_64bits(h, CHECKED))
        return V_HEADER;
    if (get16(h + 10) != HEADER_BYTES || get32(h + 56) != CHECKSUM_XXH3_64)
        return V_HEADER;
    if (memcmp(h + 40, ns, KEY_BYTES) != 0)
        return V_NAMESPACE;
    if (memcmp(h + 24, key, KEY_BYTES) != 0)
        return V_KEY;
    if (get64(h + 16) != (uint64_t)payload_len)
        return V_SIZE;
    if (get64(h + 64) != hash_buffer(payload, payload_len))
        return V_CHECKSUM;
    return V_OK;
}

/* verify(page, key, namespace, payload) -> int: 0 when the header is valid, names
   this key and namespace and the payload's length, and the payload's XXH3 matches;
   otherwise the first check that failed (VERIFY_* in _format.py). */
static PyObject *
verify(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "verify() takes 4 arguments");
        return NULL;
    }
    const unsigned char *key = key_bytes(args[1], "key");
    const unsigned char *ns = key ? key_bytes(args[2], "namespace") : NULL;
    if (ns == NULL)
        return NULL;
    Py_buffer page, payload;
    if (PyObject_GetBuffer(args[0], &page, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[3], &payload, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&page);
        return NULL;
    }
    int code = page.len < HEADER_BYTES
                   ? V_HEADER
                   : check(page.buf, key, ns, payload.buf, payload.len);
    PyBuffer_Release(&payload);
    PyBuffer_Release(&page);
    return PyLong_FromLong(code);
}

/* seal_many(pages, keys, namespace, payload_bytes, checksums, stored_at): seal() of
   pages[i] with keys[i] and checksums[i], one call for a run of blocks stored. */
static PyObject *
seal_many(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "seal_many(list, list, bytes, int, list, int)");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    if (PyList_GET_SIZE(args[1]) != n || PyList_GET_SIZE(args[4]) != n) {
        PyErr_SetString(PyExc_ValueError, "seal_many: one key and checksum per page");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *call[6] = {PyList_GET_ITEM(args[0], i), PyList_GET_ITEM(args[1], i), args[2],
                             args[3], PyList_GET_ITEM(args[4], i), args[5]};
        PyObject *r = seal(NULL, call, 6);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

/* verify_reaped(pages, keys, namespace, payloads, done, expected) -> list[tuple[int, int]]:
   for each (i, nbytes, error) an I/O engine reported for block i's read, V_TRANSFER
   when the read failed or moved other than `expected` bytes, else verify() of
   block i (payloads of 256 KiB or more hashed without the GIL); the (i, outcome)
   of the blocks that failed, none when all are sound. The reaped outcomes go in
   as the engine gave them, so a run whose reads all came back whole costs the
   pipeline no Python per block. */
static PyObject *
verify_reaped(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyList_Check(args[0]) || !PyList_Check(args[1]) ||
        !PyList_Check(args[3]) || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "verify_reaped(list, list, bytes, list, list, int)");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    if (PyList_GET_SIZE(args[1]) != n || PyList_GET_SIZE(args[3]) != n) {
        PyErr_SetString(PyExc_ValueError, "verify_reaped: one key and payload per page");
        return NULL;
    }
    Py_ssize_t expected = PyLong_AsSsize_t(args[5]);
    if (expected == -1 && PyErr_Occurred())
        return NULL;
    PyObject *done = args[4];
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t w = 0; w < PyList_GET_SIZE(done); w++) {
        PyObject *item = PyList_GET_ITEM(done, w);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_SetString(PyExc_TypeError, "verify_reaped: each outcome is (index, bytes, error)");
            goto fail;
        }
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 0));
        if (i == -1 && PyErr_Occurred())
            goto fail;
        if (i < 0 || i >= n) {
            PyErr_SetString(PyExc_IndexError, "verify_reaped: block index out of range");
            goto fail;
        }
        Py_ssize_t moved = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 1));
        if (moved == -1 && PyErr_Occurred())
            goto fail;
        long code;
        if (PyTuple_GET_ITEM(item, 2) != Py_None || moved != expected) {
            code = V_TRANSFER;
        } else {
            PyObject *call[4] = {PyList_GET_ITEM(args[0], i), PyList_GET_ITEM(args[1], i),
                                 args[2], PyList_GET_ITEM(args[3], i)};
            PyObject *r = verify(NULL, call, 4);
            if (r == NULL)
                goto fail;
            code = PyLong_AsLong(r);
            Py_DECREF(r);
        }
        if (code != V_OK) {
            PyObject *bad = Py_BuildValue("(nl)", i, code);
            if (bad == NULL || PyList_Append(out, bad) < 0) {
                Py_XDECREF(bad);
                goto fail;
            }
            Py_DECREF(bad);
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"checksum", checksum, METH_O, "checksum(buffer) -> int: XXH3-64 of a contiguous buffer."},
    {"checksums", checksums, METH_O,
     "checksums(buffers) -> list[int]: XXH3-64 of each buffer, without the GIL."},
    {"seal", (PyCFunction)(void (*)(void))seal, METH_FASTCALL,
     "seal(page, key, namespace, payload_bytes, payload_checksum, stored_at, version=1): "
     "write a block header into page[:4096]."},
    {"verify", (PyCFunction)(void (*)(void))verify, METH_FASTCALL,
     "verify(page, key, namespace, payload) -> int: 0 for a valid block, else the failed check."},
    {"seal_many", (PyCFunction)(void (*)(void))seal_many, METH_FASTCALL,
     "seal_many(pages, keys, namespace, payload_bytes, checksums, stored_at): seal() of each page."},
    {"verify_reaped", (PyCFunction)(void (*)(void))verify_reaped, METH_FASTCALL,
     "verify_reaped(pages, keys, namespace, payloads, done, expected) -> [(index, outcome)] "
     "of the failures."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier.tiers._blocks",
    .m_doc = "Block headers and payload checksums of the file tier (see kvtier.tiers.block_format).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__blocks(void)
{
    return PyModule_Create(&module_def);
}
