/*
 * kvtier.transfer._gather: one CUDA kernel that copies a table of pieces in one launch.
 *
 * Why: the gather mode of kvtier.transfer._cuda_copy moves a real layout's small
 * pieces (32 KiB each, 64 per 2 MiB row) between the KV tensors and a device
 * staging buffer on the GPU, so that the copy engines move whole rows. Two torch
 * indexing kernels per tensor per round cost ~1.5 ms of Python a round and hold
 * the GIL (docs/lab/gpu.md, run 5); this kernel takes every tensor's pieces of a
 * round as one table of (source address, destination address, bytes) and is one
 * launch, issued without the GIL.
 *
 * Nothing here is linked against CUDA: NVRTC and the driver (libcuda.so.1) are
 * loaded at run time (load), with the paths Python finds (the libnvrtc torch
 * ships, else the loader's names), so the module builds and imports without
 * CUDA. build(device) compiles the kernel with NVRTC for the device's
 * architecture (a CUBIN; PTX for the driver to compile where NVRTC does not know
 * the architecture) and loads it into the device's primary context, the one the
 * CUDA runtime and torch use; launch() queues it on a stream of that context.
 *
 * The table lives in device memory, int64 triples: source, destination, bytes.
 * One thread block copies one entry (the caller cuts pieces into entries of at
 * most a few tens of KiB, so the blocks are of a size), in 16-byte words where
 * the source, destination and length allow, else 8-byte words, else bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const char KERNEL[] =
    "struct alignas(16) kvtier_w16 { unsigned long long a, b; };\n"
    "extern \"C\" __global__ void kvtier_copy_pieces(const long long *table)\n"
    "{\n"
    "    const long long *e = table + 3 * (long long)blockIdx.x;\n"
    "    const char *src = (const char *)e[0];\n"
    "    char *dst = (char *)e[1];\n"
    "    long long n = e[2];\n"
    "    unsigned long long bits = (unsigned long long)src | (unsigned long long)dst |\n"
    "                              (unsigned long long)n;\n"
    "    if ((bits & 15) == 0) {\n"
    "        const kvtier_w16 *s = (const kvtier_w16 *)src;\n"
    "        kvtier_w16 *d = (kvtier_w16 *)dst;\n"
    "        for (long long i = threadIdx.x; i < n / 16; i += blockDim.x)\n"
    "            d[i] = s[i];\n"
    "    } else if ((bits & 7) == 0) {\n"
    "        const unsigned long long *s = (const unsigned long long *)src;\n"
    "        unsigned long long *d = (unsigned long long *)dst;\n"
    "        for (long long i = threadIdx.x; i < n / 8; i += blockDim.x)\n"
    "            d[i] = s[i];\n"
    "    } else {\n"
    "        for (long long i = threadIdx.x; i < n; i += blockDim.x)\n"
    "            dst[i] = src[i];\n"
    "    }\n"
    "}\n";
static const char KERNEL_NAME[] = "kvtier_copy_pieces";
enum { THREADS = 256, MAX_DEVICES = 64 };

/* -- NVRTC --------------------------------------------------------------------------- */

typedef void *nvrtc_program;
typedef int (*nvrtc_version_fn)(int *, int *);
typedef int (*nvrtc_create_fn)(nvrtc_program *, const char *, const char *, int,
                               const char *const *, const char *const *);
typedef int (*nvrtc_compile_fn)(nvrtc_program, int, const char *const *);
typedef int (*nvrtc_size_fn)(nvrtc_program, size_t *);
typedef int (*nvrtc_get_fn)(nvrtc_program, char *);
typedef int (*nvrtc_destroy_fn)(nvrtc_program *);
typedef const char *(*nvrtc_error_fn)(int);

