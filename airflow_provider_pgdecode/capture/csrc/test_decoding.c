/*
 * Twin of airflow_provider_pgdecode/decoding/test_decoding.py: the scanner of the lines
 * test_decoding prints (BEGIN, COMMIT with its time, "table schema.name: OP: ..." rows with their
 * old-key and new tuples), with the same rules, appending values straight to the table buffers.
 * A row it cannot read, or any other kind of row, is UNUSUAL: the Python path parses it.
 */
#include "native.h"

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
    if (over_change_bound(r)) return UNUSUAL;                 /* past the batch bound: Python cuts */
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
int td_row(Reader *r, int64_t lsn, int64_t xid, int xid_null, const char *s, Py_ssize_t n, PyObject **out) {
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
        if (over_commit_bound(r, lsn)) return UNUSUAL;
        PyObject *res = commit_txn(r, lsn, ctime, ctime_valid);
        if (!res) return FAIL;
        if (res == Py_None) Py_DECREF(res);
        else *out = res;
        return OK;
    }
    return UNUSUAL;
}
