/*
 * kvtier.transfer._copy: the copy loops of kvtier.transfer.device, compiled.
 *
 * Why C: a real model's offloaded row is many small contiguous pieces (Llama-3-8B
 * with 16-token blocks: 32 layers of K and V, 64 pieces of 32 KiB per 2 MiB row).
 * One numpy assignment or Tensor.copy_ per piece costs a few microseconds of
 * Python and dispatch before a byte moves; here a request is one call, its loop
 * runs without the GIL, and a piece costs what memcpy or cudaMemcpyAsync costs.
 *
 * A request arrives planned (kvtier.transfer.device plans it with numpy, once,
 * for both backends) as three int64 arrays:
 *
 *   table   (T, 7)  per KV tensor: device base address, host base address (row 0
 *                   of the tensor's slice), unit (bytes of one sub-block, or of
 *                   one K or V half of it), host row stride, device bytes, bytes
 *                   of the tensor's slice of a row, rows;
 *   pieces  (P, 4)  per contiguous piece, in units: host row, host unit in the
 *                   row, device unit, length;
 *   spans   (T, 2)  per tensor, the [start, stop) of its pieces (tensors of one
 *                   kind and group share theirs).
 *
 * Every piece is bounds-checked against its tensor before anything is copied,
 * so a wrong plan is a ValueError, never a write out of bounds.
 *
 * CUDA: the runtime is loaded at run time (cuda_load, with the path Python finds:
 * the libcudart torch loaded, else the usual names), so the module builds and
 * imports where CUDA is absent. cuda_copy issues the pieces on a given stream as
 * one cudaMemcpyBatchAsync per 8192 pieces where the runtime has it (12.8+; its
 * signature lost the failIdx argument in 13.0), or a loop of cudaMemcpyAsync.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { T_DEV, T_HOST, T_UNIT, T_STRIDE, T_DEV_BYTES, T_ROW_BYTES, T_ROWS, T_COLS };
enum { P_ROW, P_HOST, P_DEV, P_UNITS, P_COLS };

typedef struct {
    Py_buffer views[3];
    int held;
    const int64_t *table, *pieces, *spans;
    Py_ssize_t tensors, npieces;
    int64_t bytes;  /* over every tensor */
    int64_t copies; /* pieces over every tensor */
} Plan;

static void
plan_release(Plan *plan)
{
    for (int i = 0; i < plan->held; i++)
        PyBuffer_Release(&plan->views[i]);
    plan->held = 0;
}

/* An int64 C-contiguous buffer of rows of `cols`, or -1 with an error set. */
static int
int64_rows(Plan *plan, PyObject *obj, Py_ssize_t cols, const char *what, Py_ssize_t *rows)
{
    Py_buffer *view = &plan->views[plan->held];
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    plan->held++;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int64 array", what);
        return -1;
    }
    if (view->len % (cols * 8) != 0) {
        PyErr_Format(PyExc_ValueError, "%s must have %zd columns", what, cols);
        return -1;
    }
    *rows = view->len / (cols * 8);
    return 0;
}