static struct {
    void *lib, *builtins;
    char path[4096];
    int major, minor;
    nvrtc_create_fn create;
    nvrtc_compile_fn compile;
    nvrtc_size_fn log_size, cubin_size, ptx_size;
    nvrtc_get_fn log, cubin, ptx;
    nvrtc_destroy_fn destroy;
    nvrtc_error_fn error;
} nv;

/* -- the driver ---------------------------------------------------------------------- */

typedef int (*cu_init_fn)(unsigned);
typedef int (*cu_version_fn)(int *);
typedef int (*cu_device_get_fn)(int *, int);
typedef int (*cu_attribute_fn)(int *, int, int);
typedef int (*cu_retain_fn)(void **, int);
typedef int (*cu_set_current_fn)(void *);
typedef int (*cu_load_data_fn)(void **, const void *);
typedef int (*cu_get_function_fn)(void **, void *, const char *);
typedef int (*cu_launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, void *, void **, void **);
typedef int (*cu_error_fn)(int, const char **);
enum { CC_MAJOR = 75, CC_MINOR = 76 }; /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_* */

static struct {
    void *lib;
    char path[4096];
    int version;
    cu_device_get_fn device_get;
    cu_attribute_fn attribute;
    cu_retain_fn retain;
    cu_set_current_fn set_current;
    cu_load_data_fn load_data;
    cu_get_function_fn get_function;
    cu_launch_fn launch;
    cu_error_fn error_name, error_string;
} cu;

/* Per device: its primary context, the kernel loaded there, how it was built. */
static struct {
    void *context, *function;
    char built[160];
} devices[MAX_DEVICES];

static void *
symbol(void *lib, const char *name, const char *path, int *missing)
{
    void *f = dlsym(lib, name);
    if (f == NULL && !*missing) {
        PyErr_Format(PyExc_OSError, "%s has no %s", path, name);
        *missing = 1;
    }
    return f;
}

static void *
open_library(PyObject *arg, char *path, size_t size)
{
    const char *p = PyUnicode_AsUTF8(arg);
    if (p == NULL)
        return NULL;
    void *lib = dlopen(p, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *why = dlerror();
        PyErr_Format(PyExc_OSError, "dlopen(%s): %s", p, why ? why : "failed");
        return NULL;
    }
    snprintf(path, size, "%s", p);
    return lib;
}

/* load_nvrtc(path) -> (major, minor): dlopen NVRTC (once; later calls return its version). */
static PyObject *
load_nvrtc(PyObject *Py_UNUSED(module), PyObject *arg)
{
    if (nv.lib != NULL)
        return Py_BuildValue("(ii)", nv.major, nv.minor);
    char path[sizeof(nv.path)];
    void *lib = open_library(arg, path, sizeof(path));
    if (lib == NULL)
        return NULL;
    int missing = 0;
    nvrtc_version_fn version = symbol(lib, "nvrtcVersion", path, &missing);
    nv.create = symbol(lib, "nvrtcCreateProgram", path, &missing);
    nv.compile = symbol(lib, "nvrtcCompileProgram", path, &missing);
    nv.log_size = symbol(lib, "nvrtcGetProgramLogSize", path, &missing);
    nv.log = symbol(lib, "nvrtcGetProgramLog", path, &missing);
    nv.ptx_size = symbol(lib, "nvrtcGetPTXSize", path, &missing);
    nv.ptx = symbol(lib, "nvrtcGetPTX", path, &missing);
    nv.destroy = symbol(lib, "nvrtcDestroyProgram", path, &missing);
    nv.error = symbol(lib, "nvrtcGetErrorString", path, &missing);
    /* CUBIN output exists from NVRTC 11.1; without it, PTX for the driver to compile. */
    nv.cubin_size = dlsym(lib, "nvrtcGetCUBINSize");
    nv.cubin = dlsym(lib, "nvrtcGetCUBIN");
    if (missing || version(&nv.major, &nv.minor) != 0) {
        if (!missing)
            PyErr_Format(PyExc_OSError, "%s: nvrtcVersion failed", path);
        dlclose(lib);
        return NULL;
    }
    memcpy(nv.path, path, sizeof(path));
    nv.lib = lib;
    /* NVRTC dlopens libnvrtc-builtins.so.<major>.<minor> by name when it compiles, and
       finds it only on the loader's path; a pip-installed NVRTC (torch's) has it beside
       itself, off that path. Loaded here first, the one beside it is the one found. */
    const char *slash = strrchr(path, '/');
    if (slash != NULL) {
        char builtins[sizeof(path) + 64];
        snprintf(builtins, sizeof(builtins), "%.*s/libnvrtc-builtins.so.%d.%d",
                 (int)(slash - path), path, nv.major, nv.minor);
        nv.builtins = dlopen(builtins, RTLD_NOW | RTLD_GLOBAL);
    }
    return Py_BuildValue("(ii)", nv.major, nv.minor);
}

