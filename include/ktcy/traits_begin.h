/* Opens a traits header: from the format's descriptor row (KT_ROW, set by the traits header)
 * the geometry every skeleton uses.  No include guard; traits_end.h closes it. */
#define KT_ACT KTCY_ROW_COL(ACT, KT_ROW)
#define KT_BB KTCY_ROW_COL(BLOCK_BYTES, KT_ROW)          /* bytes of one packed block */
#define KT_INT_ACT (KT_ACT == KTCY_ACT_INT8)
#define KT_KPR (KT_INT_ACT ? 4 : 2)                      /* K values per 32-bit lane of a block row */
#define KT_BK (KT_KPR * 16)                              /* K values per block */
#define KT_ASIZE (KT_INT_ACT ? 1 : 2)                    /* bytes per activation element */

/* The skeletons' accumulator types, by activation kind. */
#if KT_SKEL == KT_SKEL_AVX512
#if KT_INT_ACT
typedef __m512i KT_(acc_t);
#else
typedef __m512 KT_(acc_t);
#endif
#elif KT_SKEL == KT_SKEL_AVX2
typedef __m256i KT_(acc_t);  /* int32 lanes, or float bits for bf16 activations */
#elif KT_SKEL == KT_SKEL_REF
#if KT_INT_ACT
typedef int32_t KT_(part_t);
#else
typedef float KT_(part_t);
#endif
#endif
