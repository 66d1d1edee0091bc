/* stepscope.analysis.tp._decodeloops: the decoder's sequential loops, which numpy can only do in
 * many passes (optional; protoscan.py, state.py, packets.py and decode.py have the numpy twins, same results).
 *
 * split_repeated(buf, start, end, tag) -> (starts, ends, stop): the items of a run of one
 * repeated length-delimited field (Trace.packet) in buf[start:end], as protoscan.split_repeated
 * defines them: starts/ends are the payload bounds (native int64 bytes), stop is where the walk
 * stopped (end for a clean run; a byte that is not `tag`, or an item running past end, stops it
 * and such an item is dropped). A length varint longer than 10 bytes or above 2**40 counts as
 * 2**40 (it runs past any end).
 *
 * nest(typ, track, ts, begin, end, instant, out_slice, dur, depth, parent) -> unmatched ends:
 * slices from begin / end / instant events in time order (typ, track, ts: one per event), as
 * decode._build_slices defines them: each begin or instant opens the next slice id, one level
 * below the slice open on its track (parent), and an end closes the innermost open one; an end
 * with nothing open is ignored (as trace processor). out_slice gets each event's slice (-1: an
 * ignored end); dur (-1: never closed; instants 0), depth and parent (-1: none) one per slice.
 * Tracks are indexes 0..ntracks-1 (ntracks = the size of `top`, a scratch array).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define LEN_CAP ((int64_t)1 << 40)

/* one walk; with out != NULL, the payload bounds are stored. Returns the item count. */
static Py_ssize_t walk(const unsigned char *b, Py_ssize_t blen, Py_ssize_t start, Py_ssize_t end,
                       unsigned char tag, int64_t *starts, int64_t *ends, Py_ssize_t *stop) {
    Py_ssize_t p = start, n = 0;
    while (p < end && b[p] == tag) {
        uint64_t v = 0;
        int k = 0;
        Py_ssize_t q = p + 1;
        int ok = 0;
        for (; k < 10 && q + k < blen; k++) {
            unsigned char c = b[q + k];
            if (k < 9) v |= (uint64_t)(c & 0x7f) << (7 * k);
            else v |= (uint64_t)(c & 0x01) << 63;
            if (c < 0x80) {
                ok = 1;
                break;
            }
        }
        int64_t ln = (!ok || v > (uint64_t)LEN_CAP) ? LEN_CAP : (int64_t)v;
        int64_t body = (int64_t)q + (ok ? k + 1 : 1);
        int64_t nxt = body + ln;
        if (nxt > (int64_t)end) break; /* runs past the end: dropped, the walk stops here */
        if (starts != NULL) {
            starts[n] = body;
            ends[n] = nxt;
        }
        n++;
        p = (Py_ssize_t)nxt;
    }
    *stop = p;
    return n;
}

static PyObject *f_split_repeated(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "split_repeated(buf, start, end, tag)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), end = PyLong_AsSsize_t(args[2]);
    long tag = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *res = NULL, *s = NULL, *e = NULL;
    if (start < 0 || end < start || end > b.len || tag < 0 || tag > 255) {
        PyErr_SetString(PyExc_ValueError, "split_repeated: bad start, end or tag");
        goto done;
    }
    Py_ssize_t stop;
    Py_ssize_t n = walk(b.buf, b.len, start, end, (unsigned char)tag, NULL, NULL, &stop);
    s = PyBytes_FromStringAndSize(NULL, n * 8);
    e = PyBytes_FromStringAndSize(NULL, n * 8);
    if (s == NULL || e == NULL) goto done;
    walk(b.buf, b.len, start, end, (unsigned char)tag, (int64_t *)PyBytes_AS_STRING(s),
         (int64_t *)PyBytes_AS_STRING(e), &stop);
    res = Py_BuildValue("(OOn)", s, e, stop);
done:
    Py_XDECREF(s);
    Py_XDECREF(e);
    PyBuffer_Release(&b);
    return res;
}

typedef struct {
    Py_buffer b;
    int held;
} buf_t;

