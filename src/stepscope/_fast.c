/* stepscope._fast: the hot recording path in C (optional; record/recorder.py has a pure-Python twin).
 *
 * Events are (code, timestamp, thread ident) triples of int64 in one growable process-wide
 * buffer, as in viztracer: no Python object is made per event, and the writer thread takes the
 * raw bytes at flush time (drain) and decodes them with numpy. Every function here runs with the
 * GIL held and without calling back into Python between the clock read and the store, so the
 * three words of an event always land together and each thread's events stay in time order.
 *
 * The timestamp is clock_gettime(CLOCK_MONOTONIC), which is what time.perf_counter_ns() reads on
 * Linux (the only platform this module is built for); a test checks that both agree.
 *
 * Range objects, the annotate()/push_range()/pop_range() fast paths and the decorator wrapper
 * read one global mode: OFF (do nothing), RECORD (store), DELEGATE (call the Python slow path,
 * e.g. to forward to NVTX as well).
 *
 * Also here, for the profiler's step (once per training step, so every operation of Python it
 * saves counts): step_boundary (a step's begin, end and the next placeholder in one call),
 * StepCounters (the step timer's figures), and for the writer assemble/numbered_events (a
 * batch's packets and step begins built in one call each).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <structmember.h>
#include <stddef.h>
#include <stdio.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "_wire_tags.h" /* the tags written here, generated from stepscope/format/wire.py */

enum { MODE_OFF = 0, MODE_RECORD = 1, MODE_DELEGATE = 2 };

static int64_t *buf = NULL;
static Py_ssize_t buf_len = 0; /* int64 words used (a multiple of 3) */
static Py_ssize_t buf_cap = 0;
static long long lost = 0; /* events not stored because memory ran out */
static int mode = MODE_OFF;
static int recording = 0; /* recorder.ON (set_recording, by recorder.set_state): summary events */
static int64_t end_code = 1; /* the code of a detail-level range end */

/* configured from Python (owned references) */
static PyObject *by_message = NULL;  /* message -> cached range object (annotate fast path) */
static PyObject *push_codes = NULL;  /* message -> begin code (push_range fast path) */
static PyObject *annotate_slow = NULL;
static PyObject *push_slow = NULL;
static PyObject *pop_slow = NULL;
static PyObject *str_enter_slow = NULL;
static PyObject *str_exit_slow = NULL;

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int grow(Py_ssize_t need) {
    Py_ssize_t cap = buf_cap ? buf_cap : 3 * 4096;
    while (cap < need) cap *= 2;
    int64_t *nb = PyMem_RawRealloc(buf, (size_t)cap * sizeof(int64_t));
    if (nb == NULL) return -1;
    buf = nb;
    buf_cap = cap;
    return 0;
}

/* Thread marks. Python reuses a thread ident (pthread_self) as soon as its thread has ended, so
 * the ident alone cannot tell two threads apart. The first event of each OS thread in each
 * recording (since the last clear) is preceded by (THREAD_MARK, native thread id, ident): the
 * writer starts a new thread there. The check is one thread-local load per event. */
#define THREAD_MARK 7 /* _recorder.THREAD: code(0, 1, 3), a code no event has */
/* _recorder.STEPS: ident | STEPS_IDENT is the ident of the thread's step events (a sequence
 * and a track of their own) */
#define STEPS_IDENT (1LL << 62)
static int64_t generation = 1; /* bumped by clear(): every thread marks itself again */
/* initial-exec: a direct %fs access, not a __tls_get_addr call on every put() */
static __thread __attribute__((tls_model("initial-exec"))) int64_t marked_generation = 0;
/* the latest timestamp this thread recorded (thread_last_ts(): a time given for an event now,
 * one read earlier, must not precede it: each thread's events stay in time order) */
static __thread __attribute__((tls_model("initial-exec"))) int64_t last_ts = 0;

static void mark_thread(void) {
    if (buf_len + 3 > buf_cap && grow(buf_len + 3) < 0) return; /* retried at the next event */
    int64_t *p = buf + buf_len;
    p[0] = THREAD_MARK;
    p[1] = (int64_t)PyThread_get_thread_native_id();
    p[2] = (int64_t)PyThread_get_thread_ident();
    buf_len += 3;
    marked_generation = generation;
}

static inline void put(int64_t code, int64_t ts) {
    if (__builtin_expect(marked_generation != generation, 0)) mark_thread();
    if (buf_len + 3 > buf_cap && grow(buf_len + 3) < 0) {
        lost++;
        return;
    }
    int64_t *p = buf + buf_len;
    p[0] = code;
    p[1] = ts;
    p[2] = (int64_t)PyThread_get_thread_ident();
    buf_len += 3;
    if (ts > last_ts) last_ts = ts;
}

static inline void put_now(int64_t code) { put(code, now_ns()); }

/* ---- module functions: the buffer ------------------------------------------------------------ */

static PyObject *f_extend(PyObject *self, PyObject *seq) {
    /* Append whole events from a sequence of ints (len % 3 == 0), all or nothing. A tuple
     * copy: an item's __index__ cannot change what is being read. */
    PyObject *fast = PySequence_Tuple(seq);
    if (fast == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(fast);
    if (n % 3) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "extend() needs whole (code, ts, ident) triples");
        return NULL;
    }
    int64_t small[12];
    int64_t *tmp = n <= 12 ? small : PyMem_Malloc((size_t)n * sizeof(int64_t));
    if (tmp == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    PyObject **items = &PyTuple_GET_ITEM(fast, 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        tmp[i] = PyLong_AsLongLong(items[i]);
        if (tmp[i] == -1 && PyErr_Occurred()) {
            if (tmp != small) PyMem_Free(tmp);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    if (n && marked_generation != generation) mark_thread();
    if (buf_len + n > buf_cap && grow(buf_len + n) < 0) {
        lost += n / 3;
    } else {
        memcpy(buf + buf_len, tmp, (size_t)n * sizeof(int64_t));
        buf_len += n;
        const int64_t me = (int64_t)PyThread_get_thread_ident();
        for (Py_ssize_t i = 0; i < n; i += 3)
            if (tmp[i + 2] == me && tmp[i] != THREAD_MARK && tmp[i + 1] > last_ts)
                last_ts = tmp[i + 1];
    }
    if (tmp != small) PyMem_Free(tmp);
    Py_RETURN_NONE;
}

static PyObject *f_drain(PyObject *self, PyObject *unused) {
    /* Everything recorded so far, as raw native int64 bytes; the buffer is emptied. */
    PyObject *out = PyBytes_FromStringAndSize((const char *)buf, buf_len * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL) return NULL;
    buf_len = 0;
    if (buf_cap > 3 * (1 << 20)) { /* give back a buffer grown by a burst */
        PyMem_RawFree(buf);
        buf = NULL;
        buf_cap = 0;
    }
    return out;
}

static PyObject *f_size(PyObject *self, PyObject *unused) { return PyLong_FromSsize_t(buf_len); }

static PyObject *f_thread_last_ts(PyObject *self, PyObject *unused) {
    return PyLong_FromLongLong(last_ts);
}

static PyObject *f_lost(PyObject *self, PyObject *unused) { return PyLong_FromLongLong(lost); }

static PyObject *f_clear(PyObject *self, PyObject *unused) {
    buf_len = 0;
    generation++; /* the marks went with the events */
    Py_RETURN_NONE;
}

/* The index of the last recorded event (code, ts, ident) among the last `lookback`, or -1. */
static Py_ssize_t find_event(long long code, long long ts, long long ident, long long lookback) {
    Py_ssize_t stop = buf_len - 3 * (Py_ssize_t)(lookback < 0 ? 0 : lookback);
    if (stop < 0) stop = 0;
    for (Py_ssize_t i = buf_len - 3; i >= stop; i -= 3)
        if (buf[i + 1] == ts && buf[i] == code && buf[i + 2] == ident) return i;
    return -1;
}

/* The recorded event (code, ts, ident) among the last `lookback` becomes `new_code`, in place
 * (a placeholder its begin, or an event a placeholder): 1, or 0 if it is gone. */
static int replace_event(long long code, long long ts, long long ident, long long new_code,
                         long long lookback) {
    Py_ssize_t at = find_event(code, ts, ident, lookback);
    if (at < 0) return 0;
    buf[at] = new_code;
    return 1;
}

/* Append n words (whole events) recorded by this thread. */
static void append_words(const int64_t *w, Py_ssize_t n) {
    if (marked_generation != generation) mark_thread();
    if (buf_len + n > buf_cap && grow(buf_len + n) < 0) {
        lost += n / 3;
        return;
    }
    memcpy(buf + buf_len, w, (size_t)n * sizeof(int64_t));
    buf_len += n;
    for (Py_ssize_t i = 1; i < n; i += 3)
        if (w[i] > last_ts) last_ts = w[i];
}

/* A step boundary: the open step's placeholder (null_code, bts, bident) becomes its `begin`,
 * then its end (end, ts, ident) and the next step's placeholder (null_code, ts, ident) are
 * appended; 0, with nothing written, if a flush took the placeholder. */
static int step_boundary(long long end, long long ts, long long ident, long long begin,
                         long long bts, long long bident, long long null_code,
                         long long lookback) {
    if (!replace_event(null_code, bts, bident, begin, lookback)) return 0;
    int64_t w[6] = {end, ts, ident, null_code, ts, ident};
    append_words(w, 6);
    return 1;
}

static PyObject *f_withdraw(PyObject *self, PyObject *args) {
    /* Turn the recorded event (code, ts, ident) into `null_code`, searching the last `lookback`
     * events; True if found. */
    long long code, ts, ident, null_code;
    Py_ssize_t lookback;
    if (!PyArg_ParseTuple(args, "LLLLn", &code, &ts, &ident, &null_code, &lookback)) return NULL;
    return PyBool_FromLong(replace_event(code, ts, ident, null_code, lookback));
}

static PyObject *f_set_recording(PyObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    recording = on;
    Py_RETURN_NONE;
}

static PyObject *f_set_mode(PyObject *self, PyObject *arg) {
    int m = PyLong_AsLong(arg);
    if (m == -1 && PyErr_Occurred()) return NULL;
    if (m < MODE_OFF || m > MODE_DELEGATE) {
        PyErr_SetString(PyExc_ValueError, "mode must be 0, 1 or 2");
        return NULL;
    }
    mode = m;
    Py_RETURN_NONE;
}

static PyObject *f_configure(PyObject *self, PyObject *args) {
    /* configure(end_code, by_message: dict, push_codes: dict, annotate_slow, push_slow,
     *           pop_slow) */
    PyObject *bm, *pc, *as, *ps, *pp;
    long long end;
    if (!PyArg_ParseTuple(args, "LO!O!OOO", &end, &PyDict_Type, &bm, &PyDict_Type, &pc, &as, &ps,
                          &pp))
        return NULL;
    end_code = end;
    Py_INCREF(bm); Py_XSETREF(by_message, bm);
    Py_INCREF(pc); Py_XSETREF(push_codes, pc);
    Py_INCREF(as); Py_XSETREF(annotate_slow, as);
    Py_INCREF(ps); Py_XSETREF(push_slow, ps);
    Py_INCREF(pp); Py_XSETREF(pop_slow, pp);
    Py_RETURN_NONE;
}

static PyObject *call_slow(PyObject *fn, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    if (fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "stepscope._fast is not configured");
        return NULL;
    }
    return PyObject_Vectorcall(fn, args, nargs, kwnames);
}

/* The entry of a fast-path cache for `key` (borrowed), or NULL: not cached, or unhashable (a
 * TypeError, cleared: the Python path cleans such keys). *failed is set for any other error,
 * which must reach the caller. */
static PyObject *cached(PyObject *cache, PyObject *key, int *failed) {
    *failed = 0;
    PyObject *v = PyDict_GetItemWithError(cache, key);
    if (v == NULL && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) PyErr_Clear();
        else *failed = 1;
    }
    return v;
}

