/*
 * pgdecode native fast path: COPY BINARY rows of a peek -> per-table columnar text buffers.
 *
 * The Python side (airflow_provider_pgdecode.capture.native) drives a Reader:
 *   feed(block)  appends COPY bytes (rows may straddle blocks);
 *   run()        parses rows until it needs input (None), has rows for Python ("rows", [...]),
 *                has Parquet parts to write ("flush", [(table_id, rows), ...]) or saw the end
 *                ("end", [rows of a transaction cut off by the end]);
 *   pump(ptr)    the same, reading rows itself from libpq (PQgetCopyData on the PGconn* of
 *                psycopg's connection, from the libpq psycopg loaded: bind_libpq(path)); ("eof",)
 *                once the trailer was read or libpq ended the COPY.
 * Only plain committed transactions of INSERT/UPDATE/DELETE are handled here. Any other row,
 * and any row this scanner cannot read, is handed to Python together with the raw rows of the
 * transaction it belongs to (the scanner keeps a copy of them); the reader then passes every
 * row through until Python calls resume(). Python parses such rows with the pure-Python parsers,
 * so errors and rare cases behave exactly as on the Python path.
 *
 * Buffers hold, per table, the rows not yet written: text values in Arrow layout (validity,
 * int32 offsets, bytes) plus the writer's metadata columns. The part-splitting rules of
 * batch/writer.py (a budget of part_rows rows over all tables, flushing the largest table,
 * a flush when a table's columns change) are reproduced exactly; see native.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define PG_EPOCH_US 946684800000000LL

/* ---------------------------------------------------------------- growable buffers */

typedef struct {
    char *p;
    Py_ssize_t len, cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (!p) { PyErr_NoMemory(); return -1; }
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline int buf_put(Buf *b, const void *src, Py_ssize_t n) {
    if (b->len + n > b->cap && buf_reserve(b, n) < 0) return -1;
    if (n) memcpy(b->p + b->len, src, n);
    b->len += n;
    return 0;
}

static inline int buf_i64(Buf *b, int64_t v) { return buf_put(b, &v, 8); }
static inline int buf_i32(Buf *b, int32_t v) { return buf_put(b, &v, 4); }
static inline int buf_u8(Buf *b, uint8_t v) { return buf_put(b, &v, 1); }

static void buf_free(Buf *b) { PyMem_Free(b->p); b->p = NULL; b->len = b->cap = 0; }

/* Drop the first `bytes` bytes. */
static void buf_shift(Buf *b, Py_ssize_t bytes) {
    if (bytes >= b->len) { b->len = 0; return; }
    memmove(b->p, b->p + bytes, b->len - bytes);
    b->len -= bytes;
}

/* ---------------------------------------------------------------- text columns */

typedef struct {
    Buf valid; /* uint8 per row */
    Buf offs;  /* int32 per row + 1 */
    Buf data;
    Py_ssize_t n;
} TextCol;

static int tc_init(TextCol *c) {
    memset(c, 0, sizeof(*c));
    return buf_i32(&c->offs, 0);
}

static void tc_free(TextCol *c) { buf_free(&c->valid); buf_free(&c->offs); buf_free(&c->data); }

static inline int tc_end_row(TextCol *c, uint8_t valid) {
    if (c->data.len > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "more than 2 GiB of text in one column of one part; lower part_rows");
        return -1;
    }
    if (buf_u8(&c->valid, valid) < 0 || buf_i32(&c->offs, (int32_t)c->data.len) < 0) return -1;
    c->n++;
    return 0;
}

static inline int tc_append(TextCol *c, const char *s, Py_ssize_t n) {
    if (buf_put(&c->data, s, n) < 0) return -1;
    return tc_end_row(c, 1);
}

