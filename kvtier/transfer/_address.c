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
 *
 * It also holds the io_uring engine's per-request loops (check_rw, prep_rw,
 * reap): a batch of requests is validated, its iovecs and submission entries
 * written, and the completions read, one call each instead of a few
 * microseconds of Python per request (kvtier.transfer._ring keeps Python
 * equivalents for when this module is not built).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

/* A writable contiguous buffer of at least `need` bytes, or NULL with an error set. */
static int
writable(PyObject *obj, Py_buffer *view, Py_ssize_t need, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0)
        return -1;
    if (view->len < need) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, %zd needed", what, view->len, need);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* check_rw(requests, offsets, alignment, writable) -> int: -1 when every request
   (a list of buffers) is at most 1024 contiguous buffers, writable where asked, and
   every address, length and offset a multiple of `alignment` (<= 1: none); else the
   index of the first request that is not, for the caller to name its fault. */
static PyObject *
check_rw(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "check_rw(list, list, int, bool)");
        return NULL;
    }
    PyObject *requests = args[0], *offsets = args[1];
    long alignment = PyLong_AsLong(args[2]);
    if (alignment == -1 && PyErr_Occurred())
        return NULL;
    int flags = PyObject_IsTrue(args[3]) ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    uint64_t mask = alignment > 1 ? (uint64_t)alignment - 1 : 0;
    Py_ssize_t n = PyList_GET_SIZE(requests);
    if (PyList_GET_SIZE(offsets) != n) {
        PyErr_SetString(PyExc_ValueError, "one offset per request");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *req = PyList_GET_ITEM(requests, i);
        long long off = PyLong_AsLongLong(PyList_GET_ITEM(offsets, i));
        if (off == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return PyLong_FromSsize_t(i);
        }
        if (!PyList_Check(req) || PyList_GET_SIZE(req) == 0 || PyList_GET_SIZE(req) > 1024 ||
            off < 0 || ((uint64_t)off & mask))
            return PyLong_FromSsize_t(i);
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(req); j++) {
            Py_buffer v;
            if (PyObject_GetBuffer(PyList_GET_ITEM(req, j), &v, flags) < 0) {
                PyErr_Clear();
                return PyLong_FromSsize_t(i);
            }
            int bad = (((uintptr_t)v.buf | (uint64_t)v.len) & mask) != 0;
            PyBuffer_Release(&v);
            if (bad)
                return PyLong_FromSsize_t(i);
        }
    }
    return PyLong_FromLong(-1);
}

#define SQE_BYTES 64
#define CQE_BYTES 16
#define IOVEC_BYTES 16

/* prep_rw(sqes, mask, tail, opcode, fd, iovecs, stride, requests, offsets, start,
   count, batch) -> int: write the iovecs and submission entries of
   requests[start:start + count] (each a list of at most `stride` buffers, already
   checked by check_rw) at ring positions tail, tail + 1, ...; request i's iovecs go
   to iovecs[i * stride] and its tag is batch << 32 | i. Returns the new tail. The
   buffers stay exported by the caller's objects (the requests list) until reaped. */
