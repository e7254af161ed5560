/* The event ring's per-step publish in one C call: `RingWriter.publish_one` (ring.py).
 *
 * The same accesses in the same order as ring.py's `publish_array` for a one-event record:
 * record bytes; [full fence for a large copy]; published_ns; head (store-release); full fence;
 * sleeps and tail loads. The memory ordering is the C11 atomics' (ARM64 included): the
 * store-release orders the record bytes before the head, the sequentially consistent fence
 * orders the head store before the sleeps load (Dekker; see ring.py's docstring). Every index
 * read from the mapping is validated against the writer's own copy before use, exactly as
 * ring.py validates it; a violation is reported to the caller, which raises RingCorrupt.
 *
 * publish_one(data, words, payload, head, published, tail, sleeps_seen, max_payload)
 *   data: the writable data region (its length is the capacity, a power of two)
 *   words: the writable header (at least 192 bytes, 8-byte aligned)
 *   payload: one encoded event (any bytes-like object)
 *   sleeps_seen: None or the sleeps value of the last doorbell
 * -> (code, head, tail, sleeps_seen): code 0 published (no doorbell), 1 published (ring the
 *    doorbell), -1 not written (no room, or over max_payload), -2 the tail read from the mapping
 *    is impossible (tail holds it; published as far as head says).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define SLOT_BYTES 64u
#define LEN_BYTES 4u
#define HEADER_BYTES 192
#define W_HEAD 8       /* word indices: HEAD_OFFSET / 8 ... */
#define W_PUBLISHED_NS 9
#define W_TAIL 16
#define W_SLEEPS 17
#define LARGE_COPY_BYTES (1u << 16)
#define FIXARRAY_OF_ONE 0x91

static int as_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

static void copy_in(uint8_t *data, uint64_t cap, uint64_t off, const uint8_t *src, uint64_t n) {
    uint64_t first = cap - off < n ? cap - off : n;
    memcpy(data + off, src, first);
    if (first < n) memcpy(data, src + first, n - first);
}

static PyObject *publish_one(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "publish_one takes 8 arguments");
        return NULL;
    }
    Py_buffer data, words, payload;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &words, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &payload, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&words);
        return NULL;
    }
    PyObject *result = NULL;
    uint64_t head, published, tail, seen = 0, max_payload;
    int have_seen = args[6] != Py_None;
    if (as_u64(args[3], &head) < 0 || as_u64(args[4], &published) < 0
        || as_u64(args[5], &tail) < 0 || (have_seen && as_u64(args[6], &seen) < 0)
        || as_u64(args[7], &max_payload) < 0)
        goto done;
    uint64_t cap = (uint64_t)data.len;
    if (words.len < HEADER_BYTES || (uintptr_t)words.buf % 8 || cap < 2 * SLOT_BYTES
        || (cap & (cap - 1)) || !(tail <= published && published <= head && head - tail <= cap)) {
        PyErr_SetString(PyExc_ValueError, "publish_one: not a ring writer's views and state");
        goto done;
    }
    uint64_t *w = (uint64_t *)words.buf;
    uint8_t *d = (uint8_t *)data.buf;
    uint64_t n = 1 + (uint64_t)payload.len;
    uint64_t size = (n + LEN_BYTES + SLOT_BYTES - 1) & ~(uint64_t)(SLOT_BYTES - 1);
    long code;
    if (n > max_payload || n > UINT32_MAX) {
        code = -1;
        goto out;
    }
    if (size > cap - (head - tail)) { /* refresh_tail: forward, up to what was published */
        uint64_t t = __atomic_load_n(&w[W_TAIL], __ATOMIC_ACQUIRE);
        if (!(tail <= t && t <= published) || t % SLOT_BYTES) {
            tail = t;
            code = -2;
            goto out;
        }
        tail = t;
        if (size > cap - (head - tail)) {
            code = -1;
            goto out;
        }
    }
    {
        uint8_t prefix[LEN_BYTES + 1];
        uint32_t n32 = (uint32_t)n;
        memcpy(prefix, &n32, LEN_BYTES); /* little-endian host (ring.py refuses others) */
        prefix[LEN_BYTES] = FIXARRAY_OF_ONE;
        uint64_t off = head % cap;
        copy_in(d, cap, off, prefix, sizeof prefix);
        copy_in(d, cap, (off + sizeof prefix) % cap, (const uint8_t *)payload.buf,
                (uint64_t)payload.len);
    }
    if (head - published + size >= LARGE_COPY_BYTES)
        __atomic_thread_fence(__ATOMIC_SEQ_CST); /* memcpy may have used non-temporal stores */
    head += size;
    {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
        __atomic_store_n(&w[W_PUBLISHED_NS], ns, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&w[W_HEAD], head, __ATOMIC_RELEASE); /* record bytes before the head */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);              /* the head before the sleeps load */
    {
        uint64_t sleeps = __atomic_load_n(&w[W_SLEEPS], __ATOMIC_RELAXED);
        uint64_t t = __atomic_load_n(&w[W_TAIL], __ATOMIC_ACQUIRE);
        if (t != tail) {
            if (!(tail <= t && t <= head) || t % SLOT_BYTES) {
                tail = t;
                code = -2;
                goto out;
            }
            tail = t;
        }
        if (have_seen && (sleeps == seen || !(sleeps & 1))) {
            code = 0;
        } else {
            code = 1;
            seen = sleeps;
            have_seen = 1;
        }
    }
out:
    {
        PyObject *s = have_seen ? PyLong_FromUnsignedLongLong(seen) : Py_NewRef(Py_None);
        if (s != NULL)
            result = Py_BuildValue("(lKKN)", code, (unsigned long long)head,
                                   (unsigned long long)tail, s);
    }
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&words);
    PyBuffer_Release(&payload);
    return result;
}

static PyMethodDef methods[] = {
    {"publish_one", (PyCFunction)(void (*)(void))publish_one, METH_FASTCALL,
     "publish_one(data, words, payload, head, published, tail, sleeps_seen, max_payload)"
     " -> (code, head, tail, sleeps_seen): ring.py's one-event publish in one call."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_ringfast", "The event ring's per-step publish (ring.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ringfast(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    /* the layout this build assumes: ring.py uses it only where it equals its own */
    PyObject *layout = Py_BuildValue(
        "(IIIIIIII)", SLOT_BYTES, LEN_BYTES, W_HEAD * 8u, W_PUBLISHED_NS * 8u, W_TAIL * 8u,
        W_SLEEPS * 8u, (unsigned)HEADER_BYTES, LARGE_COPY_BYTES);
    if (layout == NULL || PyModule_AddObject(m, "LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