/* annotate(message=None, ...): the cached range of a plain message, else the Python path. */
static PyObject *f_annotate(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    if (nargs == 1 && kwnames == NULL && by_message != NULL) {
        int failed;
        PyObject *r = cached(by_message, args[0], &failed);
        if (r != NULL) return Py_NewRef(r);
        if (failed) return NULL;
    }
    return call_slow(annotate_slow, args, nargs, kwnames);
}

static PyObject *f_push_range(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    if (mode == MODE_OFF) Py_RETURN_NONE;
    if (mode == MODE_RECORD && nargs == 1 && kwnames == NULL && push_codes != NULL) {
        int failed;
        PyObject *c = cached(push_codes, args[0], &failed);
        if (c != NULL) {
            long long code = PyLong_AsLongLong(c);
            if (code == -1 && PyErr_Occurred()) return NULL;
            put_now(code);
            Py_RETURN_NONE;
        }
        if (failed) return NULL;
    }
    return call_slow(push_slow, args, nargs, kwnames);
}

static PyObject *f_pop_range(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
    if (mode == MODE_OFF) Py_RETURN_NONE;
    if (mode == MODE_RECORD) {
        put_now(end_code);
        Py_RETURN_NONE;
    }
    return call_slow(pop_slow, args, nargs, kwnames);
}

/* ---- Emit: a callable that records one fixed code now ----------------------------------------
 * It ignores any arguments, so that it can stand as an __exit__ (as a staticmethod) too. */

typedef struct {
    PyObject_HEAD
    int64_t code;
    vectorcallfunc vectorcall;
} EmitObject;

/* The summary-level ranges open on each thread, as its Emit calls began and ended them (phases,
 * record_function and captured nvtx ranges: every summary begin of a cached name and every
 * summary end), so that a boundary the program did not place itself (the step driver's, after an
 * optimizer step) is made where it cuts no range: at_top(fn, base) calls fn after the end that
 * brings the calling thread's count down to base (0: closes its outermost range);
 * before_top(fn, base) calls fn(code) before each begin made with base ranges open, until fn
 * returns True. base is the loop's own level: the ranges that span the loop's iterations (a
 * record_function around it) stay open across steps, and a boundary waits for none of them.
 * The driver reads it as the lowest count since the last boundary (summary_low(); mark_low()
 * starts it again at the current count, and at_top's call does so itself). An end with no begin
 * counted (a begin recorded otherwise, a range begun before recording) leaves the count at 0.
 * reset_depth() (a profiler's start) zeroes every thread's count and low, each at its next
 * Emit, and drops both calls. */
static __thread __attribute__((tls_model("initial-exec"))) long depth = 0;
static __thread __attribute__((tls_model("initial-exec"))) long depth_low = 0;
static __thread __attribute__((tls_model("initial-exec"))) int64_t depth_seen = 0;
static int64_t depth_epoch = 1;
static PyObject *at_top_fn = NULL; /* (owned) called once, on thread at_top_ident */
static long long at_top_ident = 0;
static long at_top_base = 0;
static PyObject *before_top_fn = NULL; /* (owned) called on thread before_top_ident */
static long long before_top_ident = 0;
static long before_top_base = 0;

static int boundary_failed(void);

static inline long *thread_depth(void) {
    if (depth_seen != depth_epoch) {
        depth = 0;
        depth_low = 0;
        depth_seen = depth_epoch;
    }
    return &depth;
}

static PyObject *emit_call(PyObject *self, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
    int64_t code = ((EmitObject *)self)->code;
    if (code < 0 || !(code & 4)) { /* (bit 2: LEVEL_SUMMARY) */
        put_now(code);
        Py_RETURN_NONE;
    }
    long *d = thread_depth();
    if ((code & 3) == 0) { /* BEGIN */
        if (before_top_fn != NULL && *d == before_top_base
            && before_top_ident == (long long)PyThread_get_thread_ident()) {
            PyObject *fn = Py_NewRef(before_top_fn);
            PyObject *c = PyLong_FromLongLong(code);
            PyObject *r = c != NULL ? PyObject_CallOneArg(fn, c) : NULL;
            Py_XDECREF(c);
            if (r == Py_True && before_top_fn == fn) Py_CLEAR(before_top_fn); /* taken */
            Py_DECREF(fn);
            if (r == NULL && boundary_failed() < 0) return NULL;
            Py_XDECREF(r);
        }
        put_now(code);
        ++*d;
        Py_RETURN_NONE;
    }
    put_now(code);
    if ((code & 3) != 1 || *d == 0) Py_RETURN_NONE;
    if (--*d < depth_low) depth_low = *d;
    if (at_top_fn != NULL && *d == at_top_base
        && at_top_ident == (long long)PyThread_get_thread_ident()) {
        PyObject *fn = at_top_fn; /* taken before the call: called once */
        at_top_fn = NULL;
        depth_low = *d; /* a boundary: the next one's base is read from here */
        PyObject *r = PyObject_CallNoArgs(fn);
        Py_DECREF(fn);
        if (r == NULL && boundary_failed() < 0) return NULL;
        Py_XDECREF(r);
    }
    Py_RETURN_NONE;
}

static PyObject *f_summary_depth(PyObject *self, PyObject *unused) {
    return PyLong_FromLong(*thread_depth());
}

static PyObject *f_summary_low(PyObject *self, PyObject *unused) {
    thread_depth();
    return PyLong_FromLong(depth_low);
}

static PyObject *f_mark_low(PyObject *self, PyObject *unused) {
    depth_low = *thread_depth();
    Py_RETURN_NONE;
}

/* (fn[, base]) of at_top and before_top: base >= 0, 0 when not given */
static int top_args(PyObject *const *args, Py_ssize_t nargs, const char *name, long *base) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes fn and an optional base", name);
        return -1;
    }
    *base = 0;
    if (nargs == 2) {
        *base = PyLong_AsLong(args[1]);
        if (*base == -1 && PyErr_Occurred()) return -1;
        if (*base < 0) {
            PyErr_Format(PyExc_ValueError, "%s(): base must be >= 0", name);
            return -1;
        }
    }
    return 0;
}

static PyObject *f_at_top(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long base;
    if (top_args(args, nargs, "at_top", &base) < 0) return NULL;
    PyObject *was = at_top_fn; /* (returned: the call it replaces, if one was still to come) */
    at_top_fn = args[0] == Py_None ? NULL : Py_NewRef(args[0]);
    at_top_ident = (long long)PyThread_get_thread_ident();
    at_top_base = base;
    return was != NULL ? was : Py_NewRef(Py_None);
}

static PyObject *f_before_top(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long base;
    if (top_args(args, nargs, "before_top", &base) < 0) return NULL;
    PyObject *was = before_top_fn; /* (returned: the call it replaces) */
    before_top_fn = args[0] == Py_None ? NULL : Py_NewRef(args[0]);
    before_top_ident = (long long)PyThread_get_thread_ident();
    before_top_base = base;
    return was != NULL ? was : Py_NewRef(Py_None);
}

static PyObject *f_reset_depth(PyObject *self, PyObject *unused) {
    depth_epoch++;
    Py_CLEAR(at_top_fn);
    Py_CLEAR(before_top_fn);
    Py_RETURN_NONE;
}

static PyObject *emit_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    long long code;
    if (!PyArg_ParseTuple(args, "L:Emit", &code)) return NULL;
    EmitObject *self = (EmitObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->code = code;
    self->vectorcall = emit_call;
    return (PyObject *)self;
}

static PyObject *emit_get_code(EmitObject *self, void *closure) {
    return PyLong_FromLongLong(self->code);
}

static PyGetSetDef emit_getset[] = {
    {"code", (getter)emit_get_code, NULL, "the event code recorded", NULL},
    {NULL},
};

static PyTypeObject EmitType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepscope._fast.Emit",
    .tp_basicsize = sizeof(EmitObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(EmitObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = emit_new,
    .tp_getset = emit_getset,
    .tp_doc = "Emit(code)(*ignored): record (code, now, thread ident); returns None.",
};

/* ---- Range: the cached context manager of one message ---------------------------------------
 *
 * `with r:` looks __enter__ and __exit__ up on r's type and binds them to r. A plain method
 * would make (and free) two bound-method objects per `with`, which costs more than everything
 * else a range does (about 80 ns of 130 on CPython 3.11). So the type holds two RangeMethod
 * descriptors instead, which hand out bound callables made once per range and kept on it: a
 * cached range costs a `with` no allocation at all. The kept callables point back at the range
 * (a cycle the GC can see: ranges are tracked). */

typedef struct {
    PyObject_HEAD
    int64_t code;
    PyObject *bound[2]; /* __enter__, __exit__ bound to this range (made on first use) */
} RangeObject;

static int range_init(PyObject *self, PyObject *args, PyObject *kwds) {
    long long code = 0;
    if (!PyArg_ParseTuple(args, "|L:Range", &code)) return -1;
    ((RangeObject *)self)->code = code;
    return 0;
}

static PyObject *range_enter(PyObject *self, PyObject *unused) {
    if (mode == MODE_RECORD) {
        put_now(((RangeObject *)self)->code);
    } else if (mode == MODE_DELEGATE) {
        PyObject *r = PyObject_CallMethodNoArgs(self, str_enter_slow);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    return Py_NewRef(self);
}

static PyObject *range_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (mode == MODE_RECORD) {
        put_now(end_code);
    } else if (mode == MODE_DELEGATE) {
        PyObject *r = PyObject_CallMethodNoArgs(self, str_exit_slow);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE; /* never swallows the exception */
}

static PyMethodDef range_method_defs[2] = {
    {"__enter__", range_enter, METH_NOARGS, "Begin the range on this thread."},
    {"__exit__", (PyCFunction)(void (*)(void))range_exit, METH_FASTCALL,
     "End the innermost range of this thread."},
};

static PyTypeObject RangeType;

typedef struct {
    PyObject_HEAD
    int which; /* 0: __enter__, 1: __exit__ */
} RangeMethodObject;

static PyObject *rangemethod_get(PyObject *op, PyObject *obj, PyObject *type) {
    if (obj == NULL) return Py_NewRef(op); /* looked up on the class */
    if (!PyObject_TypeCheck(obj, &RangeType)) {
        PyErr_SetString(PyExc_TypeError, "a Range method bound to a non-Range object");
        return NULL;
    }
    int which = ((RangeMethodObject *)op)->which;
    PyObject **slot = &((RangeObject *)obj)->bound[which];
    if (*slot == NULL) {
        PyObject *bound = PyCFunction_New(&range_method_defs[which], obj);
        if (bound == NULL) return NULL;
        if (*slot == NULL) *slot = bound; /* the allocation may have let another thread in */
        else Py_DECREF(bound);
    }
    return Py_NewRef(*slot);
}

static PyObject *rangemethod_call(PyObject *op, PyObject *args, PyObject *kwds) {
    /* Range.__enter__(r) / Range.__exit__(r, *exc), as with any method taken from the class */
    if (PyTuple_GET_SIZE(args) < 1 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "a Range method needs the range as first argument");
        return NULL;
    }
    PyObject *bound = rangemethod_get(op, PyTuple_GET_ITEM(args, 0), NULL);
    if (bound == NULL) return NULL;
    PyObject *rest = PyTuple_GetSlice(args, 1, PyTuple_GET_SIZE(args));
    PyObject *res = rest ? PyObject_Call(bound, rest, NULL) : NULL;
    Py_XDECREF(rest);
    Py_DECREF(bound);
    return res;
}

static PyTypeObject RangeMethodType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepscope._fast.RangeMethod",
    .tp_basicsize = sizeof(RangeMethodObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_descr_get = rangemethod_get,
    .tp_call = rangemethod_call,
    .tp_doc = "Range.__enter__ / Range.__exit__: bound once per range, then reused.",
};

static int range_traverse(RangeObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->bound[0]);
    Py_VISIT(self->bound[1]);
    return 0;
}

