/*
 * kvtier.manager._native: the residency manager's state and its LRU and ARC
 * policies in C, behind kvtier.manager.native.NativeResidencyManager.
 *
 * Why C: the pure-Python manager costs 1.3-2.5 us per requested key at 1M
 * slots, most of it per-key interpreter work and cold dict probes (see
 * docs/manager.md). Here every call is one loop over its keys in C, and all
 * per-block state lives in flat arrays indexed by slot.
 *
 * Semantics are the pure-Python manager's, call for call: the same plans, the
 * same slots in the same order, the same victims, the same errors (the same
 * exception classes, which Python hands over once with set_errors), and an
 * exact LRU order. The conformance suite, the Hypothesis state machine and the
 * policy scenarios run against both implementations.
 *
 * Layout
 * ------
 * - table: open addressing with linear probing, a power of two >= 2x the
 *   capacity, 8 bytes an entry: the low 32 bits of the key's hash and the slot
 *   (-1: empty). Every occupied slot, in any state, has one entry. A probe
 *   reads the key object only when the 32 hash bits match. Deletion shifts
 *   later entries back (no tombstones, so probes stay short under churn).
 * - per slot: the key (a strong reference while the slot is occupied), the
 *   state, the pin count, and the recency list links (prev/next, which list).
 * - recency lists are doubly linked through the slots: exact order, O(1)
 *   moves. LRU uses list 1; ARC uses list 1 as T1 and list 2 as T2.
 * - ARC's ghosts: a direct-mapped table of CRC-32 fingerprints, as the Python
 *   policy keeps them (the same table size, the same entries).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { S_FREE = 0, S_WRITING = 1, S_READY = 2, S_REM_WRITING = 3, S_REM_PINNED = 4 };
enum { L_NONE = 0, L_ONE = 1, L_TWO = 2 };

#define GHOST_TOP 0x80000000u
#define GHOST_B2 1u
#define SCRATCH_STACK 128

static PyObject *InvalidArgumentError;
static PyObject *ProtocolError;
static PyObject *BlockNotFoundError;
static PyObject *BusyError;

static uint32_t crc_table[256];

static void
crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

/* zlib.crc32 of the bytes: the Python ARC policy's ghost fingerprint. */
static uint32_t
crc32_of(const unsigned char *p, Py_ssize_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    for (Py_ssize_t i = 0; i < n; i++)
        c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

typedef struct {
    uint32_t h;
    int32_t slot;
} Entry;

typedef struct {
    int32_t head; /* most recent */
    int32_t tail; /* least recent */
    Py_ssize_t size;
} List;

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity;
    int arc;
    /* per slot */
    PyObject **keys;
    uint8_t *state;
    uint8_t *where;
    uint8_t *ghost_hit; /* ARC: stored key was a ghost; enters T2 when ready */
    uint32_t *khash;    /* the low 32 bits of the key's hash: no key read to delete it */
    uint32_t *kcrc;     /* ARC: the key's ghost fingerprint, for when it is evicted */
    int32_t *pins;
    int32_t *prev;
    int32_t *next;
    /* key -> slot */
    Entry *table;
    size_t mask;
    /* slots freed, in the order freed; never-used slots are counted by `fresh` */
    int32_t *free_slots;
    Py_ssize_t n_free;
    Py_ssize_t fresh;
    /* counts */
    Py_ssize_t n_ready;
    Py_ssize_t n_writing;
    Py_ssize_t n_rem_writing;
    Py_ssize_t n_rem_pinned;
    Py_ssize_t n_pinned; /* slots with pins > 0 */
    long long hits, misses, evictions;
    /* policy */
    List l1, l2;
    uint32_t *ghosts;
    size_t ghost_mask;
    Py_ssize_t b1, b2;
    double p;
} Core;

/* A Core made by Core.__new__ without __init__ has no arrays: every entry point
   checks, so that misuse raises instead of crashing the interpreter. */
static int
not_ready(Core *c)
{
    if (c->table != NULL)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "kvtier.manager._native.Core is not initialized");
    return 1;
}

/* -- hashing and the table ------------------------------------------------------------ */

static inline uint32_t
hash32(PyObject *key)
{
    /* bytes cache their hash: after the first call this is a field read. */
    return (uint32_t)(Py_uhash_t)PyObject_Hash(key);
}

static inline int
same_key(PyObject *a, PyObject *b)
{
    if (a == b)
        return 1;
    Py_ssize_t n = PyBytes_GET_SIZE(a);
    return n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), n) == 0;
}

/* The slot of `key` (any state), or -1. */
static inline int32_t
find(Core *c, PyObject *key, uint32_t h)
{
    size_t i = h & c->mask;
    for (;;) {
        Entry e = c->table[i];
        if (e.slot < 0)
            return -1;
        if (e.h == h && same_key(c->keys[e.slot], key))
            return e.slot;
        i = (i + 1) & c->mask;
    }
}

static inline void
table_insert(Core *c, uint32_t h, int32_t slot)
{
    size_t i = h & c->mask;
    while (c->table[i].slot >= 0)
        i = (i + 1) & c->mask;
    c->table[i].h = h;
    c->table[i].slot = slot;
}

