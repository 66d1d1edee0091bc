/* stepscope.analysis.sqlimage._sqlpages: the per-row loops of sqlimage/image.py in C (optional).
 *
 * sqlimage.image lays out an SQLite database file image from numpy columns. Its numpy twin costs about
 * 0.75 us per row (a dozen array passes per column); these two loops do the same in one pass
 * each: the size of every cell (to plan the pages) and the leaf pages themselves. Page planning,
 * interior pages and the schema stay in Python (a handful of rows per page).
 *
 * A column is a tuple (type, values, null): type 0 = the rowid alias (stored as NULL), 1 = int64,
 * 2 = float64, 3 = text (int64 ids into the string table: blob, offsets, lengths; -1 = NULL);
 * values is a C-contiguous buffer of 8-byte items, null an optional buffer of one byte per row
 * (non-zero: NULL). The records written are those SQLite writes itself: integers in the smallest
 * serial type (none for 0 and 1), doubles as serial 7, text as 2 * length + 13.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "values are byte-swapped as on a little-endian CPU: build nothing, the numpy writer serves"
#endif

#define MAX_COLS 64
#define MAX_PAGE_CELLS (65536 / 2) /* a cell takes at least its 2-byte pointer */

typedef struct {
    int type;
    int wide;            /* int and text ids: 8-byte (i64) or 4-byte (i32) items */
    const int64_t *i64;
    const int32_t *i32;
    const double *f64;
    const unsigned char *null;
} col_t;

typedef struct {
    int ncols;
    col_t c[MAX_COLS];
    Py_buffer views[2 * MAX_COLS + 5]; /* values and nulls per column; rows, rowid, strings */
    int nviews;
    const int64_t *rows; /* cell -> row (NULL: cell i is row i) */
    const int64_t *rowid; /* table B-trees: rowid per row (NULL: index B-tree) */
    const unsigned char *blob;
    Py_ssize_t blob_len;
    const int64_t *soff, *slen;
    Py_ssize_t nstrings, nrows, ncells;
} spec_t;

/* bytes of SQLite's varint of v (1..9); branch-free below 2**56 */
static inline int varint_len(uint64_t v) {
    if (v > 0x00ffffffffffffffULL) return 9;
    int bits = 64 - __builtin_clzll(v | 1);
    return (bits + 6) / 7;
}

/* SQLite's varint: big-endian groups of 7 bits, the 9th byte (if any) holds 8 bits */
static unsigned char *put_varint(unsigned char *p, uint64_t v) {
    if (v < 0x80) {
        *p = (unsigned char)v;
        return p + 1;
    }
    if (v > 0x00ffffffffffffffULL) {
        p[8] = (unsigned char)v;
        v >>= 8;
        for (int i = 7; i >= 0; i--) {
            p[i] = (unsigned char)((v & 0x7f) | 0x80);
            v >>= 7;
        }
        return p + 9;
    }
    int n = varint_len(v);
    for (int i = n - 1; i >= 0; i--) {
        p[i] = (unsigned char)((v & 0x7f) | (i == n - 1 ? 0 : 0x80));
        v >>= 7;
    }
    return p + n;
}

/* serial type of an integer by the bit length of v (v >= 0) or of -v - 1 (v < 0) */
static const unsigned char serial_by_bits[65] = {
    1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 5,
    5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6};

/* value bytes of a serial type (text: (serial - 13) / 2) */
static inline int value_bytes(uint32_t serial) {
    static const unsigned char fixed[13] = {0, 1, 2, 3, 4, 6, 8, 8, 0, 0, 0, 0, 0};
    return serial < 13 ? fixed[serial] : (int)((serial - 13) >> 1);
}

/* smallest serial type holding v, as SQLite writes it (none for 0 and 1) */
static inline uint32_t int_serial(int64_t v) {
    uint64_t m = (uint64_t)(v ^ (v >> 63));
    uint32_t t = serial_by_bits[m ? 64 - __builtin_clzll(m) : 0];
    t = v == 1 ? 9 : t;
    return v == 0 ? 8 : t;
}

static inline int64_t get_int(const col_t *c, Py_ssize_t r) {
    return c->wide ? c->i64[r] : (int64_t)c->i32[r];
}

/* serial type of column c at row r */
static inline uint32_t serial_of(const spec_t *s, const col_t *c, Py_ssize_t r) {
    if (c->type == 0 || (c->null != NULL && c->null[r])) return 0;
    if (c->type == 1) return int_serial(get_int(c, r));
    if (c->type == 2) return 7;
    int64_t id = get_int(c, r);
    return id < 0 ? 0 : (uint32_t)(2 * s->slen[id] + 13);
}