/* load_driver(path) -> int: dlopen the CUDA driver and cuInit it (once); its version. */
static PyObject *
load_driver(PyObject *Py_UNUSED(module), PyObject *arg)
{
    if (cu.lib != NULL)
        return PyLong_FromLong(cu.version);
    char path[sizeof(cu.path)];
    void *lib = open_library(arg, path, sizeof(path));
    if (lib == NULL)
        return NULL;
    int missing = 0, err = 0;
    cu_init_fn init = symbol(lib, "cuInit", path, &missing);
    cu_version_fn version = symbol(lib, "cuDriverGetVersion", path, &missing);
    cu.device_get = symbol(lib, "cuDeviceGet", path, &missing);
    cu.attribute = symbol(lib, "cuDeviceGetAttribute", path, &missing);
    cu.retain = symbol(lib, "cuDevicePrimaryCtxRetain", path, &missing);
    cu.set_current = symbol(lib, "cuCtxSetCurrent", path, &missing);
    cu.load_data = symbol(lib, "cuModuleLoadData", path, &missing);
    cu.get_function = symbol(lib, "cuModuleGetFunction", path, &missing);
    cu.launch = symbol(lib, "cuLaunchKernel", path, &missing);
    cu.error_name = symbol(lib, "cuGetErrorName", path, &missing);
    cu.error_string = symbol(lib, "cuGetErrorString", path, &missing);
    if (missing)
        goto fail;
    if ((err = init(0)) != 0 || (err = version(&cu.version)) != 0) {
        const char *name = NULL;
        cu.error_name(err, &name);
        PyErr_Format(PyExc_OSError, "%s: cuInit or cuDriverGetVersion failed: %s (%d)", path,
                     name ? name : "?", err);
        goto fail;
    }
    memcpy(cu.path, path, sizeof(path));
    cu.lib = lib;
    return PyLong_FromLong(cu.version);
fail:
    dlclose(lib);
    return NULL;
}

/* A RuntimeError naming the driver call that failed and its error. */
static PyObject *
driver_error(const char *what, int err)
{
    const char *name = NULL, *text = NULL;
    cu.error_name(err, &name);
    cu.error_string(err, &text);
    PyErr_Format(PyExc_RuntimeError, "%s failed: %s (%d): %s", what, name ? name : "?", err,
                 text ? text : "?");
    return NULL;
}

/* Compile `source` for compute capability `arch` (90 for sm_90): a CUBIN, or PTX where
   `ptx` or this NVRTC has no CUBIN output. NULL with a RuntimeError holding the log. */
