/*
 * Twin of airflow_provider_pgdecode/decoding/pgoutput.py: Begin, Commit and Insert/Update/Delete
 * messages of pgoutput read into the table buffers. Relation messages go to Python (the
 * relation callback), which parses them with the Python parser and caches the result here with
 * set_relation(), so column names and types come from the same place on both paths.
 */
#include "native.h"

#define PG_EPOCH_US 946684800000000LL

/* ---------------------------------------------------------------- relations */

void relation_free(Relation *r) {
    Py_XDECREF(r->schema); Py_XDECREF(r->table); Py_XDECREF(r->names); Py_XDECREF(r->types);
    for (Py_ssize_t i = 0; i < r->ncols; i++) { PyMem_Free(r->unames[i]); PyMem_Free(r->utypes[i]); }
    PyMem_Free(r->unames); PyMem_Free(r->utypes); PyMem_Free(r->unlen); PyMem_Free(r->utlen);
    PyMem_Free(r->key); PyMem_Free(r->oldidx);
    memset(r, 0, sizeof(*r));
}

/* ---------------------------------------------------------------- pgoutput */

Relation *find_rel(Reader *r, uint32_t relid) {
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
    if (r->txn_items + 1 >= r->memory_items || over_change_bound(r)) return UNUSUAL;
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

int po_row(Reader *r, int64_t lsn, int64_t xid, int xid_null, const char *s, Py_ssize_t n, PyObject **out) {
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
        if (over_commit_bound(r, lsn)) return UNUSUAL;
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