/* Remove the entry of `slot` (whose key hashes to h), shifting later entries back. */
static void
table_delete(Core *c, uint32_t h, int32_t slot)
{
    size_t mask = c->mask;
    size_t i = h & mask;
    while (c->table[i].slot != slot)
        i = (i + 1) & mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        Entry e = c->table[j];
        if (e.slot < 0)
            break;
        size_t home = e.h & mask;
        /* e may move to the hole at i unless its home lies in (i, j]. */
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (stays)
            continue;
        c->table[i] = e;
        i = j;
    }
    c->table[i].slot = -1;
}

/* Forget the key of `slot` and hand the slot back (freed last, taken first). */
static void
free_slot(Core *c, int32_t s)
{
    PyObject *k = c->keys[s];
    table_delete(c, c->khash[s], s);
    c->keys[s] = NULL;
    c->state[s] = S_FREE;
    c->ghost_hit[s] = 0;
    c->free_slots[c->n_free++] = s;
    Py_DECREF(k);
}

/* -- recency lists -------------------------------------------------------------------- */

static inline List *
list_of(Core *c, uint8_t w)
{
    return w == L_ONE ? &c->l1 : &c->l2;
}

static inline void
unlink_slot(Core *c, int32_t s)
{
    List *l = list_of(c, c->where[s]);
    int32_t p = c->prev[s], n = c->next[s];
    if (p >= 0)
        c->next[p] = n;
    else
        l->head = n;
    if (n >= 0)
        c->prev[n] = p;
    else
        l->tail = p;
    l->size--;
    c->where[s] = L_NONE;
}

static inline void
push_front(Core *c, uint8_t w, int32_t s)
{
    List *l = list_of(c, w);
    c->prev[s] = -1;
    c->next[s] = l->head;
    if (l->head >= 0)
        c->prev[l->head] = s;
    else
        l->tail = s;
    l->head = s;
    l->size++;
    c->where[s] = w;
}

/* Move up to n unpinned slots, least recent first, from list w to out; pinned
   slots are passed over and keep their place. Returns how many. */
static Py_ssize_t
take(Core *c, uint8_t w, Py_ssize_t n, int32_t *out)
{
    Py_ssize_t got = 0;
    int32_t s = list_of(c, w)->tail;
    while (got < n && s >= 0) {
        int32_t before = c->prev[s];
        if (c->pins[s] == 0) {
            unlink_slot(c, s);
            out[got++] = s;
        }
        s = before;
    }
    return got;
}

static void
policy_clear(Core *c)
{
    c->l1.head = c->l1.tail = c->l2.head = c->l2.tail = -1;
    c->l1.size = c->l2.size = 0;
    memset(c->where, 0, (size_t)c->capacity);
    if (c->arc)
        memset(c->ghosts, 0, (c->ghost_mask + 1) * sizeof(uint32_t));
    c->b1 = c->b2 = 0;
    c->p = 0.0;
}

/* Record evicted blocks as ghosts of list `tag` (0: B1, GHOST_B2: B2). */
static void
remember(Core *c, const int32_t *slots, Py_ssize_t n, uint32_t tag)
{
    Py_ssize_t lost1 = 0, lost2 = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        __builtin_prefetch(&c->ghosts[c->kcrc[slots[i]] & c->ghost_mask], 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t h = c->kcrc[slots[i]];
        size_t at = h & c->ghost_mask;
        uint32_t old = c->ghosts[at];
        if (old) {
            if (old & GHOST_B2)
                lost2++;
            else
                lost1++;
        }
        c->ghosts[at] = ((h | GHOST_TOP) & ~GHOST_B2) | tag;
    }
    if (tag)
        c->b2 += n;
    else
        c->b1 += n;
    c->b1 -= lost1;
    c->b2 -= lost2;
}

/* ARC: a new key whose fingerprint is h and is a ghost adapts p; returns whether it was one. */
static int
ghost_hit(Core *c, uint32_t h)
{
    size_t at = h & c->ghost_mask;
    uint32_t v = c->ghosts[at];
    if (!v)
        return 0;
    uint32_t base = (h | GHOST_TOP) & ~GHOST_B2;
    if (v == base) { /* B1: T1 was too small */
        double step = (double)c->b2 / (double)c->b1;
        c->p = fmin((double)c->capacity, c->p + fmax(1.0, step));
        c->b1--;
    }
    else if (v == (base | GHOST_B2)) { /* B2: T2 was too small */
        double step = (double)c->b1 / (double)c->b2;
        c->p = fmax(0.0, c->p - fmax(1.0, step));
        c->b2--;
    }
    else
        return 0;
    c->ghosts[at] = 0;
    return 1;
}

