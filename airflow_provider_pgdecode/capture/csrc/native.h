/*
 * Internal header of the native fast path (airflow_provider_pgdecode.capture._native), shared by
 * the C files of this folder; see module.c for the overview. The structs, the growable-buffer
 * and text-column helpers and the per-row helpers that the scanners call for every row are here
 * (static inline, so they inline as before the split); everything else a file calls in another
 * file has a prototype at the end, grouped by the file that defines it.
 */
#ifndef PGDECODE_NATIVE_H
#define PGDECODE_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Functions shared between the files stay internal to the extension: direct calls, and no
 * clash with a symbol of the same name in another loaded library. */
#pragma GCC visibility push(hidden)

/* ---------------------------------------------------------------- growable buffers */

typedef struct {
    char *p;
    Py_ssize_t len, cap;
} Buf;

int buf_reserve(Buf *b, Py_ssize_t extra);

static inline int buf_put(Buf *b, const void *src, Py_ssize_t n) {
    if (b->len + n > b->cap && buf_reserve(b, n) < 0) return -1;
    if (n) memcpy(b->p + b->len, src, n);
    b->len += n;
    return 0;
}

static inline int buf_i64(Buf *b, int64_t v) { return buf_put(b, &v, 8); }
static inline int buf_i32(Buf *b, int32_t v) { return buf_put(b, &v, 4); }
static inline int buf_u8(Buf *b, uint8_t v) { return buf_put(b, &v, 1); }

/* ---------------------------------------------------------------- text columns */

typedef struct {
    Buf valid; /* uint8 per row */
    Buf offs;  /* int32 per row + 1 */
    Buf data;
    Py_ssize_t n;
} TextCol;

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

static inline int tc_null(TextCol *c) { return tc_end_row(c, 0); }

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

static inline int op_index(char op) { return op == 'I' ? 0 : op == 'U' ? 1 : op == 'D' ? 2 : 3; }

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

/* Large buffers handed to Python by take() come back here once Python is done with them. */
#define SPARES_MAX 64
#define SPARE_BYTES_MAX ((Py_ssize_t)256 << 20)

typedef struct {
    char *p;
    Py_ssize_t cap;
} Spare;

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
    /* the open transaction's rows as read (for a handover): raw_rows COPY rows from offset raw_from
     * of `in`, which keeps them (compact_input drops only what lies before) */
    Py_ssize_t raw_from, raw_rows;
    /* test_decoding: raw "schema.table" texts of recent lines -> table id */
    Buf head_cache[8]; Py_ssize_t head_tid[8]; int head_next;
    /* scratch */
    Col *cols; Py_ssize_t colcap, ncol;
    Buf scratch;
    /* totals of fast transactions */
    long long w_transactions, w_changes, w_skipped, a_transactions, a_changes, empty;
    int64_t safe_lsn; int has_safe;
    /* batch bounds (set_bounds) and the Python path's share of the batch (set_python_totals) */
    long long max_changes; int has_max_changes;
    int64_t max_commit_lsn; int has_max_commit;
    long long py_changes; int py_holds;
    int stopped; /* the batch was cut: the rest of the COPY is read and dropped */
    /* buffers of parts written and released, for the next parts (see hand_over in buffers.c) */
    Spare spares[SPARES_MAX]; int nspares; Py_ssize_t spare_bytes;
} Reader;

/* ---------------------------------------------------------------- per-row helpers (static inline) */

/* The batch bounds of capture/bounds.py, mirrored: once the batch holds something, a change that
 * would take it past max_changes, or a COMMIT past max_commit_lsn, goes to Python (UNUSUAL),
 * which cuts the batch before that transaction. The Python side decides; these only route. */
static inline int batch_holds(const Reader *r) { return r->has_safe || r->py_holds; }
static inline int over_change_bound(const Reader *r) {
    return r->has_max_changes && batch_holds(r) && r->a_changes + r->py_changes + r->txn_items + 1 > r->max_changes;
}
static inline int over_commit_bound(const Reader *r, int64_t lsn) {
    return r->has_max_commit && batch_holds(r) && lsn > r->max_commit_lsn;
}

static inline Table *get_table(Reader *r, Py_ssize_t id) { return &r->tables[id]; }

/* Start a row of table t in the open transaction. */
static inline int txn_touch(Reader *r, Py_ssize_t tid) {
    Table *t = get_table(r, tid);
    if (!t->in_txn) {
        t->in_txn = 1;
        t->txn_mark = t->n;
        if (buf_put(&r->txn_tables, &tid, sizeof(tid)) < 0) return -1;
    }
    return 0;
}

