/*
 * Twin of airflow_provider_pgdecode/batch/writer.py's per-table buffers (_TableBuffer), kept in
 * the layout capture/native.py's NativeWriter wraps as Arrow arrays without copying: growable
 * byte buffers, text columns in Arrow layout (validity, int32 offsets, bytes), a table's layout
 * of new tuples, its old-image fields and metadata columns, and take(), which hands the first
 * rows of a table to NativeWriter as one part and removes them.
 */
#include "native.h"

/* ---------------------------------------------------------------- growable buffers */

int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (!p) { PyErr_NoMemory(); return -1; }
    b->p = p;
    b->cap = cap;
    return 0;
}

void buf_free(Buf *b) { PyMem_Free(b->p); b->p = NULL; b->len = b->cap = 0; }

/* Drop the first `bytes` bytes. */
void buf_shift(Buf *b, Py_ssize_t bytes) {
    if (bytes >= b->len) { b->len = 0; return; }
    memmove(b->p, b->p + bytes, b->len - bytes);
    b->len -= bytes;
}

/* ---------------------------------------------------------------- text columns */

int tc_init(TextCol *c) {
    memset(c, 0, sizeof(*c));
    return buf_i32(&c->offs, 0);
}

void tc_free(TextCol *c) { buf_free(&c->valid); buf_free(&c->offs); buf_free(&c->data); }

/* A single-quoted literal's body with '' standing for '. */
int tc_append_undouble(TextCol *c, const char *s, Py_ssize_t n) {
    if (buf_reserve(&c->data, n) < 0) return -1;
    char *out = c->data.p + c->data.len;
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        out[j++] = s[i];
        if (s[i] == '\'' && i + 1 < n && s[i + 1] == '\'') i++;
    }
    c->data.len += j;
    return tc_end_row(c, 1);
}

void tc_truncate(TextCol *c, Py_ssize_t n) {
    if (n >= c->n) return;
    int32_t *offs = (int32_t *)c->offs.p;
    c->data.len = offs[n];
    c->offs.len = (n + 1) * 4;
    c->valid.len = n;
    c->n = n;
}

static PyObject *bitmap(const uint8_t *valid, Py_ssize_t n, Py_ssize_t *nulls) {
    Py_ssize_t bytes = (n + 7) / 8;
    PyObject *out = PyBytes_FromStringAndSize(NULL, bytes ? bytes : 1);
    if (!out) return NULL;
    uint8_t *bits = (uint8_t *)PyBytes_AS_STRING(out);
    memset(bits, 0, bytes ? bytes : 1);
    Py_ssize_t missing = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (valid[i]) bits[i >> 3] |= (uint8_t)(1u << (i & 7));
        else missing++;
    }
    *nulls = missing;
    return out;
}

/* ---------------------------------------------------------------- handing buffers over */

/* A part's buffer handed to Python without a copy: read-only, the buffer protocol (pyarrow wraps
 * it as is). When Python lets it go, its memory becomes a spare of the reader that made it, for a
 * later part: copying each part out of the buffers (and touching fresh pages for the copy) was a
 * tenth of the reader's CPU. */
typedef struct {
    PyObject_HEAD
    char *p;
    Py_ssize_t len, cap;
    Reader *owner; /* strong: its spares outlive the block */
} Block;

static int Block_getbuffer(Block *b, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)b, b->p, b->len, 1, flags);
}

static void Block_dealloc(Block *b) {
    Reader *r = b->owner;
    if (r && r->nspares < SPARES_MAX && r->spare_bytes + b->cap <= SPARE_BYTES_MAX) {
        r->spares[r->nspares].p = b->p;
        r->spares[r->nspares].cap = b->cap;
        r->nspares++;
        r->spare_bytes += b->cap;
    } else {
        PyMem_Free(b->p);
    }
    Py_XDECREF((PyObject *)r);
    PyObject_Free(b);
}