static int range_clear(RangeObject *self) {
    Py_CLEAR(self->bound[0]);
    Py_CLEAR(self->bound[1]);
    return 0;
}

static void range_dealloc(RangeObject *self) {
    PyObject_GC_UnTrack(self);
    range_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *range_get_code(RangeObject *self, void *closure) {
    return PyLong_FromLongLong(self->code);
}

static int range_set_code(RangeObject *self, PyObject *value, void *closure) {
    long long c = value ? PyLong_AsLongLong(value) : 0;
    if (c == -1 && PyErr_Occurred()) return -1;
    self->code = c;
    return 0;
}

static PyGetSetDef range_getset[] = {
    {"code", (getter)range_get_code, (setter)range_set_code, "the begin code recorded", NULL},
    {NULL},
};

static PyTypeObject RangeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepscope._fast.Range",
    .tp_basicsize = sizeof(RangeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = range_init,
    .tp_dealloc = (destructor)range_dealloc,
    .tp_traverse = (traverseproc)range_traverse,
    .tp_clear = (inquiry)range_clear,
    .tp_getset = range_getset,
    .tp_doc = "Range(code): a context manager recording a begin and an end on this thread.",
};

/* Put the two RangeMethod descriptors into Range's dict (after PyType_Ready). */
static int range_add_methods(void) {
    for (int which = 0; which < 2; which++) {
        RangeMethodObject *d = PyObject_New(RangeMethodObject, &RangeMethodType);
        if (d == NULL) return -1;
        d->which = which;
        int rc = PyDict_SetItemString(RangeType.tp_dict, range_method_defs[which].ml_name,
                                      (PyObject *)d);
        Py_DECREF(d);
        if (rc < 0) return -1;
    }
    PyType_Modified(&RangeType);
    return 0;
}

/* noop(*args, **kwargs) -> None: the cheapest C callable, for switched-off __enter__/__exit__ */
static PyObject *f_noop(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                        PyObject *kwnames) {
    Py_RETURN_NONE;
}

/* ---- Decorated: a function wrapped in a range ----------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *func;
    PyObject *slow; /* called instead of func in DELEGATE mode (the Python wrapper) */
    PyObject *dict;
    PyObject *weakreflist;
    int64_t code;
    vectorcallfunc vectorcall;
} DecoratedObject;

static PyObject *decorated_call(PyObject *op, PyObject *const *args, size_t nargsf,
                                PyObject *kwnames) {
    DecoratedObject *self = (DecoratedObject *)op;
    if (mode == MODE_OFF) return PyObject_Vectorcall(self->func, args, nargsf, kwnames);
    if (mode == MODE_DELEGATE) return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    put_now(self->code);
    PyObject *res = PyObject_Vectorcall(self->func, args, nargsf, kwnames);
    put_now(end_code); /* also when the call raised (like a finally) */
    return res;
}

static PyObject *decorated_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *func, *slow;
    long long code;
    if (!PyArg_ParseTuple(args, "OOL:Decorated", &func, &slow, &code)) return NULL;
    if (!PyCallable_Check(func) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "Decorated() needs callables");
        return NULL;
    }
    DecoratedObject *self = (DecoratedObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->func = Py_NewRef(func);
    self->slow = Py_NewRef(slow);
    self->code = code;
    self->vectorcall = decorated_call;
    return (PyObject *)self;
}

static int decorated_traverse(DecoratedObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->func);
    Py_VISIT(self->slow);
    Py_VISIT(self->dict);
    return 0;
}

static int decorated_clear(DecoratedObject *self) {
    Py_CLEAR(self->func);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->dict);
    return 0;
}

static void decorated_dealloc(DecoratedObject *self) {
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) PyObject_ClearWeakRefs((PyObject *)self);
    decorated_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *decorated_descr_get(PyObject *self, PyObject *obj, PyObject *type) {
    /* a decorated function in a class body becomes a method, like a plain function */
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *decorated_reduce(PyObject *self, PyObject *unused) {
    /* pickled by name, like the function it replaces (multiprocessing sends functions so) */
    return PyObject_GetAttrString(self, "__qualname__");
}

static PyObject *decorated_get_func(DecoratedObject *self, void *closure) {
    return Py_NewRef(self->func);
}

static PyMethodDef decorated_methods[] = {
    {"__reduce__", decorated_reduce, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef decorated_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {"func", (getter)decorated_get_func, NULL, "the wrapped function", NULL},
    {NULL},
};

static PyTypeObject DecoratedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepscope._fast.Decorated",
    .tp_basicsize = sizeof(DecoratedObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
                | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(DecoratedObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = decorated_new,
    .tp_dealloc = (destructor)decorated_dealloc,
    .tp_traverse = (traverseproc)decorated_traverse,
    .tp_clear = (inquiry)decorated_clear,
    .tp_descr_get = decorated_descr_get,
    .tp_dictoffset = offsetof(DecoratedObject, dict),
    .tp_weaklistoffset = offsetof(DecoratedObject, weakreflist),
    .tp_methods = decorated_methods,
    .tp_getset = decorated_getset,
    .tp_doc = "Decorated(func, slow, code): func recorded as a range on every call.",
};

/* ---- encoding: the writer's inner loop ------------------------------------------------------ */

static inline Py_ssize_t varint_size(uint64_t v) {
    Py_ssize_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline char *put_varint(char *p, uint64_t v) {
    while (v >= 0x80) {
        *p++ = (char)(v | 0x80);
        v >>= 7;
    }
    *p++ = (char)v;
    return p;
}

static int get_int64_buffer(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || view->format == NULL
        || (strcmp(view->format, "q") && strcmp(view->format, "l") && strcmp(view->format, "<q")
            && strcmp(view->format, "<l") && strcmp(view->format, "=q")
            && strcmp(view->format, "=l"))) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "assemble(): %s must be a contiguous int64 array", what);
        return -1;
    }
    return 0;
}

/* assemble(deltas, tidx, templates) -> bytes: for each i, one `Trace.packet` entry holding the
 * TracePacket `{timestamp: deltas[i]} + templates[tidx[i]]` (no timestamp where deltas[i] < 0).
 * The same bytes as the numpy version in write/encoder.py, in one pass. */
static PyObject *f_assemble(PyObject *self, PyObject *args) {
    PyObject *dobj, *tobj, *templates;
    if (!PyArg_ParseTuple(args, "OOO!", &dobj, &tobj, &PyList_Type, &templates)) return NULL;
    Py_buffer dv, tv;
    if (get_int64_buffer(dobj, &dv, "deltas") < 0) return NULL;
    if (get_int64_buffer(tobj, &tv, "tidx") < 0) {
        PyBuffer_Release(&dv);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t n = dv.len / 8, nt = PyList_GET_SIZE(templates);
    const int64_t *d = dv.buf, *ti = tv.buf;
    if (tv.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "assemble(): deltas and tidx differ in length");
        goto done;
    }
    for (Py_ssize_t k = 0; k < nt; k++) {
        if (!PyBytes_Check(PyList_GET_ITEM(templates, k))) {
            PyErr_SetString(PyExc_TypeError, "assemble(): templates must be bytes");
            goto done;
        }
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ti[i] < 0 || ti[i] >= nt) {
            PyErr_SetString(PyExc_IndexError, "assemble(): template index out of range");
            goto done;
        }
        Py_ssize_t body = PyBytes_GET_SIZE(PyList_GET_ITEM(templates, ti[i]));
        if (d[i] >= 0) body += 1 + varint_size((uint64_t)d[i]);
        total += 1 + varint_size((uint64_t)body) + body;
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) goto done;
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(templates, ti[i]);
        Py_ssize_t tl = PyBytes_GET_SIZE(t), body = tl;
        if (d[i] >= 0) body += 1 + varint_size((uint64_t)d[i]);
        *p++ = (char)STEPSCOPE_TAG_TRACE_PACKET;
        p = put_varint(p, (uint64_t)body);
        if (d[i] >= 0) {
            *p++ = (char)STEPSCOPE_TAG_PACKET_TIMESTAMP;
            p = put_varint(p, (uint64_t)d[i]);
        }
        memcpy(p, PyBytes_AS_STRING(t), (size_t)tl);
        p += tl;
    }
done:
    PyBuffer_Release(&dv);
    PyBuffer_Release(&tv);
    return out;
}

/* numbered_event(te_tag, head, name_tag, prefix, suffix, da_tag, da_head, n) -> bytes: the
 * TrackEvent field of a slice begin with the inline name prefix + str(n) + suffix and the one
 * int arg n (the profiler's "step N"):
 *   te_tag len(head + name_tag len(name) name + da_tag len(da_head n) da_head n)
 * with n as a protobuf int64 varint. The same bytes as _encoder.track_event, without its
 * dozen Python operations per event. numbered_events(..., pkt_prefix, numbers) does a whole
 * batch: a list of pkt_prefix + that field, one per int64 in the buffer `numbers`. */
typedef struct {
    const char *pre, *suf;
    Py_ssize_t pre_len, suf_len;
    PyObject *te_tag, *head, *name_tag, *da_tag, *da_head;
} numbered_parts;

static int numbered_parse(PyObject *const *args, numbered_parts *np) {
    for (int k = 0; k < 7; k++) {
        if (k != 3 && k != 4 && !PyBytes_Check(args[k])) {
            PyErr_SetString(PyExc_TypeError, "numbered_event(): tags and heads must be bytes");
            return -1;
        }
    }
    np->pre = PyUnicode_AsUTF8AndSize(args[3], &np->pre_len);
    if (np->pre == NULL) return -1; /* not a str, or lone surrogates: the caller's Python path */
    np->suf = PyUnicode_AsUTF8AndSize(args[4], &np->suf_len);
    if (np->suf == NULL) return -1;
    np->te_tag = args[0];
    np->head = args[1];
    np->name_tag = args[2];
    np->da_tag = args[5];
    np->da_head = args[6];
    return 0;
}