/* Open and check a plan: every piece inside its tensor, on both sides. */
static int
plan_open(Plan *plan, PyObject *table, PyObject *pieces, PyObject *spans)
{
    Py_ssize_t nspans;
    memset(plan, 0, sizeof(*plan));
    if (int64_rows(plan, table, T_COLS, "table", &plan->tensors) < 0 ||
        int64_rows(plan, pieces, P_COLS, "pieces", &plan->npieces) < 0 ||
        int64_rows(plan, spans, 2, "spans", &nspans) < 0)
        goto fail;
    if (nspans != plan->tensors) {
        PyErr_Format(PyExc_ValueError, "%zd spans for %zd tensors", nspans, plan->tensors);
        goto fail;
    }
    plan->table = plan->views[0].buf;
    plan->pieces = plan->views[1].buf;
    plan->spans = plan->views[2].buf;
    for (Py_ssize_t t = 0; t < plan->tensors; t++) {
        const int64_t *tt = plan->table + t * T_COLS;
        int64_t unit = tt[T_UNIT], a = plan->spans[2 * t], b = plan->spans[2 * t + 1];
        if (unit <= 0 || tt[T_STRIDE] < 0 || tt[T_DEV_BYTES] < 0 || tt[T_ROW_BYTES] < 0 ||
            tt[T_ROWS] < 0 || tt[T_DEV] == 0 || tt[T_HOST] == 0) {
            PyErr_Format(PyExc_ValueError, "tensor %zd: bad table entry", t);
            goto fail;
        }
        if (a < 0 || b < a || b > plan->npieces) {
            PyErr_Format(PyExc_ValueError, "tensor %zd: span [%lld, %lld) outside %zd pieces", t,
                         (long long)a, (long long)b, plan->npieces);
            goto fail;
        }
        for (int64_t i = a; i < b; i++) {
            const int64_t *p = plan->pieces + i * P_COLS;
            int64_t host_end, dev_end, len, last;
            if (p[P_ROW] < 0 || p[P_ROW] >= tt[T_ROWS] || p[P_HOST] < 0 || p[P_DEV] < 0 ||
                p[P_UNITS] <= 0 || __builtin_add_overflow(p[P_HOST], p[P_UNITS], &host_end) ||
                __builtin_add_overflow(p[P_DEV], p[P_UNITS], &dev_end) ||
                __builtin_mul_overflow(host_end, unit, &host_end) ||
                __builtin_mul_overflow(dev_end, unit, &dev_end) ||
                __builtin_mul_overflow(p[P_UNITS], unit, &len) || host_end > tt[T_ROW_BYTES] ||
                dev_end > tt[T_DEV_BYTES] ||
                __builtin_mul_overflow(p[P_ROW], tt[T_STRIDE], &last) ||
                __builtin_add_overflow(plan->bytes, len, &plan->bytes)) {
                PyErr_Format(PyExc_ValueError,
                             "tensor %zd, piece %lld (row %lld, host unit %lld, device unit "
                             "%lld, %lld units of %lld bytes) is outside the tensor or its rows",
                             t, (long long)i, (long long)p[P_ROW], (long long)p[P_HOST],
                             (long long)p[P_DEV], (long long)p[P_UNITS], (long long)unit);
                goto fail;
            }
        }
        plan->copies += b - a;
    }
    return 0;
fail:
    plan_release(plan);
    return -1;
}

static inline char *
host_at(const int64_t *tt, const int64_t *p)
{
    return (char *)(uintptr_t)tt[T_HOST] + p[P_ROW] * tt[T_STRIDE] + p[P_HOST] * tt[T_UNIT];
}

static inline char *
dev_at(const int64_t *tt, const int64_t *p)
{
    return (char *)(uintptr_t)tt[T_DEV] + p[P_DEV] * tt[T_UNIT];
}

static int
parse_plan(Plan *plan, PyObject *const *args, int *store)
{
    if (plan_open(plan, args[0], args[1], args[2]) < 0)
        return -1;
    *store = PyObject_IsTrue(args[3]);
    if (*store < 0) {
        plan_release(plan);
        return -1;
    }
    return 0;
}

/* Requests of at least this many bytes are written with non-temporal stores... */
#define STREAM_BYTES (4 << 20)
/* ...in pieces of at least this many bytes (smaller ones are not worth the alignment). */
#define STREAM_PIECE 4096

/* memcpy without reading the destination into the caches first. A large copy is
   memory-bound: a plain store reads each destination line before writing it (a
   third more traffic), and glibc's memcpy only streams a single call larger than
   a share of the last-level cache, never a request's pieces of a few KiB. The
   caller issues an sfence before the copy is reported done. */
static void
copy_stream(char *dst, const char *src, size_t n)
{
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

/* check(table, pieces, spans) -> (bytes, copies): validate a plan, copy nothing. */
static PyObject *
check(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Plan plan;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "check(table, pieces, spans)");
        return NULL;
    }
    if (plan_open(&plan, args[0], args[1], args[2]) < 0)
        return NULL;
    plan_release(&plan);
    return Py_BuildValue("(LL)", (long long)plan.bytes, (long long)plan.copies);
}

/* copy_host(table, pieces, spans, store, part, parts) -> int: memcpy the bytes of
   part `part` of `parts` equal shares of the plan (by bytes, cutting pieces where a
   share ends), device -> host if `store`, else host -> device; the bytes copied. */