/* Choose n victims into out, least valuable first; all are unlinked. */
static void
evict(Core *c, Py_ssize_t n, int32_t *out)
{
    if (!c->arc) {
        take(c, L_ONE, n, out);
        return;
    }
    Py_ssize_t want1 = n;
    if (c->l2.size) {
        double d = ceil((double)c->l1.size - c->p);
        want1 = d <= 0 ? 0 : (d < (double)n ? (Py_ssize_t)d : n);
    }
    Py_ssize_t got1 = want1 ? take(c, L_ONE, want1, out) : 0;
    Py_ssize_t got2 = got1 < n ? take(c, L_TWO, n - got1, out + got1) : 0;
    Py_ssize_t more = 0;
    if (got1 + got2 < n) /* T2 ran out of unpinned blocks: T1 gives the rest */
        more = take(c, L_ONE, n - got1 - got2, out + got1 + got2);
    remember(c, out, got1, 0);
    remember(c, out + got1, got2, GHOST_B2);
    remember(c, out + got1 + got2, more, 0);
}

/* -- a call's keys ------------------------------------------------------------------- */

typedef struct {
    uint32_t h;
    PyObject *key;
} Seen;

/* One call's keys with their hashes and, after batch_find, their slots. */
typedef struct {
    PyObject **items;
    Py_ssize_t n;
    uint32_t *h;
    int32_t *slot; /* -1: absent; also scratch for the calls that need no lookup result */
    uint32_t hstack[SCRATCH_STACK];
    int32_t sstack[SCRATCH_STACK];
} Batch;

static void
batch_end(Batch *b)
{
    if (b->h != b->hstack)
        PyMem_Free(b->h);
    if (b->slot != b->sstack)
        PyMem_Free(b->slot);
}

/* Take a call's keys: a list or tuple (the Python side converts other
   sequences) of distinct, exact bytes. Hashes every key and
   asks for its table line, so that the probes of batch_find overlap their
   cache misses instead of paying them one after another. 0, or -1 with an
   exception set (nothing to free then). */
static int
batch_begin(Core *c, PyObject *keys, const char *what, Batch *b)
{
    PyObject **items;
    Py_ssize_t n;
    if (not_ready(c))
        return -1;
    if (PyList_CheckExact(keys)) {
        items = ((PyListObject *)keys)->ob_item;
        n = PyList_GET_SIZE(keys);
    }
    else if (PyTuple_CheckExact(keys)) {
        items = ((PyTupleObject *)keys)->ob_item;
        n = PyTuple_GET_SIZE(keys);
    }
    else {
        PyErr_Format(InvalidArgumentError, "%s: keys must be a list or tuple of bytes, got %R",
                     what, keys);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(items[i])) {
            PyErr_Format(InvalidArgumentError, "%s: every key must be bytes, got %R", what,
                         items[i]);
            return -1;
        }
    }
    b->items = items;
    b->n = n;
    b->h = n <= SCRATCH_STACK ? b->hstack : PyMem_Malloc((size_t)n * sizeof(uint32_t));
    b->slot = n <= SCRATCH_STACK ? b->sstack : PyMem_Malloc((size_t)n * sizeof(int32_t));
    if (b->h == NULL || b->slot == NULL) {
        if (b->h != b->hstack)
            PyMem_Free(b->h);
        if (b->slot != b->sstack)
            PyMem_Free(b->slot);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t h = hash32(items[i]);
        b->h[i] = h;
        __builtin_prefetch(&c->table[h & c->mask]);
    }
    if (n < 2)
        return 0;
    size_t size = 4;
    while (size < 2 * (size_t)n)
        size <<= 1;
    Seen stack[2 * SCRATCH_STACK];
    Seen *seen = size <= 2 * SCRATCH_STACK ? stack : PyMem_Malloc(size * sizeof(Seen));
    if (seen == NULL) {
        batch_end(b);
        PyErr_NoMemory();
        return -1;
    }
    memset(seen, 0, size * sizeof(Seen));
    size_t mask = size - 1;
    int dup = 0;
    for (Py_ssize_t i = 0; i < n && !dup; i++) {
        PyObject *k = items[i];
        uint32_t h = b->h[i];
        size_t at = h & mask;
        while (seen[at].key != NULL) {
            if (seen[at].h == h && same_key(seen[at].key, k)) {
                dup = 1;
                break;
            }
            at = (at + 1) & mask;
        }
        seen[at].h = h;
        seen[at].key = k;
    }
    if (seen != stack)
        PyMem_Free(seen);
    if (dup) {
        batch_end(b);
        PyErr_Format(InvalidArgumentError, "%s: duplicate keys in one call", what);
        return -1;
    }
    return 0;
}

/* The slot of every key (any state), or -1, into b->slot. Two passes: the
   first finds each key's candidate entry (the first whose hash bits match)
   and asks for the candidate's key pointer; the second confirms. */
static void
batch_find(Core *c, Batch *b)
{
    for (Py_ssize_t i = 0; i < b->n; i++) {
        uint32_t h = b->h[i];
        size_t at = h & c->mask;
        int32_t cand = -1;
        for (;;) {
            Entry e = c->table[at];
            if (e.slot < 0)
                break;
            if (e.h == h) {
                cand = e.slot;
                __builtin_prefetch(&c->keys[cand]);
                break;
            }
            at = (at + 1) & c->mask;
        }
        b->slot[i] = cand;
    }
    for (Py_ssize_t i = 0; i < b->n; i++) {
        int32_t cand = b->slot[i];
        if (cand >= 0 && !same_key(c->keys[cand], b->items[i]))
            b->slot[i] = find(c, b->items[i], b->h[i]); /* 32 hash bits collided */
    }
}