/* n in decimal (what "%lld" writes) into `out` (24 bytes); its length. By hand: snprintf was
 * some 700 instructions a step begin in the writer. */
static int decimal(long long n, char *out) {
    char tmp[24];
    int len = 0;
    unsigned long long u = n < 0 ? 0ULL - (unsigned long long)n : (unsigned long long)n;
    do {
        tmp[len++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    int k = 0;
    if (n < 0) out[k++] = '-';
    while (len) out[k++] = tmp[--len];
    return k;
}

static PyObject *numbered_build(const numbered_parts *np, const char *lead, Py_ssize_t lead_len,
                                long long n) {
    char digits[24];
    int dig_len = decimal(n, digits);
    Py_ssize_t name_len = np->pre_len + dig_len + np->suf_len;
    Py_ssize_t da_len = PyBytes_GET_SIZE(np->da_head) + varint_size((uint64_t)n);
    Py_ssize_t body = PyBytes_GET_SIZE(np->head) + PyBytes_GET_SIZE(np->name_tag)
                      + varint_size((uint64_t)name_len) + name_len
                      + PyBytes_GET_SIZE(np->da_tag) + varint_size((uint64_t)da_len) + da_len;
    Py_ssize_t total = lead_len + PyBytes_GET_SIZE(np->te_tag) + varint_size((uint64_t)body)
                       + body;
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) return NULL;
    char *p = PyBytes_AS_STRING(out);
#define PUT(src, len)                    \
    do {                                 \
        memcpy(p, (src), (size_t)(len)); \
        p += (len);                      \
    } while (0)
#define PUT_BYTES(o) PUT(PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o))
    if (lead_len) PUT(lead, lead_len); /* (memcpy from NULL, even of 0 bytes, is undefined) */
    PUT_BYTES(np->te_tag);
    p = put_varint(p, (uint64_t)body);
    PUT_BYTES(np->head);
    PUT_BYTES(np->name_tag);
    p = put_varint(p, (uint64_t)name_len);
    PUT(np->pre, np->pre_len);
    PUT(digits, dig_len);
    PUT(np->suf, np->suf_len);
    PUT_BYTES(np->da_tag);
    p = put_varint(p, (uint64_t)da_len);
    PUT_BYTES(np->da_head);
    p = put_varint(p, (uint64_t)n);
#undef PUT_BYTES
#undef PUT
    return out;
}

static PyObject *f_numbered_event(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "numbered_event() takes 8 arguments");
        return NULL;
    }
    numbered_parts np;
    if (numbered_parse(args, &np) < 0) return NULL;
    long long n = PyLong_AsLongLong(args[7]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    return numbered_build(&np, NULL, 0, n);
}

static PyObject *f_numbered_events(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "numbered_events() takes 9 arguments");
        return NULL;
    }
    numbered_parts np;
    if (numbered_parse(args, &np) < 0) return NULL;
    if (!PyBytes_Check(args[7])) {
        PyErr_SetString(PyExc_TypeError, "numbered_events(): pkt_prefix must be bytes");
        return NULL;
    }
    Py_buffer nv;
    if (get_int64_buffer(args[8], &nv, "numbers") < 0) return NULL;
    Py_ssize_t count = nv.len / 8;
    const int64_t *nums = nv.buf;
    PyObject *out = PyList_New(count);
    if (out != NULL) {
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *b = numbered_build(&np, PyBytes_AS_STRING(args[7]),
                                         PyBytes_GET_SIZE(args[7]), (long long)nums[i]);
            if (b == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, i, b);
        }
    }
    PyBuffer_Release(&nv);
    return out;
}

/* step_boundary(end, ts, ident, begin, begin_ts, begin_ident, null_code, lookback) -> bool: the
 * profiler's step boundary in one call. The open step's begin placeholder (null_code,
 * begin_ts, begin_ident), searched in the last `lookback` events, becomes `begin`; then
 * (end, ts, ident) and the next step's placeholder (null_code, ts, ident) are appended. False,
 * with nothing changed, where the placeholder is gone (a flush took it): the caller's slow
 * path then writes the begin late. */
static PyObject *f_step_boundary(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "step_boundary() takes 8 arguments");
        return NULL;
    }
    long long v[8];
    for (int k = 0; k < 8; k++) {
        v[k] = PyLong_AsLongLong(args[k]);
        if (v[k] == -1 && PyErr_Occurred()) return NULL;
    }
    return PyBool_FromLong(step_boundary(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]));
}

/* ---- StepCounters: the step timer's running figures -----------------------------------------
 *
 * The base of profiler.timer.StepTimer (its figures live here, its stats() in Python): a
 * step() is one C call instead of some thirty attribute operations of Python, on every step of
 * the program. The pure-Python twin is timer._PyCounters; both keep the same fields. */

typedef struct {
    PyObject_HEAD
    int has_t0;
    long long t0, reader, steps, b_sum, b_max, b_min, r_sum, r_max, r_min, s_time;
    double s_sum, s_max, s_min;
} CountersObject;

static void counters_reset(CountersObject *c) {
    c->reader = 0;
    c->steps = 0;
    c->b_sum = c->b_max = c->r_sum = c->r_max = c->s_time = 0;
    c->b_min = c->r_min = 0; /* read as inf while steps == 0 */
    c->s_sum = c->s_max = 0.0;
    c->s_min = Py_HUGE_VAL;
}

static int counters_init(CountersObject *c, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "StepCounters() takes no arguments");
        return -1;
    }
    c->has_t0 = 0;
    c->t0 = 0;
    counters_reset(c);
    return 0;
}

/* Up to `n` optional arguments named `names`, by position or keyword, into `out` (NULL where
 * not given): the calls of start(now=None) and step(num_samples=None, now=None). */
static int counters_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int n,
                         const char *const *names, const char *fname, PyObject **out) {
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments", fname, n);
        return -1;
    }
    for (int k = 0; k < n; k++) out[k] = k < nargs ? args[k] : NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int at = -1;
        for (int j = 0; j < n; j++)
            if (PyUnicode_CompareWithASCIIString(key, names[j]) == 0) at = j;
        if (at < 0 || out[at] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected or repeated argument %R", fname,
                         key);
            return -1;
        }
        out[at] = args[nargs + k];
    }
    return 0;
}

