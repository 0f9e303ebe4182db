/*
 * Twin of airflow_provider_pgdecode/batch/writer.py's part rules (BatchWriter: a budget of
 * part_rows rows over all tables, the largest table flushed first), for the transactions the
 * scanners read in C; capture/native.py's NativeWriter applies the same rules to transactions
 * assembled in Python and writes the parts. Here: the reader's tables (table id per
 * (schema, table), the include callback), the open transaction and the handover of its rows as
 * read (kept in the input buffer: copy_reader.c's compact_input) to Python, and its COMMIT,
 * which fills in the commit fields and replays the writer's budget over the transaction's rows
 * to list the parts to write.
 */
#include "native.h"

/* ---------------------------------------------------------------- the reader's tables */

/* Table id for (schema, table) as UTF-8; -1 excluded; -2 error. */
Py_ssize_t lookup_table_obj(Reader *r, PyObject *schema, PyObject *table) {
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

Py_ssize_t lookup_table(Reader *r, const char *s, Py_ssize_t slen, const char *t, Py_ssize_t tlen) {
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

PyObject *raw_row(int64_t lsn, int64_t xid, const char *data, Py_ssize_t len) {
    if (xid == INT64_MIN) return Py_BuildValue("(LOy#)", (long long)lsn, Py_None, data, len);
    return Py_BuildValue("(LLy#)", (long long)lsn, (long long)xid, data, len);
}

static void txn_reset(Reader *r) {
    Py_ssize_t *ids = (Py_ssize_t *)r->txn_tables.p;
    Py_ssize_t n = r->txn_tables.len / sizeof(Py_ssize_t);
    for (Py_ssize_t i = 0; i < n; i++) r->tables[ids[i]].in_txn = 0;
    r->txn_tables.len = 0;
    r->txn_tids.len = 0;
    r->raw_rows = 0;
    r->open = 0; r->txn_items = 0; r->txn_skipped = 0;
}

/* Give up the open transaction: drop its buffered rows, return its raw rows plus the current one. */
PyObject *handover(Reader *r, int have_current, int64_t lsn, int64_t xid, const char *data, Py_ssize_t len) {
    Py_ssize_t *ids = (Py_ssize_t *)r->txn_tables.p;
    Py_ssize_t n = r->txn_tables.len / sizeof(Py_ssize_t);
    for (Py_ssize_t i = 0; i < n; i++) table_truncate(&r->tables[ids[i]], r->tables[ids[i]].txn_mark);
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    /* the rows as read, still in the input buffer (complete and well-formed: each was parsed) */
    Py_ssize_t at = r->raw_from;
    for (Py_ssize_t i = 0; i < r->raw_rows; i++) {
        int64_t rlsn, rxid;
        int rxid_null;
        const char *rdata;
        Py_ssize_t rlen;
        Py_ssize_t size = copy_row(r->in.p + at, r->in.len - at, &rlsn, &rxid, &rxid_null, &rdata, &rlen);
        if (size <= 0) {
            if (size == 0) PyErr_SetString(PyExc_RuntimeError, "a transaction's raw row is no longer buffered");
            Py_DECREF(list);
            return NULL;
        }
        at += size;
        PyObject *row = raw_row(rlsn, rxid_null ? INT64_MIN : rxid, rdata, rlen);
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

int check_tid(Reader *r, Py_ssize_t tid) {
    if (tid < 0 || tid >= r->ntables) { PyErr_SetString(PyExc_IndexError, "no such table"); return -1; }
    return 0;
}

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

/* COMMIT of the open fast transaction. Returns a "flush" result, Py_None (nothing to do) or NULL. */
PyObject *commit_txn(Reader *r, int64_t lsn, int64_t ctime, int ctime_valid) {
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