static int get(buf_t *x, PyObject *o, int writable, Py_ssize_t itemsize, Py_ssize_t n,
               const char *what) {
    if (PyObject_GetBuffer(o, &x->b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    x->held = 1;
    if (x->b.itemsize != itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: items of %zd bytes expected", what, itemsize);
        return -1;
    }
    if (n >= 0 && x->b.len != n * itemsize) { /* n < 0: any length */
        PyErr_Format(PyExc_ValueError, "%s: %zd items expected", what, n);
        return -1;
    }
    return 0;
}

/* the call's result `res` (NULL: an error is set), once the buffers held in v[0..n-1] are
 * released */
static PyObject *release(buf_t *v, int n, PyObject *res) {
    for (int i = 0; i < n; i++)
        if (v[i].held) PyBuffer_Release(&v[i].b);
    return res;
}

static PyObject *f_nest(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError,
                        "nest(typ, track, ts, begin, end, instant, out_slice, dur, depth, parent, "
                        "top)");
        return NULL;
    }
    buf_t v[8] = {{{0}}};
    PyObject *res = NULL;
    long tb = PyLong_AsLong(args[3]), te = PyLong_AsLong(args[4]), ti = PyLong_AsLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (get(&v[0], args[0], 0, 1, -1, "typ") < 0) goto done; /* int8 per event */
    Py_ssize_t k = v[0].b.len;
    if (get(&v[1], args[1], 0, 4, k, "track") < 0 || get(&v[2], args[2], 0, 8, k, "ts") < 0 ||
        get(&v[3], args[6], 1, 4, k, "out_slice") < 0)
        goto done;
    const int8_t *typ = v[0].b.buf;
    const int32_t *trk = v[1].b.buf;
    const int64_t *ts = v[2].b.buf;
    int32_t *out = v[3].b.buf;
    Py_ssize_t nsl = 0;
    for (Py_ssize_t i = 0; i < k; i++) nsl += typ[i] == tb || typ[i] == ti;
    if (nsl > INT32_MAX) { /* slice numbers are int32 */
        PyErr_SetString(PyExc_ValueError, "nest: more than 2**31 - 1 slices");
        goto done;
    }
    if (get(&v[4], args[7], 1, 8, nsl, "dur") < 0 || get(&v[5], args[8], 1, 4, nsl, "depth") < 0 ||
        get(&v[6], args[9], 1, 4, nsl, "parent") < 0)
        goto done;
    if (get(&v[7], args[10], 1, 4, -1, "top") < 0) goto done;
    int64_t *dur = v[4].b.buf;
    int32_t *depth = v[5].b.buf, *parent = v[6].b.buf, *top = v[7].b.buf;
    Py_ssize_t ntracks = v[7].b.len / 4;
    for (Py_ssize_t t = 0; t < ntracks; t++) top[t] = -1;
    int64_t *begin_ts = dur; /* an open slice's dur holds its begin time until it closes */
    Py_ssize_t next = 0, unmatched = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        int32_t t = trk[i];
        if (t < 0 || t >= ntracks) {
            PyErr_SetString(PyExc_IndexError, "track: index out of range");
            goto done;
        }
        int y = typ[i];
        if (y == tb || y == ti) {
            int32_t s = (int32_t)next++, up = top[t];
            parent[s] = up;
            depth[s] = up < 0 ? 0 : depth[up] + 1;
            out[i] = s;
            if (y == tb) {
                begin_ts[s] = ts[i];
                top[t] = s;
            } else {
                dur[s] = 0;
            }
        } else if (y == te) {
            int32_t s = top[t];
            if (s < 0) {
                out[i] = -1;
                unmatched++;
                continue;
            }
            dur[s] = ts[i] - begin_ts[s];
            top[t] = parent[s];
            out[i] = s;
        } else {
            out[i] = -1;
        }
    }
    for (Py_ssize_t t = 0; t < ntracks; t++) { /* still open: never closed */
        for (int32_t s = top[t]; s >= 0; s = parent[s]) dur[s] = -1;
    }
    res = PyLong_FromSsize_t(unmatched);
done:
    return release(v, 8, res);
}

/* The owners of a walk (the defaults packets of the sequences), read in packet order while the
 * walk goes through the packets: owner_at(o, upto, g) moves past the owners at or before packet
 * `upto`, keeping the latest one per generation in `last` (one slot per generation: owner
 * generations are < its size, any other generation has no owner), and gives the one of
 * generation g, or -1. */