static PyBufferProcs Block_as_buffer = {(getbufferproc)Block_getbuffer, NULL};

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "airflow_provider_pgdecode.capture._native.Block",
    .tp_basicsize = sizeof(Block),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Block_dealloc,
    .tp_as_buffer = &Block_as_buffer,
    .tp_doc = "a part's buffer taken from the reader (read-only; the buffer protocol)",
};

int block_type_ready(void) { return PyType_Ready(&BlockType); }

void spares_free(Reader *r) {
    for (int i = 0; i < r->nspares; i++) PyMem_Free(r->spares[i].p);
    r->nspares = 0;
    r->spare_bytes = 0;
}

/* The smallest spare of at least `cap` bytes (removed from the spares), or a new buffer. */
static char *spare_or_new(Reader *r, Py_ssize_t cap, Py_ssize_t *got) {
    int best = -1;
    for (int i = 0; i < r->nspares; i++)
        if (r->spares[i].cap >= cap && (best < 0 || r->spares[i].cap < r->spares[best].cap)) best = i;
    if (best >= 0) {
        char *p = r->spares[best].p;
        *got = r->spares[best].cap;
        r->spare_bytes -= *got;
        r->spares[best] = r->spares[--r->nspares];
        return p;
    }
    char *p = PyMem_Malloc(cap);
    if (!p) { PyErr_NoMemory(); return NULL; }
    *got = cap;
    return p;
}

/* Below this many bytes a part's buffer is copied out (bytes), above it handed over (a Block). */
#define HAND_OVER_MIN ((Py_ssize_t)64 << 10)

/* The first `bytes` bytes of b for Python; b keeps its bytes from `keep` on (keep <= bytes). Large
 * ones go without a copy: b's memory becomes the Block and b continues in a buffer of the same
 * capacity (a spare when there is one) holding the kept bytes, usually few (the open
 * transaction's rows). */
static PyObject *hand_over(Reader *r, Buf *b, Py_ssize_t bytes, Py_ssize_t keep) {
    if (bytes < HAND_OVER_MIN) {
        PyObject *out = PyBytes_FromStringAndSize(b->p, bytes);
        if (out) buf_shift(b, keep);
        return out;
    }
    Py_ssize_t rest = b->len - keep, cap;
    char *fresh = spare_or_new(r, b->cap, &cap);
    if (!fresh) return NULL;
    Block *blk = PyObject_New(Block, &BlockType);
    if (!blk) {
        PyMem_Free(fresh);
        return NULL;
    }
    if (rest > 0) memcpy(fresh, b->p + keep, rest);
    blk->p = b->p;
    blk->len = bytes;
    blk->cap = b->cap;
    Py_INCREF((PyObject *)r);
    blk->owner = r;
    b->p = fresh;
    b->cap = cap;
    b->len = rest;
    return (PyObject *)blk;
}

/* (validity bitmap, null count, offsets, data) of the first k rows; removes them. */
static PyObject *tc_take(Reader *r, TextCol *c, Py_ssize_t k) {
    Py_ssize_t nulls = 0;
    PyObject *valid = bitmap((uint8_t *)c->valid.p, k, &nulls);
    if (!valid) return NULL;
    int32_t cut = ((int32_t *)c->offs.p)[k];
    Py_ssize_t rest = c->n - k;
    PyObject *o = hand_over(r, &c->offs, (k + 1) * 4, k * 4);
    PyObject *d = o ? hand_over(r, &c->data, cut, cut) : NULL;
    if (!o || !d) { Py_XDECREF(o); Py_XDECREF(d); Py_DECREF(valid); return NULL; }
    PyObject *res = Py_BuildValue("(NnNN)", valid, nulls, o, d);
    if (!res) return NULL;
    /* the rest's offsets start at 0 */
    int32_t *offs = (int32_t *)c->offs.p;
    for (Py_ssize_t i = 0; i <= rest; i++) offs[i] -= cut;
    buf_shift(&c->valid, k);
    c->n = rest;
    return res;
}