static PyObject *
copy_host(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Plan plan;
    int store;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "copy_host(table, pieces, spans, store, part, parts)");
        return NULL;
    }
    long part = PyLong_AsLong(args[4]), parts = PyLong_AsLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (parts < 1 || part < 0 || part >= parts) {
        PyErr_Format(PyExc_ValueError, "part %ld of %ld", part, parts);
        return NULL;
    }
    if (parse_plan(&plan, args, &store) < 0)
        return NULL;
    /* Shares by bytes, not pieces: the helper and the worker finish together. */
    int64_t lo = (int64_t)((__int128)plan.bytes * part / parts);
    int64_t hi = (int64_t)((__int128)plan.bytes * (part + 1) / parts);
    int64_t pos = 0;
    int stream = plan.bytes >= STREAM_BYTES;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < plan.tensors && pos < hi; t++) {
        const int64_t *tt = plan.table + t * T_COLS;
        for (int64_t i = plan.spans[2 * t]; i < plan.spans[2 * t + 1]; i++) {
            const int64_t *p = plan.pieces + i * P_COLS;
            int64_t len = p[P_UNITS] * tt[T_UNIT];
            if (pos + len > lo) {
                int64_t from = pos < lo ? lo - pos : 0;
                int64_t to = pos + len > hi ? hi - pos : len;
                char *h = host_at(tt, p) + from, *d = dev_at(tt, p) + from;
                char *dst = store ? h : d, *src = store ? d : h;
                if (stream && to - from >= STREAM_PIECE)
                    copy_stream(dst, src, (size_t)(to - from));
                else
                    memcpy(dst, src, (size_t)(to - from));
            }
            pos += len;
            if (pos >= hi)
                break;
        }
    }
#if defined(__SSE2__)
    /* Streamed stores are weakly ordered: drain them before the copy is reported. */
    if (stream)
        _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    plan_release(&plan);
    return PyLong_FromLongLong(hi - lo);
}

/* -- planning a request, and checking its indices --------------------------------- */

/* A C-contiguous int64 buffer, read as flat, or -1 with an error set that names
   `what` and what it must be (the view is held only on success; the caller
   releases it). The Python side hands these functions arrays it made contiguous
   (kvtier.transfer.device._as_index); anything else is refused here with a
   message, not with the buffer protocol's bare "ndarray is not C-contiguous". */
static int
int64_vector(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be an int64 array, got %.200s", what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int64 array, got format '%.20s'", what,
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a C-contiguous int64 array, got a strided view "
                     "(numpy.ascontiguousarray makes one)",
                     what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int
int64_cmp(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* check_index(values, bound, unique) -> int: 0 when every value is in [0, bound)
   (and, with `unique`, none repeats); 1 for a value out of range, 2 for a repeat.
   What numpy's min, max and unique cost per call (about 10 us for 32 values) is
   a few nanoseconds a value here. */
static PyObject *
check_index(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "check_index(values, bound, unique)");
        return NULL;
    }
    long long bound = PyLong_AsLongLong(args[1]);
    int unique = PyObject_IsTrue(args[2]);
    if ((bound == -1 && PyErr_Occurred()) || unique < 0)
        return NULL;
    if (int64_vector(args[0], &view, "values") < 0)
        return NULL;
    const int64_t *v = view.buf;
    Py_ssize_t n = view.len / 8;
    int code = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (v[i] < 0 || v[i] >= bound) {
            code = 1;
            break;
        }
    if (code == 0 && unique && n > 1) {
        /* A bitmap of the bound when it is small enough, else a sorted copy. */
        if (bound <= ((long long)1 << 26)) {
            uint64_t *seen = calloc((size_t)(bound + 63) / 64, 8);
            if (seen == NULL) {
                PyBuffer_Release(&view);
                return PyErr_NoMemory();
            }
            for (Py_ssize_t i = 0; i < n && code == 0; i++) {
                uint64_t bit = (uint64_t)1 << (v[i] & 63), *word = &seen[v[i] >> 6];
                if (*word & bit)
                    code = 2;
                *word |= bit;
            }
            free(seen);
        } else {
            int64_t *copy = malloc((size_t)n * 8);
            if (copy == NULL) {
                PyBuffer_Release(&view);
                return PyErr_NoMemory();
            }
            memcpy(copy, v, (size_t)n * 8);
            qsort(copy, (size_t)n, 8, int64_cmp);
            for (Py_ssize_t i = 1; i < n; i++)
                if (copy[i] == copy[i - 1]) {
                    code = 2;
                    break;
                }
            free(copy);
        }
    }
    PyBuffer_Release(&view);
    return PyLong_FromLong(code);
}