static PyObject *
nvrtc_build(const char *source, int arch, int ptx)
{
    nvrtc_program prog = NULL;
    char option[64];
    const char *options[] = {option, "--std=c++17"};
    int err, compiled = -1;
    size_t size = 0, log_size = 0;
    char *log = NULL;
    PyObject *out = NULL;
    ptx = ptx || nv.cubin == NULL;
    snprintf(option, sizeof(option), "--gpu-architecture=%s_%d", ptx ? "compute" : "sm", arch);
    Py_BEGIN_ALLOW_THREADS
    err = nv.create(&prog, source, "kvtier_gather.cu", 0, NULL, NULL);
    if (err == 0) {
        compiled = nv.compile(prog, 2, options);
        if (nv.log_size(prog, &log_size) == 0 && log_size > 1 && (log = malloc(log_size)) &&
            nv.log(prog, log) != 0)
            log[0] = 0;
    }
    Py_END_ALLOW_THREADS
    if (err != 0) {
        PyErr_Format(PyExc_RuntimeError, "nvrtcCreateProgram failed: %s", nv.error(err));
        goto done;
    }
    if (compiled != 0) {
        PyErr_Format(PyExc_RuntimeError, "NVRTC %d.%d could not compile the kernel (%s): %s\n%s",
                     nv.major, nv.minor, option, nv.error(compiled), log ? log : "(no log)");
        goto done;
    }
    if ((err = (ptx ? nv.ptx_size : nv.cubin_size)(prog, &size)) != 0) {
        PyErr_Format(PyExc_RuntimeError, "nvrtcGet%sSize failed: %s", ptx ? "PTX" : "CUBIN",
                     nv.error(err));
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (out != NULL && (err = (ptx ? nv.ptx : nv.cubin)(prog, PyBytes_AS_STRING(out))) != 0) {
        Py_CLEAR(out);
        PyErr_Format(PyExc_RuntimeError, "nvrtcGet%s failed: %s", ptx ? "PTX" : "CUBIN",
                     nv.error(err));
    }
done:
    free(log);
    if (prog != NULL)
        nv.destroy(&prog);
    return out;
}

/* compile(arch, ptx=False, source=None) -> bytes: NVRTC alone (no GPU needed): the kernel,
   or `source`, as a CUBIN for sm_<arch>, or PTX for compute_<arch>. */
static PyObject *
compile(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"arch", "ptx", "source", NULL};
    int arch, ptx = 0;
    const char *source = KERNEL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i|pz", names, &arch, &ptx, &source))
        return NULL;
    if (nv.lib == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "NVRTC is not loaded (load_nvrtc)");
        return NULL;
    }
    return nvrtc_build(source ? source : KERNEL, arch, ptx);
}

/* The device's primary context made current on this thread; 0 or a driver error. */
static int
make_current(int device, const char **what)
{
    int err = 0, dev;
    if (devices[device].context == NULL) {
        *what = "cuDeviceGet";
        if ((err = cu.device_get(&dev, device)) != 0)
            return err;
        *what = "cuDevicePrimaryCtxRetain";
        if ((err = cu.retain(&devices[device].context, dev)) != 0)
            return err;
    }
    *what = "cuCtxSetCurrent";
    return cu.set_current(devices[device].context);
}

/* build(device) -> str: compile the kernel for `device` and load it into its primary
   context (once per device); how it was built. RuntimeError (NVRTC's log included) if
   it cannot be. */
