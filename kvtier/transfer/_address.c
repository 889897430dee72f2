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

/* check_views(views, nbytes, alignment, writable) -> int: -1 when `views` is a
   list of memoryviews, each 1-D unsigned bytes ("B"), C-contiguous, of exactly
   `nbytes` bytes, writable where asked, its address and length multiples of `alignment`
   (<= 1: any); else the index of the first that is not (a view of another
   shape may still be fine once cast: the caller's own checks decide). The file
   tier's calls check every row so, once per call instead of five Python loops
   per row. */
static PyObject *
check_views(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "check_views(list, int, int, bool)");
        return NULL;
    }
    PyObject *views = args[0];
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    long alignment = PyLong_AsLong(args[2]);
    if (alignment == -1 && PyErr_Occurred())
        return NULL;
    int want_writable = PyObject_IsTrue(args[3]);
    if (want_writable < 0)
        return NULL;
    uintptr_t mask = alignment > 1 ? (uintptr_t)alignment - 1 : 0;
    Py_ssize_t n = PyList_GET_SIZE(views);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PyList_GET_ITEM(views, i);
        if (!PyMemoryView_Check(obj))
            return PyLong_FromSsize_t(i);
        /* A released view's buffer is gone: its own checks raise ValueError. */
        if (((PyMemoryViewObject *)obj)->flags & _Py_MEMORYVIEW_RELEASED)
            return PyLong_FromSsize_t(i);
        const Py_buffer *v = PyMemoryView_GET_BUFFER(obj);
        int bytes = v->ndim == 1 && v->itemsize == 1 &&
                    (v->format == NULL || strcmp(v->format, "B") == 0) &&
                    (v->strides == NULL || v->strides[0] == 1);
        if (!bytes || v->len != nbytes || (((uintptr_t)v->buf | (uintptr_t)v->len) & mask) ||
            (want_writable && v->readonly))
            return PyLong_FromSsize_t(i);
    }
    return PyLong_FromLong(-1);
}

#define SQE_BYTES 64
#define CQE_BYTES 16
#define IOVEC_BYTES 16
#define OP_READV 1
#define OP_WRITEV 2
#define OP_READ_FIXED 4
#define OP_WRITE_FIXED 5
/* A tag's low word: bit 31 marks one part of a request sent as two fixed-buffer
   entries, bit 30 which part; the index is below. */
#define TAG_SPLIT 0x80000000u
#define TAG_PART 0x40000000u
#define TAG_INDEX 0x3FFFFFFFu
/* A split request's record in its batch's accumulator: the first part's length,
   each part's result, and how many parts are still out. */
#define ACC_BYTES 32
/* A two-buffer request is split only when its second buffer (the row) has at
   least this many bytes: below, the second entry costs the kernel more than
   pinning the pages saves (run 12: 64 KiB blocks read 25% slower, at 40% more
   CPU per GB, split than vectored; 2 and 8 MiB ones 4-13% cheaper). */
#define SPLIT_MIN (1u << 20)

/* The registered buffer holding [addr, addr + len) whole, from `table` (sorted
   (start, end, index) triples of uint64); -1 when none does. */
