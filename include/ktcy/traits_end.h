/* Closes one skeleton instantiation: every macro the skeleton and its traits header defined. */
#undef KT_ROW
#undef KT_FORMATS
#undef KT_ACT
#undef KT_BB
#undef KT_INT_ACT
#undef KT_KPR
#undef KT_BK
#undef KT_ASIZE
#undef KT_WKIND
#undef KT_PREDECODE
#undef KT_REG_DECODE
#undef KT_PLAIN_ROWS
#undef KT_SKEL
#undef KT_AI
#undef KT_
#undef KT_CAT
#undef KT_CAT_