/* plan_units' bounds: device ids (and num_blocks) below 2^62, bpc below 2^31. */
#define PLAN_MAX_ID ((int64_t)1 << 62)
#define PLAN_MAX_BPC ((int64_t)1 << 31)

typedef struct {
    int64_t key, order;
} run_key;

static int
run_cmp(const void *a, const void *b)
{
    const run_key *x = a, *y = b;
    if (x->key != y->key)
        return (x->key > y->key) - (x->key < y->key);
    return (x->order > y->order) - (x->order < y->order); /* stable */
}

/* plan_units(rows, ids, bpc, skip, num_blocks, kv_first, store, out) -> int: the
   pieces of one request for tensors of one kind, in units, written into `out` (an
   int64 array of at least 8 * len(ids) values); how many rows of 4 it wrote.

   Sub-block j of the request is sub-block (j + skip) % bpc of host row
   rows[(j + skip) / bpc] and device block ids[j]. Sub-blocks that follow each
   other in one host row and on the device are one piece; pieces are ordered by
   the side the copy reads (device ids for a store, host rows for a load: reads
   in address order keep the prefetchers ahead), and a K/V-first tensor's piece
   is two, K then V (V bpc units further in the row, num_blocks units further on
   the device). Columns: host row, host unit in the row, device unit, units. The
   same as kvtier.transfer.device._unit_pieces, without its dozen numpy calls.
   Out of contract, a ValueError before anything is written: bpc outside
   1..2^31, num_blocks outside 0..2^62, an id outside [0, num_blocks), a row
   reached outside [0, 2^62 / (2 * bpc)): with those, no sum or product of the
   loop overflows. */
static PyObject *
plan_units(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer rv, iv, ov;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "plan_units(rows, ids, bpc, skip, num_blocks, kv_first, store, out)");
        return NULL;
    }
    long long bpc = PyLong_AsLongLong(args[2]), skip = PyLong_AsLongLong(args[3]);
    long long num_blocks = PyLong_AsLongLong(args[4]);
    int kv_first = PyObject_IsTrue(args[5]), store = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred() || kv_first < 0 || store < 0)
        return NULL;
    /* Bounds that keep every sum and product below in int64 (see the loop): the
       callers' values are far inside them (bpc <= 4096, ids and rows below a
       tensor's and a region's counts). */
    if (bpc < 1 || bpc > PLAN_MAX_BPC || skip < 0 || skip >= bpc) {
        PyErr_Format(PyExc_ValueError, "bpc %lld (1..%lld), skip %lld (0..bpc - 1)", bpc,
                     (long long)PLAN_MAX_BPC, skip);
        return NULL;
    }
    if (num_blocks < 0 || num_blocks > PLAN_MAX_ID) {
        PyErr_Format(PyExc_ValueError, "num_blocks %lld outside 0..%lld", num_blocks,
                     (long long)PLAN_MAX_ID);
        return NULL;
    }
    /* row * (2 * bpc) + sub (a load's sort key) stays below 2^62. */
    const int64_t max_row = PLAN_MAX_ID / (2 * bpc);
    if (int64_vector(args[0], &rv, "rows") < 0)
        return NULL;
    if (int64_vector(args[1], &iv, "ids") < 0) {
        PyBuffer_Release(&rv);
        return NULL;
    }
    if (int64_vector(args[7], &ov, "out") < 0) {
        PyBuffer_Release(&rv);
        PyBuffer_Release(&iv);
        return NULL;
    }
    const int64_t *rows = rv.buf, *ids = iv.buf;
    int64_t *out = ov.buf;
    Py_ssize_t nrows = rv.len / 8, n = iv.len / 8, written = 0;
    run_key *keys = NULL;
    int64_t *first = NULL;
    /* (n + skip) / bpc, rounded up, is the rows the ids reach: no product to overflow. */
    if (ov.readonly || ov.len / 8 < 8 * n || (n + skip + bpc - 1) / bpc > nrows) {
        PyErr_SetString(PyExc_ValueError, "plan_units: out too small, or more ids than rows hold");
        goto done;
    }
    if (n == 0)
        goto done;
    first = malloc((size_t)n * 4 * 8);
    keys = malloc((size_t)n * sizeof(run_key));
    if (first == NULL || keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t runs = 0;
    int64_t prow = 0, psub = 0, pid = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t p = j + skip, row = rows[p / bpc], sub = p % bpc, id = ids[j];
        /* In range, every sum and product below fits: id + 1 and id + num_blocks
           below 2^63, row * (2 * bpc) + sub below 2^62, sub + bpc below 2^32. */
        if (id < 0 || id >= num_blocks || row < 0 || row >= max_row) {
            PyErr_Format(PyExc_ValueError,
                         "plan_units: id %lld outside [0, %lld) or row %lld outside [0, %lld)",
                         (long long)id, num_blocks, (long long)row, (long long)max_row);
            goto done;
        }
        if (j && row == prow && sub == psub + 1 && id == pid + 1) {
            first[4 * (runs - 1) + 3]++;
        } else {
            int64_t *f = first + 4 * runs;
            f[0] = row, f[1] = sub, f[2] = id, f[3] = 1;
            keys[runs].key = store ? id : row * (2 * bpc) + sub;
            keys[runs].order = runs;
            runs++;
        }
        prow = row, psub = sub, pid = id;
    }
    int sorted = 1;
    for (Py_ssize_t r = 1; r < runs && sorted; r++)
        sorted = keys[r].key >= keys[r - 1].key;
    if (!sorted)
        qsort(keys, (size_t)runs, sizeof(run_key), run_cmp);
    for (Py_ssize_t r = 0; r < runs; r++) {
        const int64_t *f = first + 4 * keys[r].order;
        int64_t *o = out + 4 * written;
        o[0] = f[0], o[1] = f[1], o[2] = f[2], o[3] = f[3];
        written++;
        if (kv_first) {
            o[4] = f[0], o[5] = f[1] + bpc, o[6] = f[2] + num_blocks, o[7] = f[3];
            written++;
        }
    }
