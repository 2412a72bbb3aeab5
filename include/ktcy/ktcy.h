/* Umbrella header for the Cython layer. */
#ifndef KTCY_H
#define KTCY_H
#include "act_quant.h"
#include "activation.h"
#include "cpu.h"
#include "numeric.h"
#include "pack.h"
#include "prefetch.h"
#include "quantize.h"
#include "registry.h"
#include "roofline.h"
#include "tile_emu.h"
#include "types.h"
#include "worklist.h"
#endif