static inline int header_len(int body) {
    int k = 1;
    while (varint_len((uint64_t)(body + k)) > k) k++;
    return body + k;
}

/* the serial types of row r (into ser), its payload size, and its cell size */
static inline Py_ssize_t cell_size(const spec_t *s, Py_ssize_t r, uint32_t *ser,
                                   Py_ssize_t *payload_out) {
    int body = 0;
    Py_ssize_t values = 0;
    for (int i = 0; i < s->ncols; i++) {
        uint32_t st = serial_of(s, &s->c[i], r);
        ser[i] = st;
        values += value_bytes(st);
        body += st < 0x80 ? 1 : varint_len(st);
    }
    Py_ssize_t payload = header_len(body) + values;
    *payload_out = payload;
    Py_ssize_t cell = varint_len((uint64_t)payload) + payload;
    if (s->rowid != NULL) cell += varint_len((uint64_t)s->rowid[r]);
    return cell;
}

/* write the cell of row r (serial types and payload size from cell_size) at p; returns its end */
static unsigned char *write_cell(const spec_t *s, Py_ssize_t r, const uint32_t *ser,
                                 Py_ssize_t payload, unsigned char *p) {
    int body = 0;
    p = put_varint(p, (uint64_t)payload);
    if (s->rowid != NULL) p = put_varint(p, (uint64_t)s->rowid[r]);
    for (int i = 0; i < s->ncols; i++) body += ser[i] < 0x80 ? 1 : varint_len(ser[i]);
    p = put_varint(p, (uint64_t)header_len(body));
    for (int i = 0; i < s->ncols; i++) {
        if (ser[i] < 0x80)
            *p++ = (unsigned char)ser[i];
        else
            p = put_varint(p, ser[i]);
    }
    for (int i = 0; i < s->ncols; i++) {
        const col_t *c = &s->c[i];
        int z = value_bytes(ser[i]);
        if (z == 0) continue;
        if (c->type == 3) {
            memcpy(p, s->blob + s->soff[get_int(c, r)], (size_t)z);
        } else {
            uint64_t u;
            if (c->type == 1) {
                u = (uint64_t)get_int(c, r);
            } else {
                memcpy(&u, &c->f64[r], 8);
            }
            u = __builtin_bswap64(u); /* big-endian: the low z bytes are the last z */
            memcpy(p, (unsigned char *)&u + (8 - z), (size_t)z);
        }
        p += z;
    }
    return p;
}

static void release(spec_t *s) {
    for (int i = 0; i < s->nviews; i++) PyBuffer_Release(&s->views[i]);
    s->nviews = 0;
}

/* a read-only contiguous buffer of n items of `item` bytes; NULL (no error) for None */
static const void *view(spec_t *s, PyObject *o, Py_ssize_t n, Py_ssize_t item, const char *what) {
    if (o == Py_None) return NULL;
    Py_buffer *b = &s->views[s->nviews];
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    s->nviews++;
    if (b->itemsize != item || b->len < n * item) {
        PyErr_Format(PyExc_ValueError, "%s: %zd items of %zd bytes needed", what, n, item);
        return NULL;
    }
    return b->buf;
}

#define NEED(ptr, obj)                                                                        \
    if ((ptr) == NULL && ((obj) != Py_None || PyErr_Occurred())) goto fail