done:
    free(first);
    free(keys);
    PyBuffer_Release(&rv);
    PyBuffer_Release(&iv);
    PyBuffer_Release(&ov);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(written);
}

/* -- CUDA, through the runtime loaded at run time ------------------------------- */

typedef int (*memcpy_async_fn)(void *, const void *, size_t, int, void *);
typedef int (*set_device_fn)(int);
typedef int (*get_last_error_fn)(void);
typedef int (*runtime_version_fn)(int *);
typedef const char *(*error_text_fn)(int);
/* struct cudaMemcpyAttributes: srcAccessOrder, srcLocHint {type, id}, dstLocHint, flags. */
typedef struct {
    int src_access_order;
    int src_type, src_id;
    int dst_type, dst_id;
    unsigned int flags;
} memcpy_attributes;
typedef int (*batch12_fn)(void **, void **, size_t *, size_t, memcpy_attributes *, size_t *,
                          size_t, size_t *, void *);
typedef int (*batch13_fn)(void **, void **, size_t *, size_t, memcpy_attributes *, size_t *,
                          size_t, void *);

enum { HOST_TO_DEVICE = 1, DEVICE_TO_HOST = 2, SRC_ACCESS_ORDER_STREAM = 1 };
#define BATCH_MAX 8192

static struct {
    void *lib;
    char path[4096];
    int version;
    memcpy_async_fn memcpy_async;
    set_device_fn set_device;
    get_last_error_fn get_last_error;
    error_text_fn error_name, error_string;
    void *batch;    /* batch12_fn or batch13_fn, by version */
    int batch_error; /* the first error a batch returned: the loop is used since */
} rt;

/* cuda_load(path) -> int: dlopen a CUDA runtime; its version (major * 1000 + minor * 10).
   Once one is loaded, later calls return its version whatever the path. */
