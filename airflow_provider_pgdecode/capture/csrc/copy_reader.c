/*
 * Twin of airflow_provider_pgdecode/postgres/slot.py's peek_copy (the COPY ... TO STDOUT
 * (FORMAT BINARY) of the peek): the COPY BINARY framing (signature, header, rows of lsn, xid,
 * data; the trailer) and run(), which dispatches each row to the test_decoding or pgoutput
 * scanner, plus pump(), which reads the COPY data itself from the libpq psycopg loaded
 * (bind_libpq: the addresses of its PQgetCopyData and PQfreemem; PQgetCopyData on the
 * connection's PGconn) while the COPY is open.
 */
#include "native.h"

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

/* Drop the input read, but the open transaction's rows (a handover gives them to Python): they
 * stay where the COPY put them instead of being copied aside row by row. */
void compact_input(Reader *r) {
    Py_ssize_t drop = r->raw_rows ? r->raw_from : r->pos;
    if (drop > 0) {
        buf_shift(&r->in, drop);
        r->pos -= drop;
        r->raw_from -= r->raw_rows ? drop : 0;
    }
}

/* One row of the COPY (lsn, xid, data) at b, after its field count: its size from b; 0 when
 * `avail` bytes do not hold it whole; -1 (error set) when malformed. */
Py_ssize_t copy_row(const char *b, Py_ssize_t avail, int64_t *lsn, int64_t *xid, int *xid_null, const char **data,
                    Py_ssize_t *len) {
    /* lsn (pg_lsn or int8: 8 bytes), xid (xid: 4 bytes, or int8; NULL), data (bytea) */
    Py_ssize_t p = 2;
    if (avail < p + 4) return 0;
    if ((int32_t)be32(b + p) != 8) { copy_error("lsn is not 8 bytes"); return -1; }
    if (avail < p + 12) return 0;
    *lsn = be64(b + p + 4);
    p += 12;
    if (avail < p + 4) return 0;
    int32_t xl = (int32_t)be32(b + p);
    *xid = 0;
    *xid_null = 1;
    if (xl == 4 || xl == 8) {
        if (avail < p + 4 + xl) return 0;
        *xid = xl == 4 ? (int64_t)be32(b + p + 4) : be64(b + p + 4);
        *xid_null = *xid == 0; /* the Python path reads 0 as None too */
        p += 4 + xl;
    } else if (xl == -1) {
        p += 4;
    } else {
        copy_error("xid is neither 4 nor 8 bytes");
        return -1;
    }
    if (avail < p + 4) return 0;
    int32_t dl = (int32_t)be32(b + p);
    if (dl < 0) { copy_error("data is NULL"); return -1; }
    if (avail < p + 4 + dl) return 0;
    *data = b + p + 4;
    *len = dl;
    return p + 4 + dl;
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
        int64_t lsn, xid;
        int xid_null;
        const char *data;
        Py_ssize_t dl;
        Py_ssize_t size = copy_row(b, avail, &lsn, &xid, &xid_null, &data, &dl);
        if (size < 0) return NULL;
        if (size == 0) NEED_INPUT;
        Py_ssize_t row_at = r->pos;
        r->pos += size;
        r->rows_read++;
        if (r->stopped) continue;
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
        if (r->open && r->raw_rows++ == 0) r->raw_from = row_at;
        if (out) return out;
    }
}

PyObject *Reader_run(Reader *r, PyObject *unused) {
    int need;
    PyObject *res = parse_some(r, &need);
    if (!res && need) Py_RETURN_NONE;
    return res;
}

/* libpq of the connection: the addresses of PQgetCopyData and PQfreemem in the very library
 * psycopg loaded, found by the caller (native.py opens it with RTLD_NOLOAD through ctypes). The
 * extension resolves no symbol itself: no dlopen/dlsym, whose GLIBC_2.34 versions would make the
 * wheel manylinux_2_34; it needs only libc symbols old enough for manylinux_2_17. */
typedef int (*get_copy_data_fn)(void *conn, char **buffer, int async);
typedef void (*freemem_fn)(void *ptr);
static get_copy_data_fn pq_get_copy_data = NULL;
static freemem_fn pq_freemem = NULL;

/* bind_libpq(get_copy_data, freemem): the two function addresses, as integers. */
PyObject *native_bind_libpq(PyObject *mod, PyObject *args) {
    PyObject *g_obj, *f_obj;
    if (!PyArg_ParseTuple(args, "OO:bind_libpq", &g_obj, &f_obj)) return NULL;
    void *g = PyLong_AsVoidPtr(g_obj);
    if (!g && PyErr_Occurred()) return NULL;
    void *f = PyLong_AsVoidPtr(f_obj);
    if (!f && PyErr_Occurred()) return NULL;
    if (!g || !f) { PyErr_SetString(PyExc_ValueError, "PQgetCopyData or PQfreemem address is NULL"); return NULL; }
    /* ISO C has no cast between object and function pointers; POSIX guarantees it works (as dlsym's does). */
    memcpy(&pq_get_copy_data, &g, sizeof g);
    memcpy(&pq_freemem, &f, sizeof f);
    Py_RETURN_NONE;
}

/* pump(pgconn_ptr): like run(), reading COPY data straight from libpq when it needs input.
 * ("eof",) when libpq has no more COPY data (psycopg then finishes the COPY and reports errors). */
PyObject *Reader_pump(Reader *r, PyObject *arg) {
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