/* `now` (ns), or the clock where it is None or not given */
static int counters_time(PyObject *now, long long *out) {
    if (now == NULL || now == Py_None) {
        *out = now_ns();
        return 0;
    }
    *out = PyLong_AsLongLong(now);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *counters_start(CountersObject *c, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
    static const char *const names[] = {"now"};
    PyObject *a[1];
    long long t;
    if (counters_args(args, nargs, kwnames, 1, names, "start", a) < 0
        || counters_time(a[0], &t) < 0)
        return NULL;
    c->has_t0 = 1;
    c->t0 = t;
    c->reader = 0;
    Py_RETURN_NONE;
}

/* step(num_samples, now=t): close the open step and open the next; 0, or -1 with an error */
static int counters_advance(CountersObject *c, PyObject *num_samples, long long t) {
    double ns = 0.0;
    int have = num_samples != NULL && num_samples != Py_None;
    if (have) {
        ns = PyFloat_AsDouble(num_samples);
        if (ns == -1.0 && PyErr_Occurred()) return -1;
    }
    if (!c->has_t0) {
        c->has_t0 = 1;
        c->t0 = t;
        c->reader = 0;
        return 0;
    }
    long long b = t - c->t0, r = c->reader;
    c->t0 = t;
    c->reader = 0;
    if (c->steps == 0 || b < c->b_min) c->b_min = b;
    if (c->steps == 0 || r < c->r_min) c->r_min = r;
    c->steps += 1;
    c->b_sum += b;
    if (b > c->b_max) c->b_max = b;
    c->r_sum += r;
    if (r > c->r_max) c->r_max = r;
    if (have && b > 0) {
        c->s_sum += ns;
        c->s_time += b;
        double sps = ns * 1e9 / (double)b;
        if (sps > c->s_max) c->s_max = sps;
        if (sps < c->s_min) c->s_min = sps;
    }
    return 0;
}

static PyObject *counters_step(CountersObject *c, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    static const char *const names[] = {"num_samples", "now"};
    PyObject *a[2];
    long long t;
    if (counters_args(args, nargs, kwnames, 2, names, "step", a) < 0
        || counters_time(a[1], &t) < 0 || counters_advance(c, a[0], t) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *counters_add_reader(CountersObject *c, PyObject *arg) {
    long long ns = PyLong_AsLongLong(arg);
    if (ns == -1 && PyErr_Occurred()) return NULL;
    c->reader += ns;
    Py_RETURN_NONE;
}

static PyObject *counters_reset_m(CountersObject *c, PyObject *unused) {
    counters_reset(c);
    Py_RETURN_NONE;
}

static PyObject *counters_get_t0(CountersObject *c, void *unused) {
    if (!c->has_t0) Py_RETURN_NONE;
    return PyLong_FromLongLong(c->t0);
}

static PyObject *counters_get_min(CountersObject *c, void *which) {
    if (c->steps == 0) return PyFloat_FromDouble(Py_HUGE_VAL);
    return PyLong_FromLongLong(which ? c->r_min : c->b_min);
}

static PyMethodDef counters_methods[] = {
    {"start", (PyCFunction)(void (*)(void))counters_start, METH_FASTCALL | METH_KEYWORDS,
     "start(now=None): open the first step."},
    {"step", (PyCFunction)(void (*)(void))counters_step, METH_FASTCALL | METH_KEYWORDS,
     "step(num_samples=None, now=None): close the open step and open the next."},
    {"add_reader", (PyCFunction)counters_add_reader, METH_O,
     "add_reader(ns): account ns of data-loader wait to the open step."},
    {"reset", (PyCFunction)counters_reset_m, METH_NOARGS,
     "reset(): forget every completed step (the open step keeps its start)."},
    {NULL},
};

static PyMemberDef counters_members[] = {
    {"_reader", T_LONGLONG, offsetof(CountersObject, reader), 0, NULL},
    {"steps", T_LONGLONG, offsetof(CountersObject, steps), READONLY, NULL},
    {"_b_sum", T_LONGLONG, offsetof(CountersObject, b_sum), READONLY, NULL},
    {"_b_max", T_LONGLONG, offsetof(CountersObject, b_max), READONLY, NULL},
    {"_r_sum", T_LONGLONG, offsetof(CountersObject, r_sum), READONLY, NULL},
    {"_r_max", T_LONGLONG, offsetof(CountersObject, r_max), READONLY, NULL},
    {"_s_time", T_LONGLONG, offsetof(CountersObject, s_time), READONLY, NULL},
    {"_s_sum", T_DOUBLE, offsetof(CountersObject, s_sum), READONLY, NULL},
    {"_s_max", T_DOUBLE, offsetof(CountersObject, s_max), READONLY, NULL},
    {"_s_min", T_DOUBLE, offsetof(CountersObject, s_min), READONLY, NULL},
    {NULL},
};

static PyGetSetDef counters_getset[] = {
    {"_t0", (getter)counters_get_t0, NULL, "the open step's start (ns), None before any", NULL},
    {"_b_min", (getter)counters_get_min, NULL, "shortest step (ns); inf before any", NULL},
    {"_r_min", (getter)counters_get_min, NULL, "shortest reader wait (ns); inf before any",
     (void *)1},
    {NULL},
};

static PyTypeObject CountersType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepscope._fast.StepCounters",
    .tp_basicsize = sizeof(CountersObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)counters_init,
    .tp_methods = counters_methods,
    .tp_members = counters_members,
    .tp_getset = counters_getset,
    .tp_doc = "StepCounters(): the step timer's running figures (see profiler.timer).",
};

/* ---- ProfilerCore: the profiler's per-step state and methods in C ------------------------------
 *
 * The base of profiler.Profiler (with the C buffer): the state that every step reads and writes
 * lives in this struct, as attributes of the same names for the class's Python code (member
 * descriptors), and step(), _activity() and phase() are installed on the class by
 * install_profiler() as method descriptors: on every step of the program the common case runs
 * without a Python frame and without an attribute lookup (cachegrind, all threads, the writer's
 * share included: 17,000 instructions a step() of Python, 10,000 this one). Every case other
 * than the common one calls the Python method that profiler.py keeps for it (its twin, used as
 * is with the pure-Python buffer):
 *
 * - step(num_samples=None, epoch=None) -> Profiler._step_py for arguments that are no int/float
 *   (or no int epoch), sync_gpu, or a virtual clock in profiler.time (tests); after the hooks'
 *   step_end and the clock read, Profiler._step_at(num_samples, epoch, t) where the schedule's
 *   state changes, and Profiler._step_write(...) where the buffer part is not the common one (a
 *   flush took the step's placeholder, a step begun late, _plock held by another thread);
 * - _activity() -> Profiler._activity_py while a step is pending, or where the placeholder is
 *   gone or _plock is held;
 * - phase(name) -> Profiler._new_phase(name) for a phase not cached yet.
 *
 * The lock: _plock guards the open step's placeholder against a flush. These functions never
 * release the GIL and call no Python code between reading `_plock.locked()` and their last
 * store, so where it is free they are atomic with respect to its holders; where another thread
 * holds it they take the Python path, which waits for it. */

typedef struct {
    PyObject_HEAD
    PyObject *started, *stopped, *sync_gpu, *hooks, *epoch, *batch, *stable_until, *in_step,
        *timer, *step, *recording, *last_end, *plock, *tentative, *late_track, *step_begin,
        *pending, *active, *quiet;
} CoreObject;

#define CORE_FIELDS(X) X(started) X(stopped) X(sync_gpu) X(hooks) X(epoch) X(batch) \
    X(stable_until) X(in_step) X(timer) X(step) X(recording) X(last_end) X(plock) \
    X(tentative) X(late_track) X(step_begin) X(pending) X(active) X(quiet)

static int core_traverse(CoreObject *self, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(self->f);
    CORE_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int core_clear(CoreObject *self) {
#define CLEAR(f) Py_CLEAR(self->f);
    CORE_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void core_dealloc(CoreObject *self) {
    PyObject_GC_UnTrack(self);
    core_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef core_members[] = {
    {"_started", T_OBJECT_EX, offsetof(CoreObject, started), 0, NULL},
    {"_stopped", T_OBJECT_EX, offsetof(CoreObject, stopped), 0, NULL},
    {"sync_gpu", T_OBJECT_EX, offsetof(CoreObject, sync_gpu), 0, NULL},
    {"hooks", T_OBJECT_EX, offsetof(CoreObject, hooks), 0, NULL},
    {"_epoch", T_OBJECT_EX, offsetof(CoreObject, epoch), 0, NULL},
    {"_batch", T_OBJECT_EX, offsetof(CoreObject, batch), 0, NULL},
    {"_stable_until", T_OBJECT_EX, offsetof(CoreObject, stable_until), 0, NULL},
    {"_in_step", T_OBJECT_EX, offsetof(CoreObject, in_step), 0, NULL},
    {"timer", T_OBJECT_EX, offsetof(CoreObject, timer), 0, NULL},
    {"_step", T_OBJECT_EX, offsetof(CoreObject, step), 0, NULL},
    {"_recording", T_OBJECT_EX, offsetof(CoreObject, recording), 0, NULL},
    {"_last_end", T_OBJECT_EX, offsetof(CoreObject, last_end), 0, NULL},
    {"_plock", T_OBJECT_EX, offsetof(CoreObject, plock), 0, NULL},
    {"_tentative", T_OBJECT_EX, offsetof(CoreObject, tentative), 0, NULL},
    {"_late_track", T_OBJECT_EX, offsetof(CoreObject, late_track), 0, NULL},
    {"_step_begin", T_OBJECT_EX, offsetof(CoreObject, step_begin), 0, NULL},
    {"_pending", T_OBJECT_EX, offsetof(CoreObject, pending), 0, NULL},
    {"_active", T_OBJECT_EX, offsetof(CoreObject, active), 0, NULL},
    {"_quiet", T_OBJECT_EX, offsetof(CoreObject, quiet), 0, NULL},
    {NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepscope._fast.ProfilerCore",
    .tp_basicsize = sizeof(CoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_members = core_members,
    .tp_doc = "The profiler's per-step state (the base of profiler.Profiler; see _fast.c).",
};

static struct {
    PyObject *step_end, *now, *locked, *timer_step, *start, *time, *step_py, *step_at,
        *step_write, *begin_step, *activity_py, *new_phase, *hook_failed, *phase_py, *gates,
        *name, *waiting, *idle_prefix;
} pn; /* interned attribute and method names (intern_names, at import) */

static int intern_names(void) {
#define NAME(f, s) if ((pn.f = PyUnicode_InternFromString(s)) == NULL) return -1;
    NAME(step_end, "step_end") NAME(now, "now") NAME(locked, "locked")
    NAME(timer_step, "step") NAME(start, "start") NAME(time, "time") NAME(step_py, "_step_py")
    NAME(step_at, "_step_at") NAME(step_write, "_step_write") NAME(begin_step, "_begin_step")
    NAME(activity_py, "_activity_py") NAME(new_phase, "_new_phase")
    NAME(hook_failed, "_hook_failed") NAME(phase_py, "_phase_py")
    NAME(gates, "step_end_gates")
    NAME(name, "name") NAME(waiting, "waiting") NAME(idle_prefix, "idle_prefix")
#undef NAME
    return 0;
}

/* Whether timer.step(...) is StepCounters.step itself (the profiler's StepTimer, a subclass
 * with no instance dict and no step of its own): then the profiler's step() calls
 * counters_advance directly, without the method's lookup and its arguments' parsing. The
 * answer is kept per type until the type changes (its version tag). */
static int counters_plain(PyObject *timer) {
    static PyTypeObject *known;
    static unsigned int known_version;
    PyTypeObject *tp = Py_TYPE(timer);
    if (tp == known && tp->tp_version_tag == known_version
        && (tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG))
        return 1;
    if (!PyObject_TypeCheck(timer, &CountersType) || tp->tp_dictoffset != 0
        || tp->tp_getattro != PyObject_GenericGetAttr)
        return 0;
    PyObject *found = _PyType_Lookup(tp, pn.timer_step); /* borrowed; assigns the version tag */
    PyObject *own = _PyType_Lookup(&CountersType, pn.timer_step);
    if (found == NULL || found != own || !(tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) return 0;
    known = tp;
    known_version = tp->tp_version_tag;
    return 1;
}

static struct {
    PyObject *no_phase, *phases, *sync_phases, *begin_code, *end_code;
    PyObject *globals, *time; /* profiler.py's globals; the time module its clock is read from */
    PyObject *kw_now;         /* ("now",) */
    PyObject *one;
    long long code0, code_max, null_code, lookback;
} pc;

/* a field's truth (-1: not set yet, or an error) */
static inline int truth(PyObject *v) {
    if (v == Py_True) return 1;
    if (v == Py_False || v == Py_None) return 0;
    return v == NULL ? -1 : PyObject_IsTrue(v);
}

static inline void set_field(PyObject **slot, PyObject *v) { Py_XSETREF(*slot, Py_NewRef(v)); }

static PyObject *call_method(PyObject *self, PyObject *name, PyObject *const *args,
                             Py_ssize_t n) {
    PyObject *stack[8];
    stack[0] = self;
    for (Py_ssize_t k = 0; k < n; k++) stack[k + 1] = args[k];
    return PyObject_VectorcallMethod(name, stack, (size_t)(n + 1), NULL);
}

/* _plock is free: 1; another thread holds it: 0; error: -1 */
static int plock_free(CoreObject *c) {
    if (c->plock == NULL) return 0;
    PyObject *r = PyObject_CallMethodNoArgs(c->plock, pn.locked);
    if (r == NULL) return -1;
    int held = PyObject_IsTrue(r);
    Py_DECREF(r);
    return held < 0 ? -1 : !held;
}

/* *slot += 1 for an int field; *out: the new value (LLONG_MAX past a long long) */
static int incr(PyObject **slot, long long *out) {
    PyObject *nv = PyNumber_Add(*slot, pc.one);
    if (nv == NULL) return -1;
    int overflow = 0;
    *out = PyLong_Check(nv) ? PyLong_AsLongLongAndOverflow(nv, &overflow) : LLONG_MAX;
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *out = LLONG_MAX;
    }
    Py_SETREF(*slot, nv);
    return 0;
}

/* An error of the kind the Python twins catch (Exception) is cleared: 0; a KeyboardInterrupt or
 * SystemExit (a signal handler that ran inside an attribute's Python code) stays set: -1. */
static int keep_interrupts(void) {
    if (!PyErr_Occurred()) return 0;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyErr_Clear();
    return 0;
}

/* profiler._gate_open: whether a hook's step_end is called: unless its step_end_gates,
 * (object, attribute) pairs, are all unset (a missing attribute counts as set; anything odd
 * opens the gate: the hook itself then decides, and its failure is caught) */
static int gate_open(PyObject *h) {
    PyObject *gates = PyObject_GetAttr(h, pn.gates);
    int open = 1;
    if (gates != NULL && gates != Py_None) {
        PyObject *seq = PySequence_Fast(gates, "step_end_gates is a sequence of pairs");
        Py_ssize_t n = seq == NULL ? 0 : PySequence_Fast_GET_SIZE(seq);
        open = seq == NULL;
        for (Py_ssize_t k = 0; k < n && !open; k++) {
            PyObject *pair = PySequence_Fast_GET_ITEM(seq, k);
            PyObject *v = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2
                ? PyObject_GetAttr(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)) : NULL;
            open = v == NULL || PyObject_IsTrue(v) != 0;
            Py_XDECREF(v);
        }
        Py_XDECREF(seq);
    }
    Py_XDECREF(gates);
    return keep_interrupts() < 0 ? -1 : open;
}

/* the hooks' step_end(), as Profiler._hook("step_end"): a producer never breaks the program */
static int run_step_end_hooks(PyObject *self, PyObject *hooks) {
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(hooks); k++) {
        PyObject *h = Py_NewRef(PyList_GET_ITEM(hooks, k));
        int open = gate_open(h);
        if (open <= 0) {
            Py_DECREF(h);
            if (open < 0) return -1;
            continue;
        }
        PyObject *fn = PyObject_GetAttr(h, pn.step_end);
        if (fn == NULL) {
            int missing = PyErr_ExceptionMatches(PyExc_AttributeError);
            Py_DECREF(h);
            if (!missing) return -1;
            PyErr_Clear();
            continue;
        }
        PyObject *r = PyObject_CallNoArgs(fn);
        Py_DECREF(fn);
        if (r == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                Py_DECREF(h);
                return -1;
            }
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyObject *a[3] = {h, pn.step_end, value ? value : Py_None};
            r = call_method(self, pn.hook_failed, a, 3);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        Py_DECREF(h);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* (a, b, c) as a tuple of ints (Py_BuildValue parses its format string on every call) */
static PyObject *triple(long long a, long long b, long long c) {
    PyObject *t = PyTuple_New(3);
    if (t == NULL) return NULL;
    long long v[3] = {a, b, c};
    for (int k = 0; k < 3; k++) {
        PyObject *i = PyLong_FromLongLong(v[k]);
        if (i == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, k, i);
    }
    return t;
}

static int tent_parts(PyObject *tent, long long *v) {
    if (!PyTuple_CheckExact(tent) || PyTuple_GET_SIZE(tent) != 3) return 0;
    for (int k = 0; k < 3; k++) {
        v[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(tent, k));
        if (v[k] == -1 && PyErr_Occurred()) return -1;
    }
    return 1;
}

static PyObject *prof_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    static const char *const names[] = {"num_samples", "epoch"};
    CoreObject *c = (CoreObject *)self;
    PyObject *a[2];
    if (counters_args(args, nargs, kwnames, 2, names, "step", a) < 0) return NULL;
    PyObject *ns = a[0] ? a[0] : Py_None, *ep = a[1] ? a[1] : Py_None;
    int started = truth(c->started), stopped = truth(c->stopped), sync = truth(c->sync_gpu);
    if (started == 0 || stopped == 1) Py_RETURN_NONE;
    /* (a test's virtual clock in profiler.time: the Python twin reads it) */
    PyObject *clock = PyDict_GetItemWithError(pc.globals, pn.time);
    if (clock == NULL && PyErr_Occurred()) return NULL;
    if (started < 0 || stopped < 0 || sync != 0 || clock != pc.time || c->hooks == NULL
        || !PyList_CheckExact(c->hooks)
        || (ns != Py_None && !PyLong_CheckExact(ns) && !PyFloat_CheckExact(ns))
        || (ep != Py_None && !PyLong_CheckExact(ep))) {
        if (keep_interrupts() < 0) return NULL;
        PyObject *pa[2] = {ns, ep};
        return call_method(self, pn.step_py, pa, 2);
    }
    if (PyList_GET_SIZE(c->hooks)) {
        PyObject *hooks = Py_NewRef(c->hooks);
        int r = run_step_end_hooks(self, hooks);
        Py_DECREF(hooks);
        if (r < 0) return NULL;
    }
    long long t = now_ns();
    PyObject *tobj = PyLong_FromLongLong(t);
    if (tobj == NULL) return NULL;
    PyObject *result = NULL, *new_tent = NULL;
    /* the schedule's state changes (a new epoch, a window's edge): the Python twin; past a
     * long long, stable_until is schedule.NEVER (2**63); anything else: Python compares */
    int moves = c->epoch == NULL || c->batch == NULL || c->stable_until == NULL
        || !PyLong_CheckExact(c->batch) || !PyLong_CheckExact(c->stable_until);
    if (!moves && ep != Py_None) {
        moves = PyObject_RichCompareBool(ep, c->epoch, Py_NE);
        if (moves < 0) goto done;
    }
    if (!moves) {
        int bo = 0, so = 0;
        long long b = PyLong_AsLongLongAndOverflow(c->batch, &bo);
        long long s = PyLong_AsLongLongAndOverflow(c->stable_until, &so);
        moves = bo || so < 0 || b == LLONG_MAX || (so == 0 && b + 1 >= s);
    }
    if (moves) {
        PyObject *pa[3] = {ns, ep, tobj};
        result = call_method(self, pn.step_at, pa, 3);
        goto done;
    }
    int in_step = truth(c->in_step);
    if (in_step < 0 || c->timer == NULL || c->step == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "Profiler not initialized");
        goto done;
    }
    if (in_step) { /* timer.step(num_samples, now=t) */
        if (counters_plain(c->timer)) {
            if (counters_advance((CountersObject *)c->timer, ns, t) < 0) goto done;
        } else {
            PyObject *stack[3] = {c->timer, ns, tobj};
            PyObject *r = PyObject_VectorcallMethod(pn.timer_step, stack, 2, pc.kw_now);
            if (r == NULL) goto done;
            Py_DECREF(r);
        }
    }
    long long n, unused;
    if (incr(&c->step, &n) < 0 || incr(&c->batch, &unused) < 0) goto done;
    int rec = truth(c->recording);
    if (rec > 0) rec = recording;
    if (rec < 0) goto done;
    if (!rec) {
        PyObject *pa[1] = {tobj};
        result = call_method(self, pn.begin_step, pa, 1);
        goto done;
    }
    long long ident = (long long)PyThread_get_thread_ident() | STEPS_IDENT; /* its steps' */
    long long begin;
    if (n < pc.code_max) {
        begin = pc.code0 + (n << 3);
    } else {
        PyObject *code = PyObject_CallOneArg(pc.begin_code, c->step);
        if (code == NULL) goto done;
        begin = PyLong_AsLongLong(code);
        Py_DECREF(code);
        if (begin == -1 && PyErr_Occurred()) goto done;
    }
    /* the end's code: the last step's again where epoch and num_samples are the same objects */
    long long end = 0;
    if (in_step) {
        PyObject *last = c->last_end;
        if (last != NULL && PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) == 3
            && PyTuple_GET_ITEM(last, 0) == ns && PyTuple_GET_ITEM(last, 1) == c->epoch) {
            end = PyLong_AsLongLong(PyTuple_GET_ITEM(last, 2));
            if (end == -1 && PyErr_Occurred()) goto done;
        } else {
            PyObject *epoch = Py_NewRef(c->epoch);
            PyObject *ea[2] = {epoch, ns};
            PyObject *code = PyObject_Vectorcall(pc.end_code, ea, 2, NULL);
            if (code != NULL) end = PyLong_AsLongLong(code);
            if (code == NULL || (end == -1 && PyErr_Occurred())) {
                Py_DECREF(epoch);
                Py_XDECREF(code);
                goto done;
            }
            if (end >= 0) { /* (a parked blob's code is used once) */
                PyObject *nl = PyTuple_Pack(3, ns, epoch, code);
                if (nl != NULL) Py_XSETREF(c->last_end, nl);
            }
            Py_DECREF(epoch);
            Py_DECREF(code);
            if (PyErr_Occurred()) goto done;
        }
    }
    /* the buffer part; objects first (an allocation may run a collection, hence Python) */
    new_tent = triple(begin, t, ident);
    if (new_tent == NULL) goto done;
    int free_ = plock_free(c);
    if (free_ < 0) goto done;
    int written = 0;
    if (free_ && c->tentative != NULL && c->late_track != NULL) {
        if (!in_step) {
            int64_t w[3] = {pc.null_code, t, ident};
            append_words(w, 3);
            written = 1;
        } else if (c->tentative == Py_None && c->late_track == Py_None) { /* begin written */
            /* (on another thread's steps track: Python's _step_write ends it there) */
            long long bv[3];
            int ok = c->step_begin == Py_None ? 1 : tent_parts(c->step_begin, bv);
            if (ok < 0) goto done;
            if (ok && (c->step_begin == Py_None || bv[2] == ident)) {
                int64_t w[6] = {end, t, ident, pc.null_code, t, ident};
                append_words(w, 6);
                written = 1;
            }
        } else if (c->tentative != Py_None) { /* a step with no phase: its begin too */
            long long tv[3];
            int ok = tent_parts(c->tentative, tv);
            if (ok < 0) goto done;
            written = ok && tv[2] == ident
                      && step_boundary(end, t, ident, tv[0], tv[1], tv[2], pc.null_code,
                                       pc.lookback);
        }
    }
    if (written) {
        Py_XSETREF(c->tentative, new_tent);
        new_tent = NULL;
        set_field(&c->step_begin, Py_None);
        set_field(&c->late_track, Py_None);
    } else {
        PyObject *be = PyLong_FromLongLong(begin), *en = PyLong_FromLongLong(end);
        PyObject *id = PyLong_FromLongLong(ident);
        PyObject *r = NULL;
        if (be && en && id) {
            PyObject *pa[6] = {in_step ? Py_True : Py_False, be, en, tobj, id, ns};
            r = call_method(self, pn.step_write, pa, 6);
        }
        Py_XDECREF(be);
        Py_XDECREF(en);
        Py_XDECREF(id);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    if (!in_step) { /* timer.start(t) */
        PyObject *stack[2] = {c->timer, tobj};
        PyObject *r = PyObject_VectorcallMethod(pn.start, stack, 2, NULL);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    set_field(&c->in_step, Py_True);
    set_field(&c->pending, Py_False);
    set_field(&c->active, Py_False);
    set_field(&c->quiet, Py_True);
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(tobj);
    Py_XDECREF(new_tent);
    return result;
}

static PyObject *prof_activity(PyObject *self, PyObject *unused) {
    CoreObject *c = (CoreObject *)self;
    int started = truth(c->started), stopped = truth(c->stopped);
    if (started == 0 || stopped == 1) Py_RETURN_NONE;
    int pending = truth(c->pending);
    int free_ = started < 0 || stopped < 0 || pending != 0 || c->tentative == NULL
        ? 0 : plock_free(c);
    if (free_ < 0) return NULL;
    long long tv[3];
    int ok = free_ && c->tentative != Py_None ? tent_parts(c->tentative, tv) : 1;
    if (ok < 0) return NULL;
    int has = free_ && ok && c->tentative != Py_None;
    /* pending, held, or the placeholder is gone (a late begin): Python */
    if (!free_ || !ok || (has && !replace_event(pc.null_code, tv[1], tv[2], tv[0], pc.lookback))) {
        if (keep_interrupts() < 0) return NULL;
        return call_method(self, pn.activity_py, NULL, 0);
    }
    if (has) { /* the open step's placeholder became its begin */
        PyObject *tent = c->tentative;
        c->tentative = Py_NewRef(Py_None);
        Py_XSETREF(c->step_begin, tent);
    }
    set_field(&c->active, Py_True);
    set_field(&c->quiet, Py_False);
    Py_RETURN_NONE;
}

static PyObject *prof_phase(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    static const char *const names[] = {"name"};
    CoreObject *c = (CoreObject *)self;
    PyObject *a[1];
    if (counters_args(args, nargs, kwnames, 1, names, "phase", a) < 0) return NULL;
    if (a[0] == NULL) {
        PyErr_SetString(PyExc_TypeError, "phase() missing required argument: 'name'");
        return NULL;
    }
    int quiet = truth(c->quiet), rec = truth(c->recording), sync = truth(c->sync_gpu);
    if (quiet < 0 || rec < 0 || sync < 0) { /* (a field not set: the Python twin says so) */
        if (keep_interrupts() < 0) return NULL;
        return call_method(self, pn.phase_py, a, 1);
    }
    if (quiet) {
        PyObject *r = prof_activity(self, NULL);
        if (r == NULL) return NULL;
        Py_DECREF(r);
        rec = truth(c->recording);
        if (rec < 0) return NULL;
    }
    if (!rec) return Py_NewRef(pc.no_phase);
    PyObject *ph = PyDict_GetItemWithError(sync ? pc.sync_phases : pc.phases, a[0]);
    if (ph != NULL) return Py_NewRef(ph);
    if (PyErr_Occurred()) return NULL;
    return call_method(self, pn.new_phase, a, 1);
}

static PyMethodDef prof_defs[3] = {
    {"step", (PyCFunction)(void (*)(void))prof_step, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"_activity", prof_activity, METH_NOARGS, NULL},
    {"phase", (PyCFunction)(void (*)(void))prof_phase, METH_FASTCALL | METH_KEYWORDS, NULL},
};
static PyObject *prof_docs[3]; /* the docstrings (kept: ml_doc points into them) */

static PyObject *f_install_profiler(PyObject *self, PyObject *args) {
    /* install_profiler(cls, config: dict, docs: tuple of 3 str) */
    PyObject *cls, *cfg, *docs;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyType_Type, &cls, &PyDict_Type, &cfg, &PyTuple_Type,
                          &docs))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)cls, &CoreType) || PyTuple_GET_SIZE(docs) != 3) {
        PyErr_SetString(PyExc_TypeError, "install_profiler: a ProfilerCore class and 3 docs");
        return NULL;
    }
#define OBJ(f, s) { PyObject *v = PyDict_GetItemString(cfg, s); \
        if (v == NULL) return PyErr_Format(PyExc_KeyError, "install_profiler: %s", s); \
        Py_XSETREF(pc.f, Py_NewRef(v)); }
    OBJ(no_phase, "no_phase") OBJ(phases, "phases") OBJ(sync_phases, "sync_phases")
    OBJ(begin_code, "begin_code") OBJ(end_code, "end_code")
    OBJ(globals, "globals") OBJ(time, "time")
#undef OBJ
#define NUM(f, s) { PyObject *v = PyDict_GetItemString(cfg, s); \
        if (v == NULL) return PyErr_Format(PyExc_KeyError, "install_profiler: %s", s); \
        pc.f = PyLong_AsLongLong(v); if (pc.f == -1 && PyErr_Occurred()) return NULL; }
    NUM(code0, "code0") NUM(code_max, "code_max") NUM(null_code, "null_code")
    NUM(lookback, "lookback")