static PyObject *
prep_rw(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 12 || !PyList_Check(args[7]) || !PyList_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError, "prep_rw() takes 12 arguments");
        return NULL;
    }
    unsigned long mask = PyLong_AsUnsignedLong(args[1]);
    unsigned long tail = PyLong_AsUnsignedLong(args[2]);
    long opcode = PyLong_AsLong(args[3]);
    long fd = PyLong_AsLong(args[4]);
    Py_ssize_t stride = PyLong_AsSsize_t(args[6]);
    Py_ssize_t start = PyLong_AsSsize_t(args[9]);
    Py_ssize_t count = PyLong_AsSsize_t(args[10]);
    unsigned long long batch = PyLong_AsUnsignedLongLong(args[11]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *requests = args[7], *offsets = args[8];
    Py_ssize_t n = PyList_GET_SIZE(requests);
    if (start < 0 || count < 0 || start + count > n || PyList_GET_SIZE(offsets) != n ||
        stride < 1 || count > (Py_ssize_t)mask + 1) {
        PyErr_SetString(PyExc_ValueError, "prep_rw: requests out of range");
        return NULL;
    }
    Py_buffer sqes, iov;
    if (writable(args[0], &sqes, (Py_ssize_t)(mask + 1) * SQE_BYTES, "sqes") < 0)
        return NULL;
    if (writable(args[5], &iov, n * stride * IOVEC_BYTES, "iovecs") < 0) {
        PyBuffer_Release(&sqes);
        return NULL;
    }
    PyObject *out = NULL;
    for (Py_ssize_t i = start; i < start + count; i++) {
        PyObject *req = PyList_GET_ITEM(requests, i);
        if (!PyList_Check(req) || PyList_GET_SIZE(req) > stride || PyList_GET_SIZE(req) == 0) {
            PyErr_SetString(PyExc_ValueError, "prep_rw: a request is not a list of buffers");
            goto done;
        }
        unsigned long long off = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(offsets, i));
        if (off == (unsigned long long)-1 && PyErr_Occurred())
            goto done;
        unsigned char *vec = (unsigned char *)iov.buf + i * stride * IOVEC_BYTES;
        Py_ssize_t nvec = PyList_GET_SIZE(req);
        for (Py_ssize_t j = 0; j < nvec; j++) {
            Py_buffer v;
            if (PyObject_GetBuffer(PyList_GET_ITEM(req, j), &v, PyBUF_SIMPLE) < 0)
                goto done;
            uint64_t base = (uint64_t)(uintptr_t)v.buf, len = (uint64_t)v.len;
            PyBuffer_Release(&v);
            memcpy(vec + j * IOVEC_BYTES, &base, 8);
            memcpy(vec + j * IOVEC_BYTES + 8, &len, 8);
        }
        /* struct io_uring_sqe: opcode flags ioprio fd off addr len rw_flags user_data. */
        unsigned char *sqe = (unsigned char *)sqes.buf + (tail & mask) * SQE_BYTES;
        memset(sqe, 0, SQE_BYTES);
        sqe[0] = (unsigned char)opcode;
        int32_t fd32 = (int32_t)fd;
        uint64_t addr = (uint64_t)(uintptr_t)vec, tag = ((uint64_t)batch << 32) | (uint64_t)i;
        uint32_t len32 = (uint32_t)nvec;
        memcpy(sqe + 4, &fd32, 4);
        memcpy(sqe + 8, &off, 8);
        memcpy(sqe + 16, &addr, 8);
        memcpy(sqe + 24, &len32, 4);
        memcpy(sqe + 32, &tag, 8);
        tail = (tail + 1) & 0xFFFFFFFFul;
    }
    out = PyLong_FromUnsignedLong(tail);
done:
    PyBuffer_Release(&iov);
    PyBuffer_Release(&sqes);
    return out;
}

/* Close the run being collected: append (batch, outcomes, moved, failed) to out. */
static int
end_run(PyObject *out, unsigned long batch, PyObject **outcomes, long long moved, long failed)
{
    if (*outcomes == NULL)
        return 0;
    PyObject *run = Py_BuildValue("(kOLl)", batch, *outcomes, moved, failed);
    Py_CLEAR(*outcomes);
    if (run == NULL)
        return -1;
    int rc = PyList_Append(out, run);
    Py_DECREF(run);
    return rc;
}

/* reap(cq, head_at, tail_at, mask, cqes_at) -> list[tuple[int, list, int, int]]: every
   completion posted so far, oldest first, released to the kernel, in runs of one
   batch (tag >> 32): (batch, outcomes, moved, failed), where outcomes holds
   (tag & 0xffffffff, result, None) per completion (the shape a submit_many
   callback takes), moved the sum of the results that are not negative and failed
   the count of those that are (-errno, for the caller to turn into errors).
   Consecutive completions of one batch share a run; a batch may have several
   runs in one reap. `cq` is the completion ring's mapping; the other arguments
   are byte offsets into it and the ring's mask. The tail is loaded with acquire
   order, so the entries read after it are the kernel's (on any CPU). */