static PyObject *
build(PyObject *Py_UNUSED(module), PyObject *arg)
{
    long device = PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
    if (device < 0 || device >= MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "device %ld out of range", device);
        return NULL;
    }
    if (devices[device].function != NULL)
        return PyUnicode_FromString(devices[device].built);
    if (nv.lib == NULL || cu.lib == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "NVRTC and the driver are not both loaded");
        return NULL;
    }
    const char *what = "";
    int err, major = 0, minor = 0, dev = 0;
    if ((err = make_current((int)device, &what)) != 0)
        return driver_error(what, err);
    what = "cuDeviceGetAttribute";
    if ((err = cu.device_get(&dev, (int)device)) != 0 ||
        (err = cu.attribute(&major, CC_MAJOR, dev)) != 0 ||
        (err = cu.attribute(&minor, CC_MINOR, dev)) != 0)
        return driver_error(what, err);
    int arch = major * 10 + minor, ptx = 0;
    PyObject *image = nvrtc_build(KERNEL, arch, 0);
    if (image == NULL) {
        /* An architecture newer than this NVRTC knows as a CUBIN: PTX for the driver. */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        image = nvrtc_build(KERNEL, arch, 1);
        if (image == NULL) {
            Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(tb);
            return NULL;
        }
        Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(tb);
        ptx = 1;
    }
    void *module = NULL, *function = NULL;
    Py_BEGIN_ALLOW_THREADS
    what = "cuModuleLoadData";
    err = cu.load_data(&module, PyBytes_AS_STRING(image));
    if (err == 0) {
        what = "cuModuleGetFunction";
        err = cu.get_function(&function, module, KERNEL_NAME);
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(image);
    if (err != 0)
        return driver_error(what, err);
    snprintf(devices[device].built, sizeof(devices[device].built),
             "%s for sm_%d by NVRTC %d.%d, driver %d.%d", ptx ? "PTX" : "CUBIN", arch, nv.major,
             nv.minor, cu.version / 1000, cu.version % 1000 / 10);
    devices[device].function = function;
    return PyUnicode_FromString(devices[device].built);
}

/* launch(table, count, stream, device) -> None: queue the kernel on `stream` over `count`
   entries of the device table at address `table` (built for `device` first). */
static PyObject *
launch(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "launch(table, count, stream, device)");
        return NULL;
    }
    unsigned long long table = PyLong_AsUnsignedLongLong(args[0]);
    long long count = PyLong_AsLongLong(args[1]);
    void *stream = PyLong_AsVoidPtr(args[2]);
    long device = PyLong_AsLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (device < 0 || device >= MAX_DEVICES || devices[device].function == NULL) {
        PyErr_Format(PyExc_RuntimeError, "the kernel is not built for device %ld (build)", device);
        return NULL;
    }
    if (stream == NULL) {
        /* The legacy default stream would serialize with the model's work. */
        PyErr_SetString(PyExc_ValueError, "launch needs a created stream, not stream 0");
        return NULL;
    }
    if (count < 0 || table == 0 || table % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "bad table (address %llu, %lld entries)", table, count);
        return NULL;
    }
    const char *what = "";
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    err = make_current((int)device, &what);
    while (err == 0 && count > 0) {
        /* The grid's x dimension holds 2^31 - 1 blocks. */
        unsigned grid = count > INT_MAX ? INT_MAX : (unsigned)count;
        void *params[] = {&table};
        what = "cuLaunchKernel";
        err = cu.launch(devices[device].function, grid, 1, 1, THREADS, 1, 1, 0, stream, params,
                        NULL);
        table += (unsigned long long)grid * 24, count -= grid;
    }
    Py_END_ALLOW_THREADS
    if (err != 0)
        return driver_error(what, err);
    Py_RETURN_NONE;
}

/* -- the table ------------------------------------------------------------------------ */

/* A C-contiguous int64 buffer of rows of `cols` (held in `view`), or -1 with an error. */
static int
int64_view(PyObject *obj, Py_ssize_t cols, const char *what, Py_buffer *view, Py_ssize_t *rows)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0) ||
        view->len % (cols * 8) != 0) {
        PyErr_Format(PyExc_TypeError, "%s must be an int64 array of %zd columns", what, cols);
        PyBuffer_Release(view);
        return -1;
    }
    *rows = view->len / (cols * 8);
    return 0;
}

/* The index of `row` in the sorted `rows`, or -1. */
static Py_ssize_t
find_row(const int64_t *rows, Py_ssize_t n, int64_t row)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (rows[mid] < row)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && rows[lo] == row ? lo : -1;
}

/* table(table, pieces, spans, store, rows, cap, buffers, offsets, slice_bytes, entry)
   -> (entries, bounds): kvtier.transfer._cuda_copy.piece_table, compiled (its docstring
   says what the table holds); both as bytearrays of int64. The plan is checked against
   its tensors first (kvtier.transfer._copy.check); here, that every piece's row is one
   of `rows` and the arguments agree. */