static PyObject *
cuda_load(PyObject *Py_UNUSED(module), PyObject *arg)
{
    if (rt.lib != NULL)
        return PyLong_FromLong(rt.version);
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL)
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *why = dlerror();
        PyErr_Format(PyExc_OSError, "dlopen(%s): %s", path, why ? why : "failed");
        return NULL;
    }
    runtime_version_fn version = (runtime_version_fn)dlsym(lib, "cudaRuntimeGetVersion");
    memcpy_async_fn memcpy_async = (memcpy_async_fn)dlsym(lib, "cudaMemcpyAsync");
    set_device_fn set_device = (set_device_fn)dlsym(lib, "cudaSetDevice");
    get_last_error_fn get_last_error = (get_last_error_fn)dlsym(lib, "cudaGetLastError");
    error_text_fn name = (error_text_fn)dlsym(lib, "cudaGetErrorName");
    error_text_fn string = (error_text_fn)dlsym(lib, "cudaGetErrorString");
    int v = 0;
    if (!version || !memcpy_async || !set_device || !get_last_error || !name || !string ||
        version(&v) != 0) {
        dlclose(lib);
        PyErr_Format(PyExc_OSError, "%s is not a usable CUDA runtime", path);
        return NULL;
    }
    rt.lib = lib;
    rt.version = v;
    rt.memcpy_async = memcpy_async;
    rt.set_device = set_device;
    rt.get_last_error = get_last_error;
    rt.error_name = name;
    rt.error_string = string;
    /* Before 12.8 there is none; 12.8 and 12.9 take a failIdx argument, 13.0 does not. */
    rt.batch = v >= 12080 ? dlsym(lib, "cudaMemcpyBatchAsync") : NULL;
    snprintf(rt.path, sizeof(rt.path), "%s", path);
    return PyLong_FromLong(v);
}

/* cuda_status() -> dict: what cuda_load loaded (empty before). */
static PyObject *
cuda_status(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(arg))
{
    if (rt.lib == NULL)
        return PyDict_New();
    return Py_BuildValue("{s:s,s:i,s:O,s:i}", "path", rt.path, "version", rt.version, "batch",
                         rt.batch != NULL ? Py_True : Py_False, "batch_error", rt.batch_error);
}

static int
issue_batch(void **dsts, void **srcs, size_t *sizes, size_t n, void *stream)
{
    memcpy_attributes attr;
    size_t first = 0, fail = (size_t)-1;
    memset(&attr, 0, sizeof(attr));
    /* The source is read in stream order: after the event the stream waits on. */
    attr.src_access_order = SRC_ACCESS_ORDER_STREAM;
    if (rt.version >= 13000)
        return ((batch13_fn)rt.batch)(dsts, srcs, sizes, n, &attr, &first, 1, stream);
    return ((batch12_fn)rt.batch)(dsts, srcs, sizes, n, &attr, &first, 1, &fail, stream);
}

/* Piece i of tensor t: destination, source, bytes. */
static inline size_t
piece(const Plan *plan, Py_ssize_t t, int64_t i, int store, void **dst, void **src)
{
    const int64_t *tt = plan->table + t * T_COLS, *p = plan->pieces + i * P_COLS;
    char *h = host_at(tt, p), *d = dev_at(tt, p);
    *dst = store ? h : d, *src = store ? d : h;
    return (size_t)(p[P_UNITS] * tt[T_UNIT]);
}

/* Every piece, one cudaMemcpyAsync each; the first error. */
static int
issue_each(const Plan *plan, int store, void *stream)
{
    int kind = store ? DEVICE_TO_HOST : HOST_TO_DEVICE, err;
    for (Py_ssize_t t = 0; t < plan->tensors; t++)
        for (int64_t i = plan->spans[2 * t]; i < plan->spans[2 * t + 1]; i++) {
            void *dst, *src;
            size_t len = piece(plan, t, i, store, &dst, &src);
            if ((err = rt.memcpy_async(dst, src, len, kind, stream)) != 0)
                return err;
        }
    return 0;
}

/* Every piece, in batches of up to BATCH_MAX (arrays of that many given); the first error. */
static int
issue_batches(const Plan *plan, int store, void *stream, void **dsts, void **srcs, size_t *sizes)
{
    size_t n = 0;
    int err;
    for (Py_ssize_t t = 0; t < plan->tensors; t++)
        for (int64_t i = plan->spans[2 * t]; i < plan->spans[2 * t + 1]; i++) {
            sizes[n] = piece(plan, t, i, store, &dsts[n], &srcs[n]);
            if (++n == BATCH_MAX) {
                if ((err = issue_batch(dsts, srcs, sizes, n, stream)) != 0)
                    return err;
                n = 0;
            }
        }
    return n > 0 ? issue_batch(dsts, srcs, sizes, n, stream) : 0;
}

/* cuda_copy(table, pieces, spans, store, stream, device, batch) -> int: issue every
   piece on `stream` (device -> host if `store`), batched if `batch` and the runtime
   can; the number of pieces. Returns once they are queued, not copied. */