/* A single-quoted literal's body with '' standing for '. */
static int tc_append_undouble(TextCol *c, const char *s, Py_ssize_t n) {
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

static inline int tc_null(TextCol *c) { return tc_end_row(c, 0); }

static void tc_truncate(TextCol *c, Py_ssize_t n) {
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

/* (validity bitmap, null count, offsets, data) of the first k rows; removes them. */
static PyObject *tc_take(TextCol *c, Py_ssize_t k) {
    Py_ssize_t nulls = 0;
    PyObject *valid = bitmap((uint8_t *)c->valid.p, k, &nulls);
    if (!valid) return NULL;
    int32_t *offs = (int32_t *)c->offs.p;
    int32_t cut = offs[k];
    PyObject *o = PyBytes_FromStringAndSize(c->offs.p, (k + 1) * 4);
    PyObject *d = PyBytes_FromStringAndSize(c->data.p, cut);
    if (!o || !d) { Py_XDECREF(o); Py_XDECREF(d); Py_DECREF(valid); return NULL; }
    PyObject *res = Py_BuildValue("(NnNN)", valid, nulls, o, d);
    if (!res) return NULL;
    /* compact the rest */
    Py_ssize_t rest = c->n - k;
    memmove(offs, offs + k, (rest + 1) * 4);
    for (Py_ssize_t i = 0; i <= rest; i++) offs[i] -= cut;
    c->offs.len = (rest + 1) * 4;
    buf_shift(&c->data, cut);
    buf_shift(&c->valid, k);
    c->n = rest;
    return res;
}

/* ---------------------------------------------------------------- tables */

typedef struct {
    PyObject *name, *type; /* str */
    char *uname; Py_ssize_t ulen;
    char *utype; Py_ssize_t utlen;
    TextCol col;
    Buf present; /* uint8 per row: the old image has this column */
} OldField;

typedef struct {
    PyObject *schema, *table; /* str */
    char *key; Py_ssize_t keylen;
    int included;
    int registered; /* in the writer's table order */
    /* layout of new tuples */
    int has_layout;
    Py_ssize_t ncols;
    PyObject *names, *types; /* tuples of str */
    char **unames; Py_ssize_t *unlen;
    char **utypes; Py_ssize_t *utlen;
    TextCol *cols;
    long layout_version;
    /* test_decoding: each column's " name[type]:" text as printed, for a fast match */
    int has_markers;
    Buf markers;
    Py_ssize_t *mk_off;
    /* old images */
    Py_ssize_t nold, oldcap;
    OldField *old;
    /* metadata, one entry per row */
    Buf commit_lsn, seq, op, xid, xid_valid, ctime, ctime_valid, change_lsn, has_old;
    Buf toast_offs, toast_valid; /* list<string> of unchanged TOAST column names */
    TextCol toast_names;
    Py_ssize_t n;
    /* open transaction */
    int in_txn;
    Py_ssize_t txn_mark;
    /* totals */
    long long counts[4]; /* I U D T */
    int64_t min_commit, max_commit;
    int has_commit;
} Table;

static int op_index(char op) { return op == 'I' ? 0 : op == 'U' ? 1 : op == 'D' ? 2 : 3; }

/* Drop rows from n on, including a partly appended row (columns may hold n + 1 entries). */
static void table_truncate(Table *t, Py_ssize_t n) {
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

static char *dup_utf8(PyObject *s, Py_ssize_t *len) {
    const char *u = PyUnicode_AsUTF8AndSize(s, len);
    if (!u) return NULL;
    char *out = PyMem_Malloc(*len + 1);
    if (!out) { PyErr_NoMemory(); return NULL; }
    memcpy(out, u, *len + 1);
    return out;
}

/* New layout (tuples of str); the table must hold no rows. */
static int set_layout(Table *t, PyObject *names, PyObject *types) {
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

static Py_ssize_t old_field(Table *t, const char *name, Py_ssize_t nlen, const char *type, Py_ssize_t tlen) {
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

static void table_free(Table *t) {
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

/* ---------------------------------------------------------------- relations (pgoutput) */

typedef struct {
    uint32_t relid;
    int used;
    PyObject *schema, *table, *names, *types;
    Py_ssize_t ncols;
    uint8_t *key;
    char **unames; Py_ssize_t *unlen;
    char **utypes; Py_ssize_t *utlen;
    Py_ssize_t table_id; /* -2: not looked up */
    long matched_version; /* the table layout version these columns equal; -1 none */
    Py_ssize_t *oldidx;   /* column -> old field of the table; -1 unknown */
} Relation;

static void relation_free(Relation *r) {
    Py_XDECREF(r->schema); Py_XDECREF(r->table); Py_XDECREF(r->names); Py_XDECREF(r->types);
    for (Py_ssize_t i = 0; i < r->ncols; i++) { PyMem_Free(r->unames[i]); PyMem_Free(r->utypes[i]); }
    PyMem_Free(r->unames); PyMem_Free(r->utypes); PyMem_Free(r->unlen); PyMem_Free(r->utlen);
    PyMem_Free(r->key); PyMem_Free(r->oldidx);
    memset(r, 0, sizeof(*r));
}

/* ---------------------------------------------------------------- parsed columns (test_decoding) */

typedef struct {
    const char *marker; Py_ssize_t marker_len; /* " name[type]:" as printed */
    Py_ssize_t name_at, name_len; /* into the scratch buffer (unescaped) */
    const char *type; Py_ssize_t type_len;
    int kind; /* 0 text, 1 null, 2 unchanged toast */
    const char *v; Py_ssize_t vlen;
    int doubled;
} Col;

/* ---------------------------------------------------------------- the reader */

enum { P_TEST_DECODING = 0, P_PGOUTPUT = 1 };
enum { OK = 0, UNUSUAL = 1, FAIL = -1 };

typedef struct {
    PyObject_HEAD
    int plugin;
    Py_ssize_t part_rows, memory_items;
    int64_t resume_after; int has_resume;
    PyObject *include_cb, *relation_cb, *toast_marker;
    /* input */
    Buf in; Py_ssize_t pos; int header_done; int ended;
    int passthrough;
    long long rows_read;
    /* tables */
    Table *tables; Py_ssize_t ntables, tabcap;
    PyObject *table_ids; /* dict (schema, table) -> int */
    Py_ssize_t *order; Py_ssize_t norder;
    Py_ssize_t buffered;
    /* relations */
    Relation *rels; Py_ssize_t nrels, relcap;
    /* open transaction */
    int open; int64_t txn_xid; int txn_xid_valid;
    Py_ssize_t txn_items, txn_skipped;
    Buf txn_tables; /* Py_ssize_t per touched table */
    Buf txn_tids;   /* int32 table id per included row */
    Buf raw; Py_ssize_t raw_rows;
    /* test_decoding: raw "schema.table" texts of recent lines -> table id */
    Buf head_cache[8]; Py_ssize_t head_tid[8]; int head_next;
    /* scratch */
    Col *cols; Py_ssize_t colcap, ncol;
    Buf scratch;
    /* totals of fast transactions */
    long long w_transactions, w_changes, w_skipped, a_transactions, a_changes, empty;
    int64_t safe_lsn; int has_safe;
} Reader;

static Table *get_table(Reader *r, Py_ssize_t id) { return &r->tables[id]; }

/* Table id for (schema, table) as UTF-8; -1 excluded; -2 error. */
static Py_ssize_t lookup_table_obj(Reader *r, PyObject *schema, PyObject *table) {
    PyObject *key = PyTuple_Pack(2, schema, table);
    if (!key) return -2;
    PyObject *found = PyDict_GetItemWithError(r->table_ids, key);
    if (found) { Py_DECREF(key); return PyLong_AsSsize_t(found); }
    if (PyErr_Occurred()) { Py_DECREF(key); return -2; }
    PyObject *res = PyObject_CallFunctionObjArgs(r->include_cb, schema, table, NULL);
    if (!res) { Py_DECREF(key); return -2; }
    int inc = PyObject_IsTrue(res);
    Py_DECREF(res);
    if (inc < 0) { Py_DECREF(key); return -2; }
    Py_ssize_t id = -1;
    if (inc) {
        if (r->ntables == r->tabcap) {
            Py_ssize_t cap = r->tabcap ? r->tabcap * 2 : 16;
            Table *tt = PyMem_Realloc(r->tables, cap * sizeof(Table));
            Py_ssize_t *oo = PyMem_Realloc(r->order, cap * sizeof(Py_ssize_t));
            if (!tt || !oo) { if (tt) r->tables = tt; if (oo) r->order = oo; Py_DECREF(key); PyErr_NoMemory(); return -2; }
            r->tables = tt; r->order = oo; r->tabcap = cap;
        }
        Table *t = &r->tables[r->ntables];
        memset(t, 0, sizeof(*t));
        t->included = 1;
        Py_INCREF(schema); Py_INCREF(table);
        t->schema = schema; t->table = table;
        if (buf_i32(&t->toast_offs, 0) < 0 || tc_init(&t->toast_names) < 0) { Py_DECREF(key); return -2; }
        id = r->ntables++;
    }
    PyObject *v = PyLong_FromSsize_t(id);
    if (!v || PyDict_SetItem(r->table_ids, key, v) < 0) { Py_XDECREF(v); Py_DECREF(key); return -2; }
    Py_DECREF(v);
    Py_DECREF(key);
    return id;
}

static Py_ssize_t lookup_table(Reader *r, const char *s, Py_ssize_t slen, const char *t, Py_ssize_t tlen) {
    PyObject *schema = PyUnicode_DecodeUTF8(s, slen, "strict");
    PyObject *table = PyUnicode_DecodeUTF8(t, tlen, "strict");
    if (!schema || !table) {
        Py_XDECREF(schema); Py_XDECREF(table);
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) { PyErr_Clear(); return -3; }
        return -2;
    }
    Py_ssize_t id = lookup_table_obj(r, schema, table);
    Py_DECREF(schema); Py_DECREF(table);
    return id;
}

static int raw_put(Reader *r, int64_t lsn, int64_t xid, int xid_null, const char *data, Py_ssize_t len) {
    int64_t head[3] = {lsn, xid_null ? INT64_MIN : xid, (int64_t)len};
    if (buf_put(&r->raw, head, sizeof(head)) < 0 || buf_put(&r->raw, data, len) < 0) return -1;
    r->raw_rows++;
    return 0;
}

static PyObject *raw_row(int64_t lsn, int64_t xid, const char *data, Py_ssize_t len) {
    if (xid == INT64_MIN) return Py_BuildValue("(LOy#)", (long long)lsn, Py_None, data, len);
    return Py_BuildValue("(LLy#)", (long long)lsn, (long long)xid, data, len);
}

/* Start a row of table t in the open transaction. */
static int txn_touch(Reader *r, Py_ssize_t tid) {
    Table *t = get_table(r, tid);
    if (!t->in_txn) {
        t->in_txn = 1;
        t->txn_mark = t->n;
        if (buf_put(&r->txn_tables, &tid, sizeof(tid)) < 0) return -1;
    }
    return 0;
}

static void txn_reset(Reader *r) {
    Py_ssize_t *ids = (Py_ssize_t *)r->txn_tables.p;
    Py_ssize_t n = r->txn_tables.len / sizeof(Py_ssize_t);
    for (Py_ssize_t i = 0; i < n; i++) r->tables[ids[i]].in_txn = 0;
    r->txn_tables.len = 0;
    r->txn_tids.len = 0;
    r->raw.len = 0; r->raw_rows = 0;
    r->open = 0; r->txn_items = 0; r->txn_skipped = 0;
}

/* Give up the open transaction: drop its buffered rows, return its raw rows plus the current one. */
static PyObject *handover(Reader *r, int have_current, int64_t lsn, int64_t xid, const char *data, Py_ssize_t len) {
    Py_ssize_t *ids = (Py_ssize_t *)r->txn_tables.p;
    Py_ssize_t n = r->txn_tables.len / sizeof(Py_ssize_t);
    for (Py_ssize_t i = 0; i < n; i++) table_truncate(&r->tables[ids[i]], r->tables[ids[i]].txn_mark);
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    const char *p = r->raw.p, *end = r->raw.p + r->raw.len;
    while (p < end) {
        int64_t head[3];
        memcpy(head, p, sizeof(head));
        p += sizeof(head);
        PyObject *row = raw_row(head[0], head[1], p, (Py_ssize_t)head[2]);
        p += head[2];
        if (!row || PyList_Append(list, row) < 0) { Py_XDECREF(row); Py_DECREF(list); return NULL; }
        Py_DECREF(row);
    }
    if (have_current) {
        PyObject *row = raw_row(lsn, xid, data, len);
        if (!row || PyList_Append(list, row) < 0) { Py_XDECREF(row); Py_DECREF(list); return NULL; }
        Py_DECREF(row);
    }
    txn_reset(r);
    r->passthrough = 1;
    return Py_BuildValue("(sN)", "rows", list);
}

/* Append the metadata of one row (commit fields filled later). */
static int meta_row(Table *t, int32_t seq, char op, int64_t xid, int xid_valid, int64_t change_lsn, uint8_t has_old) {
    if (buf_i64(&t->commit_lsn, 0) < 0 || buf_i32(&t->seq, seq) < 0 || buf_u8(&t->op, (uint8_t)op) < 0 ||
        buf_i64(&t->xid, xid_valid ? xid : 0) < 0 || buf_u8(&t->xid_valid, (uint8_t)xid_valid) < 0 ||
        buf_i64(&t->ctime, 0) < 0 || buf_u8(&t->ctime_valid, 0) < 0 || buf_i64(&t->change_lsn, change_lsn) < 0 ||
        buf_u8(&t->has_old, has_old) < 0)
        return -1;
    return 0;
}

static int toast_end(Table *t, int any) {
    if (buf_i32(&t->toast_offs, (int32_t)t->toast_names.n) < 0 || buf_u8(&t->toast_valid, (uint8_t)any) < 0) return -1;
    return 0;
}

static int starts_pg(const char *s, Py_ssize_t n) { return n >= 4 && memcmp(s, "_pg_", 4) == 0; }

/* ---------------------------------------------------------------- budget replay */

static PyObject *flush_list_from_counts(Reader *r, Py_ssize_t *cnt, Py_ssize_t tid_stream_len, const int32_t *tids,
                                        int *any) {
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    Py_ssize_t buffered = r->buffered;
    for (Py_ssize_t i = 0; i < tid_stream_len; i++) {
        cnt[tids[i]]++;
        buffered++;
        if (buffered >= r->part_rows) {
            Py_ssize_t best = -1, bestn = -1;
            for (Py_ssize_t j = 0; j < r->norder; j++) {
                Py_ssize_t id = r->order[j];
                if (cnt[id] > bestn) { bestn = cnt[id]; best = id; }
            }
            PyObject *item = Py_BuildValue("(nn)", best, bestn);
            if (!item || PyList_Append(list, item) < 0) { Py_XDECREF(item); Py_DECREF(list); return NULL; }
            Py_DECREF(item);
            cnt[best] = 0;
            buffered = 0;
            for (Py_ssize_t j = 0; j < r->norder; j++) buffered += cnt[r->order[j]];
            *any = 1;
        }
    }
    r->buffered = buffered;
    return list;
}

static void register_order(Reader *r, Py_ssize_t tid) {
    Table *t = get_table(r, tid);
    if (!t->registered) { t->registered = 1; r->order[r->norder++] = tid; }
}

static void count_row(Table *t, char op, int64_t commit) {
    t->counts[op_index(op)]++;
    if (!t->has_commit) { t->min_commit = commit; t->has_commit = 1; }
    t->max_commit = commit;
}

/* COMMIT of the open fast transaction. Returns a "flush" result, Py_None (nothing to do) or NULL. */
static PyObject *commit_txn(Reader *r, int64_t lsn, int64_t ctime, int ctime_valid) {
    if (!r->has_safe || lsn > r->safe_lsn) { r->safe_lsn = lsn; r->has_safe = 1; }
    if (r->txn_items == 0) {
        r->empty++;
        txn_reset(r);
        Py_RETURN_NONE;
    }
    r->a_transactions++;
    r->a_changes += r->txn_items;
    Py_ssize_t *ids = (Py_ssize_t *)r->txn_tables.p;
    Py_ssize_t ntouched = r->txn_tables.len / sizeof(Py_ssize_t);
    Py_ssize_t staged = 0;
    for (Py_ssize_t i = 0; i < ntouched; i++) {
        Table *t = get_table(r, ids[i]);
        int64_t *cl = (int64_t *)t->commit_lsn.p, *ct = (int64_t *)t->ctime.p;
        for (Py_ssize_t row = t->txn_mark; row < t->n; row++) {
            cl[row] = lsn;
            ct[row] = ctime_valid ? ctime : 0;
            t->ctime_valid.p[row] = (char)ctime_valid;
            count_row(t, t->op.p[row], lsn);
        }
        staged += t->n - t->txn_mark;
        register_order(r, ids[i]);
    }
    r->w_skipped += r->txn_skipped;
    if (staged) { r->w_transactions++; r->w_changes += staged; }
    PyObject *result = Py_None;
    Py_INCREF(Py_None);
    if (r->buffered + staged < r->part_rows) {
        r->buffered += staged;
    } else {
        Py_ssize_t *cnt = PyMem_Calloc(r->ntables ? r->ntables : 1, sizeof(Py_ssize_t));
        if (!cnt) { Py_DECREF(result); PyErr_NoMemory(); return NULL; }
        for (Py_ssize_t j = 0; j < r->norder; j++) {
            Table *t = get_table(r, r->order[j]);
            cnt[r->order[j]] = t->in_txn ? t->txn_mark : t->n;
        }
        /* buffered before this transaction = sum of cnt */
        Py_ssize_t before = 0;
        for (Py_ssize_t j = 0; j < r->norder; j++) before += cnt[r->order[j]];
        r->buffered = before;
        int any = 0;
        PyObject *list = flush_list_from_counts(r, cnt, r->txn_tids.len / 4, (const int32_t *)r->txn_tids.p, &any);
        PyMem_Free(cnt);
        if (!list) { Py_DECREF(result); return NULL; }
        if (any) {
            Py_DECREF(result);
            result = Py_BuildValue("(sN)", "flush", list);
        } else {
            Py_DECREF(list);
        }
    }
    txn_reset(r);
    return result;
}

/* ---------------------------------------------------------------- test_decoding scanner */

static Py_ssize_t find_byte(const char *s, Py_ssize_t from, Py_ssize_t n, char c) {
    if (from >= n) return -1;
    const char *p = memchr(s + from, c, n - from);
    return p ? p - s : -1;
}

static int starts(const char *s, Py_ssize_t pos, Py_ssize_t n, const char *lit) {
    size_t l = strlen(lit);
    return pos >= 0 && pos + (Py_ssize_t)l <= n && memcmp(s + pos, lit, l) == 0;
}

/* A quote_identifier'd name at pos (a double quote); unescaped into scratch. Returns the
 * position after it, or -1. */
static Py_ssize_t td_quoted_ident(Reader *r, const char *s, Py_ssize_t pos, Py_ssize_t n, Py_ssize_t *at, Py_ssize_t *len) {
    Py_ssize_t start = pos + 1;
    *at = r->scratch.len;
    for (;;) {
        Py_ssize_t end = find_byte(s, start, n, '"');
        if (end < 0) return -1;
        if (end + 1 < n && s[end + 1] == '"') {
            if (buf_put(&r->scratch, s + start, end + 1 - start) < 0) return -2;
            start = end + 2;
            continue;
        }
        if (buf_put(&r->scratch, s + start, end - start) < 0) return -2;
        *len = r->scratch.len - *at;
        return end + 1;
    }
}

/* read_identifier with stops ".:, " */
static Py_ssize_t td_ident(Reader *r, const char *s, Py_ssize_t pos, Py_ssize_t n, Py_ssize_t *at, Py_ssize_t *len) {
    if (pos < n && s[pos] == '"') return td_quoted_ident(r, s, pos, n, at, len);
    Py_ssize_t end = pos;
    while (end < n && s[end] != '.' && s[end] != ':' && s[end] != ',' && s[end] != ' ') end++;
    if (end == pos) return -1;
    *at = r->scratch.len;
    if (buf_put(&r->scratch, s + pos, end - pos) < 0) return -2;
    *len = end - pos;
    return end;
}

static Py_ssize_t td_value(const char *s, Py_ssize_t pos, Py_ssize_t n, Col *c) {
    c->doubled = 0;
    if (pos < n && s[pos] == '\'') {
        Py_ssize_t start = pos + 1, search = start;
        for (;;) {
            Py_ssize_t end = find_byte(s, search, n, '\'');
            if (end < 0) return -1;
            if (end + 1 < n && s[end + 1] == '\'') { c->doubled = 1; search = end + 2; continue; }
            c->kind = 0; c->v = s + start; c->vlen = end - start;
            return end + 1;
        }
    }
    if (pos + 1 < n && s[pos] == 'B' && s[pos + 1] == '\'') {
        Py_ssize_t end = find_byte(s, pos + 2, n, '\'');
        if (end < 0) return -1;
        c->kind = 0; c->v = s + pos + 2; c->vlen = end - pos - 2;
        return end + 1;
    }
    Py_ssize_t end = find_byte(s, pos, n, ' ');
    if (end < 0) end = n;
    Py_ssize_t tl = end - pos;
    if (tl <= 0) return -1;
    if (tl == 4 && memcmp(s + pos, "null", 4) == 0) { c->kind = 1; return end; }
    if (tl == 21 && memcmp(s + pos, "unchanged-toast-datum", 21) == 0) { c->kind = 2; return end; }
    c->kind = 0; c->v = s + pos; c->vlen = tl;
    return end;
}

static Py_ssize_t td_type_end_with_quotes(Reader *r, const char *s, Py_ssize_t pos, Py_ssize_t n) {
    while (pos < n) {
        if (s[pos] == '"') {
            Py_ssize_t at, len, save = r->scratch.len;
            Py_ssize_t next = td_quoted_ident(r, s, pos, n, &at, &len);
            r->scratch.len = save;
            if (next < 0) return -1;
            pos = next;
            continue;
        }
        if (s[pos] == ']' && pos + 1 < n && s[pos + 1] == ':') return pos;
        pos++;
    }
    return -1;
}

/* read_tuple: columns into r->cols. Returns the end position, -1 malformed, -2 error. */
static Py_ssize_t td_tuple(Reader *r, const char *s, Py_ssize_t pos, Py_ssize_t n, int stop_at_new) {
    r->ncol = 0;
    while (pos < n) {
        if (s[pos] != ' ') return -1;
        pos++;
        if (stop_at_new && starts(s, pos, n, "new-tuple:")) return pos - 1;
        if (r->ncol == r->colcap) {
            Py_ssize_t cap = r->colcap ? r->colcap * 2 : 32;
            Col *c = PyMem_Realloc(r->cols, cap * sizeof(Col));
            if (!c) { PyErr_NoMemory(); return -2; }
            r->cols = c; r->colcap = cap;
        }
        Col *c = &r->cols[r->ncol];
        c->marker = s + pos - 1;
        if (pos >= n) return -1;
        if (s[pos] == '"') {
            pos = td_quoted_ident(r, s, pos, n, &c->name_at, &c->name_len);
            if (pos < 0) return pos;
        } else {
            Py_ssize_t end = find_byte(s, pos, n, '[');
            if (end < 0) return -1;
            c->name_at = r->scratch.len;
            if (buf_put(&r->scratch, s + pos, end - pos) < 0) return -2;
            c->name_len = end - pos;
            pos = end;
        }
        if (pos >= n || s[pos] != '[') return -1;
        /* type: up to the first "]:" (skipping quoted parts when a double quote comes before it) */
        Py_ssize_t end = -1;
        for (Py_ssize_t q = pos; q + 1 < n; q++) {
            q = find_byte(s, q, n - 1, ']');
            if (q < 0) break;
            if (s[q + 1] == ':') { end = q; break; }
        }
        if (end >= 0 && memchr(s + pos, '"', end - pos) != NULL) end = td_type_end_with_quotes(r, s, pos + 1, n);
        if (end < 0) return -1;
        c->type = s + pos + 1;
        c->type_len = end - pos - 1;
        pos = end + 2;
        c->marker_len = s + pos - c->marker;
        pos = td_value(s, pos, n, c);
        if (pos < 0) return -1;
        r->ncol++;
    }
    if (stop_at_new) return -1;
    return pos;
}

/* The new tuple when every column's marker is where the generic scanner would read it
 * (the same result, as in test_decoding.py's _Layout). -1: not so, scan generically. */
static Py_ssize_t td_tuple_fast(Reader *r, Table *t, const char *s, Py_ssize_t pos, Py_ssize_t n) {
    if (!t->has_markers) return -1;
    if (r->colcap < t->ncols) {
        Col *c = PyMem_Realloc(r->cols, (t->ncols + 1) * sizeof(Col));
        if (!c) return -1;
        r->cols = c; r->colcap = t->ncols + 1;
    }
    for (Py_ssize_t i = 0; i < t->ncols; i++) {
        Py_ssize_t ml = t->mk_off[i + 1] - t->mk_off[i];
        if (pos + ml > n || memcmp(s + pos, t->markers.p + t->mk_off[i], ml) != 0) return -1;
        pos = td_value(s, pos + ml, n, &r->cols[i]);
        if (pos < 0) return -1;
    }
    if (pos != n) return -1;
    r->ncol = t->ncols;
    return pos;
}

static int td_store_markers(Reader *r, Table *t) {
    if (t->has_markers || t->ncols != r->ncol) return 0;
    t->markers.len = 0;
    PyMem_Free(t->mk_off);
    t->mk_off = PyMem_Malloc((r->ncol + 1) * sizeof(Py_ssize_t));
    if (!t->mk_off) { PyErr_NoMemory(); return -1; }
    t->mk_off[0] = 0;
    for (Py_ssize_t i = 0; i < r->ncol; i++) {
        if (buf_put(&t->markers, r->cols[i].marker, r->cols[i].marker_len) < 0) return -1;
        t->mk_off[i + 1] = t->markers.len;
    }
    t->has_markers = 1;
    return 0;
}

static int td_layout_equal(Reader *r, Table *t) {
    if (!t->has_layout || t->ncols != r->ncol) return 0;
    for (Py_ssize_t i = 0; i < r->ncol; i++) {
        Col *c = &r->cols[i];
        if (t->unlen[i] != c->name_len || memcmp(t->unames[i], r->scratch.p + c->name_at, c->name_len) != 0) return 0;
        if (t->utlen[i] != c->type_len || memcmp(t->utypes[i], c->type, c->type_len) != 0) return 0;
    }
    return 1;
}

/* Make the parsed columns the table's layout when allowed. OK, UNUSUAL or FAIL. */
static int td_adopt_layout(Reader *r, Table *t) {
    if (td_layout_equal(r, t)) return OK;
    if (t->n > 0 && t->has_layout) return UNUSUAL; /* rows of the old layout are buffered: Python path flushes */
    PyObject *names = PyTuple_New(r->ncol), *types = PyTuple_New(r->ncol);
    if (!names || !types) { Py_XDECREF(names); Py_XDECREF(types); return FAIL; }
    for (Py_ssize_t i = 0; i < r->ncol; i++) {
        Col *c = &r->cols[i];
        if (starts_pg(r->scratch.p + c->name_at, c->name_len)) { Py_DECREF(names); Py_DECREF(types); return UNUSUAL; }
        PyObject *nm = PyUnicode_DecodeUTF8(r->scratch.p + c->name_at, c->name_len, "strict");
        PyObject *ty = PyUnicode_DecodeUTF8(c->type, c->type_len, "strict");
        if (!nm || !ty) {
            Py_XDECREF(nm); Py_XDECREF(ty); Py_DECREF(names); Py_DECREF(types);
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) { PyErr_Clear(); return UNUSUAL; }
            return FAIL;
        }
        PyTuple_SET_ITEM(names, i, nm);
        PyTuple_SET_ITEM(types, i, ty);
    }
    int rc = set_layout(t, names, types);
    Py_DECREF(names); Py_DECREF(types);
    return rc < 0 ? FAIL : OK;
}

static int put_value(TextCol *col, Col *c) {
    if (c->kind != 0) return tc_null(col);
    return c->doubled ? tc_append_undouble(col, c->v, c->vlen) : tc_append(col, c->v, c->vlen);
}

/* The parsed columns as this row's new values (layout already checked). */
static int td_put_new(Reader *r, Table *t) {
    int any = 0;
    for (Py_ssize_t i = 0; i < r->ncol; i++) {
        Col *c = &r->cols[i];
        if (put_value(&t->cols[i], c) < 0) return -1;
        if (c->kind == 2) {
            any = 1;
            if (tc_append(&t->toast_names, t->unames[i], t->unlen[i]) < 0) return -1;
        }
    }
    return toast_end(t, any);
}

static int put_nulls_new(Table *t) {
    for (Py_ssize_t i = 0; i < t->ncols; i++) if (tc_null(&t->cols[i]) < 0) return -1;
    return toast_end(t, 0);
}

/* Old image from the parsed columns (test_decoding). */
static int td_put_old(Reader *r, Table *t) {
    Py_ssize_t rows = t->n; /* the row being added has index rows */
    for (Py_ssize_t i = 0; i < r->ncol; i++) {
        Col *c = &r->cols[i];
        Py_ssize_t f = old_field(t, r->scratch.p + c->name_at, c->name_len, c->type, c->type_len);
        if (f < 0) return -1;
        OldField *of = &t->old[f];
        if (of->col.n > rows) continue; /* a repeated column name: keep the first (dict semantics keep the last) */
        if (put_value(&of->col, c) < 0 || buf_u8(&of->present, 1) < 0) return -1;
    }
    for (Py_ssize_t i = 0; i < t->nold; i++) {
        OldField *of = &t->old[i];
        if (of->col.n == rows && (tc_null(&of->col) < 0 || buf_u8(&of->present, 0) < 0)) return -1;
    }
    return 0;
}

static int put_no_old(Table *t) {
    for (Py_ssize_t i = 0; i < t->nold; i++)
        if (tc_null(&t->old[i].col) < 0 || buf_u8(&t->old[i].present, 0) < 0) return -1;
    return 0;
}

static int check_duplicate_names(Reader *r) {
    /* RowImage.as_dict keeps the last of repeated names; such rows go to Python */
    for (Py_ssize_t i = 0; i < r->ncol; i++)
        for (Py_ssize_t j = i + 1; j < r->ncol; j++)
            if (r->cols[i].name_len == r->cols[j].name_len &&
                memcmp(r->scratch.p + r->cols[i].name_at, r->scratch.p + r->cols[j].name_at, r->cols[i].name_len) == 0)
                return 1;
    return 0;
}

static int parse_uint(const char *s, Py_ssize_t n, int64_t *out, int *present) {
    /* str.strip() then isdigit(); empty means none */
    Py_ssize_t a = 0, b = n;
    while (a < b && (s[a] == ' ' || s[a] == '\t' || s[a] == '\n' || s[a] == '\r')) a++;
    while (b > a && (s[b - 1] == ' ' || s[b - 1] == '\t' || s[b - 1] == '\n' || s[b - 1] == '\r')) b--;
    if (a == b) { *present = 0; return 0; }
    if (b - a > 18) return -1;
    int64_t v = 0;
    for (Py_ssize_t i = a; i < b; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    *out = v; *present = 1;
    return 0;
}

static int64_t days_from_civil(int64_t y, int m, int d) {
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

static int digits(const char *s, int n, int *out) {
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return 0;
}

/* "YYYY-MM-DD HH:MM:SS[.f{1,6}]+HH[:MM]" -> microseconds since the Unix epoch. */
static int parse_ts(const char *s, Py_ssize_t n, int64_t *out) {
    int y, mo, d, h, mi, se, frac = 0, oh, om = 0;
    if (n < 22) return -1;
    if (digits(s, 4, &y) || s[4] != '-' || digits(s + 5, 2, &mo) || s[7] != '-' || digits(s + 8, 2, &d) ||
        s[10] != ' ' || digits(s + 11, 2, &h) || s[13] != ':' || digits(s + 14, 2, &mi) || s[16] != ':' ||
        digits(s + 17, 2, &se))
        return -1;
    Py_ssize_t p = 19;
    if (p < n && s[p] == '.') {
        int nd = 0;
        p++;
        while (p < n && s[p] >= '0' && s[p] <= '9' && nd < 7) { frac = frac * 10 + (s[p] - '0'); p++; nd++; }
        if (nd == 0 || nd > 6) return -1;
        while (nd < 6) { frac *= 10; nd++; }
    }
    if (p >= n || (s[p] != '+' && s[p] != '-')) return -1;
    int sign = s[p] == '-' ? -1 : 1;
    p++;
    if (p + 2 > n || digits(s + p, 2, &oh)) return -1;
    p += 2;
    if (p < n) {
        if (s[p] != ':' || p + 3 != n || digits(s + p + 1, 2, &om)) return -1;
        p += 3;
    }
    if (p != n) return -1;
    static const int mdays[] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (y < 1 || mo < 1 || mo > 12 || d < 1 || d > mdays[mo - 1] || h > 23 || mi > 59 || se > 59 || oh > 23 || om > 59)
        return -1;
    if (mo == 2 && d == 29 && !((y % 4 == 0 && y % 100 != 0) || y % 400 == 0)) return -1;
    int64_t secs = days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60 + se - sign * (oh * 3600 + om * 60);
    *out = secs * 1000000 + frac;
    return 0;
}

/* One test_decoding "table ..." row in fast mode. */
static int td_change(Reader *r, int64_t lsn, const char *s, Py_ssize_t n) {
    r->scratch.len = 0;
    Py_ssize_t sat, slen, tat, tlen;
    Py_ssize_t pos = td_ident(r, s, 6, n, &sat, &slen);
    if (pos == -2) return FAIL;
    if (pos < 0 || pos >= n || s[pos] != '.') return UNUSUAL;
    pos = td_ident(r, s, pos + 1, n, &tat, &tlen);
    if (pos == -2) return FAIL;
    if (pos < 0 || !starts(s, pos, n, ": ")) return UNUSUAL; /* includes multi-table TRUNCATE */
    Py_ssize_t head_len = pos - 6;
    pos += 2;
    Py_ssize_t colon = find_byte(s, pos, n, ':');
    if (colon < 0) return UNUSUAL;
    char op;
    Py_ssize_t wl = colon - pos;
    if (wl == 6 && memcmp(s + pos, "INSERT", 6) == 0) op = 'I';
    else if (wl == 6 && memcmp(s + pos, "UPDATE", 6) == 0) op = 'U';
    else if (wl == 6 && memcmp(s + pos, "DELETE", 6) == 0) op = 'D';
    else return UNUSUAL;
    pos = colon + 1;
    if (starts(s, pos, n, " (no-tuple-data)") && pos + 16 == n) return UNUSUAL;
    if (r->txn_items + 1 >= r->memory_items) return UNUSUAL; /* large: the Python path spools it */
    Py_ssize_t tid = -4;
    for (int i = 0; i < 8; i++) {
        Buf *h = &r->head_cache[i];
        if (h->p && h->len == head_len && memcmp(h->p, s + 6, head_len) == 0) { tid = r->head_tid[i]; break; }
    }
    if (tid == -4) {
        tid = lookup_table(r, r->scratch.p + sat, slen, r->scratch.p + tat, tlen);
        if (tid == -2) return FAIL;
        if (tid == -3) return UNUSUAL;
        int slot = r->head_next;
        r->head_next = (slot + 1) % 8;
        r->head_cache[slot].len = 0;
        if (buf_put(&r->head_cache[slot], s + 6, head_len) < 0) return FAIL;
        r->head_tid[slot] = tid;
    }
    int32_t seq = (int32_t)r->txn_items;
    if (tid == -1) {
        /* an excluded table: the line must still read (the Python path parses it too) */
        Py_ssize_t p2 = pos, end;
        if (op == 'U' && starts(s, p2, n, " old-key:")) {
            end = td_tuple(r, s, p2 + 9, n, 1);
            if (end == -2) return FAIL;
            if (end < 0) return UNUSUAL;
            p2 = end + 11;
            if (starts(s, p2, n, " (no-tuple-data)") && p2 + 16 == n) return UNUSUAL;
        }
        end = td_tuple(r, s, p2, n, 0);
        if (end == -2) return FAIL;
        if (end < 0) return UNUSUAL;
        r->txn_items++;
        r->txn_skipped++;
        return OK;
    }
    Table *t = get_table(r, tid);
    if (txn_touch(r, tid) < 0) return FAIL;
    Py_ssize_t base = t->n;
    int rc;
    if (op == 'I' || op == 'D') {
        Py_ssize_t end = op == 'I' ? td_tuple_fast(r, t, s, pos, n) : -1;
        int fast = end >= 0;
        if (!fast) {
            end = td_tuple(r, s, pos, n, 0);
            if (end == -2) return FAIL;
            if (end < 0) return UNUSUAL;
            if (check_duplicate_names(r)) return UNUSUAL;
        }
        if (op == 'I') {
            if (!fast) {
                rc = td_adopt_layout(r, t);
                if (rc != OK) return rc;
                if (td_store_markers(r, t) < 0) return FAIL;
            }
            if (td_put_new(r, t) < 0 || put_no_old(t) < 0) goto fail;
        } else {
            if (put_nulls_new(t) < 0 || td_put_old(r, t) < 0) goto fail;
        }
        if (meta_row(t, seq, op, r->txn_xid, r->txn_xid_valid, lsn, op == 'D') < 0) goto fail;
    } else {
        int has_old = 0;
        if (starts(s, pos, n, " old-key:")) {
            Py_ssize_t end = td_tuple(r, s, pos + 9, n, 1);
            if (end == -2) return FAIL;
            if (end < 0) return UNUSUAL;
            if (check_duplicate_names(r)) return UNUSUAL;
            if (td_put_old(r, t) < 0) goto fail;
            has_old = 1;
            pos = end + 11;
            if (starts(s, pos, n, " (no-tuple-data)") && pos + 16 == n) { table_truncate(t, base); return UNUSUAL; }
        }
        Py_ssize_t end = td_tuple_fast(r, t, s, pos, n);
        if (end < 0) {
            end = td_tuple(r, s, pos, n, 0);
            if (end < 0 || check_duplicate_names(r)) { table_truncate(t, base); return end == -2 ? FAIL : UNUSUAL; }
            rc = td_adopt_layout(r, t);
            if (rc != OK) { table_truncate(t, base); return rc; }
            if (td_store_markers(r, t) < 0) return FAIL;
        }
        if (td_put_new(r, t) < 0) goto fail;
        if (!has_old && put_no_old(t) < 0) goto fail;
        if (meta_row(t, seq, 'U', r->txn_xid, r->txn_xid_valid, lsn, (uint8_t)has_old) < 0) goto fail;
    }
    t->n++;
    r->txn_items++;
    {
        int32_t id32 = (int32_t)tid;
        if (buf_i32(&r->txn_tids, id32) < 0) return FAIL;
    }
    return OK;
fail:
    return FAIL;
}

/* Dispatch one row in fast mode. Sets *out for a result to return (flush), else NULL. */
static int td_row(Reader *r, int64_t lsn, int64_t xid, int xid_null, const char *s, Py_ssize_t n, PyObject **out) {
    if (starts(s, 0, n, "table ")) {
        if (!r->open) return UNUSUAL;
        return td_change(r, lsn, s, n);
    }
    if (starts(s, 0, n, "BEGIN")) {
        if (r->open) return UNUSUAL;
        int64_t lx = 0; int present = 0;
        if (parse_uint(s + 5, n - 5, &lx, &present) < 0) return UNUSUAL;
        r->open = 1;
        if (!xid_null) { r->txn_xid = xid; r->txn_xid_valid = 1; }
        else { r->txn_xid = lx; r->txn_xid_valid = present; }
        return OK;
    }
    if (starts(s, 0, n, "COMMIT") && !starts(s, 0, n, "COMMIT PREPARED ")) {
        if (!r->open) return UNUSUAL;
        const char *rest = s + 6;
        Py_ssize_t rn = n - 6;
        int64_t ctime = 0; int ctime_valid = 0;
        if (rn > 0 && rest[rn - 1] == ')') {
            Py_ssize_t at = -1;
            for (Py_ssize_t i = rn - 5; i >= 0; i--) if (memcmp(rest + i, " (at ", 5) == 0) { at = i; break; }
            if (at >= 0) {
                if (parse_ts(rest + at + 5, rn - at - 6, &ctime) < 0) return UNUSUAL;
                ctime_valid = 1;
                rn = at;
            }
        }
        int64_t lx = 0; int present = 0;
        if (parse_uint(rest, rn, &lx, &present) < 0) return UNUSUAL;
        int64_t cx = xid_null ? lx : xid;
        int cx_valid = xid_null ? present : 1;
        if (cx_valid && r->txn_xid_valid && cx != r->txn_xid) return UNUSUAL;
        if (r->has_resume && lsn <= r->resume_after) return UNUSUAL;
        PyObject *res = commit_txn(r, lsn, ctime, ctime_valid);
        if (!res) return FAIL;
        if (res == Py_None) Py_DECREF(res);
        else *out = res;
        return OK;
    }
    return UNUSUAL;
}

/* ---------------------------------------------------------------- pgoutput */

static inline uint32_t be32(const char *p) {
    const uint8_t *u = (const uint8_t *)p;
    return ((uint32_t)u[0] << 24) | ((uint32_t)u[1] << 16) | ((uint32_t)u[2] << 8) | u[3];
}
static inline int64_t be64(const char *p) { return (int64_t)(((uint64_t)be32(p) << 32) | be32(p + 4)); }
static inline int16_t be16(const char *p) { const uint8_t *u = (const uint8_t *)p; return (int16_t)((u[0] << 8) | u[1]); }

static Relation *find_rel(Reader *r, uint32_t relid) {
    for (Py_ssize_t i = 0; i < r->nrels; i++) if (r->rels[i].used && r->rels[i].relid == relid) return &r->rels[i];
    return NULL;
}

/* The relation's table: columns equal the layout, or the layout can change (no rows buffered). */
static int po_layout(Reader *r, Relation *rel, Table *t) {
    if (t->has_layout && rel->matched_version == t->layout_version) return OK;
    if (t->has_layout && t->ncols == rel->ncols) {
        int same = 1;
        for (Py_ssize_t i = 0; i < rel->ncols && same; i++)
            same = t->unlen[i] == rel->unlen[i] && memcmp(t->unames[i], rel->unames[i], rel->unlen[i]) == 0 &&
                   t->utlen[i] == rel->utlen[i] && memcmp(t->utypes[i], rel->utypes[i], rel->utlen[i]) == 0;
        if (same) { rel->matched_version = t->layout_version; return OK; }
    }
    if (t->n > 0 && t->has_layout) return UNUSUAL;
    for (Py_ssize_t i = 0; i < rel->ncols; i++) if (starts_pg(rel->unames[i], rel->unlen[i])) return UNUSUAL;
    if (set_layout(t, rel->names, rel->types) < 0) return FAIL;
    rel->matched_version = t->layout_version;
    return OK;
}

/* Check a tuple's shape: count, kinds; returns position after it or -1. */
static Py_ssize_t po_scan_tuple(const char *s, Py_ssize_t pos, Py_ssize_t n, Py_ssize_t ncols) {
    if (pos + 2 > n || be16(s + pos) != ncols) return -1;
    pos += 2;
    for (Py_ssize_t i = 0; i < ncols; i++) {
        if (pos >= n) return -1;
        char k = s[pos++];
        if (k == 't') {
            if (pos + 4 > n) return -1;
            int32_t len = (int32_t)be32(s + pos);
            if (len < 0 || pos + 4 + len > n) return -1;
            pos += 4 + len;
        } else if (k != 'n' && k != 'u') {
            return -1;
        }
    }
    return pos;
}

static int po_put_new(Table *t, const char *s, Py_ssize_t pos) {
    pos += 2;
    int any = 0;
    for (Py_ssize_t i = 0; i < t->ncols; i++) {
        char k = s[pos++];
        if (k == 't') {
            int32_t len = (int32_t)be32(s + pos);
            if (tc_append(&t->cols[i], s + pos + 4, len) < 0) return -1;
            pos += 4 + len;
        } else {
            if (tc_null(&t->cols[i]) < 0) return -1;
            if (k == 'u') {
                any = 1;
                if (tc_append(&t->toast_names, t->unames[i], t->unlen[i]) < 0) return -1;
            }
        }
    }
    return toast_end(t, any);
}

static int po_put_old(Table *t, Relation *rel, const char *s, Py_ssize_t pos, int key_only) {
    Py_ssize_t rows = t->n;
    pos += 2;
    for (Py_ssize_t i = 0; i < rel->ncols; i++) {
        char k = s[pos++];
        const char *v = NULL;
        int32_t len = 0;
        if (k == 't') { len = (int32_t)be32(s + pos); v = s + pos + 4; pos += 4 + len; }
        if (key_only ? !rel->key[i] : k == 'n') continue;
        Py_ssize_t f = rel->oldidx[i];
        if (f < 0 || f >= t->nold || t->old[f].ulen != rel->unlen[i] || t->old[f].utlen != rel->utlen[i] ||
            memcmp(t->old[f].utype, rel->utypes[i], rel->utlen[i]) != 0) {
            f = old_field(t, rel->unames[i], rel->unlen[i], rel->utypes[i], rel->utlen[i]);
            if (f < 0) return -1;
            rel->oldidx[i] = f;
        }
        OldField *of = &t->old[f];
        if (of->col.n > rows) continue;
        if ((k == 't' ? tc_append(&of->col, v, len) : tc_null(&of->col)) < 0 || buf_u8(&of->present, 1) < 0) return -1;
    }
    for (Py_ssize_t i = 0; i < t->nold; i++) {
        OldField *of = &t->old[i];
        if (of->col.n == rows && (tc_null(&of->col) < 0 || buf_u8(&of->present, 0) < 0)) return -1;
    }
    return 0;
}

static int po_change(Reader *r, int64_t lsn, const char *s, Py_ssize_t n) {
    if (n < 6) return UNUSUAL;
    Relation *rel = find_rel(r, be32(s + 1));
    if (!rel) return UNUSUAL;
    char op = s[0];
    Py_ssize_t pos = 5, oldpos = -1, newpos = -1;
    int key_only = 0;
    if (op == 'U' || op == 'D') {
        if (pos < n && (s[pos] == 'K' || s[pos] == 'O')) {
            key_only = s[pos] == 'K';
            oldpos = pos + 1;
            pos = po_scan_tuple(s, pos + 1, n, rel->ncols);
            if (pos < 0) return UNUSUAL;
        } else if (op == 'D') {
            return UNUSUAL;
        }
    }
    if (op != 'D') {
        if (pos >= n || s[pos] != 'N') return UNUSUAL;
        newpos = pos + 1;
        if (po_scan_tuple(s, pos + 1, n, rel->ncols) < 0) return UNUSUAL;
    }
    if (r->txn_items + 1 >= r->memory_items) return UNUSUAL;
    if (rel->table_id == -2) {
        Py_ssize_t id = lookup_table_obj(r, rel->schema, rel->table);
        if (id == -2) return FAIL;
        rel->table_id = id;
    }
    int32_t seq = (int32_t)r->txn_items;
    if (rel->table_id == -1) { r->txn_items++; r->txn_skipped++; return OK; }
    Py_ssize_t tid = rel->table_id;
    Table *t = get_table(r, tid);
    if (newpos >= 0) {
        int rc = po_layout(r, rel, t);
        if (rc != OK) return rc;
    } else if (!t->has_layout && 0) {
        return UNUSUAL;
    }
    if (txn_touch(r, tid) < 0) return FAIL;
    if (newpos >= 0) { if (po_put_new(t, s, newpos) < 0) return FAIL; }
    else if (put_nulls_new(t) < 0) return FAIL;
    if (oldpos >= 0) { if (po_put_old(t, rel, s, oldpos, key_only) < 0) return FAIL; }
    else if (put_no_old(t) < 0) return FAIL;
    if (meta_row(t, seq, op, r->txn_xid, r->txn_xid_valid, lsn, oldpos >= 0) < 0) return FAIL;
    t->n++;
    r->txn_items++;
    if (buf_i32(&r->txn_tids, (int32_t)tid) < 0) return FAIL;
    return OK;
}

static int po_row(Reader *r, int64_t lsn, int64_t xid, int xid_null, const char *s, Py_ssize_t n, PyObject **out) {
    if (n < 1) return UNUSUAL;
    switch (s[0]) {
    case 'I': case 'U': case 'D':
        if (!r->open) return UNUSUAL;
        return po_change(r, lsn, s, n);
    case 'B':
        if (r->open || n < 21) return UNUSUAL;
        r->open = 1;
        r->txn_xid = be32(s + 17);
        r->txn_xid_valid = 1;
        return OK;
    case 'C': {
        if (!r->open || n < 26) return UNUSUAL;
        if (!xid_null && r->txn_xid_valid && xid != r->txn_xid) return UNUSUAL;
        if (r->has_resume && lsn <= r->resume_after) return UNUSUAL;
        int64_t ts = be64(s + 18);
        PyObject *res = commit_txn(r, lsn, ts + PG_EPOCH_US, ts != 0);
        if (!res) return FAIL;
        if (res == Py_None) Py_DECREF(res);
        else *out = res;
        return OK;
    }
    case 'R': case 'Y': {
        if (!r->relation_cb) return UNUSUAL;
        PyObject *lo = PyLong_FromLongLong(lsn);
        PyObject *xo = xid_null ? (Py_INCREF(Py_None), Py_None) : PyLong_FromLongLong(xid);
        PyObject *data = PyBytes_FromStringAndSize(s, n);
        PyObject *res = (lo && xo && data) ? PyObject_CallFunctionObjArgs(r->relation_cb, lo, xo, data, NULL) : NULL;
        Py_XDECREF(lo); Py_XDECREF(xo); Py_XDECREF(data);
        if (!res) return FAIL;
        Py_DECREF(res);
        return OK;
    }
    default:
        return UNUSUAL;
    }
}

/* ---------------------------------------------------------------- COPY framing and run() */

static const char COPY_SIG[11] = {'P', 'G', 'C', 'O', 'P', 'Y', '\n', '\377', '\r', '\n', '\0'};

static PyObject *copy_error(const char *what) {
    PyObject *mod = PyImport_ImportModule("airflow_provider_pgdecode.errors");
    if (!mod) return NULL;
    PyObject *cls = PyObject_GetAttrString(mod, "DecodingError");
    Py_DECREF(mod);
    if (!cls) return NULL;
    PyErr_Format(cls, "malformed COPY data from the peek: %s", what);
    Py_DECREF(cls);
    return NULL;
}

static void compact_input(Reader *r) {
    if (r->pos > 0) { buf_shift(&r->in, r->pos); r->pos = 0; }
}

#define NEED_INPUT do { compact_input(r); *need = 1; return NULL; } while (0)

/* Parse buffered rows; NULL with *need set when more input is needed (NULL alone: an error). */
static PyObject *parse_some(Reader *r, int *need) {
    *need = 0;
    for (;;) {
        const char *b = r->in.p + r->pos;
        Py_ssize_t avail = r->in.len - r->pos;
        if (r->ended) NEED_INPUT;
        if (!r->header_done) {
            if (avail < 19) NEED_INPUT;
            if (memcmp(b, COPY_SIG, 11) != 0) return copy_error("bad signature");
            uint32_t ext = be32(b + 15);
            if (avail < 19 + (Py_ssize_t)ext) NEED_INPUT;
            r->pos += 19 + ext;
            r->header_done = 1;
            continue;
        }
        if (avail < 2) NEED_INPUT;
        int16_t nf = be16(b);
        if (nf == -1) {
            r->pos += 2;
            r->ended = 1;
            if (r->open) {
                PyObject *res = handover(r, 0, 0, 0, NULL, 0);
                if (!res) return NULL;
                PyObject *list = PyTuple_GET_ITEM(res, 1);
                Py_INCREF(list);
                Py_DECREF(res);
                return Py_BuildValue("(sN)", "end", list);
            }
            return Py_BuildValue("(sN)", "end", PyList_New(0));
        }
        if (nf != 3) return copy_error("expected 3 columns per row");
        /* lsn (pg_lsn or int8: 8 bytes), xid (xid: 4 bytes, or int8; NULL), data (bytea) */
        Py_ssize_t p = 2;
        if (avail < p + 4) NEED_INPUT;
        if ((int32_t)be32(b + p) != 8) return copy_error("lsn is not 8 bytes");
        if (avail < p + 12) NEED_INPUT;
        int64_t lsn = be64(b + p + 4);
        p += 12;
        if (avail < p + 4) NEED_INPUT;
        int32_t xl = (int32_t)be32(b + p);
        int64_t xid = 0;
        int xid_null = 1;
        if (xl == 4 || xl == 8) {
            if (avail < p + 4 + xl) NEED_INPUT;
            xid = xl == 4 ? (int64_t)be32(b + p + 4) : be64(b + p + 4);
            xid_null = xid == 0; /* the Python path reads 0 as None too */
            p += 4 + xl;
        } else if (xl == -1) {
            p += 4;
        } else {
            return copy_error("xid is neither 4 nor 8 bytes");
        }
        if (avail < p + 4) NEED_INPUT;
        int32_t dl = (int32_t)be32(b + p);
        if (dl < 0) return copy_error("data is NULL");
        if (avail < p + 4 + dl) NEED_INPUT;
        const char *data = b + p + 4;
        r->pos += p + 4 + dl;
        r->rows_read++;
        if (r->passthrough) {
            PyObject *row = raw_row(lsn, xid_null ? INT64_MIN : xid, data, dl);
            if (!row) return NULL;
            return Py_BuildValue("(s[N])", "rows", row);
        }
        PyObject *out = NULL;
        int rc = r->plugin == P_TEST_DECODING ? td_row(r, lsn, xid, xid_null, data, dl, &out)
                                              : po_row(r, lsn, xid, xid_null, data, dl, &out);
        if (rc == FAIL) return NULL;
        if (rc == UNUSUAL) {
            if (r->open) return handover(r, 1, lsn, xid_null ? INT64_MIN : xid, data, dl);
            r->passthrough = 1;
            PyObject *row = raw_row(lsn, xid_null ? INT64_MIN : xid, data, dl);
            if (!row) return NULL;
            return Py_BuildValue("(s[N])", "rows", row);
        }
        if (r->open && raw_put(r, lsn, xid_null ? INT64_MIN : xid, xid_null, data, dl) < 0) return NULL;
        if (out) return out;
    }
}

static PyObject *Reader_run(Reader *r, PyObject *unused) {
    int need;
    PyObject *res = parse_some(r, &need);
    if (!res && need) Py_RETURN_NONE;
    return res;
}

/* libpq of the connection (the very library psycopg loaded, found by the caller) */
#include <dlfcn.h>
typedef int (*get_copy_data_fn)(void *conn, char **buffer, int async);
typedef void (*freemem_fn)(void *ptr);
static get_copy_data_fn pq_get_copy_data = NULL;
static freemem_fn pq_freemem = NULL;

static PyObject *native_bind_libpq(PyObject *mod, PyObject *arg) {
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path) return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!h) { PyErr_Format(PyExc_OSError, "libpq %s is not loaded: %s", path, dlerror()); return NULL; }
    get_copy_data_fn g = (get_copy_data_fn)dlsym(h, "PQgetCopyData");
    freemem_fn f = (freemem_fn)dlsym(h, "PQfreemem");
    if (!g || !f) { PyErr_SetString(PyExc_OSError, "PQgetCopyData or PQfreemem not found"); return NULL; }
    pq_get_copy_data = g;
    pq_freemem = f;
    Py_RETURN_NONE;
}

/* pump(pgconn_ptr): like run(), reading COPY data straight from libpq when it needs input.
 * ("eof",) when libpq has no more COPY data (psycopg then finishes the COPY and reports errors). */
static PyObject *Reader_pump(Reader *r, PyObject *arg) {
    if (!pq_get_copy_data) { PyErr_SetString(PyExc_RuntimeError, "bind_libpq() first"); return NULL; }
    void *conn = PyLong_AsVoidPtr(arg);
    if (!conn && PyErr_Occurred()) return NULL;
    for (;;) {
        int need;
        PyObject *res = parse_some(r, &need);
        if (res || !need) return res;
        if (r->ended) return Py_BuildValue("(s)", "eof");
        char *data = NULL;
        int n = pq_get_copy_data(conn, &data, 1);
        if (n == 0) {
            Py_BEGIN_ALLOW_THREADS
            n = pq_get_copy_data(conn, &data, 0);
            Py_END_ALLOW_THREADS
        }
        if (n <= 0) return Py_BuildValue("(s)", "eof");
        int rc = buf_put(&r->in, data, n);
        pq_freemem(data);
        if (rc < 0) return NULL;
    }
}

/* ---------------------------------------------------------------- Python API */

static PyObject *Reader_feed(Reader *r, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    compact_input(r);
    int rc = buf_put(&r->in, view.buf, view.len);
    PyBuffer_Release(&view);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Reader_resume(Reader *r, PyObject *unused) {
    r->passthrough = 0;
    Py_RETURN_NONE;
}

static PyObject *Reader_table_id(Reader *r, PyObject *args) {
    PyObject *schema, *table;
    if (!PyArg_ParseTuple(args, "UU", &schema, &table)) return NULL;
    Py_ssize_t id = lookup_table_obj(r, schema, table);
    if (id == -2) return NULL;
    return PyLong_FromSsize_t(id);
}

static int check_tid(Reader *r, Py_ssize_t tid) {
    if (tid < 0 || tid >= r->ntables) { PyErr_SetString(PyExc_IndexError, "no such table"); return -1; }
    return 0;
}

static PyObject *Reader_layout(Reader *r, PyObject *arg) {
    Py_ssize_t tid = PyLong_AsSsize_t(arg);
    if (tid == -1 && PyErr_Occurred()) return NULL;
    if (check_tid(r, tid) < 0) return NULL;
    Table *t = get_table(r, tid);
    if (!t->has_layout) Py_RETURN_NONE;
    return Py_BuildValue("(OO)", t->names, t->types);
}

static PyObject *Reader_set_layout(Reader *r, PyObject *args) {
    Py_ssize_t tid;
    PyObject *names, *types;
    if (!PyArg_ParseTuple(args, "nO!O!", &tid, &PyTuple_Type, &names, &PyTuple_Type, &types)) return NULL;
    if (check_tid(r, tid) < 0) return NULL;
    if (get_table(r, tid)->n && get_table(r, tid)->has_layout) { PyErr_SetString(PyExc_RuntimeError, "set_layout with rows buffered"); return NULL; }
    if (set_layout(get_table(r, tid), names, types) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Reader_pending(Reader *r, PyObject *arg) {
    Py_ssize_t tid = PyLong_AsSsize_t(arg);
    if (tid == -1 && PyErr_Occurred()) return NULL;
    if (check_tid(r, tid) < 0) return NULL;
    return PyLong_FromSsize_t(get_table(r, tid)->n);
}

static int put_pyvalue(TextCol *c, PyObject *v, PyObject *toast, int *is_toast) {
    *is_toast = 0;
    if (v == Py_None) return tc_null(c);
    if (v == toast) { *is_toast = 1; return tc_null(c); }
    Py_ssize_t len;
    const char *u = PyUnicode_AsUTF8AndSize(v, &len);
    if (!u) return -1;
    return tc_append(c, u, len);
}

/* append(tid, seq, op, xid, commit_lsn, commit_time_us, change_lsn, values, old) -> flush or None
 * The Python path's rows (transactions assembled in Python). values: tuple of str/None/TOAST
 * in layout order, or None; old: (names, types, values) or None. */
static PyObject *Reader_append(Reader *r, PyObject *args) {
    Py_ssize_t tid;
    int seq;
    const char *op;
    PyObject *xid, *ctime, *values, *old;
    long long commit, change;
    if (!PyArg_ParseTuple(args, "nisOLOLOO", &tid, &seq, &op, &xid, &commit, &ctime, &change, &values, &old)) return NULL;
    if (check_tid(r, tid) < 0) return NULL;
    if (r->open) { PyErr_SetString(PyExc_RuntimeError, "append while a fast transaction is open"); return NULL; }
    Table *t = get_table(r, tid);
    if (values != Py_None) {
        if (!PyTuple_Check(values) || !t->has_layout || PyTuple_GET_SIZE(values) != t->ncols) {
            PyErr_SetString(PyExc_ValueError, "values do not match the table layout");
            return NULL;
        }
        int any = 0;
        for (Py_ssize_t i = 0; i < t->ncols; i++) {
            int is_toast;
            if (put_pyvalue(&t->cols[i], PyTuple_GET_ITEM(values, i), r->toast_marker, &is_toast) < 0) goto fail;
            if (is_toast) {
                any = 1;
                if (tc_append(&t->toast_names, t->unames[i], t->unlen[i]) < 0) goto fail;
            }
        }
        if (toast_end(t, any) < 0) goto fail;
    } else if (put_nulls_new(t) < 0) {
        goto fail;
    }
    if (old != Py_None) {
        PyObject *names, *types, *vals;
        if (!PyArg_ParseTuple(old, "O!O!O!", &PyTuple_Type, &names, &PyTuple_Type, &types, &PyTuple_Type, &vals)) goto fail;
        Py_ssize_t rows = t->n;
        /* dict semantics: the last of repeated names wins */
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
            Py_ssize_t nl, tl;
            const char *nm = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(names, i), &nl);
            const char *ty = nm ? PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(types, i), &tl) : NULL;
            if (!ty) goto fail;
            Py_ssize_t f = old_field(t, nm, nl, ty, tl);
            if (f < 0) goto fail;
            OldField *of = &t->old[f];
            if (of->col.n > rows) { tc_truncate(&of->col, rows); of->present.len = rows; }
            int is_toast;
            if (put_pyvalue(&of->col, PyTuple_GET_ITEM(vals, i), r->toast_marker, &is_toast) < 0 ||
                buf_u8(&of->present, 1) < 0)
                goto fail;
        }
        for (Py_ssize_t i = 0; i < t->nold; i++) {
            OldField *of = &t->old[i];
            if (of->col.n == rows && (tc_null(&of->col) < 0 || buf_u8(&of->present, 0) < 0)) goto fail;
        }
    } else if (put_no_old(t) < 0) {
        goto fail;
    }
    int xv = xid != Py_None;
    long long xv_val = xv ? PyLong_AsLongLong(xid) : 0;
    if (xv && xv_val == -1 && PyErr_Occurred()) goto fail;
    if (meta_row(t, seq, op[0], xv_val, xv, change, old != Py_None) < 0) goto fail;
    ((int64_t *)t->commit_lsn.p)[t->n] = commit;
    if (ctime != Py_None) {
        long long us = PyLong_AsLongLong(ctime);
        if (us == -1 && PyErr_Occurred()) goto fail;
        ((int64_t *)t->ctime.p)[t->n] = us;
        t->ctime_valid.p[t->n] = 1;
    }
    t->n++;
    count_row(t, op[0], commit);
    register_order(r, tid);
    r->buffered++;
    if (r->buffered >= r->part_rows) {
        Py_ssize_t best = -1, bestn = -1;
        for (Py_ssize_t j = 0; j < r->norder; j++) {
            Table *o = get_table(r, r->order[j]);
            if (o->n > bestn) { bestn = o->n; best = r->order[j]; }
        }
        r->buffered -= bestn;
        return Py_BuildValue("(nn)", best, bestn);
    }
    Py_RETURN_NONE;
fail:
    table_truncate(t, t->n);
    return NULL;
}

static PyObject *fixed_take(Buf *b, Py_ssize_t k, Py_ssize_t width) {
    PyObject *out = PyBytes_FromStringAndSize(b->p, k * width);
    if (out) buf_shift(b, k * width);
    return out;
}

static PyObject *valid_take(Buf *b, Py_ssize_t k) {
    Py_ssize_t nulls;
    PyObject *bits = bitmap((uint8_t *)b->p, k, &nulls);
    if (!bits) return NULL;
    buf_shift(b, k);
    return Py_BuildValue("(Nn)", bits, nulls);
}

/* take(tid, k): the first k buffered rows of a table as Arrow buffers; they leave the buffer. */
static PyObject *Reader_take(Reader *r, PyObject *args) {
    Py_ssize_t tid, k;
    if (!PyArg_ParseTuple(args, "nn", &tid, &k)) return NULL;
    if (check_tid(r, tid) < 0) return NULL;
    Table *t = get_table(r, tid);
    if (k < 0 || k > t->n || (t->in_txn && k > t->txn_mark)) { PyErr_SetString(PyExc_ValueError, "bad row count"); return NULL; }
    PyObject *d = PyDict_New();
    if (!d) return NULL;
#define SET(key, expr) do { PyObject *_v = (expr); if (!_v || PyDict_SetItemString(d, key, _v) < 0) { Py_XDECREF(_v); Py_DECREF(d); return NULL; } Py_DECREF(_v); } while (0)
    SET("n", PyLong_FromSsize_t(k));
    SET("commit_lsn", fixed_take(&t->commit_lsn, k, 8));
    SET("seq", fixed_take(&t->seq, k, 4));
    {
        PyObject *offs = PyBytes_FromStringAndSize(NULL, (k + 1) * 4);
        if (!offs) { Py_DECREF(d); return NULL; }
        int32_t *o = (int32_t *)PyBytes_AS_STRING(offs);
        for (Py_ssize_t i = 0; i <= k; i++) o[i] = (int32_t)i;
        SET("op_offsets", offs);
    }
    SET("op", fixed_take(&t->op, k, 1));
    SET("xid_valid", valid_take(&t->xid_valid, k));
    SET("xid", fixed_take(&t->xid, k, 8));
    SET("ctime_valid", valid_take(&t->ctime_valid, k));
    SET("ctime", fixed_take(&t->ctime, k, 8));
    SET("change_lsn", fixed_take(&t->change_lsn, k, 8));
    SET("has_old", fixed_take(&t->has_old, k, 1));
    {
        int32_t *toffs = (int32_t *)t->toast_offs.p;
        Py_ssize_t child = toffs[k];
        SET("toast_offsets", PyBytes_FromStringAndSize(t->toast_offs.p, (k + 1) * 4));
        Py_ssize_t rest = t->toast_offs.len / 4 - 1 - k;
        memmove(toffs, toffs + k, (rest + 1) * 4);
        for (Py_ssize_t i = 0; i <= rest; i++) toffs[i] -= (int32_t)child;
        t->toast_offs.len = (rest + 1) * 4;
        SET("toast_valid", valid_take(&t->toast_valid, k));
        SET("toast_n", PyLong_FromSsize_t(child));
        SET("toast_names", tc_take(&t->toast_names, child));
    }
    {
        PyObject *vals = PyList_New(t->ncols);
        if (!vals) { Py_DECREF(d); return NULL; }
        for (Py_ssize_t i = 0; i < t->ncols; i++) {
            PyObject *c = tc_take(&t->cols[i], k);
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
            PyObject *c = tc_take(&f->col, k);
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

static PyObject *Reader_order(Reader *r, PyObject *unused) {
    PyObject *l = PyList_New(r->norder);
    if (!l) return NULL;
    for (Py_ssize_t i = 0; i < r->norder; i++) PyList_SET_ITEM(l, i, PyLong_FromSsize_t(r->order[i]));
    return l;
}

static PyObject *Reader_table_info(Reader *r, PyObject *arg) {
    Py_ssize_t tid = PyLong_AsSsize_t(arg);
    if (tid == -1 && PyErr_Occurred()) return NULL;
    if (check_tid(r, tid) < 0) return NULL;
    Table *t = get_table(r, tid);
    PyObject *mn = t->has_commit ? PyLong_FromLongLong(t->min_commit) : (Py_INCREF(Py_None), Py_None);
    return Py_BuildValue("{sOsOsLsLsLsLsNsL}", "schema", t->schema, "table", t->table, "I", t->counts[0], "U",
                         t->counts[1], "D", t->counts[2], "T", t->counts[3], "min_commit", mn, "max_commit",
                         (long long)t->max_commit);
}

static PyObject *Reader_stats(Reader *r, PyObject *unused) {
    PyObject *safe = r->has_safe ? PyLong_FromLongLong(r->safe_lsn) : (Py_INCREF(Py_None), Py_None);
    return Py_BuildValue("{sLsLsLsLsLsLsLsN}", "rows_read", r->rows_read, "transactions", r->w_transactions, "changes",
                         r->w_changes, "skipped", r->w_skipped, "assembled_transactions", r->a_transactions,
                         "assembled_changes", r->a_changes, "empty_transactions", r->empty, "safe_lsn", safe);
}

/* set_relation(relid, schema, table, names, types, key_flags) */
static PyObject *Reader_set_relation(Reader *r, PyObject *args) {
    unsigned int relid;
    PyObject *schema, *table, *names, *types, *flags;
    if (!PyArg_ParseTuple(args, "IUUO!O!O!", &relid, &schema, &table, &PyTuple_Type, &names, &PyTuple_Type, &types,
                          &PyTuple_Type, &flags))
        return NULL;
    Relation *rel = find_rel(r, relid);
    if (rel) {
        relation_free(rel);
    } else {
        if (r->nrels == r->relcap) {
            Py_ssize_t cap = r->relcap ? r->relcap * 2 : 16;
            Relation *rr = PyMem_Realloc(r->rels, cap * sizeof(Relation));
            if (!rr) return PyErr_NoMemory();
            r->rels = rr; r->relcap = cap;
        }
        rel = &r->rels[r->nrels++];
        memset(rel, 0, sizeof(*rel));
    }
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    rel->relid = relid;
    rel->used = 1;
    Py_INCREF(schema); Py_INCREF(table); Py_INCREF(names); Py_INCREF(types);
    rel->schema = schema; rel->table = table; rel->names = names; rel->types = types;
    rel->ncols = n;
    rel->table_id = -2;
    rel->matched_version = -1;
    rel->key = PyMem_Calloc(n ? n : 1, 1);
    rel->oldidx = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    rel->unames = PyMem_Calloc(n ? n : 1, sizeof(char *));
    rel->utypes = PyMem_Calloc(n ? n : 1, sizeof(char *));
    rel->unlen = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    rel->utlen = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    if (!rel->key || !rel->oldidx || !rel->unames || !rel->utypes || !rel->unlen || !rel->utlen) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        int k = PyObject_IsTrue(PyTuple_GET_ITEM(flags, i));
        if (k < 0) return NULL;
        rel->key[i] = (uint8_t)k;
        rel->oldidx[i] = -1;
        rel->unames[i] = dup_utf8(PyTuple_GET_ITEM(names, i), &rel->unlen[i]);
        rel->utypes[i] = dup_utf8(PyTuple_GET_ITEM(types, i), &rel->utlen[i]);
        if (!rel->unames[i] || !rel->utypes[i]) return NULL;
    }
    Py_RETURN_NONE;
}

static int Reader_init(Reader *r, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"plugin", "part_rows", "memory_items", "resume_after", "include", "relation", "toast", NULL};
    const char *plugin;
    PyObject *resume, *include, *relation, *toast;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "snnOOOO", kwlist, &plugin, &r->part_rows, &r->memory_items, &resume,
                                     &include, &relation, &toast))
        return -1;
    if (strcmp(plugin, "test_decoding") == 0) r->plugin = P_TEST_DECODING;
    else if (strcmp(plugin, "pgoutput") == 0) r->plugin = P_PGOUTPUT;
    else { PyErr_SetString(PyExc_ValueError, "unknown plugin"); return -1; }
    if (r->part_rows < 1 || r->memory_items < 1) { PyErr_SetString(PyExc_ValueError, "part_rows and memory_items must be positive"); return -1; }
    if (resume != Py_None) {
        r->resume_after = PyLong_AsLongLong(resume);
        if (r->resume_after == -1 && PyErr_Occurred()) return -1;
        r->has_resume = 1;
    }
    Py_INCREF(include); r->include_cb = include;
    if (relation != Py_None) { Py_INCREF(relation); r->relation_cb = relation; }
    Py_INCREF(toast); r->toast_marker = toast;
    r->table_ids = PyDict_New();
    if (!r->table_ids) return -1;
    return 0;
}

static void Reader_dealloc(Reader *r) {
    for (Py_ssize_t i = 0; i < r->ntables; i++) table_free(&r->tables[i]);
    PyMem_Free(r->tables); PyMem_Free(r->order);
    for (Py_ssize_t i = 0; i < r->nrels; i++) relation_free(&r->rels[i]);
    PyMem_Free(r->rels);
    Py_XDECREF(r->include_cb); Py_XDECREF(r->relation_cb); Py_XDECREF(r->toast_marker); Py_XDECREF(r->table_ids);
    buf_free(&r->in); buf_free(&r->txn_tables); buf_free(&r->txn_tids); buf_free(&r->raw); buf_free(&r->scratch);
    PyMem_Free(r->cols);
    for (int i = 0; i < 8; i++) buf_free(&r->head_cache[i]);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *Reader_in_transaction(Reader *r, void *closure) { return PyBool_FromLong(r->open); }
static PyObject *Reader_ended(Reader *r, void *closure) { return PyBool_FromLong(r->ended); }

static PyGetSetDef Reader_getset[] = {
    {"in_transaction", (getter)Reader_in_transaction, NULL, "a fast transaction is open", NULL},
    {"ended", (getter)Reader_ended, NULL, "the COPY trailer was read", NULL},
    {NULL}};

static PyMethodDef Reader_methods[] = {
    {"feed", (PyCFunction)Reader_feed, METH_O, "append COPY BINARY bytes"},
    {"run", (PyCFunction)Reader_run, METH_NOARGS, "process buffered rows"},
    {"pump", (PyCFunction)Reader_pump, METH_O, "process rows read from libpq"},
    {"resume", (PyCFunction)Reader_resume, METH_NOARGS, "leave pass-through mode"},
    {"table_id", (PyCFunction)Reader_table_id, METH_VARARGS, "table id (-1 excluded)"},
    {"layout", (PyCFunction)Reader_layout, METH_O, "(names, types) or None"},
    {"set_layout", (PyCFunction)Reader_set_layout, METH_VARARGS, "set an empty table's layout"},
    {"pending", (PyCFunction)Reader_pending, METH_O, "buffered rows of a table"},
    {"append", (PyCFunction)Reader_append, METH_VARARGS, "append one row from the Python path"},
    {"take", (PyCFunction)Reader_take, METH_VARARGS, "take the first rows of a table"},
    {"order", (PyCFunction)Reader_order, METH_NOARGS, "table ids in writer order"},
    {"table_info", (PyCFunction)Reader_table_info, METH_O, "names and totals of a table"},
    {"stats", (PyCFunction)Reader_stats, METH_NOARGS, "totals of the fast path"},
    {"set_relation", (PyCFunction)Reader_set_relation, METH_VARARGS, "cache a pgoutput relation"},
    {NULL}};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "airflow_provider_pgdecode.capture._native.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
    .tp_getset = Reader_getset,
    .tp_doc = "COPY BINARY peek rows to columnar buffers (see the module source).",
};

static PyMethodDef module_methods[] = {
    {"bind_libpq", (PyCFunction)native_bind_libpq, METH_O, "use the already loaded libpq at this path"},
    {NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_native", "pgdecode native fast path", -1, module_methods};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&ReaderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0) { Py_DECREF(&ReaderType); Py_DECREF(m); return NULL; }
    return m;
}
