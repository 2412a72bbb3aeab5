/* INT8_MIN traits: fmt_int8_group.h compiled for the INT8_MIN row alone (unsigned codes u stored
 * as u - 128, w = s * u + min per (K group, channel): llama.cpp's Q5_K and Q5_1), so that
 * INT8_GROUP's tiles carry none of its epilogue.  Included by a skeleton instantiation; no
 * include guard. */
#define KT_I8G_MINS_ROW 1
#include "fmt_int8_group.h"