static PyObject *
cuda_copy(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Plan plan;
    int store, err;
    const char *what = "cudaSetDevice";
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "cuda_copy(table, pieces, spans, store, stream, device, batch)");
        return NULL;
    }
    if (rt.lib == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no CUDA runtime loaded (cuda_load)");
        return NULL;
    }
    void *stream = PyLong_AsVoidPtr(args[4]);
    long device = PyLong_AsLong(args[5]);
    int batch = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred() || batch < 0)
        return NULL;
    if (stream == NULL) {
        /* The legacy default stream would serialize with the model's work. */
        PyErr_SetString(PyExc_ValueError, "cuda_copy needs a created stream, not stream 0");
        return NULL;
    }
    if (parse_plan(&plan, args, &store) < 0)
        return NULL;
    void **dsts = NULL, **srcs = NULL;
    size_t *sizes = NULL;
    batch = batch && rt.batch != NULL && rt.batch_error == 0 && plan.copies > 1;
    if (batch) {
        size_t n = plan.copies < BATCH_MAX ? (size_t)plan.copies : BATCH_MAX;
        dsts = malloc(n * sizeof(void *));
        srcs = malloc(n * sizeof(void *));
        sizes = malloc(n * sizeof(size_t));
        if (!dsts || !srcs || !sizes) {
            free(dsts), free(srcs), free(sizes);
            plan_release(&plan);
            return PyErr_NoMemory();
        }
    }
    Py_BEGIN_ALLOW_THREADS
    err = rt.set_device((int)device);
    if (err == 0 && batch) {
        what = "cudaMemcpyBatchAsync";
        if ((err = issue_batches(&plan, store, stream, dsts, srcs, sizes)) != 0) {
            /* A batch the runtime refuses was not queued (nor were the ones after
               it): clear its last error, then issue every piece one at a time
               (copying a piece twice writes the same bytes) and never batch again. */
            rt.batch_error = err;
            rt.get_last_error();
            batch = 0, err = 0;
        }
    }
    if (err == 0 && !batch) {
        what = "cudaMemcpyAsync";
        err = issue_each(&plan, store, stream);
    }
    Py_END_ALLOW_THREADS
    free(dsts), free(srcs), free(sizes);
    int64_t copies = plan.copies;
    plan_release(&plan);
    if (err != 0) {
        const char *name = rt.error_name(err), *text = rt.error_string(err);
        rt.get_last_error();
        PyErr_Format(PyExc_RuntimeError, "%s failed: %s (%d): %s", what, name ? name : "?", err,
                     text ? text : "?");
        return NULL;
    }
    return PyLong_FromLongLong(copies);
}

static PyMethodDef methods[] = {
    {"check", (PyCFunction)(void (*)(void))check, METH_FASTCALL,
     "check(table, pieces, spans) -> (bytes, copies): validate a plan, copy nothing."},
    {"copy_host", (PyCFunction)(void (*)(void))copy_host, METH_FASTCALL,
     "copy_host(table, pieces, spans, store, part, parts) -> int: memcpy one share of a "
     "plan's bytes between host memories, without the GIL; the bytes copied."},
    {"check_index", (PyCFunction)(void (*)(void))check_index, METH_FASTCALL,
     "check_index(values, bound, unique) -> int: 0 when every value is in [0, bound) "
     "(and none repeats, with unique); 1 out of range; 2 a repeat."},
    {"plan_units", (PyCFunction)(void (*)(void))plan_units, METH_FASTCALL,
     "plan_units(rows, ids, bpc, skip, num_blocks, kv_first, store, out) -> int: a "
     "request's pieces in units, into out; how many."},
    {"cuda_load", cuda_load, METH_O,
     "cuda_load(path) -> int: load a CUDA runtime library; its version."},
    {"cuda_status", cuda_status, METH_NOARGS,
     "cuda_status() -> dict: the runtime loaded, its version, whether it batches."},
    {"cuda_copy", (PyCFunction)(void (*)(void))cuda_copy, METH_FASTCALL,
     "cuda_copy(table, pieces, spans, store, stream, device, batch) -> int: queue a plan's "
     "pieces on a CUDA stream; the number of pieces."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier.transfer._copy",
    .m_doc = "Compiled copy loops of the device transfers (see kvtier.transfer.device).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__copy(void)
{
    return PyModule_Create(&module_def);
}
