/* Group hooks of a format whose partial sums need no per-group scaling (one epilogue at the
 * end), for the vector skeletons.  Included by such a traits header; no include guard. */
KT_AI int KT_(has_groups)(const ktcy_weight *w) { (void)w; return 0; }
KT_AI int64_t KT_(group_at)(const ktcy_weight *w, int64_t kb, int r, int64_t nkb) {
    (void)w; (void)kb; (void)r; (void)nkb;
    return -1;
}
#if KT_SKEL == KT_SKEL_AVX512
KT_AI void KT_(group_epilogue)(KT_(acc_t) acc[6][4], __m512 facc[6][4], const int MB, const int NP,
                               const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p0, int64_t g) {
    (void)acc; (void)facc; (void)MB; (void)NP; (void)a; (void)w; (void)m0; (void)p0; (void)g;
}
#elif KT_SKEL == KT_SKEL_AVX2
KT_AI void KT_(group_epilogue)(__m256i acc[4][2], __m256 facc[4][2], const int MB, const int NP,
                               const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p, int64_t g) {
    (void)acc; (void)facc; (void)MB; (void)NP; (void)a; (void)w; (void)m0; (void)p; (void)g;
}
KT_AI __m256 KT_(group_scale)(const ktcy_weight *w, int64_t p, int64_t g, int h) {
    (void)w; (void)p; (void)g; (void)h;
    return _mm256_set1_ps(1.0f);
}
#endif