typedef struct {
    const int64_t *gen, *pkt;
    int64_t *last;
    Py_ssize_t n, ngen, j;
} owners_t;

/* owner_gen, owner_pkt and last from args[0..2] into v[0..2]; checks the owners are in packet
 * order with generations below ngen, clears `last`. -1 with an exception set on failure. */
static int get_owners(owners_t *o, buf_t *v, PyObject *const *args) {
    if (get(&v[0], args[0], 0, 8, -1, "owner_gen") < 0 ||
        get(&v[2], args[2], 1, 8, -1, "last") < 0 ||
        get(&v[1], args[1], 0, 8, v[0].b.len / 8, "owner_pkt") < 0)
        return -1;
    *o = (owners_t){v[0].b.buf, v[1].b.buf, v[2].b.buf, v[0].b.len / 8, v[2].b.len / 8, 0};
    for (Py_ssize_t j = 0; j < o->n; j++) {
        const char *err = j > 0 && o->pkt[j] < o->pkt[j - 1] ? "owner_pkt: not in packet order"
                          : o->gen[j] >= o->ngen            ? "owner_gen: beyond last"
                                                            : NULL;
        if (err != NULL) {
            PyErr_SetString(PyExc_ValueError, err);
            return -1;
        }
    }
    for (Py_ssize_t g = 0; g < o->ngen; g++) o->last[g] = -1;
    return 0;
}

static inline int64_t owner_at(owners_t *o, int64_t upto, int64_t g) {
    for (; o->j < o->n && o->pkt[o->j] <= upto; o->j++)
        if (o->gen[o->j] >= 0) o->last[o->gen[o->j]] = o->j;
    return g >= 0 && g < o->ngen ? o->last[g] : -1;
}

/* last_owner(owner_gen, owner_pkt, last, gen, pkt, out): for each query packet pkt[i] (of
 * generation gen[i]), the index of the last owner of the same generation at or before it, or -1
 * (state.lookup_last's numpy twin). Queries are in packet order. All int64. */
static PyObject *f_last_owner(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "last_owner(owner_gen, owner_pkt, last, gen, pkt, out)");
        return NULL;
    }
    buf_t v[6] = {{{0}}};
    owners_t o;
    PyObject *res = NULL;
    if (get_owners(&o, v, args) < 0 || get(&v[3], args[3], 0, 8, -1, "gen") < 0)
        goto done;
    Py_ssize_t nq = v[3].b.len / 8;
    if (get(&v[4], args[4], 0, 8, nq, "pkt") < 0 || get(&v[5], args[5], 1, 8, nq, "out") < 0)
        goto done;
    const int64_t *gen = v[3].b.buf, *pkt = v[4].b.buf;
    int64_t *out = v[5].b.buf;
    for (Py_ssize_t i = 1; i < nq; i++)
        if (pkt[i] < pkt[i - 1]) {
            PyErr_SetString(PyExc_ValueError, "pkt: not in packet order");
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < nq; i++) out[i] = owner_at(&o, pkt[i], gen[i]);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    res = Py_None;
done:
    return release(v, 6, res);
}

/* packet_clocks(owner_gen, owner_pkt, last, owner_clock, gen, srank, clock): each packet's clock
 * id, in place (state._packet_clocks's numpy twin). A packet with no clock of its own (0) takes
 * that of the last defaults packet (owner) of its generation at or before it, or keeps 0; then
 * sequence-scoped clocks (64..127) become ((srank + 1) << 8) | clock. All int64. */
static PyObject *f_packet_clocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "packet_clocks(owner_gen, owner_pkt, last, owner_clock, gen, srank, clock)");
        return NULL;
    }
    buf_t v[7] = {{{0}}};
    owners_t o;
    PyObject *res = NULL;
    if (get_owners(&o, v, args) < 0 || get(&v[3], args[3], 0, 8, o.n, "owner_clock") < 0 ||
        get(&v[4], args[4], 0, 8, -1, "gen") < 0)
        goto done;
    Py_ssize_t n = v[4].b.len / 8;
    if (get(&v[5], args[5], 0, 8, n, "srank") < 0 || get(&v[6], args[6], 1, 8, n, "clock") < 0)
        goto done;
    const int64_t *oclk = v[3].b.buf, *gen = v[4].b.buf, *srank = v[5].b.buf;
    int64_t *clock = v[6].b.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t c = clock[i], d = owner_at(&o, i, gen[i]);
        if (c == 0 && d >= 0) c = oclk[d];
        if (c >= 64 && c <= 127) c |= (srank[i] + 1) << 8;
        clock[i] = c;
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    res = Py_None;
done:
    return release(v, 7, res);
}