static PyObject *
table(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    enum { T_DEV, T_HOST, T_UNIT, T_COLS = 7 };
    Py_buffer views[6];
    int held = 0;
    Py_ssize_t tensors, npieces, nspans, nrows, nbuffers, noffsets;
    PyObject *entries = NULL, *bounds = NULL, *out = NULL;
    int64_t *counts = NULL;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "table(table, pieces, spans, store, rows, cap, buffers, "
                                         "offsets, slice_bytes, entry)");
        return NULL;
    }
    int store = PyObject_IsTrue(args[3]);
    long long cap = PyLong_AsLongLong(args[5]), slice = PyLong_AsLongLong(args[8]),
              entry = PyLong_AsLongLong(args[9]);
    if (store < 0 || PyErr_Occurred())
        return NULL;
    /* The arrays among the arguments: which, their columns, their names, their rows. */
    static const struct { int arg, cols; const char *name; } arrays[] = {
        {0, T_COLS, "table"}, {1, 4, "pieces"},  {2, 2, "spans"},
        {4, 1, "rows"},       {6, 1, "buffers"}, {7, 1, "offsets"},
    };
    Py_ssize_t *lengths[] = {&tensors, &npieces, &nspans, &nrows, &nbuffers, &noffsets};
    for (; held < 6; held++)
        if (int64_view(args[arrays[held].arg], arrays[held].cols, arrays[held].name,
                       &views[held], lengths[held]) < 0)
            goto done;
    if (nspans != tensors || noffsets != tensors || nbuffers < 1 || cap < 1 || slice < 1 ||
        entry < 1) {
        PyErr_SetString(PyExc_ValueError, "table: the arguments do not agree");
        goto done;
    }
    const int64_t *tt = views[0].buf, *pieces = views[1].buf, *spans = views[2].buf,
                  *rows = views[3].buf, *buffers = views[4].buf, *offsets = views[5].buf;
    Py_ssize_t rounds = (nrows + cap - 1) / cap, bad = -1;
    int64_t total = 0;
    if ((counts = calloc((size_t)rounds + 1, sizeof(int64_t))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t t = 0; t < tensors && bad < 0; t++) {
        if (spans[2 * t] < 0 || spans[2 * t + 1] < spans[2 * t] || spans[2 * t + 1] > npieces) {
            bad = t;
            break;
        }
    }
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "tensor %zd: span outside the pieces", bad);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < tensors && bad < 0; t++)
        for (int64_t i = spans[2 * t]; i < spans[2 * t + 1]; i++) {
            const int64_t *p = pieces + 4 * i;
            Py_ssize_t k = find_row(rows, nrows, p[0]);
            if (k < 0) {
                bad = (Py_ssize_t)i;
                break;
            }
            counts[k / cap + 1] += (p[3] * tt[t * T_COLS + T_UNIT] + entry - 1) / entry;
        }
    for (Py_ssize_t r = 0; r < rounds; r++)
        counts[r + 1] += counts[r];
    total = counts[rounds];
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "piece %zd: its row is not one of the request's", bad);
        goto done;
    }
    entries = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(total * 24));
    bounds = PyByteArray_FromStringAndSize((const char *)counts, (Py_ssize_t)(rounds + 1) * 8);
    if (entries == NULL || bounds == NULL)
        goto done;
    int64_t *e = (int64_t *)PyByteArray_AS_STRING(entries);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < tensors; t++) {
        const int64_t *tr = tt + t * T_COLS;
        int64_t unit = tr[T_UNIT];
        for (int64_t i = spans[2 * t]; i < spans[2 * t + 1]; i++) {
            const int64_t *p = pieces + 4 * i;
            Py_ssize_t k = find_row(rows, nrows, p[0]);
            int64_t r = k / cap, slot = k % cap;
            int64_t staging = buffers[r % nbuffers] + slot * slice + offsets[t] + p[1] * unit;
            int64_t device = tr[T_DEV] + p[2] * unit, len = p[3] * unit;
            int64_t src = store ? device : staging, dst = store ? staging : device;
            for (int64_t at = 0; at < len; at += entry) {
                int64_t *w = e + 3 * counts[r]++;
                w[0] = src + at, w[1] = dst + at, w[2] = len - at < entry ? len - at : entry;
            }
        }
    }
    Py_END_ALLOW_THREADS
    out = PyTuple_Pack(2, entries, bounds);