/* ---------------------------------------------------------------- tables */

/* Drop rows from n on, including a partly appended row (columns may hold n + 1 entries). */
void table_truncate(Table *t, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < t->ncols; i++) tc_truncate(&t->cols[i], n);
    for (Py_ssize_t i = 0; i < t->nold; i++) {
        tc_truncate(&t->old[i].col, n);
        if (t->old[i].present.len > n) t->old[i].present.len = n;
    }
#define CUT(b, w) if ((b).len > n * (w)) (b).len = n * (w)
    CUT(t->commit_lsn, 8); CUT(t->seq, 4); CUT(t->op, 1); CUT(t->xid, 8); CUT(t->xid_valid, 1);
    CUT(t->ctime, 8); CUT(t->ctime_valid, 1); CUT(t->change_lsn, 8); CUT(t->has_old, 1); CUT(t->toast_valid, 1);
#undef CUT
    int32_t *toffs = (int32_t *)t->toast_offs.p;
    tc_truncate(&t->toast_names, toffs[n]);
    t->toast_offs.len = (n + 1) * 4;
    if (n < t->n) t->n = n;
}

static void free_layout(Table *t) {
    for (Py_ssize_t i = 0; i < t->ncols; i++) {
        tc_free(&t->cols[i]);
        PyMem_Free(t->unames[i]);
        PyMem_Free(t->utypes[i]);
    }
    PyMem_Free(t->cols); PyMem_Free(t->unames); PyMem_Free(t->unlen); PyMem_Free(t->utypes); PyMem_Free(t->utlen);
    t->cols = NULL; t->unames = t->utypes = NULL; t->unlen = t->utlen = NULL;
    Py_CLEAR(t->names); Py_CLEAR(t->types);
    t->ncols = 0;
    t->has_layout = 0;
    t->has_markers = 0;
    t->markers.len = 0;
    PyMem_Free(t->mk_off);
    t->mk_off = NULL;
}

char *dup_utf8(PyObject *s, Py_ssize_t *len) {
    const char *u = PyUnicode_AsUTF8AndSize(s, len);
    if (!u) return NULL;
    char *out = PyMem_Malloc(*len + 1);
    if (!out) { PyErr_NoMemory(); return NULL; }
    memcpy(out, u, *len + 1);
    return out;
}

/* New layout (tuples of str); the table must hold no rows. */
int set_layout(Table *t, PyObject *names, PyObject *types) {
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    free_layout(t);
    t->cols = PyMem_Calloc(n ? n : 1, sizeof(TextCol));
    t->unames = PyMem_Calloc(n ? n : 1, sizeof(char *));
    t->utypes = PyMem_Calloc(n ? n : 1, sizeof(char *));
    t->unlen = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    t->utlen = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    if (!t->cols || !t->unames || !t->utypes || !t->unlen || !t->utlen) { PyErr_NoMemory(); return -1; }
    t->ncols = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (tc_init(&t->cols[i]) < 0) return -1;
        for (Py_ssize_t r = 0; r < t->n; r++) if (tc_null(&t->cols[i]) < 0) return -1;
        t->unames[i] = dup_utf8(PyTuple_GET_ITEM(names, i), &t->unlen[i]);
        t->utypes[i] = dup_utf8(PyTuple_GET_ITEM(types, i), &t->utlen[i]);
        if (!t->unames[i] || !t->utypes[i]) return -1;
    }
    Py_INCREF(names); Py_INCREF(types);
    t->names = names; t->types = types;
    t->has_layout = 1;
    t->layout_version++;
    return 0;
}