/* generations(srank, flags, scratch, gen): each packet's generation id (state.generations'
 * numpy twin): -1 before the first clear (flags bit 0) of its sequence (srank: 0..nseq-1, int64),
 * else base[s] + the clears of its sequence so far, where base[s] = sum over the sequences
 * before s of (their clears + 1). flags int8; scratch int64 of 2 * nseq; gen int64, out. */
static PyObject *f_generations(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "generations(srank, flags, scratch, gen)");
        return NULL;
    }
    buf_t v[4] = {{{0}}};
    PyObject *res = NULL;
    if (get(&v[0], args[0], 0, 8, -1, "srank") < 0) goto done;
    Py_ssize_t n = v[0].b.len / 8;
    if (get(&v[1], args[1], 0, 1, n, "flags") < 0 || get(&v[2], args[2], 1, 8, -1, "scratch") < 0 ||
        get(&v[3], args[3], 1, 8, n, "gen") < 0)
        goto done;
    const int64_t *srank = v[0].b.buf;
    const int8_t *flags = v[1].b.buf;
    Py_ssize_t nseq = v[2].b.len / 16;
    int64_t *base = v[2].b.buf, *run = base + nseq, *gen = v[3].b.buf;
    for (Py_ssize_t s = 0; s < 2 * nseq; s++) base[s] = 0;
    const char *err = NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && err == NULL; i++) {
        if (srank[i] < 0 || srank[i] >= nseq) err = "srank: not in 0..nseq-1";
        else if (flags[i] & 1) run[srank[i]]++; /* clears per sequence, for now */
    }
    if (err == NULL) {
        int64_t b = 0;
        for (Py_ssize_t s = 0; s < nseq; s++) {
            base[s] = b;
            b += run[s] + 1;
            run[s] = 0;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t s = srank[i];
            if (flags[i] & 1) run[s]++;
            gen[i] = run[s] > 0 ? base[s] + run[s] : -1;
        }
    }
    Py_END_ALLOW_THREADS
    if (err != NULL) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    Py_INCREF(Py_None);
    res = Py_None;
done:
    return release(v, 4, res);
}

/* groups(buf, start, length, inv) -> rep: groups the byte strings buf[start[i]:start[i] +
 * length[i]] by equal content (packets._body_groups' numpy twin): inv[i] = the group of
 * string i, groups numbered by first appearance; rep (bytes of native int64) = the first string
 * of each group. start, length, inv: int64; each string lies inside buf. */
static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static uint64_t hash_bytes(const unsigned char *p, int64_t n) {
    uint64_t h = mix((uint64_t)n);
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = mix(h ^ w);
    }
    if (n > 0) {
        uint64_t w = 0;
        memcpy(&w, p, (size_t)n);
        h = mix(h ^ w);
    }
    return h;
}