/* Append the metadata of one row (commit fields filled later). */
static inline int meta_row(Table *t, int32_t seq, char op, int64_t xid, int xid_valid, int64_t change_lsn, uint8_t has_old) {
    if (buf_i64(&t->commit_lsn, 0) < 0 || buf_i32(&t->seq, seq) < 0 || buf_u8(&t->op, (uint8_t)op) < 0 ||
        buf_i64(&t->xid, xid_valid ? xid : 0) < 0 || buf_u8(&t->xid_valid, (uint8_t)xid_valid) < 0 ||
        buf_i64(&t->ctime, 0) < 0 || buf_u8(&t->ctime_valid, 0) < 0 || buf_i64(&t->change_lsn, change_lsn) < 0 ||
        buf_u8(&t->has_old, has_old) < 0)
        return -1;
    return 0;
}

static inline int toast_end(Table *t, int any) {
    if (buf_i32(&t->toast_offs, (int32_t)t->toast_names.n) < 0 || buf_u8(&t->toast_valid, (uint8_t)any) < 0) return -1;
    return 0;
}

static inline int starts_pg(const char *s, Py_ssize_t n) { return n >= 4 && memcmp(s, "_pg_", 4) == 0; }

static inline void register_order(Reader *r, Py_ssize_t tid) {
    Table *t = get_table(r, tid);
    if (!t->registered) { t->registered = 1; r->order[r->norder++] = tid; }
}

static inline void count_row(Table *t, char op, int64_t commit) {
    t->counts[op_index(op)]++;
    if (!t->has_commit) { t->min_commit = commit; t->has_commit = 1; }
    t->max_commit = commit;
}

static inline int put_nulls_new(Table *t) {
    for (Py_ssize_t i = 0; i < t->ncols; i++) if (tc_null(&t->cols[i]) < 0) return -1;
    return toast_end(t, 0);
}

static inline int put_no_old(Table *t) {
    for (Py_ssize_t i = 0; i < t->nold; i++)
        if (tc_null(&t->old[i].col) < 0 || buf_u8(&t->old[i].present, 0) < 0) return -1;
    return 0;
}

/* big-endian integers (pgoutput messages, COPY BINARY framing) */
static inline uint32_t be32(const char *p) {
    const uint8_t *u = (const uint8_t *)p;
    return ((uint32_t)u[0] << 24) | ((uint32_t)u[1] << 16) | ((uint32_t)u[2] << 8) | u[3];
}
static inline int64_t be64(const char *p) { return (int64_t)(((uint64_t)be32(p) << 32) | be32(p + 4)); }
static inline int16_t be16(const char *p) { const uint8_t *u = (const uint8_t *)p; return (int16_t)((u[0] << 8) | u[1]); }

/* ---------------------------------------------------------------- prototypes */

/* buffers.c */
void buf_free(Buf *b);
void buf_shift(Buf *b, Py_ssize_t bytes);
int tc_init(TextCol *c);
void tc_free(TextCol *c);
int tc_append_undouble(TextCol *c, const char *s, Py_ssize_t n);
void tc_truncate(TextCol *c, Py_ssize_t n);
void table_truncate(Table *t, Py_ssize_t n);
char *dup_utf8(PyObject *s, Py_ssize_t *len);
int set_layout(Table *t, PyObject *names, PyObject *types);
Py_ssize_t old_field(Table *t, const char *name, Py_ssize_t nlen, const char *type, Py_ssize_t tlen);
void table_free(Table *t);
PyObject *Reader_take(Reader *r, PyObject *args);
int block_type_ready(void);
void spares_free(Reader *r);

/* parts.c */
Py_ssize_t lookup_table_obj(Reader *r, PyObject *schema, PyObject *table);
Py_ssize_t lookup_table(Reader *r, const char *s, Py_ssize_t slen, const char *t, Py_ssize_t tlen);
PyObject *raw_row(int64_t lsn, int64_t xid, const char *data, Py_ssize_t len);
PyObject *handover(Reader *r, int have_current, int64_t lsn, int64_t xid, const char *data, Py_ssize_t len);
int check_tid(Reader *r, Py_ssize_t tid);
PyObject *commit_txn(Reader *r, int64_t lsn, int64_t ctime, int ctime_valid);

/* test_decoding.c */
int td_row(Reader *r, int64_t lsn, int64_t xid, int xid_null, const char *s, Py_ssize_t n, PyObject **out);

/* pgoutput.c */
void relation_free(Relation *r);
Relation *find_rel(Reader *r, uint32_t relid);
int po_row(Reader *r, int64_t lsn, int64_t xid, int xid_null, const char *s, Py_ssize_t n, PyObject **out);

/* copy_reader.c */
Py_ssize_t copy_row(const char *b, Py_ssize_t avail, int64_t *lsn, int64_t *xid, int *xid_null, const char **data,
                    Py_ssize_t *len);
void compact_input(Reader *r);
PyObject *Reader_run(Reader *r, PyObject *unused);
PyObject *native_bind_libpq(PyObject *mod, PyObject *args);
PyObject *Reader_pump(Reader *r, PyObject *arg);

#pragma GCC visibility pop

#endif