Py_ssize_t old_field(Table *t, const char *name, Py_ssize_t nlen, const char *type, Py_ssize_t tlen) {
    for (Py_ssize_t i = 0; i < t->nold; i++) {
        OldField *f = &t->old[i];
        if (f->ulen == nlen && memcmp(f->uname, name, nlen) == 0) {
            if (f->utlen != tlen || memcmp(f->utype, type, tlen) != 0) {
                /* A new type: take it when no buffered row has this column (first seen in the part). */
                int any = 0;
                for (Py_ssize_t r = 0; r < t->n && !any; r++) any = f->present.p[r];
                if (!any) {
                    PyObject *ty = PyUnicode_DecodeUTF8(type, tlen, "strict");
                    char *u = PyMem_Malloc(tlen + 1);
                    if (!ty || !u) { Py_XDECREF(ty); PyMem_Free(u); return -1; }
                    memcpy(u, type, tlen); u[tlen] = 0;
                    Py_SETREF(f->type, ty);
                    PyMem_Free(f->utype); f->utype = u; f->utlen = tlen;
                }
            }
            return i;
        }
    }
    if (t->nold == t->oldcap) {
        Py_ssize_t cap = t->oldcap ? t->oldcap * 2 : 8;
        OldField *o = PyMem_Realloc(t->old, cap * sizeof(OldField));
        if (!o) { PyErr_NoMemory(); return -1; }
        t->old = o; t->oldcap = cap;
    }
    OldField *f = &t->old[t->nold];
    memset(f, 0, sizeof(*f));
    f->name = PyUnicode_DecodeUTF8(name, nlen, "strict");
    f->type = PyUnicode_DecodeUTF8(type, tlen, "strict");
    f->uname = PyMem_Malloc(nlen + 1); f->utype = PyMem_Malloc(tlen + 1);
    if (!f->name || !f->type || !f->uname || !f->utype) return -1;
    memcpy(f->uname, name, nlen); f->uname[nlen] = 0; f->ulen = nlen;
    memcpy(f->utype, type, tlen); f->utype[tlen] = 0; f->utlen = tlen;
    if (tc_init(&f->col) < 0) return -1;
    for (Py_ssize_t r = 0; r < t->n; r++)
        if (tc_null(&f->col) < 0 || buf_u8(&f->present, 0) < 0) return -1;
    t->nold++;
    return t->nold - 1;
}

void table_free(Table *t) {
    Py_XDECREF(t->schema); Py_XDECREF(t->table);
    PyMem_Free(t->key);
    free_layout(t);
    buf_free(&t->markers);
    for (Py_ssize_t i = 0; i < t->nold; i++) {
        OldField *f = &t->old[i];
        Py_XDECREF(f->name); Py_XDECREF(f->type); PyMem_Free(f->uname); PyMem_Free(f->utype);
        tc_free(&f->col); buf_free(&f->present);
    }
    PyMem_Free(t->old);
    Buf *bufs[] = {&t->commit_lsn, &t->seq, &t->op, &t->xid, &t->xid_valid, &t->ctime, &t->ctime_valid,
                   &t->change_lsn, &t->has_old, &t->toast_offs, &t->toast_valid};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) buf_free(bufs[i]);
    tc_free(&t->toast_names);
}

/* ---------------------------------------------------------------- taking parts */

static PyObject *fixed_take(Reader *r, Buf *b, Py_ssize_t k, Py_ssize_t width) {
    return hand_over(r, b, k * width, k * width);
}

static PyObject *valid_take(Buf *b, Py_ssize_t k) {
    Py_ssize_t nulls;
    PyObject *bits = bitmap((uint8_t *)b->p, k, &nulls);
    if (!bits) return NULL;
    buf_shift(b, k);
    return Py_BuildValue("(Nn)", bits, nulls);
}

