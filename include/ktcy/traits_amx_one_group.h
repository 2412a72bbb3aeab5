/* AMX group hooks of a format whose row is one group (group_len = k_pad): no column or row
 * factor.  Included by such a traits header for the AMX skeleton; no include guard. */
KT_AI void KT_(group_cols)(const ktcy_weight *w, int64_t p, int np, int64_t g, float *s) {
    (void)w; (void)p; (void)g;
    for (int j = 0; j < 16 * np; ++j) s[j] = 1.0f;
}
KT_AI float KT_(group_row)(const ktcy_act *a, int64_t m) { (void)a; (void)m; return 1.0f; }