static PyObject *
slots_tuple(const int32_t *slots, Py_ssize_t n)
{
    PyObject *t = PyTuple_New(n);
    if (t == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLong(slots[i]);
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

/* A call's distinct keys, hashed and found (batch_begin, then batch_find). */
static int
batch_open(Core *c, PyObject *keys, const char *what, Batch *b)
{
    if (batch_begin(c, keys, what, b) < 0)
        return -1;
    batch_find(c, b);
    return 0;
}

/* -- the type ------------------------------------------------------------------------- */

static void
Core_release(Core *c)
{
    if (c->keys) {
        for (Py_ssize_t s = 0; s < c->capacity; s++)
            Py_CLEAR(c->keys[s]);
    }
    PyMem_RawFree(c->keys);
    PyMem_RawFree(c->state);
    PyMem_RawFree(c->where);
    PyMem_RawFree(c->ghost_hit);
    PyMem_RawFree(c->pins);
    PyMem_RawFree(c->khash);
    PyMem_RawFree(c->kcrc);
    PyMem_RawFree(c->prev);
    PyMem_RawFree(c->next);
    PyMem_RawFree(c->table);
    PyMem_RawFree(c->free_slots);
    PyMem_RawFree(c->ghosts);
    c->keys = NULL;
    c->state = c->where = c->ghost_hit = NULL;
    c->pins = c->prev = c->next = c->free_slots = NULL;
    c->khash = c->kcrc = NULL;
    c->table = NULL;
    c->ghosts = NULL;
}

static void
Core_dealloc(Core *c)
{
    Core_release(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static void
clear_state(Core *c)
{
    for (Py_ssize_t s = 0; s < c->capacity; s++)
        Py_CLEAR(c->keys[s]);
    memset(c->state, 0, (size_t)c->capacity);
    memset(c->ghost_hit, 0, (size_t)c->capacity);
    memset(c->pins, 0, (size_t)c->capacity * sizeof(int32_t));
    for (size_t i = 0; i <= c->mask; i++)
        c->table[i].slot = -1;
    c->n_free = c->fresh = 0;
    c->n_ready = c->n_writing = c->n_rem_writing = c->n_rem_pinned = c->n_pinned = 0;
    c->hits = c->misses = c->evictions = 0;
    policy_clear(c);
}

static int
Core_init(Core *c, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", "arc", NULL};
    Py_ssize_t capacity;
    int arc;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "np", kwlist, &capacity, &arc))
        return -1;
    if (capacity < 1 || capacity > INT32_MAX / 2) {
        PyErr_Format(InvalidArgumentError, "capacity_slots must be in [1, %d], got %zd",
                     INT32_MAX / 2, capacity);
        return -1;
    }
    Core_release(c);
    c->capacity = capacity;
    c->arc = arc;
    size_t n = (size_t)capacity;
    size_t tsize = 16;
    while (tsize < 2 * n)
        tsize <<= 1;
    c->mask = tsize - 1;
    c->keys = PyMem_RawCalloc(n, sizeof(PyObject *));
    c->state = PyMem_RawCalloc(n, 1);
    c->where = PyMem_RawCalloc(n, 1);
    c->ghost_hit = PyMem_RawCalloc(n, 1);
    c->pins = PyMem_RawCalloc(n, sizeof(int32_t));
    c->khash = PyMem_RawMalloc(n * sizeof(uint32_t));
    c->kcrc = arc ? PyMem_RawMalloc(n * sizeof(uint32_t)) : NULL;
    c->prev = PyMem_RawMalloc(n * sizeof(int32_t));
    c->next = PyMem_RawMalloc(n * sizeof(int32_t));
    c->free_slots = PyMem_RawMalloc(n * sizeof(int32_t));
    c->table = PyMem_RawMalloc(tsize * sizeof(Entry));
    if (arc) {
        /* As the Python policy: 1 << max(10, (capacity - 1).bit_length()). */
        size_t g = 1024;
        while (g < n)
            g <<= 1;
        c->ghost_mask = g - 1;
        c->ghosts = PyMem_RawCalloc(g, sizeof(uint32_t));
    }
    if (!c->keys || !c->state || !c->where || !c->ghost_hit || !c->pins || !c->khash ||
        !c->prev || !c->next || !c->free_slots || !c->table ||
        (arc && (!c->ghosts || !c->kcrc))) {
        Core_release(c);
        PyErr_NoMemory();
        return -1;
    }
    clear_state(c);
    return 0;
}

/* lookup(keys) -> int */
static PyObject *
Core_lookup(Core *c, PyObject *keys)
{
    Batch b;
    if (batch_open(c, keys, "lookup", &b) < 0)
        return NULL;
    Py_ssize_t hit = 0;
    while (hit < b.n && b.slot[hit] >= 0 && c->state[b.slot[hit]] == S_READY)
        hit++;
    c->hits += hit;
    c->misses += b.n - hit;
    batch_end(&b);
    return PyLong_FromSsize_t(hit);
}

/* Evict `need` blocks (their slots into victims), shielding the ready blocks
   of this call; `found` holds each key's slot. Returns 0, or -1 when too few
   blocks are evictable (then nothing changed). ARC's ghost checks of the new
   keys run here, after the capacity check and before the victims are chosen,
   as in the Python manager; a ghost's entry in `found` becomes -2. */
static int
make_room(Core *c, Batch *b, Py_ssize_t need, int32_t *victims, uint32_t *crcs)
{
    Py_ssize_t shielded = 0;
    if (need > 0) {
        for (Py_ssize_t i = 0; i < b->n; i++) {
            int32_t s = b->slot[i];
            if (s >= 0 && c->state[s] == S_READY && c->pins[s] == 0) {
                c->pins[s] = -1; /* a shield: nonzero for take(), undone below */
                shielded++;
            }
        }
        if (need > c->n_ready - c->n_pinned + c->n_rem_pinned - shielded) {
            for (Py_ssize_t i = 0; i < b->n; i++)
                if (b->slot[i] >= 0 && c->pins[b->slot[i]] == -1)
                    c->pins[b->slot[i]] = 0;
            return -1;
        }
    }
    if (c->arc) {
        /* Fingerprints first, asking for their ghost entries, then the checks. */
        for (Py_ssize_t i = 0; i < b->n; i++) {
            if (b->slot[i] < 0) {
                PyObject *k = b->items[i];
                crcs[i] = crc32_of((const unsigned char *)PyBytes_AS_STRING(k),
                                   PyBytes_GET_SIZE(k));
                __builtin_prefetch(&c->ghosts[crcs[i] & c->ghost_mask], 1);
            }
        }
        for (Py_ssize_t i = 0; i < b->n; i++)
            if (b->slot[i] < 0 && ghost_hit(c, crcs[i]))
                b->slot[i] = -2;
    }
    if (need > 0) {
        evict(c, need, victims);
        for (Py_ssize_t i = 0; i < b->n; i++)
            if (b->slot[i] >= 0 && c->pins[b->slot[i]] == -1)
                c->pins[b->slot[i]] = 0;
    }
    return 0;
}

/* prepare_store(keys) -> None | () | (new keys, slots, evicted keys, victim slots) */
static PyObject *
Core_prepare_store(Core *c, PyObject *keys)
{
    Batch b;
    if (batch_open(c, keys, "prepare_store", &b) < 0)
        return NULL;
    PyObject *result = NULL;
    int32_t *slots = NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < b.n; i++)
        n += b.slot[i] < 0;
    if (n == 0) {
        result = PyTuple_New(0); /* every key resident: the Python side's empty plan */
        goto done;
    }
    Py_ssize_t need = n - c->n_free - (c->capacity - c->fresh);
    Py_ssize_t n_victims = need > 0 ? need : 0;
    /* slots, then the victims' slots, then (ARC) each key's ghost fingerprint */
    slots = PyMem_Malloc((size_t)(n + n_victims + b.n) * sizeof(int32_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int32_t *victims = slots + n;
    uint32_t *crcs = (uint32_t *)(victims + n_victims);
    if (make_room(c, &b, need, victims, crcs) < 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    /* Free slots first (the last freed, in the order freed), then never-used
       ones, then the victims' slots. */
    Py_ssize_t got = n < c->n_free ? n : c->n_free;
    memcpy(slots, c->free_slots + c->n_free - got, (size_t)got * sizeof(int32_t));
    c->n_free -= got;
    while (got < n && c->fresh < c->capacity)
        slots[got++] = (int32_t)c->fresh++;
    memcpy(slots + got, victims, (size_t)n_victims * sizeof(int32_t)); /* got + need == n */
    /* From here only running out of memory fails, and the victims are gone
       already: a MemoryError then leaves the manager consistent (the victims
       freed, the new blocks being written) but not as it was. */
    PyObject *new_keys = PyTuple_New(n);
    PyObject *evicted = PyTuple_New(n_victims);
    if (new_keys == NULL || evicted == NULL) {
        Py_CLEAR(new_keys);
        Py_CLEAR(evicted);
    }
    for (Py_ssize_t v = 0; v < n_victims; v++)
        __builtin_prefetch(&c->table[c->khash[victims[v]] & c->mask], 1);
    for (Py_ssize_t v = 0; v < n_victims; v++) {
        int32_t s = victims[v];
        PyObject *k = c->keys[s];
        table_delete(c, c->khash[s], s);
        c->keys[s] = NULL;
        c->state[s] = S_FREE;
        c->ghost_hit[s] = 0;
        if (evicted != NULL)
            PyTuple_SET_ITEM(evicted, v, k); /* the reference moves to the tuple */
        else
            Py_DECREF(k);
    }
    c->n_ready -= n_victims;
    c->evictions += n_victims;
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        if (b.slot[i] >= 0)
            continue;
        PyObject *k = b.items[i];
        int32_t s = slots[j];
        c->keys[s] = Py_NewRef(k);
        c->khash[s] = b.h[i];
        if (c->arc)
            c->kcrc[s] = crcs[i];
        c->state[s] = S_WRITING;
        c->ghost_hit[s] = b.slot[i] == -2;
        table_insert(c, b.h[i], s);
        if (new_keys != NULL)
            PyTuple_SET_ITEM(new_keys, j, Py_NewRef(k));
        j++;
    }
    c->n_writing += n;
    if (new_keys == NULL || evicted == NULL) {
        Py_XDECREF(new_keys);
        Py_XDECREF(evicted);
        PyErr_NoMemory();
        goto done;
    }
    PyObject *slot_t = slots_tuple(slots, n);
    PyObject *victim_t = slots_tuple(victims, n_victims);
    if (slot_t != NULL && victim_t != NULL)
        result = PyTuple_Pack(4, new_keys, slot_t, evicted, victim_t);
    Py_DECREF(new_keys);
    Py_DECREF(evicted);
    Py_XDECREF(slot_t);
    Py_XDECREF(victim_t);
done:
    PyMem_Free(slots);
    batch_end(&b);
    return result;
}

/* complete_store(keys, success) -> tuple of the keys that became ready */
static PyObject *
Core_complete_store(Core *c, PyObject *args)
{
    PyObject *keys;
    int success;
    if (!PyArg_ParseTuple(args, "Op", &keys, &success))
        return NULL;
    Batch b;
    if (batch_open(c, keys, "complete_store", &b) < 0)
        return NULL;
    int32_t *slots = b.slot;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        int32_t s = slots[i];
        if (s < 0 || (c->state[s] != S_WRITING && c->state[s] != S_REM_WRITING)) {
            PyErr_Format(ProtocolError, "complete_store: block %R is not being written",
                         b.items[i]);
            batch_end(&b);
            return NULL;
        }
    }
    PyObject *out = success ? PyTuple_New(b.n) : NULL; /* shrunk below if some were removed */
    if (success && out == NULL) {
        batch_end(&b);
        return NULL;
    }
    /* Blocks removed while being written are freed, whatever `success` says. */
    Py_ssize_t ready = 0;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        int32_t s = slots[i];
        if (c->state[s] == S_REM_WRITING) {
            free_slot(c, s);
            c->n_rem_writing--;
        }
        else
            slots[ready++] = s; /* compacted in place: i >= ready */
    }
    c->n_writing -= ready;
    if (!success) {
        for (Py_ssize_t i = 0; i < ready; i++)
            free_slot(c, slots[i]);
        batch_end(&b);
        return PyTuple_New(0);
    }
    for (Py_ssize_t i = 0; i < ready; i++) {
        int32_t s = slots[i];
        c->state[s] = S_READY;
        PyTuple_SET_ITEM(out, i, Py_NewRef(c->keys[s]));
    }
    c->n_ready += ready;
    /* Enter the order: the first key most recent, so push the last first. */
    for (Py_ssize_t i = ready - 1; i >= 0; i--) {
        int32_t s = slots[i];
        uint8_t w = L_ONE;
        if (c->arc && c->ghost_hit[s]) {
            w = L_TWO; /* ghost hits enter T2 directly */
            c->ghost_hit[s] = 0;
        }
        push_front(c, w, s);
    }
    batch_end(&b);
    if (ready < PyTuple_GET_SIZE(out) && _PyTuple_Resize(&out, ready) < 0)
        return NULL;
    return out;
}

/* prepare_load(keys) -> tuple of slots */
static PyObject *
Core_prepare_load(Core *c, PyObject *keys)
{
    Batch b;
    if (batch_open(c, keys, "prepare_load", &b) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        int32_t s = b.slot[i];
        if (s < 0 || c->state[s] != S_READY) {
            PyErr_Format(BlockNotFoundError, "block %R %s", b.items[i],
                         s < 0 ? "is not resident" : "is not ready (being written or removed)");
            batch_end(&b);
            return NULL;
        }
    }
    PyObject *out = slots_tuple(b.slot, b.n);
    if (out != NULL) {
        for (Py_ssize_t i = 0; i < b.n; i++)
            if (c->pins[b.slot[i]]++ == 0)
                c->n_pinned++;
    }
    batch_end(&b);
    return out;
}

/* complete_load(keys) */
static PyObject *
Core_complete_load(Core *c, PyObject *keys)
{
    Batch b;
    if (batch_open(c, keys, "complete_load", &b) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        int32_t s = b.slot[i];
        if (s < 0 || c->pins[s] <= 0 ||
            (c->state[s] != S_READY && c->state[s] != S_REM_PINNED)) {
            PyErr_Format(ProtocolError, "complete_load: block %R is not pinned", b.items[i]);
            batch_end(&b);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < b.n; i++) {
        int32_t s = b.slot[i];
        if (--c->pins[s])
            continue;
        c->n_pinned--;
        if (c->state[s] == S_REM_PINNED) {
            c->n_rem_pinned--;
            free_slot(c, s);
        }
    }
    batch_end(&b);
    Py_RETURN_NONE;
}

/* touch(keys): ready keys become most recent, the first most of all. */
static PyObject *
Core_touch(Core *c, PyObject *keys)
{
    Batch b;
    if (batch_open(c, keys, "touch", &b) < 0)
        return NULL;
    for (Py_ssize_t i = b.n - 1; i >= 0; i--) {
        int32_t s = b.slot[i];
        if (s < 0 || c->state[s] != S_READY)
            continue; /* absent, being written or removed: not in the order */
        /* LRU: it stays in its list. ARC: a second use moves T1 -> T2. */
        unlink_slot(c, s);
        push_front(c, c->arc ? L_TWO : L_ONE, s);
    }
    batch_end(&b);
    Py_RETURN_NONE;
}

/* remove(keys) -> (list of the keys removed, tuple of those that were ready) */
static PyObject *
Core_remove(Core *c, PyObject *keys)
{
    Batch b;
    if (batch_open(c, keys, "remove", &b) < 0)
        return NULL;
    PyObject *gone = PyList_New(0);
    PyObject *announced = PyList_New(0);
    PyObject *out = NULL;
    if (gone == NULL || announced == NULL)
        goto done;
    /* The results first, so that running out of memory changes nothing. */
    for (Py_ssize_t i = 0; i < b.n; i++) {
        int32_t s = b.slot[i];
        if (s < 0 || (c->state[s] != S_READY && c->state[s] != S_WRITING))
            continue; /* absent, or removed already */
        if (PyList_Append(gone, b.items[i]) < 0)
            goto done;
        if (c->state[s] == S_READY && PyList_Append(announced, b.items[i]) < 0)
            goto done;
    }
    PyObject *t = PyList_AsTuple(announced);
    if (t == NULL)
        goto done;
    out = PyTuple_Pack(2, gone, t);
    Py_DECREF(t);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        int32_t s = b.slot[i];
        if (s < 0)
            continue;
        if (c->state[s] == S_WRITING) {
            c->state[s] = S_REM_WRITING;
            c->ghost_hit[s] = 0;
            c->n_writing--;
            c->n_rem_writing++;
        }
        else if (c->state[s] == S_READY) {
            c->n_ready--;
            unlink_slot(c, s);
            if (c->pins[s]) {
                c->state[s] = S_REM_PINNED;
                c->n_rem_pinned++;
            }
            else
                free_slot(c, s);
        }
    }
done:
    Py_XDECREF(gone);
    Py_XDECREF(announced);
    batch_end(&b);
    return out;
}

/* reset() -> tuple of the keys that were ready */
static PyObject *
Core_reset(Core *c, PyObject *Py_UNUSED(ignored))
{
    if (not_ready(c))
        return NULL;
    if (c->n_pinned || c->n_writing || c->n_rem_writing) {
        PyErr_SetString(BusyError,
                        "reset: blocks are pinned or being written; complete them first");
        return NULL;
    }
    PyObject *ready = PyTuple_New(c->n_ready);
    if (ready == NULL)
        return NULL;
    Py_ssize_t j = 0;
    for (Py_ssize_t s = 0; s < c->capacity; s++) {
        if (c->state[s] == S_READY) {
            Py_INCREF(c->keys[s]);
            PyTuple_SET_ITEM(ready, j++, c->keys[s]);
        }
    }
    clear_state(c);
    return ready;
}

/* The slot of `key` in any state; -1 when absent (or not bytes); -2 with an
   exception set when the Core is not initialized. */
static int32_t
find_any(Core *c, PyObject *key)
{
    if (not_ready(c))
        return -2;
    if (!PyBytes_CheckExact(key))
        return -1;
    return find(c, key, hash32(key));
}

static PyObject *
Core_slot_of(Core *c, PyObject *key)
{
    int32_t s = find_any(c, key);
    if (s == -2)
        return NULL;
    if (s < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(s);
}

static PyObject *
Core_is_ready(Core *c, PyObject *key)
{
    int32_t s = find_any(c, key);
    if (s == -2)
        return NULL;
    return PyBool_FromLong(s >= 0 && c->state[s] == S_READY);
}

static PyObject *
Core_pins(Core *c, PyObject *key)
{
    int32_t s = find_any(c, key);
    if (s == -2)
        return NULL;
    if (s < 0 || (c->state[s] != S_READY && c->state[s] != S_REM_PINNED))
        return PyLong_FromLong(0);
    return PyLong_FromLong(c->pins[s]);
}

static int
Core_contains(Core *c, PyObject *key)
{
    int32_t s = find_any(c, key);
    return s == -2 ? -1 : s >= 0;
}

static Py_ssize_t
Core_len(Core *c)
{
    return c->n_ready + c->n_writing + c->n_rem_writing + c->n_rem_pinned;
}

/* (capacity, used, ready, being written, pinned, evictable, hits, misses, evictions) */
static PyObject *
Core_statistics(Core *c, PyObject *Py_UNUSED(ignored))
{
    if (not_ready(c))
        return NULL;
    return Py_BuildValue("nnnnnnLLL", c->capacity, Core_len(c), c->n_ready,
                         c->n_writing + c->n_rem_writing, c->n_pinned,
                         c->n_ready - c->n_pinned + c->n_rem_pinned, c->hits, c->misses,
                         c->evictions);
}

/* (p, T1 size, T2 size, B1 size, B2 size); LRU: its list is T1. */
static PyObject *
Core_policy_state(Core *c, PyObject *Py_UNUSED(ignored))
{
    if (not_ready(c))
        return NULL;
    return Py_BuildValue("dnnnn", c->p, c->l1.size, c->l2.size, c->b1, c->b2);
}

static PyObject *
Core_in_t2(Core *c, PyObject *arg)
{
    if (not_ready(c))
        return NULL;
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if (s == -1 && PyErr_Occurred())
        return NULL;
    if (s < 0 || s >= c->capacity)
        return PyErr_Format(PyExc_IndexError, "slot %zd out of range", s);
    return PyBool_FromLong(c->where[s] == L_TWO);
}

/* The recency order of list w, most recent first, as slots (tests). */
static PyObject *
Core_order(Core *c, PyObject *arg)
{
    if (not_ready(c))
        return NULL;
    long w = PyLong_AsLong(arg);
    if (w == -1 && PyErr_Occurred())
        return NULL;
    if (w != L_ONE && w != L_TWO)
        return PyErr_Format(PyExc_ValueError, "list must be 1 or 2, got %ld", w);
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (int32_t s = list_of(c, (uint8_t)w)->head; s >= 0; s = c->next[s]) {
        PyObject *v = PyLong_FromLong(s);
        if (v == NULL || PyList_Append(out, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    return out;
}

static PyMethodDef Core_methods[] = {
    {"lookup", (PyCFunction)Core_lookup, METH_O, NULL},
    {"prepare_store", (PyCFunction)Core_prepare_store, METH_O, NULL},
    {"complete_store", (PyCFunction)Core_complete_store, METH_VARARGS, NULL},
    {"prepare_load", (PyCFunction)Core_prepare_load, METH_O, NULL},
    {"complete_load", (PyCFunction)Core_complete_load, METH_O, NULL},
    {"touch", (PyCFunction)Core_touch, METH_O, NULL},
    {"remove", (PyCFunction)Core_remove, METH_O, NULL},
    {"reset", (PyCFunction)Core_reset, METH_NOARGS, NULL},
    {"slot_of", (PyCFunction)Core_slot_of, METH_O, NULL},
    {"is_ready", (PyCFunction)Core_is_ready, METH_O, NULL},
    {"pins", (PyCFunction)Core_pins, METH_O, NULL},
    {"statistics", (PyCFunction)Core_statistics, METH_NOARGS, NULL},
    {"policy_state", (PyCFunction)Core_policy_state, METH_NOARGS, NULL},
    {"in_t2", (PyCFunction)Core_in_t2, METH_O, NULL},
    {"order", (PyCFunction)Core_order, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Core_as_sequence = {
    .sq_length = (lenfunc)Core_len,
    .sq_contains = (objobjproc)Core_contains,
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtier.manager._native.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Residency state and the LRU / ARC policy of one tier (see kvtier.manager.native).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_as_sequence = &Core_as_sequence,
};

static PyObject *
set_errors(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *a, *b, *c, *d;
    if (!PyArg_ParseTuple(args, "OOOO", &a, &b, &c, &d))
        return NULL;
    Py_INCREF(a);
    Py_INCREF(b);
    Py_INCREF(c);
    Py_INCREF(d);
    Py_XSETREF(InvalidArgumentError, a);
    Py_XSETREF(ProtocolError, b);
    Py_XSETREF(BlockNotFoundError, c);
    Py_XSETREF(BusyError, d);
    Py_RETURN_NONE;
}

static PyObject *
crc32_py(PyObject *Py_UNUSED(module), PyObject *arg)
{
    if (!PyBytes_Check(arg))
        return PyErr_Format(PyExc_TypeError, "expected bytes, got %R", arg);
    return PyLong_FromUnsignedLong(
        crc32_of((const unsigned char *)PyBytes_AS_STRING(arg), PyBytes_GET_SIZE(arg)));
}

static PyMethodDef module_methods[] = {
    {"set_errors", set_errors, METH_VARARGS,
     "Hand over the exception classes (invalid argument, protocol, not found, busy)."},
    {"crc32", crc32_py, METH_O, "The ghost fingerprint of a key (zlib.crc32)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier.manager._native",
    .m_doc = "The residency manager's state and policies in C.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    crc_init();
    /* Until set_errors runs, errors are plain ValueError / RuntimeError / KeyError. */
    InvalidArgumentError = Py_NewRef(PyExc_ValueError);
    ProtocolError = Py_NewRef(PyExc_RuntimeError);
    BlockNotFoundError = Py_NewRef(PyExc_KeyError);
    BusyError = Py_NewRef(PyExc_RuntimeError);
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