static PyObject *
reap(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "reap() takes 5 arguments");
        return NULL;
    }
    Py_ssize_t head_at = PyLong_AsSsize_t(args[1]), tail_at = PyLong_AsSsize_t(args[2]);
    unsigned long mask = PyLong_AsUnsignedLong(args[3]);
    Py_ssize_t cqes_at = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer cq;
    if (writable(args[0], &cq, cqes_at + (Py_ssize_t)(mask + 1) * CQE_BYTES, "cq") < 0)
        return NULL;
    if (head_at < 0 || tail_at < 0 || head_at + 4 > cq.len || tail_at + 4 > cq.len || (head_at | tail_at) & 3) {
        PyBuffer_Release(&cq);
        PyErr_SetString(PyExc_ValueError, "reap: offsets out of range");
        return NULL;
    }
    uint32_t *headp = (uint32_t *)((char *)cq.buf + head_at);
    uint32_t *tailp = (uint32_t *)((char *)cq.buf + tail_at);
    PyObject *out = PyList_New(0);
    PyObject *outcomes = NULL;
    unsigned long batch = 0;
    long long moved = 0;
    long failed = 0;
    if (out == NULL)
        goto done;
    uint32_t head = *headp;
    for (;;) {
        uint32_t tail = __atomic_load_n(tailp, __ATOMIC_ACQUIRE);
        if (tail == head)
            break;
        while (head != tail) {
            const unsigned char *cqe = (const unsigned char *)cq.buf + cqes_at + (head & mask) * CQE_BYTES;
            uint64_t tag;
            int32_t res;
            memcpy(&tag, cqe, 8);
            memcpy(&res, cqe + 8, 4);
            unsigned long this_batch = (unsigned long)(tag >> 32);
            if (outcomes == NULL || this_batch != batch) {
                if (end_run(out, batch, &outcomes, moved, failed) < 0 ||
                    (outcomes = PyList_New(0)) == NULL) {
                    Py_CLEAR(out);
                    goto done;
                }
                batch = this_batch;
                moved = 0;
                failed = 0;
            }
            if (res < 0)
                failed++;
            else
                moved += res;
            PyObject *item = Py_BuildValue("(kiO)", (unsigned long)(tag & 0xFFFFFFFFu), (int)res, Py_None);
            if (item == NULL || PyList_Append(outcomes, item) < 0) {
                Py_XDECREF(item);
                Py_CLEAR(out);
                goto done;
            }
            Py_DECREF(item);
            head++;
            __atomic_store_n(headp, head, __ATOMIC_RELEASE);
        }
    }
    if (end_run(out, batch, &outcomes, moved, failed) < 0)
        Py_CLEAR(out);
done:
    Py_XDECREF(outcomes);
    PyBuffer_Release(&cq);
    return out;
}

static PyMethodDef methods[] = {
    {"address", address, METH_O,
     "address(buffer) -> int: start address of a C-contiguous buffer (read-only ones included)."},
    {"check_rw", (PyCFunction)(void (*)(void))check_rw, METH_FASTCALL,
     "check_rw(requests, offsets, alignment, writable) -> int: -1, or the first bad request."},
    {"prep_rw", (PyCFunction)(void (*)(void))prep_rw, METH_FASTCALL,
     "prep_rw(sqes, mask, tail, opcode, fd, iovecs, stride, requests, offsets, start, count, "
     "batch) -> int: write io_uring entries for a run of requests; the new tail."},
    {"reap", (PyCFunction)(void (*)(void))reap, METH_FASTCALL,
     "reap(cq, head_at, tail_at, mask, cqes_at) -> list of (batch, outcomes, moved, failed): "
     "the completions posted, in runs of one batch."},
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