#undef NUM
    if (!PyDict_Check(pc.phases) || !PyDict_Check(pc.sync_phases)
        || !PyDict_Check(pc.globals)) {
        PyErr_SetString(PyExc_TypeError, "install_profiler: phases and globals are dicts");
        return NULL;
    }
    Py_XSETREF(pc.kw_now, PyTuple_Pack(1, pn.now));
    Py_XSETREF(pc.one, PyLong_FromLong(1));
    if (pc.kw_now == NULL || pc.one == NULL) return NULL;
    for (int k = 0; k < 3; k++) {
        PyObject *d = PyTuple_GET_ITEM(docs, k);
        if (!PyUnicode_Check(d)) {
            PyErr_SetString(PyExc_TypeError, "install_profiler: docs are str");
            return NULL;
        }
        Py_XSETREF(prof_docs[k], Py_NewRef(d));
        prof_defs[k].ml_doc = PyUnicode_AsUTF8(d);
        if (prof_defs[k].ml_doc == NULL) return NULL;
        PyObject *descr = PyDescr_NewMethod((PyTypeObject *)cls, &prof_defs[k]);
        if (descr == NULL || PyObject_SetAttrString(cls, prof_defs[k].ml_name, descr) < 0) {
            Py_XDECREF(descr);
            return NULL;
        }
        Py_DECREF(descr);
    }
    Py_RETURN_NONE;
}