/* take(tid, k): the first k buffered rows of a table as Arrow buffers; they leave the buffer. */
PyObject *Reader_take(Reader *r, PyObject *args) {
    Py_ssize_t tid, k;
    if (!PyArg_ParseTuple(args, "nn", &tid, &k)) return NULL;
    if (check_tid(r, tid) < 0) return NULL;
    Table *t = get_table(r, tid);
    if (k < 0 || k > t->n || (t->in_txn && k > t->txn_mark)) { PyErr_SetString(PyExc_ValueError, "bad row count"); return NULL; }
    PyObject *d = PyDict_New();
    if (!d) return NULL;
#define SET(key, expr) do { PyObject *_v = (expr); if (!_v || PyDict_SetItemString(d, key, _v) < 0) { Py_XDECREF(_v); Py_DECREF(d); return NULL; } Py_DECREF(_v); } while (0)
    SET("n", PyLong_FromSsize_t(k));
    SET("commit_lsn", fixed_take(r, &t->commit_lsn, k, 8));
    SET("seq", fixed_take(r, &t->seq, k, 4));
    {
        PyObject *offs = PyBytes_FromStringAndSize(NULL, (k + 1) * 4);
        if (!offs) { Py_DECREF(d); return NULL; }
        int32_t *o = (int32_t *)PyBytes_AS_STRING(offs);
        for (Py_ssize_t i = 0; i <= k; i++) o[i] = (int32_t)i;
        SET("op_offsets", offs);
    }
    SET("op", fixed_take(r, &t->op, k, 1));
    SET("xid_valid", valid_take(&t->xid_valid, k));
    SET("xid", fixed_take(r, &t->xid, k, 8));
    SET("ctime_valid", valid_take(&t->ctime_valid, k));
    SET("ctime", fixed_take(r, &t->ctime, k, 8));
    SET("change_lsn", fixed_take(r, &t->change_lsn, k, 8));
    SET("has_old", fixed_take(r, &t->has_old, k, 1));
    {
        int32_t *toffs = (int32_t *)t->toast_offs.p;
        Py_ssize_t child = toffs[k];
        Py_ssize_t rest = t->toast_offs.len / 4 - 1 - k;
        SET("toast_offsets", hand_over(r, &t->toast_offs, (k + 1) * 4, k * 4));
        toffs = (int32_t *)t->toast_offs.p;
        for (Py_ssize_t i = 0; i <= rest; i++) toffs[i] -= (int32_t)child;
        t->toast_offs.len = (rest + 1) * 4;
        SET("toast_valid", valid_take(&t->toast_valid, k));
        SET("toast_n", PyLong_FromSsize_t(child));
        SET("toast_names", tc_take(r, &t->toast_names, child));
    }
    {
        PyObject *vals = PyList_New(t->ncols);
        if (!vals) { Py_DECREF(d); return NULL; }
        for (Py_ssize_t i = 0; i < t->ncols; i++) {
            PyObject *c = tc_take(r, &t->cols[i], k);
            if (!c) { Py_DECREF(vals); Py_DECREF(d); return NULL; }
            PyList_SET_ITEM(vals, i, c);
        }
        SET("values", vals);
    }
    {
        PyObject *olds = PyList_New(0);
        if (!olds) { Py_DECREF(d); return NULL; }
        for (Py_ssize_t i = 0; i < t->nold; i++) {
            OldField *f = &t->old[i];
            int any = 0;
            for (Py_ssize_t row = 0; row < k && !any; row++) any = f->present.p[row];
            buf_shift(&f->present, k);
            PyObject *c = tc_take(r, &f->col, k);
            if (!c) { Py_DECREF(olds); Py_DECREF(d); return NULL; }
            if (!any) { Py_DECREF(c); continue; }
            PyObject *item = Py_BuildValue("(OON)", f->name, f->type, c);
            if (!item || PyList_Append(olds, item) < 0) { Py_XDECREF(item); Py_DECREF(olds); Py_DECREF(d); return NULL; }
            Py_DECREF(item);
        }
        SET("old", olds);
    }
#undef SET
    t->n -= k;
    if (t->in_txn) t->txn_mark -= k;
    return d;
}