done:
    Py_XDECREF(entries), Py_XDECREF(bounds);
    free(counts);
    while (held > 0)
        PyBuffer_Release(&views[--held]);
    return out;
}

/* status() -> dict: what is loaded, and per device how the kernel was built. */
static PyObject *
status(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(arg))
{
    PyObject *out = PyDict_New(), *built = PyDict_New(), *v = NULL;
    if (out == NULL || built == NULL)
        goto fail;
    for (int d = 0; d < MAX_DEVICES; d++) {
        if (devices[d].function == NULL)
            continue;
        PyObject *key = PyLong_FromLong(d), *text = PyUnicode_FromString(devices[d].built);
        int bad = key == NULL || text == NULL || PyDict_SetItem(built, key, text) < 0;
        Py_XDECREF(key), Py_XDECREF(text);
        if (bad)
            goto fail;
    }
    if (nv.lib != NULL) {
        v = Py_BuildValue("{s:s,s:(ii)}", "path", nv.path, "version", nv.major, nv.minor);
        if (v == NULL || PyDict_SetItemString(out, "nvrtc", v) < 0)
            goto fail;
        Py_CLEAR(v);
    }
    if (cu.lib != NULL) {
        v = Py_BuildValue("{s:s,s:i}", "path", cu.path, "version", cu.version);
        if (v == NULL || PyDict_SetItemString(out, "driver", v) < 0)
            goto fail;
        Py_CLEAR(v);
    }
    if (PyDict_SetItemString(out, "built", built) < 0)
        goto fail;
    Py_DECREF(built);
    return out;
fail:
    Py_XDECREF(v), Py_XDECREF(built), Py_XDECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"load_nvrtc", load_nvrtc, METH_O,
     "load_nvrtc(path) -> (major, minor): load NVRTC (once); its version."},
    {"load_driver", load_driver, METH_O,
     "load_driver(path) -> int: load and initialize the CUDA driver (once); its version."},
    {"compile", (PyCFunction)(void (*)(void))compile, METH_VARARGS | METH_KEYWORDS,
     "compile(arch, ptx=False, source=None) -> bytes: the kernel (or source) compiled by "
     "NVRTC alone, a CUBIN for sm_<arch> or PTX for compute_<arch>."},
    {"build", build, METH_O,
     "build(device) -> str: compile the kernel for a device and load it into its primary "
     "context (once); how it was built."},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(table, count, stream, device) -> None: queue the kernel over `count` entries "
     "(int64 source, destination, bytes) of the device table at address `table`."},
    {"table", (PyCFunction)(void (*)(void))table, METH_FASTCALL,
     "table(table, pieces, spans, store, rows, cap, buffers, offsets, slice_bytes, entry) -> "
     "(entries, bounds): the gather kernel's table of a plan, as int64 bytearrays."},
    {"status", status, METH_NOARGS,
     "status() -> dict: NVRTC and the driver loaded, and how the kernel was built per device."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier.transfer._gather",
    .m_doc = "A CUDA kernel compiled at run time that copies a table of pieces in one launch.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__gather(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (m != NULL && PyModule_AddStringConstant(m, "KERNEL", KERNEL) < 0)
        Py_CLEAR(m);
    return m;
}
