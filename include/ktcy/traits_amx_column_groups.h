/* AMX hooks of an int8-activation format whose groups carry only column factors (the weight's
 * group scales: group_cols) and whose output is the float sum times the row's activation scale
 * (INT4, INT4_ZP, INT4_MIN, INT8_GROUP).  Included by such a traits header for the AMX skeleton;
 * no include guard. */
KT_AI float KT_(group_row)(const ktcy_act *a, int64_t m) { (void)a; (void)m; return 1.0f; }
KT_AI float KT_(tile_group)(float acc, int32_t c, float r, float s) { (void)r; return acc + (float)c * s; }
KT_AI void KT_(final_cols)(const ktcy_weight *w, int64_t p, int np, float *t) {
    (void)w; (void)p;
    for (int j = 0; j < 16 * np; ++j) t[j] = 1.0f;
}
KT_AI float KT_(final_row)(const ktcy_act *a, int64_t m) { return a->scale[m]; }
KT_AI float KT_(tile_final)(float acc, float r, float t) { (void)t; return acc * r; }