/* cols, rows, rowid, nrows, ncells, blob, offsets, lengths, nstrings */
static int parse_spec(spec_t *s, PyObject *const *args) {
    memset(s, 0, sizeof(*s));
    PyObject *cols = args[0];
    s->nrows = PyLong_AsSsize_t(args[3]);
    s->ncells = PyLong_AsSsize_t(args[4]);
    s->nstrings = PyLong_AsSsize_t(args[8]);
    if (PyErr_Occurred()) return -1;
    if (!PyList_Check(cols) || PyList_GET_SIZE(cols) > MAX_COLS) {
        PyErr_SetString(PyExc_ValueError, "cols: a list of at most 64 columns");
        return -1;
    }
    s->ncols = (int)PyList_GET_SIZE(cols);
    for (int i = 0; i < s->ncols; i++) {
        PyObject *t = PyList_GET_ITEM(cols, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) {
            PyErr_SetString(PyExc_ValueError, "a column is (type, values, null)");
            goto fail;
        }
        col_t *c = &s->c[i];
        c->type = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 0));
        if (PyErr_Occurred()) goto fail;
        if (c->type < 0 || c->type > 3) {
            PyErr_SetString(PyExc_ValueError, "column type: 0..3");
            goto fail;
        }
        if (c->type == 0) continue;
        PyObject *v = PyTuple_GET_ITEM(t, 1), *nl = PyTuple_GET_ITEM(t, 2);
        if (v == Py_None) {
            PyErr_SetString(PyExc_ValueError, "values missing");
            goto fail;
        }
        Py_buffer *b = &s->views[s->nviews];
        if (PyObject_GetBuffer(v, b, PyBUF_C_CONTIGUOUS) < 0) goto fail;
        s->nviews++;
        /* doubles: 8 bytes; integers and text ids: 4 or 8 */
        if (!(b->itemsize == 8 || (b->itemsize == 4 && c->type != 2)) ||
            b->len < s->nrows * b->itemsize) {
            PyErr_Format(PyExc_ValueError, "values: %zd items of %zd bytes for %zd rows",
                         b->len / (b->itemsize ? b->itemsize : 1), b->itemsize, s->nrows);
            goto fail;
        }
        c->wide = b->itemsize == 8;
        if (c->type == 2)
            c->f64 = b->buf;
        else if (c->wide)
            c->i64 = b->buf;
        else
            c->i32 = b->buf;
        c->null = view(s, nl, s->nrows, 1, "null");
        NEED(c->null, nl);
    }
    s->rows = view(s, args[1], s->ncells, 8, "rows");
    NEED(s->rows, args[1]);
    s->rowid = view(s, args[2], s->nrows, 8, "rowid");
    NEED(s->rowid, args[2]);
    s->blob = view(s, args[5], 0, 1, "blob");
    NEED(s->blob, args[5]);
    s->blob_len = s->blob != NULL ? s->views[s->nviews - 1].len : 0;
    s->soff = view(s, args[6], s->nstrings, 8, "offsets");
    NEED(s->soff, args[6]);
    s->slen = view(s, args[7], s->nstrings, 8, "lengths");
    NEED(s->slen, args[7]);
    if (s->blob == NULL || s->soff == NULL || s->slen == NULL) {
        PyErr_SetString(PyExc_ValueError, "the string table is required");
        goto fail;
    }
    if (s->rows == NULL && s->ncells > s->nrows) {
        PyErr_SetString(PyExc_ValueError, "more cells than rows");
        goto fail;
    }
    /* every index read later is checked here once */
    for (Py_ssize_t i = 0; i < s->nstrings; i++) {
        if (s->soff[i] < 0 || s->slen[i] < 0 || s->slen[i] > 0x3fffffff ||
            s->soff[i] + s->slen[i] > s->blob_len) {
            PyErr_SetString(PyExc_ValueError, "string table: a string outside the blob");
            goto fail;
        }
    }
    for (Py_ssize_t j = 0; s->rows != NULL && j < s->ncells; j++) {
        if (s->rows[j] < 0 || s->rows[j] >= s->nrows) {
            PyErr_SetString(PyExc_IndexError, "rows: index out of range");
            goto fail;
        }
    }
    for (int i = 0; i < s->ncols; i++) {
        if (s->c[i].type != 3) continue;
        for (Py_ssize_t r = 0; r < s->nrows; r++) {
            int64_t id = get_int(&s->c[i], r);
            if (id >= s->nstrings) {
                PyErr_SetString(PyExc_IndexError, "text id out of range");
                goto fail;
            }
        }
    }
    return 0;
fail:
    release(s);
    return -1;
}

static inline Py_ssize_t row_of(const spec_t *s, Py_ssize_t j) {
    return s->rows != NULL ? (Py_ssize_t)s->rows[j] : j;
}