/* ---- CaptureFlags: the flags of pytorch/ranges.py's RangeCapture the hook reads --------------
 *
 * The base of RangeCapture (with the C buffer): `waiting` and `idle_prefix` are attributes for
 * Python (member descriptors) and struct fields for the ContextHook, which reads them without an
 * attribute lookup. */

typedef struct {
    PyObject_HEAD
    PyObject *waiting, *idle_prefix;
} FlagsObject;

static int flags_traverse(FlagsObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->waiting);
    Py_VISIT(self->idle_prefix);
    return 0;
}

static int flags_clear(FlagsObject *self) {
    Py_CLEAR(self->waiting);
    Py_CLEAR(self->idle_prefix);
    return 0;
}

static void flags_dealloc(FlagsObject *self) {
    PyObject_GC_UnTrack(self);
    flags_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef flags_members[] = {
    {"waiting", T_OBJECT_EX, offsetof(FlagsObject, waiting), 0, NULL},
    {"idle_prefix", T_OBJECT_EX, offsetof(FlagsObject, idle_prefix), 0, NULL},
    {NULL},
};

static PyTypeObject FlagsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepscope._fast.CaptureFlags",
    .tp_basicsize = sizeof(FlagsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)flags_traverse,
    .tp_clear = (inquiry)flags_clear,
    .tp_dealloc = (destructor)flags_dealloc,
    .tp_members = flags_members,
    .tp_doc = "The range capture's flags the ContextHook reads (the base of RangeCapture).",
};

/* capture.<name> (a new reference): the struct's field where capture is a CaptureFlags (an
 * unset one raises AttributeError, as the attribute would), else the attribute */
static PyObject *capture_flag(PyObject *capture, int idle) {
    if (PyObject_TypeCheck(capture, &FlagsType)) {
        PyObject *v = idle ? ((FlagsObject *)capture)->idle_prefix
                           : ((FlagsObject *)capture)->waiting;
        if (v != NULL) return Py_NewRef(v);
    }
    return PyObject_GetAttr(capture, idle ? pn.idle_prefix : pn.waiting);
}

/* 1 where obj's name (a str) starts with capture.idle_prefix (a str), else 0; -1 with an error */
static int idle_range(PyObject *capture, PyObject *name) {
    PyObject *prefix = capture_flag(capture, 1);
    if (prefix == NULL) return -1;
    int m = PyUnicode_CheckExact(prefix)
        ? (int)PyUnicode_Tailmatch(name, prefix, 0, PY_SSIZE_T_MAX, -1) : 0;
    Py_DECREF(prefix);
    return m;
}

/* ---- ContextHook: a context manager's __enter__/__exit__ that also records a range ----------
 *
 * Installed on a class in place of its __enter__ and __exit__ (pytorch/ranges.py: torch's
 * record_function, whose every range, torch's own Optimizer.step# included, passes here), with
 * the original methods kept: they run first, then the common case of the capture in C, without
 * a Python frame (the Python wrappers cost some 6,000 instructions a range here). All else is
 * the Python `rest`, which ranges.py owns:
 *
 * - __enter__(obj): original(obj); then, while recording, obj.name a str whose begin chain is
 *   cached in `by_name`, and not `capture.waiting` on the profiler's thread: the chain is
 *   called and obj appended to `opened`, after the profiler's _activity() where its step is
 *   quiet on that thread (its begin is written first: the range is work of the step; with
 *   step_on="optimizer" the first range of every step), unless the name starts with
 *   `capture.idle_prefix` (a str); otherwise rest(obj) (which appends it where it begins a
 *   range);
 * - __exit__(obj, *exc): original(obj, *exc); then, whether it raised or not, obj is taken out
 *   of `opened` where it is there and the range ended (`end()`), while recording (`rest` is
 *   not called: the step driver's boundary after an optimizer step is made by the end itself,
 *   see Emit's at_top).
 *
 * `opened`, a list the two hooks share, holds the objects whose range is open (a mark on
 * torch's object cost three attribute operations a range: a set, a read and a delete). It is
 * searched from its end (the innermost range: one look, as a rule), by identity, so an object
 * entered again before its exit (`with r: with r:`) ends each of its ranges at its own exit.
 * An object entered and never exited stays in it: at `max_open` entries, no new range begins
 * until one ends.
 */

typedef struct {
    PyObject_HEAD
    int which; /* 0: __enter__, 1: __exit__ */
    long long main; /* the profiler's thread ident */
    Py_ssize_t max_open;
    PyObject *original, *rest, *prof, *capture, *by_name, *end, *opened;
    vectorcallfunc vectorcall;
} HookObject;

/* obj out of `opened` (its last entry): 1, or 0 where it is not there; -1 with an error */
static int take_open(PyObject *opened, PyObject *obj) {
    for (Py_ssize_t i = PyList_GET_SIZE(opened) - 1; i >= 0; i--)
        if (PyList_GET_ITEM(opened, i) == obj)
            return PyList_SetSlice(opened, i, i + 1, NULL) < 0 ? -1 : 1;
    return 0;
}