static long
fixed_index(const uint64_t *table, Py_ssize_t entries, uint64_t addr, uint64_t len)
{
    Py_ssize_t lo = 0, hi = entries;
    while (lo < hi) { /* the last entry starting at or before addr */
        Py_ssize_t mid = (lo + hi) / 2;
        if (table[3 * mid] <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return -1;
    const uint64_t *e = table + 3 * (lo - 1);
    return addr + len <= e[1] && addr + len >= addr ? (long)e[2] : -1;
}

static unsigned char *
put_sqe(unsigned char *sqes, unsigned long mask, unsigned long tail, long opcode, int32_t fd,
        uint64_t off, uint64_t addr, uint32_t len, uint64_t tag, long buf_index)
{
    /* struct io_uring_sqe: opcode flags ioprio fd off addr len rw_flags user_data buf_index. */
    unsigned char *sqe = sqes + (tail & mask) * SQE_BYTES;
    memset(sqe, 0, SQE_BYTES);
    sqe[0] = (unsigned char)opcode;
    memcpy(sqe + 4, &fd, 4);
    memcpy(sqe + 8, &off, 8);
    memcpy(sqe + 16, &addr, 8);
    memcpy(sqe + 24, &len, 4);
    memcpy(sqe + 32, &tag, 8);
    if (buf_index >= 0) {
        uint16_t bi = (uint16_t)buf_index;
        memcpy(sqe + 40, &bi, 2);
    }
    return sqe;
}

/* prep_rw(sqes, mask, tail, opcode, fd, iovecs, stride, requests, offsets, start,
   count, batch, table, acc) -> int: write the iovecs and submission entries of
   requests[start:start + count] (each a list of at most `stride` buffers, already
   checked by check_rw) from ring position `tail` on; request i's iovecs go to
   iovecs[i * stride] and its tag is batch << 32 | i. Returns the new tail. The
   buffers stay exported by the caller's objects (the requests list) until reaped.

   `table` (bytes, or None) lists the registered buffers as sorted (start, end,
   index) uint64 triples. A request of one buffer inside one of them becomes one
   READ_FIXED / WRITE_FIXED entry; a request of two, each inside one, becomes two
   such entries at consecutive file offsets (tags marked TAG_SPLIT, the second
   TAG_PART too), whose record in `acc` (a bytearray of ACC_BYTES per request of
   the batch) reap() fills until both are in, when the second has at least
   SPLIT_MIN bytes. Any other request is one vectored entry. Returns (the new
   tail, how many requests went with fixed buffers). The caller leaves room for
   two entries per request. */
static PyObject *
prep_rw(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 14 || !PyList_Check(args[7]) || !PyList_Check(args[8]) ||
        (args[12] != Py_None && !PyBytes_Check(args[12])) ||
        (args[13] != Py_None && !PyByteArray_Check(args[13]))) {
        PyErr_SetString(PyExc_TypeError, "prep_rw() takes 14 arguments");
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
    const uint64_t *table = NULL;
    Py_ssize_t entries = 0;
    if (args[12] != Py_None) {
        table = (const uint64_t *)PyBytes_AS_STRING(args[12]);
        entries = PyBytes_GET_SIZE(args[12]) / 24;
    }
    unsigned char *acc = NULL;
    if (args[13] != Py_None) {
        if (PyByteArray_GET_SIZE(args[13]) < n * ACC_BYTES) {
            PyErr_SetString(PyExc_ValueError, "prep_rw: accumulator too small");
            return NULL;
        }
        acc = (unsigned char *)PyByteArray_AS_STRING(args[13]);
    }
    long fixed_op = opcode == OP_READV ? OP_READ_FIXED : opcode == OP_WRITEV ? OP_WRITE_FIXED : -1;
    if (start < 0 || count < 0 || start + count > n || PyList_GET_SIZE(offsets) != n ||
        stride < 1 || 2 * count > (Py_ssize_t)mask + 1 || n > (Py_ssize_t)TAG_INDEX) {
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
    int32_t fd32 = (int32_t)fd;
    Py_ssize_t n_fixed = 0;
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
        uint64_t base[2] = {0, 0}, len[2] = {0, 0};
        for (Py_ssize_t j = 0; j < nvec; j++) {
            Py_buffer v;
            if (PyObject_GetBuffer(PyList_GET_ITEM(req, j), &v, PyBUF_SIMPLE) < 0)
                goto done;
            uint64_t b = (uint64_t)(uintptr_t)v.buf, l = (uint64_t)v.len;
            PyBuffer_Release(&v);
            memcpy(vec + j * IOVEC_BYTES, &b, 8);
            memcpy(vec + j * IOVEC_BYTES + 8, &l, 8);
            if (j < 2) {
                base[j] = b;
                len[j] = l;
            }
        }
        uint64_t tag = ((uint64_t)batch << 32) | (uint64_t)i;
        long fixed[2] = {-1, -1};
        if (table != NULL && fixed_op >= 0 &&
            (nvec == 1 || (nvec == 2 && acc != NULL && len[1] >= SPLIT_MIN)) &&
            len[0] <= UINT32_MAX && len[1] <= UINT32_MAX) {
            fixed[0] = fixed_index(table, entries, base[0], len[0]);
            if (nvec == 2 && fixed[0] >= 0)
                fixed[1] = fixed_index(table, entries, base[1], len[1]);
        }
        if (nvec == 1 && fixed[0] >= 0) {
            put_sqe(sqes.buf, mask, tail, fixed_op, fd32, off, base[0], (uint32_t)len[0], tag, fixed[0]);
            tail = (tail + 1) & 0xFFFFFFFFul;
            n_fixed++;
        } else if (nvec == 2 && fixed[0] >= 0 && fixed[1] >= 0) {
            unsigned char *rec = acc + i * ACC_BYTES;
            int64_t zero = 0, first = (int64_t)len[0];
            int32_t out_parts = 2;
            memcpy(rec, &first, 8);
            memcpy(rec + 8, &zero, 8);
            memcpy(rec + 16, &zero, 8);
            memcpy(rec + 24, &out_parts, 4);
            tag |= TAG_SPLIT;
            put_sqe(sqes.buf, mask, tail, fixed_op, fd32, off, base[0], (uint32_t)len[0], tag, fixed[0]);
            tail = (tail + 1) & 0xFFFFFFFFul;
            put_sqe(sqes.buf, mask, tail, fixed_op, fd32, off + len[0], base[1], (uint32_t)len[1],
                    tag | TAG_PART, fixed[1]);
            tail = (tail + 1) & 0xFFFFFFFFul;
            n_fixed++;
        } else {
            put_sqe(sqes.buf, mask, tail, opcode, fd32, off, (uint64_t)(uintptr_t)vec,
                    (uint32_t)nvec, tag, -1);
            tail = (tail + 1) & 0xFFFFFFFFul;
        }
    }
    out = Py_BuildValue("(kn)", tail, n_fixed);
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

/* One part of a split request is in: its record in the batch's accumulator takes
   the result; once both are, the request's result (what one vectored transfer
   would say: the first part's error or short count, else the second's error,
   else the bytes of both) goes to *res and 1 is returned; 0 while one is out. */
static int
settle_part(unsigned char *rec, int part, int32_t got, int32_t *res)
{
    int64_t first, r0, r1, value = got;
    int32_t out_parts;
    memcpy(rec + (part ? 16 : 8), &value, 8);
    memcpy(&out_parts, rec + 24, 4);
    out_parts--;
    memcpy(rec + 24, &out_parts, 4);
    if (out_parts > 0)
        return 0;
    memcpy(&first, rec, 8);
    memcpy(&r0, rec + 8, 8);
    memcpy(&r1, rec + 16, 8);
    if (r0 < 0 || r0 < first)
        *res = (int32_t)r0;
    else if (r1 < 0)
        *res = (int32_t)r1;
    else
        *res = (int32_t)(r0 + r1 > INT32_MAX ? INT32_MAX : r0 + r1);
    return 1;
}

/* reap(cq, head_at, tail_at, mask, cqes_at, split) -> list[tuple[int, list, int, int]]:
   every completion posted so far, oldest first, released to the kernel, in runs of
   one batch (tag >> 32): (batch, outcomes, moved, failed), where outcomes holds
   (index, result, None) per request completed (the shape a submit_many callback
   takes), moved the sum of the results that are not negative and failed the count
   of those that are (-errno, for the caller to turn into errors). Consecutive
   completions of one batch share a run; a batch may have several runs in one reap.
   A request prep_rw split in two (tag bit TAG_SPLIT) is reported once, when its
   second part is in, from its record in split[batch] (a dict of accumulators, or
   None when no batch is split). `cq` is the completion ring's mapping; the other
   arguments are byte offsets into it and the ring's mask. The tail is loaded with
   acquire order, so the entries read after it are the kernel's (on any CPU). */
static PyObject *
reap(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || (args[5] != Py_None && !PyDict_Check(args[5]))) {
        PyErr_SetString(PyExc_TypeError, "reap() takes 6 arguments");
        return NULL;
    }
    Py_ssize_t head_at = PyLong_AsSsize_t(args[1]), tail_at = PyLong_AsSsize_t(args[2]);
    unsigned long mask = PyLong_AsUnsignedLong(args[3]);
    Py_ssize_t cqes_at = PyLong_AsSsize_t(args[4]);
    PyObject *split = args[5] == Py_None ? NULL : args[5];
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
    /* The accumulator of the last split batch seen, and which batch it is. */
    PyObject *acc = NULL;
    unsigned long acc_batch = 0;
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
            uint32_t low = (uint32_t)tag;
            unsigned long index = low;
            if (low & TAG_SPLIT) {
                index = low & TAG_INDEX;
                if (acc == NULL || acc_batch != this_batch) {
                    PyObject *key = PyLong_FromUnsignedLong(this_batch);
                    if (key == NULL) {
                        Py_CLEAR(out);
                        goto done;
                    }
                    acc = split ? PyDict_GetItemWithError(split, key) : NULL;
                    Py_DECREF(key);
                    if (acc == NULL && PyErr_Occurred()) {
                        Py_CLEAR(out);
                        goto done;
                    }
                    acc_batch = this_batch;
                }
                if (acc != NULL && PyByteArray_Check(acc) &&
                    (Py_ssize_t)(index + 1) * ACC_BYTES <= PyByteArray_GET_SIZE(acc)) {
                    unsigned char *rec = (unsigned char *)PyByteArray_AS_STRING(acc) + index * ACC_BYTES;
                    if (!settle_part(rec, (low & TAG_PART) != 0, res, &res)) {
                        head++;
                        __atomic_store_n(headp, head, __ATOMIC_RELEASE);
                        continue;
                    }
                }
                /* (No record: a batch already forgotten, reported as it came.) */
            }
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
            PyObject *item = Py_BuildValue("(kiO)", index, (int)res, Py_None);
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
    {"check_views", (PyCFunction)(void (*)(void))check_views, METH_FASTCALL,
     "check_views(views, nbytes, alignment, writable) -> int: -1, or the first view that is "
     "not a writable-where-asked, aligned, C-contiguous 1-D byte view of nbytes bytes."},
    {"prep_rw", (PyCFunction)(void (*)(void))prep_rw, METH_FASTCALL,
     "prep_rw(sqes, mask, tail, opcode, fd, iovecs, stride, requests, offsets, start, count, "
     "batch, table, acc) -> (int, int): write io_uring entries for a run of requests; the new "
     "tail and how many went with fixed buffers."},
    {"reap", (PyCFunction)(void (*)(void))reap, METH_FASTCALL,
     "reap(cq, head_at, tail_at, mask, cqes_at, split) -> list of (batch, outcomes, moved, failed): "
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