/* cell_sizes(cols, rows, rowid, nrows, ncells, blob, offsets, lengths, nstrings, out_int32) */
static PyObject *f_cell_sizes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "cell_sizes takes 10 arguments");
        return NULL;
    }
    spec_t s;
    if (parse_spec(&s, args) < 0) return NULL;
    Py_buffer out;
    if (PyObject_GetBuffer(args[9], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        release(&s);
        return NULL;
    }
    if (out.len < s.ncells * 4) {
        PyErr_SetString(PyExc_ValueError, "out: too small");
    } else {
        int32_t *o = out.buf;
        uint32_t ser[MAX_COLS];
        Py_ssize_t payload;
        Py_BEGIN_ALLOW_THREADS /* plain C on buffers held by this call: B-trees in parallel */
        for (Py_ssize_t j = 0; j < s.ncells; j++)
            o[j] = (int32_t)cell_size(&s, row_of(&s, j), ser, &payload);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    release(&s);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* write_leaves(cols, rows, rowid, nrows, ncells, blob, offsets, lengths, nstrings,
 *              out, base, page_size, kind, page_first)
 * Leaf page k (at out[base + k * page_size]) holds cells page_first[k] .. page_first[k + 1] - 1
 * (the last one up to ncells), laid out as the numpy writer does: the cells in order, the last
 * one ending at the page's end. */
static PyObject *f_write_leaves(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "write_leaves takes 14 arguments");
        return NULL;
    }
    spec_t s;
    if (parse_spec(&s, args) < 0) return NULL;
    Py_ssize_t base = PyLong_AsSsize_t(args[10]);
    long page_size = PyLong_AsLong(args[11]);
    long kind = PyLong_AsLong(args[12]);
    if (PyErr_Occurred()) {
        release(&s);
        return NULL;
    }
    Py_buffer out, pf;
    if (PyObject_GetBuffer(args[9], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        release(&s);
        return NULL;
    }
    if (PyObject_GetBuffer(args[13], &pf, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&out);
        release(&s);
        return NULL;
    }
    const int64_t *first = pf.buf;
    Py_ssize_t npages = pf.len / 8;
    unsigned char *img = out.buf;
    /* per page: each cell's payload size and serial types (computed once, used to write) */
    int32_t *psize = PyMem_Malloc(sizeof(int32_t) * MAX_PAGE_CELLS);
    uint32_t *ser = PyMem_Malloc(sizeof(uint32_t) * MAX_PAGE_CELLS * (s.ncols ? s.ncols : 1));
    if (psize == NULL || ser == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (page_size < 512 || page_size > 65536 || base < 0 ||
        base + npages * page_size > out.len) {
        PyErr_SetString(PyExc_ValueError, "pages do not fit the image");
        goto done;
    }
    if (npages < 1 || first[0] != 0) {
        PyErr_SetString(PyExc_ValueError, "page_first: not increasing cell numbers from 0");
        goto done;
    }
    const char *err = NULL; /* set without the GIL, raised after */
    Py_BEGIN_ALLOW_THREADS /* plain C on buffers held by this call: B-trees in parallel */
    for (Py_ssize_t k = 0; k < npages; k++) {
        Py_ssize_t lo = first[k], hi = k + 1 < npages ? first[k + 1] : s.ncells;
        if (lo < 0 || hi < lo || hi > s.ncells || hi - lo > MAX_PAGE_CELLS) {
            err = "page_first: not increasing cell numbers from 0";
            break;
        }
        unsigned char *page = img + base + k * page_size;
        Py_ssize_t bytes = 0;
        for (Py_ssize_t j = lo; j < hi; j++) {
            Py_ssize_t payload;
            bytes += cell_size(&s, row_of(&s, j), ser + (j - lo) * s.ncols, &payload);
            psize[j - lo] = (int32_t)payload;
        }
        Py_ssize_t ptr = 8, at = page_size - bytes;
        if (at < ptr + 2 * (hi - lo)) {
            err = "page overflow";
            break;
        }
        page[5] = (unsigned char)((at % 65536) >> 8); /* content start; 65536 is written as 0 */
        page[6] = (unsigned char)(at % 65536);
        unsigned char *p = page + at;
        for (Py_ssize_t j = lo; j < hi; j++) { /* cells in order, from the content start */
            Py_ssize_t off = p - page;
            page[ptr] = (unsigned char)(off >> 8);
            page[ptr + 1] = (unsigned char)off;
            ptr += 2;
            p = write_cell(&s, row_of(&s, j), ser + (j - lo) * s.ncols, psize[j - lo], p);
        }
        Py_ssize_t n = hi - lo;
        page[0] = (unsigned char)kind;
        page[1] = page[2] = 0;
        page[3] = (unsigned char)(n >> 8);
        page[4] = (unsigned char)n;
        page[7] = 0;
    }
    Py_END_ALLOW_THREADS
    if (err != NULL) PyErr_SetString(PyExc_ValueError, err);
done:
    PyMem_Free(psize);
    PyMem_Free(ser);
    PyBuffer_Release(&pf);
    PyBuffer_Release(&out);
    release(&s);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"cell_sizes", (PyCFunction)(void (*)(void))f_cell_sizes, METH_FASTCALL,
     "Cell size (int32) of each cell of a B-tree's leaves."},
    {"write_leaves", (PyCFunction)(void (*)(void))f_write_leaves, METH_FASTCALL,
     "Write the leaf pages of a table or index B-tree into an image."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sqlpages",
                                    "SQLite leaf pages from columns (see sqlimage/pages.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__sqlpages(void) { return PyModule_Create(&module); }