static PyObject *f_groups(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "groups(buf, start, length, inv)");
        return NULL;
    }
    buf_t v[4] = {{{0}}};
    PyObject *res = NULL;
    int64_t *rep = NULL, *slot = NULL;
    uint64_t *ghash = NULL;
    if (get(&v[0], args[0], 0, 1, -1, "buf") < 0 || get(&v[1], args[1], 0, 8, -1, "start") < 0)
        goto done;
    Py_ssize_t n = v[1].b.len / 8;
    if (get(&v[2], args[2], 0, 8, n, "length") < 0 || get(&v[3], args[3], 1, 8, n, "inv") < 0)
        goto done;
    const unsigned char *b = v[0].b.buf;
    const int64_t *start = v[1].b.buf, *len = v[2].b.buf;
    int64_t *inv = v[3].b.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (start[i] < 0 || len[i] < 0 || start[i] + len[i] > v[0].b.len) {
            PyErr_SetString(PyExc_ValueError, "groups: a string outside buf");
            goto done;
        }
    Py_ssize_t cap = 1024, ngroups = 0, gcap = 256; /* slots (a power of 2), groups */
    slot = PyMem_RawMalloc(sizeof(int64_t) * cap); /* Raw: also used without the GIL */
    rep = PyMem_RawMalloc(sizeof(int64_t) * gcap);
    ghash = PyMem_RawMalloc(sizeof(uint64_t) * gcap);
    if (slot == NULL || rep == NULL || ghash == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < cap; k++) slot[k] = -1;
    int nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *p = b + start[i];
        uint64_t h = hash_bytes(p, len[i]);
        Py_ssize_t k = (Py_ssize_t)(h & (uint64_t)(cap - 1));
        int64_t g;
        while ((g = slot[k]) >= 0) {
            if (ghash[g] == h && len[rep[g]] == len[i] &&
                memcmp(b + start[rep[g]], p, (size_t)len[i]) == 0)
                break;
            k = (k + 1) & (cap - 1);
        }
        if (g < 0) { /* a new group */
            if (ngroups == gcap) {
                gcap *= 2;
                int64_t *r2 = PyMem_RawRealloc(rep, sizeof(int64_t) * gcap);
                if (r2 != NULL) rep = r2;
                uint64_t *h2 = PyMem_RawRealloc(ghash, sizeof(uint64_t) * gcap);
                if (h2 != NULL) ghash = h2;
                if (r2 == NULL || h2 == NULL) {
                    nomem = 1;
                    break;
                }
            }
            g = ngroups++;
            rep[g] = i;
            ghash[g] = h;
            slot[k] = g;
            if (2 * ngroups > cap) { /* keep the table at most half full */
                Py_ssize_t ncap = 2 * cap;
                int64_t *s2 = PyMem_RawMalloc(sizeof(int64_t) * ncap);
                if (s2 == NULL) {
                    nomem = 1;
                    break;
                }
                for (Py_ssize_t j = 0; j < ncap; j++) s2[j] = -1;
                for (int64_t q = 0; q < ngroups; q++) {
                    Py_ssize_t j = (Py_ssize_t)(ghash[q] & (uint64_t)(ncap - 1));
                    while (s2[j] >= 0) j = (j + 1) & (ncap - 1);
                    s2[j] = q;
                }
                PyMem_RawFree(slot);
                slot = s2;
                cap = ncap;
            }
        }
        inv[i] = g;
    }
    Py_END_ALLOW_THREADS
    if (nomem) {
        PyErr_NoMemory();
        goto done;
    }
    res = PyBytes_FromStringAndSize((const char *)rep, ngroups * 8);
done:
    PyMem_RawFree(slot);
    PyMem_RawFree(rep);
    PyMem_RawFree(ghash);
    return release(v, 4, res);
}

static PyMethodDef methods[] = {
    {"split_repeated", (PyCFunction)(void (*)(void))f_split_repeated, METH_FASTCALL,
     "Payload bounds of the items of a repeated length-delimited field, and where it stopped."},
    {"nest", (PyCFunction)(void (*)(void))f_nest, METH_FASTCALL,
     "Slices (duration, depth, parent) from begin/end/instant events in time order."},
    {"last_owner", (PyCFunction)(void (*)(void))f_last_owner, METH_FASTCALL,
     "Per query packet: the last owner of its generation at or before it (-1: none)."},
    {"groups", (PyCFunction)(void (*)(void))f_groups, METH_FASTCALL,
     "Groups of equal byte strings of a buffer, numbered by first appearance."},
    {"generations", (PyCFunction)(void (*)(void))f_generations, METH_FASTCALL,
     "Each packet's generation id from its sequence rank and flags."},
    {"packet_clocks", (PyCFunction)(void (*)(void))f_packet_clocks, METH_FASTCALL,
     "Each packet's clock id: the defaults' where it has none, sequence clocks scoped."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_decodeloops",
                                    "The decoder's sequential loops (see tp/loops.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__decodeloops(void) { return PyModule_Create(&module); }