static PyObject *hook_enter(HookObject *h, PyObject *obj) {
    PyObject *result = PyObject_CallOneArg(h->original, obj);
    if (result == NULL) return NULL;
    if (!recording) return result;
    PyObject *name = PyObject_GetAttr(obj, pn.name);
    PyObject *chain = NULL;
    int common = 0;
    if (name != NULL && PyUnicode_CheckExact(name)) {
        chain = PyDict_GetItemWithError(h->by_name, name); /* borrowed */
        common = chain != NULL && chain != Py_None;
    }
    if (PyErr_Occurred()) {
        Py_XDECREF(name);
        Py_DECREF(result);
        return NULL;
    }
    if (common && PyList_GET_SIZE(h->opened) >= h->max_open) { /* (see above) */
        Py_DECREF(name);
        return result;
    }
    if (common) { /* a quiet step or a batch wait on the profiler's thread (see above) */
        int core = PyObject_TypeCheck(h->prof, &CoreType);
        int quiet = core ? truth(((CoreObject *)h->prof)->quiet) : 1;
        PyObject *w = quiet >= 0 ? capture_flag(h->capture, 0) : NULL;
        int waiting = w == NULL ? 1 : truth(w);
        Py_XDECREF(w);
        int failed = keep_interrupts() < 0;
        if (!failed && (quiet != 0 || waiting != 0)
            && (long long)PyThread_get_thread_ident() == h->main) {
            if (core && quiet == 1 && waiting == 0) {
                /* the step's begin first, as phase(); not for an idle range (see ranges.py) */
                int idle = idle_range(h->capture, name);
                PyObject *r = idle == 0 ? prof_activity(h->prof, NULL) : NULL;
                failed = idle < 0 || (idle == 0 && r == NULL);
                Py_XDECREF(r);
            } else {
                common = 0;
            }
        }
        if (failed) {
            Py_DECREF(name);
            Py_DECREF(result);
            return NULL;
        }
    }
    Py_XDECREF(name);
    PyObject *r;
    if (common) {
        Py_INCREF(chain);
        r = PyObject_CallNoArgs(chain);
        Py_DECREF(chain);
        if (r != NULL) {
            Py_DECREF(r);
            r = PyList_Append(h->opened, obj) < 0 ? NULL : Py_NewRef(Py_None);
        }
    } else {
        r = PyObject_CallOneArg(h->rest, obj);
    }
    if (r == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    Py_DECREF(r);
    return result;
}

/* at_top's call (the step boundary) failed: an Exception is reported in one line and dropped,
 * so the program's optimizer step goes on; an interrupt propagates. The line is
 * record/recorder.py's BOUNDARY_FAILED, which its Python twins print. */
static int boundary_failed(void) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PySys_FormatStderr("stepscope: optimizer step boundary failed: %R\n",
                       value != NULL ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return 0;
}

static int hook_exit_rest(HookObject *h, PyObject *obj) {
    int was_open = take_open(h->opened, obj); /* (0: begun while not recording, or in a wait) */
    if (was_open < 0) return -1;
    if (was_open && recording) {
        PyObject *r = PyObject_CallNoArgs(h->end);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
}

static PyObject *hook_call(PyObject *op, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
    HookObject *h = (HookObject *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1 || (h->which == 0 && (nargs != 1 || kwnames != NULL))) {
        PyErr_SetString(PyExc_TypeError, h->which ? "__exit__ needs the object"
                                                  : "__enter__ takes the object only");
        return NULL;
    }
    if (h->which == 0) return hook_enter(h, args[0]);
    PyObject *res = PyObject_Vectorcall(h->original, args, nargs, kwnames);
    /* then the capture's part, as a `finally`: also where the original raised */
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    if (res == NULL) PyErr_Fetch(&type, &value, &tb);
    if (hook_exit_rest(h, args[0]) < 0) {
        Py_XDECREF(res);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    if (res == NULL) PyErr_Restore(type, value, tb);
    return res;
}

static PyObject *hook_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    /* ContextHook(which, original, rest, prof, capture, by_name, end, main, opened,
     *             max_open) */
    int which;
    long long main;
    Py_ssize_t max_open;
    PyObject *original, *rest, *prof, *capture, *by_name, *end, *opened;
    if (!PyArg_ParseTuple(args, "iOOOOO!OLO!n:ContextHook", &which, &original, &rest, &prof,
                          &capture, &PyDict_Type, &by_name, &end, &main, &PyList_Type, &opened,
                          &max_open))
        return NULL;
    HookObject *h = (HookObject *)type->tp_alloc(type, 0);
    if (h == NULL) return NULL;
    h->which = which != 0;
    h->main = main;
    h->max_open = max_open;
    h->original = Py_NewRef(original);
    h->rest = Py_NewRef(rest);
    h->prof = Py_NewRef(prof);
    h->capture = Py_NewRef(capture);
    h->by_name = Py_NewRef(by_name);
    h->end = Py_NewRef(end);
    h->opened = Py_NewRef(opened);
    h->vectorcall = hook_call;
    return (PyObject *)h;
}

static int hook_traverse(HookObject *h, visitproc visit, void *arg) {
    Py_VISIT(h->original);
    Py_VISIT(h->rest);
    Py_VISIT(h->prof);
    Py_VISIT(h->capture);
    Py_VISIT(h->by_name);
    Py_VISIT(h->end);
    Py_VISIT(h->opened);
    return 0;
}

static int hook_clear(HookObject *h) {
    Py_CLEAR(h->original);
    Py_CLEAR(h->rest);
    Py_CLEAR(h->prof);
    Py_CLEAR(h->capture);
    Py_CLEAR(h->by_name);
    Py_CLEAR(h->end);
    Py_CLEAR(h->opened);
    return 0;
}

static void hook_dealloc(HookObject *h) {
    PyObject_GC_UnTrack(h);
    hook_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyObject *hook_descr_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *hook_get_original(HookObject *h, void *closure) {
    return Py_NewRef(h->original);
}

static PyGetSetDef hook_getset[] = {
    {"__wrapped__", (getter)hook_get_original, NULL, "the original method", NULL},
    {NULL},
};

static PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepscope._fast.ContextHook",
    .tp_basicsize = sizeof(HookObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
                | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(HookObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = hook_new,
    .tp_dealloc = (destructor)hook_dealloc,
    .tp_traverse = (traverseproc)hook_traverse,
    .tp_clear = (inquiry)hook_clear,
    .tp_descr_get = hook_descr_get,
    .tp_getset = hook_getset,
    .tp_doc = "ContextHook(which, original, rest, prof, capture, by_name, end, main, opened, "
              "max_open): "
              "__enter__ (0) or __exit__ (1) of a class, recording a range.",
};

/* ---- the module ----------------------------------------------------------------------------- */

static PyMethodDef module_methods[] = {
    {"extend", f_extend, METH_O, "Append whole (code, ts, ident) triples."},
    {"drain", f_drain, METH_NOARGS, "Take all recorded events as native int64 bytes."},
    {"size", f_size, METH_NOARGS, "int64 words recorded and not yet drained (3 per event)."},
    {"thread_last_ts", f_thread_last_ts, METH_NOARGS,
     "The latest timestamp the calling thread recorded (0: none)."},
    {"lost", f_lost, METH_NOARGS, "Events not stored for lack of memory."},
    {"clear", f_clear, METH_NOARGS, "Forget everything recorded."},
    {"summary_depth", f_summary_depth, METH_NOARGS,
     "The summary ranges open on the calling thread (as its Emit calls began and ended them)."},
    {"summary_low", f_summary_low, METH_NOARGS,
     "The lowest summary_depth of the calling thread since its last mark_low (or at_top call)."},
    {"mark_low", f_mark_low, METH_NOARGS,
     "Start summary_low again at the calling thread's summary_depth."},
    {"at_top", (PyCFunction)(void (*)(void))f_at_top, METH_FASTCALL,
     "at_top(fn, base=0) -> the fn it replaces: call fn after the end that brings the calling "
     "thread's summary_depth down to base (None: no call)."},
    {"before_top", (PyCFunction)(void (*)(void))f_before_top, METH_FASTCALL,
     "before_top(fn, base=0) -> the fn it replaces: call fn(code) before each begin made with "
     "base summary ranges open on the calling thread, until it returns True (None: no call)."},
    {"reset_depth", f_reset_depth, METH_NOARGS,
     "Every thread's summary_depth to 0, and at_top's and before_top's calls dropped."},
    {"withdraw", f_withdraw, METH_VARARGS, "withdraw(code, ts, ident, null_code, lookback)."},
    {"set_mode", f_set_mode, METH_O, "set_mode(mode): 0 off, 1 record, 2 delegate."},
    {"set_recording", f_set_recording, METH_O,
     "set_recording(on): recorder.ON, for the profiler's C methods and ContextHook."},
    {"assemble", f_assemble, METH_VARARGS,
     "assemble(deltas, tidx, templates) -> bytes: Trace.packet entries (see _encoder.assemble)."},
    {"numbered_event", (PyCFunction)(void (*)(void))f_numbered_event, METH_FASTCALL,
     "numbered_event(te_tag, head, name_tag, prefix, suffix, da_tag, da_head, n) -> bytes."},
    {"numbered_events", (PyCFunction)(void (*)(void))f_numbered_events, METH_FASTCALL,
     "numbered_events(te_tag, head, name_tag, prefix, suffix, da_tag, da_head, pkt_prefix, "
     "numbers) -> list[bytes]."},
    {"step_boundary", (PyCFunction)(void (*)(void))f_step_boundary, METH_FASTCALL,
     "step_boundary(end, ts, ident, begin, begin_ts, begin_ident, null_code, lookback) -> bool."},
    {"install_profiler", f_install_profiler, METH_VARARGS,
     "install_profiler(cls, config, docs): ProfilerCore.step/_activity/phase on cls."},
    {"configure", f_configure, METH_VARARGS,
     "configure(end_code, by_message, push_codes, annotate_slow, push_slow, pop_slow)."},
    {"annotate", (PyCFunction)(void (*)(void))f_annotate, METH_FASTCALL | METH_KEYWORDS,
     "annotate(message=None, color=None, domain=None, category=None, payload=None, **args)\n--\n\n"
     "A range, as ``with annotate(\"x\"):`` or ``@annotate(\"x\")`` / ``@annotate``."},
    {"push_range", (PyCFunction)(void (*)(void))f_push_range, METH_FASTCALL | METH_KEYWORDS,
     "push_range(message=None, color=None, domain=None, category=None, payload=None)\n--\n\n"
     "Open a range on this thread; close it with ``pop_range``."},
    {"noop", (PyCFunction)(void (*)(void))f_noop, METH_FASTCALL | METH_KEYWORDS,
     "noop(*args, **kwargs) -> None: does nothing, as cheaply as a C call can."},
    {"pop_range", (PyCFunction)(void (*)(void))f_pop_range, METH_FASTCALL | METH_KEYWORDS,
     "pop_range(domain=None)\n--\n\nClose the innermost range opened by ``push_range``."},
    {NULL},
};

static struct PyModuleDef fast_module = {
    PyModuleDef_HEAD_INIT, "stepscope._fast", "The hot recording path in C.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__fast(void) {
    if (PyType_Ready(&EmitType) < 0 || PyType_Ready(&RangeMethodType) < 0
        || PyType_Ready(&RangeType) < 0 || range_add_methods() < 0
        || PyType_Ready(&DecoratedType) < 0 || PyType_Ready(&CountersType) < 0
        || PyType_Ready(&CoreType) < 0 || PyType_Ready(&HookType) < 0
        || PyType_Ready(&FlagsType) < 0 || intern_names() < 0)
        return NULL;
    str_enter_slow = PyUnicode_InternFromString("_enter_slow");
    str_exit_slow = PyUnicode_InternFromString("_exit_slow");
    if (str_enter_slow == NULL || str_exit_slow == NULL) return NULL;
    PyObject *m = PyModule_Create(&fast_module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "TAG_TRACE_PACKET", STEPSCOPE_TAG_TRACE_PACKET) < 0
        || PyModule_AddIntConstant(m, "TAG_PACKET_TIMESTAMP", STEPSCOPE_TAG_PACKET_TIMESTAMP) < 0
        || PyModule_AddObjectRef(m, "Emit", (PyObject *)&EmitType) < 0
        || PyModule_AddObjectRef(m, "StepCounters", (PyObject *)&CountersType) < 0
        || PyModule_AddObjectRef(m, "ProfilerCore", (PyObject *)&CoreType) < 0
        || PyModule_AddObjectRef(m, "ContextHook", (PyObject *)&HookType) < 0
        || PyModule_AddObjectRef(m, "CaptureFlags", (PyObject *)&FlagsType) < 0
        || PyModule_AddObjectRef(m, "Range", (PyObject *)&RangeType) < 0
        || PyModule_AddObjectRef(m, "Decorated", (PyObject *)&DecoratedType) < 0
        || PyModule_AddIntConstant(m, "THREAD_MARK", THREAD_MARK) < 0
        || PyModule_AddObject(m, "STEPS_IDENT", PyLong_FromLongLong(STEPS_IDENT)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
