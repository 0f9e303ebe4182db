/*
 * Twin of airflow_provider_pgdecode/capture/native.py: the Reader type it drives (the methods
 * not defined in the other files of this folder) and the module.
 *
 * pgdecode native fast path: COPY BINARY rows of a peek -> per-table columnar text buffers.
 *
 * The Python side (airflow_provider_pgdecode.capture.native) drives a Reader:
 *   feed(block)  appends COPY bytes (rows may straddle blocks);
 *   run()        parses rows until it needs input (None), has rows for Python ("rows", [...]),
 *                has Parquet parts to write ("flush", [(table_id, rows), ...]) or saw the end
 *                ("end", [rows of a transaction cut off by the end]);
 *   pump(ptr)    the same, reading rows itself from libpq (PQgetCopyData on the PGconn* of
 *                psycopg's connection, from the libpq psycopg loaded: bind_libpq(get_copy_data,
 *                freemem) takes the addresses of its PQgetCopyData and PQfreemem, which
 *                native.py looks up; the module resolves no symbol itself); ("eof",) once the
 *                trailer was read or libpq ended the COPY.
 * Only plain committed transactions of INSERT/UPDATE/DELETE are handled here. Any other row,
 * and any row this scanner cannot read, is handed to Python together with the raw rows of the
 * transaction it belongs to (kept as read in the input buffer until its COMMIT); the reader then passes every
 * row through until Python calls resume(). Python parses such rows with the pure-Python parsers,
 * so errors and rare cases behave exactly as on the Python path.
 *
 * Buffers hold, per table, the rows not yet written: text values in Arrow layout (validity,
 * int32 offsets, bytes) plus the writer's metadata columns. The part-splitting rules of
 * batch/writer.py (a budget of part_rows rows over all tables, flushing the largest table,
 * a flush when a table's columns change) are reproduced exactly; see native.py.
 *
 * Files (this folder; native.h holds the shared structs, inline helpers and prototypes):
 *   buffers.c        growable buffers, Arrow-layout text columns, per-table buffers, take();
 *   parts.c          the reader's tables, the open transaction, COMMIT and the part budget;
 *   test_decoding.c  the test_decoding line scanner;
 *   pgoutput.c       the pgoutput message reader;
 *   copy_reader.c    COPY BINARY framing, run(), pump() and bind_libpq();
 *   module.c         the Reader type, its other methods and the module.
 */
#include "native.h"

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

/* set_bounds(max_changes or None, max_commit_lsn or None) */
static PyObject *Reader_set_bounds(Reader *r, PyObject *args) {
    PyObject *changes, *lsn;
    if (!PyArg_ParseTuple(args, "OO", &changes, &lsn)) return NULL;
    r->has_max_changes = changes != Py_None;
    r->has_max_commit = lsn != Py_None;
    if (r->has_max_changes) { r->max_changes = PyLong_AsLongLong(changes); if (PyErr_Occurred()) return NULL; }
    if (r->has_max_commit) { r->max_commit_lsn = PyLong_AsLongLong(lsn); if (PyErr_Occurred()) return NULL; }
    Py_RETURN_NONE;
}

/* set_python_totals(changes, holds): what the Python path has put into the batch so far */
static PyObject *Reader_set_python_totals(Reader *r, PyObject *args) {
    long long changes;
    int holds;
    if (!PyArg_ParseTuple(args, "Lp", &changes, &holds)) return NULL;
    r->py_changes = changes;
    r->py_holds = holds;
    Py_RETURN_NONE;
}

/* next_copy(resume_after or None): read another peek's COPY after this one's trailer (the
 * extract's second decoding session); its transactions committed at or before resume_after
 * were read already and go to Python, which drops them. */
static PyObject *Reader_next_copy(Reader *r, PyObject *arg) {
    if (!r->ended || r->open) {
        PyErr_SetString(PyExc_RuntimeError, "next_copy() before the COPY ended on a transaction boundary");
        return NULL;
    }
    if (arg != Py_None) {
        long long lsn = PyLong_AsLongLong(arg);
        if (lsn == -1 && PyErr_Occurred()) return NULL;
        r->resume_after = lsn;
        r->has_resume = 1;
    }
    r->in.len = 0;
    r->pos = 0;
    r->header_done = 0;
    r->ended = 0;
    Py_RETURN_NONE;
}

static PyObject *Reader_stop(Reader *r, PyObject *unused) {
    r->stopped = 1;
    Py_RETURN_NONE;
}

static PyObject *Reader_table_id(Reader *r, PyObject *args) {
    PyObject *schema, *table;
    if (!PyArg_ParseTuple(args, "UU", &schema, &table)) return NULL;
    Py_ssize_t id = lookup_table_obj(r, schema, table);
    if (id == -2) return NULL;
    return PyLong_FromSsize_t(id);
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

/* The callbacks may refer back to the reader (the extract's relation callback does, through its
 * closure): the reader takes part in the cycle collector, or every pgoutput batch's reader, with
 * its buffers, would stay in memory. */
static int Reader_traverse(Reader *r, visitproc visit, void *arg) {
    Py_VISIT(r->include_cb);
    Py_VISIT(r->relation_cb);
    Py_VISIT(r->toast_marker);
    Py_VISIT(r->table_ids);
    return 0;
}

static int Reader_clear(Reader *r) {
    Py_CLEAR(r->include_cb);
    Py_CLEAR(r->relation_cb);
    Py_CLEAR(r->toast_marker);
    Py_CLEAR(r->table_ids);
    return 0;
}

static void Reader_dealloc(Reader *r) {
    PyObject_GC_UnTrack(r);
    for (Py_ssize_t i = 0; i < r->ntables; i++) table_free(&r->tables[i]);
    PyMem_Free(r->tables); PyMem_Free(r->order);
    for (Py_ssize_t i = 0; i < r->nrels; i++) relation_free(&r->rels[i]);
    PyMem_Free(r->rels);
    Py_XDECREF(r->include_cb); Py_XDECREF(r->relation_cb); Py_XDECREF(r->toast_marker); Py_XDECREF(r->table_ids);
    buf_free(&r->in); buf_free(&r->txn_tables); buf_free(&r->txn_tids); buf_free(&r->scratch);
    PyMem_Free(r->cols);
    for (int i = 0; i < 8; i++) buf_free(&r->head_cache[i]);
    spares_free(r);
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
    {"set_bounds", (PyCFunction)Reader_set_bounds, METH_VARARGS, "batch bounds: (max_changes, max_commit_lsn)"},
    {"set_python_totals", (PyCFunction)Reader_set_python_totals, METH_VARARGS, "changes and holds of the Python path"},
    {"next_copy", (PyCFunction)Reader_next_copy, METH_O, "read another COPY: (resume_after or None)"},
    {"stop", (PyCFunction)Reader_stop, METH_NOARGS, "drop the rest of the COPY (the batch was cut)"},
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
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Reader_traverse,
    .tp_clear = (inquiry)Reader_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
    .tp_getset = Reader_getset,
    .tp_doc = "COPY BINARY peek rows to columnar buffers (see the module source).",
};

static PyMethodDef module_methods[] = {
    {"bind_libpq", (PyCFunction)native_bind_libpq, METH_VARARGS,
     "bind_libpq(get_copy_data, freemem): use the libpq functions at these addresses (PQgetCopyData, PQfreemem)"},
    {NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_native", "pgdecode native fast path", -1, module_methods};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&ReaderType) < 0 || block_type_ready() < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0) { Py_DECREF(&ReaderType); Py_DECREF(m); return NULL; }
    return m;
}
