# MoE expert execution (included by _native.pyx).
#
# forward(x, ids, weights): group the T*k (token, expert) pairs by expert (counting sort), convert
# or quantize each token's activations once and gather them into per-expert row segments (each
# padded to 16 rows for AMX tiles), then in one OpenMP team:
#   1. work items (expert, about 8 output panels of I, 16 at decode; ktcy_split_panels): gate and
#      up GEMMs over the same rows (the activations stay in cache), SwiGLU on those columns;
#   2. per expert, by the thread that finishes its last gate and up item: quantize / convert
#      its SwiGLU rows for the down projection, then publish them (worklist.h);
#   3. work items (expert, about 8 output panels of H, 16 at decode): down GEMM, once the
#      expert's rows are published.
#   The items of 1 and 3 form one list, taken in order and one ahead (worklist.h), and each GEMM
#   is told the panels this thread multiplies next (gate -> up's same panels -> the next item's
#   gate, or the first down item's panels), which prefill's tiles fetch as they go and decode's
#   streams run on into.  A thread out of gate and up items goes on to the next down items
#   (whose experts are nearly always done by then) instead of waiting for the team at a barrier
#   (one item of up to 1.5 MB of weights at decode);
#   4. per token: y = sum_j w[t, j] * down_out[slot(t, j)], j in order (deterministic); or, when a
#      slot array is given, each product w[t, j] * down_out[slot(t, j)] on its own (the addends of
#      that sum: expert parallelism adds them up after an all-reduce, in the same order).
# Expert id -1 is a slot handled elsewhere (another rank, a GPU): no rows, no contribution.
# Per expert, rows >= big_min_rows run the prefill kernel (AMX when chosen), fewer rows the decode
# kernel (the best non-AMX ISA).  Buffers live in an arena sized for the call; one up to
# ARENA_KEEP_BYTES is kept for the next call (decode reuses it), a larger one (a long prefill)
# is released after its call instead of holding the memory for the layer's life.
#
# The activation kind (int8 codes + row scales + group sums, or bf16 bits) comes from the format
# descriptor: gate's and up's for the token rows, down's for the SwiGLU rows (down may have its
# own format and group, as a GGUF Q4_K_M layer's Q6_K down beside Q4_K gate and up); SwiGLU and
# the activation conversions run on the least capable ISA of the selected kernels (all their
# versions give the same bits).

from libc.string cimport memcpy
from cython.parallel cimport parallel

cdef enum:
    MOE_ITEM_PANELS = 8   # about this many output panels (x16 channels) per work item
    MOE_AMX_ITEM_PANELS = 24  # ...for experts on the AMX kernel (see __init__)
    MOE_DECODE_ITEM_PANELS = 48  # the same for experts of a few rows (decode)...
    MOE_DECODE_ITEM_BYTES = 1536 * 1024  # ...but no more packed bytes than this, nor under 16 panels
    MOE_DECODE_ITEMS_PER_THREAD = 4  # decode items are smaller where a phase would give fewer
    MOE_STREAM_ROWS = 4   # experts with at most this many rows take decode-sized items

ARENA_KEEP_BYTES = 256 << 20

_ISA_RANK = {"ref": 0, "amx_emu": 0, "avx2": 1, "avx512": 2, "amx": 2}

cdef int _layer_need(str isa_a, str isa_b):
    """The KTCY_NEED_* bit (AVX-512, AVX2 or none) of the less capable of the two ISAs a layer
    runs: its SwiGLU and activation conversions run there (all their versions give the same
    bits; ref and amx_emu take the portable C)."""
    rank = min(_ISA_RANK[isa_a], _ISA_RANK[isa_b])
    return KTCY_NEED_AVX512 if rank == 2 else KTCY_NEED_AVX2 if rank == 1 else 0

cdef ktcy_swiglu_fn _swiglu_for(int need):
    if need & KTCY_NEED_AVX512:
        return ktcy_swiglu_avx512
    if need & KTCY_NEED_AVX2:
        return ktcy_swiglu_avx2
    return ktcy_swiglu_ref

cdef ktcy_glu_clamped_fn _glu_clamped_for(int need):
    """GPT-OSS's clamped GLU."""
    if need & KTCY_NEED_AVX512:
        return ktcy_glu_clamped_avx512
    if need & KTCY_NEED_AVX2:
        return ktcy_glu_clamped_avx2
    return ktcy_glu_clamped_ref

ACTIVATIONS = ("silu", "gpt_oss")

cdef const float *_bias_rows(object a, int rows, int64_t cols, str what) except? NULL:
    """Pointer to a float32 [rows, cols] C-contiguous array, or NULL for None."""
    cdef const float[:, ::1] v
    if a is None:
        return NULL
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (rows, cols) or not a.flags.c_contiguous:
        raise ValueError(f"{what} bias must be a C-contiguous float32 array of shape {(rows, cols)}")
    v = a
    return &v[0, 0]

cdef inline int64_t _round16(int64_t m) noexcept nogil:
    return (m + 15) // 16 * 16

cdef inline int64_t _decode_per(int64_t panels, int64_t panel_bytes, int64_t active, int nthreads,
                                int64_t most_parts) noexcept nogil:
    """Panels per decode item of a matrix with `panels` panels of `panel_bytes` packed bytes each,
    `active` experts routed to."""
    cdef int64_t target = min(MOE_DECODE_ITEM_PANELS, max(16, MOE_DECODE_ITEM_BYTES // max(panel_bytes, 1)))
    cdef int64_t parts = (panels + target - 1) // target
    cdef int64_t balanced = (MOE_DECODE_ITEMS_PER_THREAD * nthreads + active - 1) // max(active, 1)
    if balanced > parts:
        parts = balanced
    if parts > most_parts:  # the item buffers hold the prefill split's count
        parts = most_parts
    return ktcy_split_panels(panels, parts)


cdef inline int _expert_gemm(ktcy_gemm_fn fn, const ktcy_weight *w, float *y, int64_t ldy, int64_t p0,
                             int64_t p1, void *scratch, int64_t m, int64_t k_pad, int group, const int8_t *q,
                             const float *scale, const int32_t *gsum, const uint16_t *bf16,
                             const ktcy_weight *next_w, int64_t next_p0, int64_t next_p1,
                             int rows_in_scratch=0) noexcept nogil:
    """One expert's rows [m] through panels [p0, p1); the descriptor is a local of this call.
    next_w (or NULL): the weight whose panels [next_p0, next_p1) this thread multiplies next.
    rows_in_scratch: the call before on this scratch was fn on the same rows (gate, then up)."""
    cdef ktcy_act act
    memset(&act, 0, sizeof(ktcy_act))
    act.m, act.m_pad, act.k_pad, act.group = m, _round16(m), k_pad, group
    act.q, act.scale, act.group_sum, act.bf16 = q, scale, gsum, bf16
    act.next_w, act.next_pb, act.next_pe = next_w, next_p0, next_p1
    act.rows_in_scratch = rows_in_scratch
    _set_tile_choices(&act)
    return fn(&act, w, y, ldy, p0, p1, scratch)


cdef class MoEEngine:
    # gate and up share a format (they multiply the same activations); down may have its own
    # (a GGUF Q4_K_M layer: Q4_K gate and up, Q6_K down), with its own activation kind and group
    cdef int fmt, num_experts, group, integer, fmt_d, group_d, integer_d
    cdef int64_t hidden, inter, kpad_h, kpad_i
    cdef ktcy_weight *gate_w
    cdef ktcy_weight *up_w
    cdef ktcy_weight *down_w
    cdef ktcy_gemm_fn big_fn, small_fn, big_fn_d, small_fn_d
    cdef ktcy_swiglu_fn swiglu
    cdef ktcy_quant_act_fn quant_act
    # MXFP4_A8's block sums (act_quant.h) of the gate/up and the down activations; NULL for the others
    cdef ktcy_e2m1_starts_fn e2m1_starts, e2m1_starts_d
    cdef ktcy_bf16_act_fn bf16_act
    cdef ktcy_glu_clamped_fn glu_clamped
    cdef int activation
    cdef bint busy  # a forward is running (see forward)
    cdef float alpha, limit
    cdef const float *bias_gate
    cdef const float *bias_up
    cdef const float *bias_down
    cdef object biases
    cdef int64_t min_rows, min_rows_d  # rows from which an expert's GEMMs take the big kernel
    cdef object keep
    cdef int64_t arena_rows, arena_tokens, arena_slots, arena_threads, arena_nbytes
    # the arena: typed views of its arrays (they keep them alive), taken when it is built rather
    # than on every call
    cdef int8_t[:, ::1] a_xq, a_q1, a_q2
    cdef float[::1] a_xs, a_s1, a_s2
    cdef int32_t[:, ::1] a_xg, a_g1, a_g2
    cdef uint16_t[:, ::1] a_xb, a_b1, a_b2
    cdef float[:, ::1] a_gate, a_up, a_down
    cdef uint8_t[::1] a_scratch
    cdef int64_t[::1] a_row_token, a_slot
    cdef uint8_t[:, ::1] a_messages
    # the routing's bookkeeping, sized by the expert count once: a call allocates nothing
    cdef int64_t per_i, per_h, items_i, items_h, amx_per_i, amx_per_h
    cdef bint big_on_amx, big_on_amx_d
    cdef int ready  # __init__ finished: the buffers above exist
    cdef bint made  # __init__ began (once only)
    cdef int64_t[::1] counts, seg, fill, pending
    cdef int64_t[::1] ids_taken  # the call's topk_ids, copied as they are checked
    cdef int32_t[::1] published
    cdef int64_t[:, ::1] items1, items2
    cdef int[::1] status

    def __cinit__(self):
        self.gate_w = self.up_w = self.down_w = NULL

    def __dealloc__(self):
        free(self.gate_w)
        free(self.up_w)
        free(self.down_w)

    def __init__(self, str format_name, list gate, list up, list down, str big_variant, str small_variant,
                 int64_t big_min_rows, dict bias=None, str activation="silu", float alpha=1.702, float limit=7.0,
                 str down_format=None, str down_big=None, str down_small=None, down_min_rows=None):
        """format_name, big_variant, small_variant, big_min_rows: gate's and up's; down_*: the down
        projection's (None: the same)."""
        cdef int e, E = len(gate)
        cdef Weight g, d
        _made_once(self.made, "MoEEngine")  # its buffers are sized by the first call's experts
        self.made = True
        down_format = format_name if down_format is None else down_format
        down_big = big_variant if down_big is None else down_big
        down_small = small_variant if down_small is None else down_small
        self.fmt, self.fmt_d = _format_index(format_name), _format_index(down_format)
        self.integer = ktcy_format(self.fmt).act == KTCY_ACT_INT8
        self.integer_d = ktcy_format(self.fmt_d).act == KTCY_ACT_INT8
        if E < 1 or len(up) != E or len(down) != E:
            raise ValueError(f"gate/up/down hold {len(gate)}/{len(up)}/{len(down)} experts; need the same count >= 1")
        g, d = gate[0], down[0]
        for name, ws, shape, fmt, group in (("gate", gate, (g.view.n, g.view.k), self.fmt, g.view.group),
                                            ("up", up, (g.view.n, g.view.k), self.fmt, g.view.group),
                                            ("down", down, (g.view.k, g.view.n), self.fmt_d, d.view.group)):
            for e in range(E):
                w = <Weight?>ws[e]
                if w.fmt != fmt or w.shape != shape or w.group != group:
                    raise ValueError(f"{name}[{e}] is {FORMATS[w.fmt]} {w.shape} group {w.group}; the layer's {name} is "
                                     f"{FORMATS[fmt]} {shape} group {group}")
        self.num_experts = E
        self.keep = (gate, up, down)
        cdef int vb = _variant_index(format_name, big_variant), vs = _variant_index(format_name, small_variant)
        cdef int vbd = _variant_index(down_format, down_big), vsd = _variant_index(down_format, down_small)
        self.big_fn, self.small_fn = KTCY_VARIANTS[vb].fn, KTCY_VARIANTS[vs].fn
        self.big_fn_d, self.small_fn_d = KTCY_VARIANTS[vbd].fn, KTCY_VARIANTS[vsd].fn
        isas = [ISAS[KTCY_VARIANTS[v].isa] for v in (vb, vs, vbd, vsd)]
        # SwiGLU and the conversions run on the least capable ISA of the four (the same bits anywhere)
        least = min(isas, key=_ISA_RANK.get)
        need = _layer_need(least, least)
        self.swiglu = _swiglu_for(need)
        self.quant_act = _quant_act_for(need)
        self.e2m1_starts = _e2m1_starts_for(need) if self.fmt == KTCY_FMT_MXFP4_A8 else NULL
        self.e2m1_starts_d = _e2m1_starts_for(need) if self.fmt_d == KTCY_FMT_MXFP4_A8 else NULL
        self.bf16_act = _bf16_act_for(need)
        self.glu_clamped = _glu_clamped_for(need)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: choose one of {', '.join(ACTIVATIONS)}")
        self.activation, self.alpha, self.limit = ACTIVATIONS.index(activation), alpha, limit
        self.min_rows = big_min_rows
        self.min_rows_d = big_min_rows if down_min_rows is None else down_min_rows
        self.gate_w = <ktcy_weight *>malloc(E * sizeof(ktcy_weight))
        self.up_w = <ktcy_weight *>malloc(E * sizeof(ktcy_weight))
        self.down_w = <ktcy_weight *>malloc(E * sizeof(ktcy_weight))
        if self.gate_w == NULL or self.up_w == NULL or self.down_w == NULL:
            raise MemoryError()
        for e in range(E):
            self.gate_w[e] = (<Weight>gate[e]).view
            self.up_w[e] = (<Weight>up[e]).view
            self.down_w[e] = (<Weight>down[e]).view
        self.inter, self.hidden, self.group, self.group_d = g.view.n, g.view.k, g.view.group, d.view.group
        bias = dict(bias or {})  # its own dict: the caller's may change, the arrays below stay held
        if set(bias) - {"gate", "up", "down"}:
            raise ValueError(f"bias keys must be gate, up, down; got {sorted(bias)}")
        self.biases = bias
        self.bias_gate = _bias_rows(bias.get("gate"), E, self.inter, "gate")
        self.bias_up = _bias_rows(bias.get("up"), E, self.inter, "up")
        self.bias_down = _bias_rows(bias.get("down"), E, self.hidden, "down")
        self.kpad_h = g.view.k_pad
        self.kpad_i = (<Weight>down[0]).view.k_pad
        self._drop_arena()
        # work items split each expert's panels evenly (ktcy_split_panels, as the GEMM driver
        # does): about MOE_ITEM_PANELS per item; decode's are larger (_decode_per), where an
        # item's fixed costs (two GEMM calls, their set-up, the streams' switch) weigh on a
        # single row (with a few rows per expert, T=32, larger items were up to 1.1x slower)
        panels_i, panels_h = ktcy_n_pad(self.inter) // KTCY_PANEL, ktcy_n_pad(self.hidden) // KTCY_PANEL
        self.per_i = ktcy_split_panels(panels_i, (panels_i + MOE_ITEM_PANELS - 1) // MOE_ITEM_PANELS)
        self.per_h = ktcy_split_panels(panels_h, (panels_h + MOE_ITEM_PANELS - 1) // MOE_ITEM_PANELS)
        self.items_i = (panels_i + self.per_i - 1) // self.per_i  # the larger counts: buffers fit both
        self.items_h = (panels_h + self.per_h - 1) // self.per_h
        # Experts on the AMX kernel take items three times larger: each GEMM call there packs its
        # rows into tile order and its panel pairs' weights start a stream cold, and larger items
        # do that a third as often (a Xeon with AMX, 128 experts of about 32 rows, 2 threads:
        # INT8 T = 512 0.93x the time; AVX-512 experts, with AMX off, gained 2-4%, not measured
        # on AMD: they keep theirs).  amx_emu runs the same split, so hosts without AMX test it.
        self.big_on_amx, self.big_on_amx_d = isas[0] in ("amx", "amx_emu"), isas[2] in ("amx", "amx_emu")
        self.amx_per_i = ktcy_split_panels(panels_i, (panels_i + MOE_AMX_ITEM_PANELS - 1) // MOE_AMX_ITEM_PANELS)
        self.amx_per_h = ktcy_split_panels(panels_h, (panels_h + MOE_AMX_ITEM_PANELS - 1) // MOE_AMX_ITEM_PANELS)
        self.counts, self.seg, self.fill = np.zeros(E, np.int64), np.zeros(E + 1, np.int64), np.zeros(E, np.int64)
        self.pending, self.published = np.zeros(E, np.int64), np.zeros(E, np.int32)  # per expert, phase 1 -> 3
        self.items1 = np.zeros((E * self.items_i, 3), np.int64)
        self.items2 = np.zeros((E * self.items_h, 3), np.int64)
        self.status = np.zeros(E * (self.items_i + self.items_h) + 1, np.int32)
        self.ready = 1

    @property
    def big_min_rows(self):
        """Rows from which an expert's gate and up GEMMs take the big (prefill) kernel; setting it
        sets the down projection's too (big_min_rows_down after that for its own)."""
        return self.min_rows

    @big_min_rows.setter
    def big_min_rows(self, int64_t rows):
        self.min_rows = self.min_rows_d = rows

    @property
    def big_min_rows_down(self):
        return self.min_rows_d

    @big_min_rows_down.setter
    def big_min_rows_down(self, int64_t rows):
        self.min_rows_d = rows

    cdef _drop_arena(self):
        self.arena_nbytes = 0
        self.arena_rows = self.arena_tokens = self.arena_slots = self.arena_threads = -1
        self.a_xq = self.a_q1 = self.a_q2 = None
        self.a_xs = self.a_s1 = self.a_s2 = None
        self.a_xg = self.a_g1 = self.a_g2 = None
        self.a_xb = self.a_b1 = self.a_b2 = None
        self.a_gate = self.a_up = self.a_down = None
        self.a_scratch = None
        self.a_row_token = self.a_slot = None
        self.a_messages = None

    cdef _ensure_arena(self, int64_t tokens, int64_t rows, int64_t slots, int threads):
        scratch_bytes = ktcy_gemm_scratch_bytes(max(self.kpad_h, self.kpad_i))
        if tokens <= self.arena_tokens and rows <= self.arena_rows and slots <= self.arena_slots \
                and threads <= self.arena_threads:
            return
        tokens, rows = max(tokens, self.arena_tokens, 1), max(rows, self.arena_rows, 16)
        slots, threads = max(slots, self.arena_slots, 1), max(threads, self.arena_threads, 1)
        gh = self.kpad_h // self.group if self.group else 1
        gi = self.kpad_i // self.group_d if self.group_d else 1
        a = {}
        if self.integer:
            a["xq"], a["xs"], a["xg"] = np.zeros((tokens, self.kpad_h), np.int8), np.zeros(tokens, np.float32), np.zeros((tokens, gh), np.int32)
            a["q1"], a["s1"], a["g1"] = np.zeros((rows, self.kpad_h), np.int8), np.zeros(rows, np.float32), np.zeros((rows, gh), np.int32)
        else:
            a["xb"] = np.zeros((tokens, self.kpad_h), np.uint16)
            a["b1"] = np.zeros((rows, self.kpad_h), np.uint16)
        if self.integer_d:
            a["q2"], a["s2"], a["g2"] = np.zeros((rows, self.kpad_i), np.int8), np.zeros(rows, np.float32), np.zeros((rows, gi), np.int32)
        else:
            a["b2"] = np.zeros((rows, self.kpad_i), np.uint16)
        a["gate"] = np.zeros((rows, self.inter), np.float32)
        a["up"] = np.zeros((rows, self.inter), np.float32)
        a["down"] = np.zeros((rows, self.hidden), np.float32)
        a["scratch"] = np.empty(threads * scratch_bytes, np.uint8)  # per-thread GEMM scratch
        a["row_token"], a["slot"] = np.empty(rows, np.int64), np.empty(slots, np.int64)
        a["messages"] = np.zeros((threads, 160), np.uint8)  # one per thread: no shared buffer
        self._drop_arena()
        self.arena_tokens, self.arena_rows, self.arena_slots = tokens, rows, slots
        self.arena_threads, self.arena_nbytes = threads, sum(v.nbytes for v in a.values())
        if self.integer:
            self.a_xq, self.a_xs, self.a_xg = a["xq"], a["xs"], a["xg"]
            self.a_q1, self.a_s1, self.a_g1 = a["q1"], a["s1"], a["g1"]
        else:
            self.a_xb, self.a_b1 = a["xb"], a["b1"]
        if self.integer_d:
            self.a_q2, self.a_s2, self.a_g2 = a["q2"], a["s2"], a["g2"]
        else:
            self.a_b2 = a["b2"]
        self.a_gate, self.a_up, self.a_down = a["gate"], a["up"], a["down"]
        self.a_scratch, self.a_messages = a["scratch"], a["messages"]
        self.a_row_token, self.a_slot = a["row_token"], a["slot"]

    def arena_bytes(self):
        return self.arena_nbytes

    cdef _release_large_arena(self):
        if self.arena_nbytes > ARENA_KEEP_BYTES:
            self._drop_arena()

    def forward(self, const float[:, ::1] x, const int64_t[:, ::1] ids, const float[:, ::1] rw, float[:, ::1] out,
                int nthreads, float[:, :, ::1] slots=None):
        """One call at a time: every call reuses the engine's buffers and arena (and may replace
        the arena) while its threads run without the GIL, so a second caller would free or
        rewrite memory under the first.  ktcy.MoE holds a lock; this refuses what gets past one."""
        if not self.ready:
            raise RuntimeError("MoEEngine.forward before __init__")
        if self.busy:
            raise RuntimeError("MoEEngine.forward is already running on another thread (one call per engine at a "
                               "time; ktcy.MoE serializes its calls)")
        self.busy = True  # checked and set with the GIL held: no other thread runs in between
        try:
            self._forward(x, ids, rw, out, nthreads, slots)
        finally:
            self.busy = False

    cdef _forward(self, const float[:, ::1] x, const int64_t[:, ::1] ids, const float[:, ::1] rw,
                  float[:, ::1] out, int nthreads, float[:, :, ::1] slots):
        cdef int64_t T = ids.shape[0], k = ids.shape[1], S = T * k
        cdef int E = self.num_experts, e
        cdef int64_t t, j, r, s, i, c, rows = 0, n_items1, n_items2, eid
        cdef int integer = self.integer, integer_d = self.integer_d
        cdef int group = self.group, group_d = self.group_d
        cdef int64_t H = self.hidden, I = self.inter, kh = self.kpad_h, ki = self.kpad_i
        cdef int64_t gh = kh // self.group if self.group else 1
        cdef int64_t panels_i = ktcy_n_pad(I) // KTCY_PANEL, panels_h = ktcy_n_pad(H) // KTCY_PANEL
        cdef int64_t per_i = self.per_i, per_h = self.per_h, active = 0, small_i, small_h, pe_i, pe_h
        if T == 0:
            return
        cdef int per_slot = slots is not None
        if x.shape[0] != T or x.shape[1] != H or rw.shape[0] != T or rw.shape[1] != k \
                or out.shape[0] != T or out.shape[1] != H:
            raise ValueError("x, ids, weights and out disagree in shape")
        if per_slot and (slots.shape[0] != T or slots.shape[1] != k or slots.shape[2] != H):
            raise ValueError("the slot array must be [T, k, H]")
        if nthreads < 1:
            raise ValueError(f"thread count must be >= 1, got {nthreads}")
        nthreads = _team(nthreads)
        # Counting sort of the (token, expert) pairs, in plain loops over buffers kept from call
        # to call: numpy calls and fresh arrays here cost a decode call 10-15 us (2-3% of it).
        # The ids are read once, into a copy the later passes read: the caller's array may change
        # meanwhile (another thread runs while the arena's allocation below releases the GIL), and
        # ids other than those counted would write rows past their expert's segment.
        if self.ids_taken is None or self.ids_taken.shape[0] < S:
            self.ids_taken = np.empty(max(S, 64), np.int64)
        cdef int64_t[::1] cnt = self.counts, segv = self.seg, fillv = self.fill, ids_copy = self.ids_taken
        for e in range(E):
            cnt[e] = 0
        for t in range(T):
            for j in range(k):
                eid = ids[t, j]
                if eid < -1 or eid >= E:
                    raise ValueError(f"topk_ids holds expert id {eid}, outside [0, {E}) (-1 skips a slot)")
                ids_copy[t * k + j] = eid
                if eid >= 0:
                    cnt[eid] += 1
        for e in range(E):
            active += cnt[e] > 0
        # Experts of a few rows (all of them in decode) stream their panels once per call: whole
        # matrices per item (16-panel items took 1.02-1.09x the time of 48-panel ones at T=1-2,
        # 2 threads) unless a thread would get fewer than a few items
        cdef const ktcy_format_desc *desc = ktcy_format(self.fmt)
        cdef const ktcy_format_desc *desc_d = ktcy_format(self.fmt_d)
        small_i = _decode_per(panels_i, kh // desc.block_k * desc.block_bytes, active, nthreads, self.items_i)
        small_h = _decode_per(panels_h, ki // desc_d.block_k * desc_d.block_bytes, active, nthreads, self.items_h)
        segv[0] = 0
        for e in range(E):
            segv[e + 1] = segv[e] + _round16(cnt[e])
        rows = segv[E]
        if rows == 0:  # every slot is -1: nothing routed here
            if per_slot:
                slots[...] = 0
            else:
                out[...] = 0
            return
        self._ensure_arena(T, rows, S, nthreads)
        cdef int64_t[::1] rtok = self.a_row_token, slotv = self.a_slot
        for r in range(rows):
            rtok[r] = -1
        for e in range(E):
            fillv[e] = segv[e]
        for t in range(T):
            for j in range(k):
                e = <int>ids_copy[t * k + j]
                if e < 0:
                    slotv[t * k + j] = -1
                    continue
                slotv[t * k + j] = fillv[e]
                rtok[fillv[e]] = t
                fillv[e] += 1
        # work items: (expert, first panel, end panel) for both GEMM phases
        cdef int64_t[:, ::1] it1 = self.items1, it2 = self.items2
        cdef int64_t[::1] pend = self.pending
        cdef int32_t[::1] pub = self.published
        c = 0
        s = 0
        for e in range(E):
            pend[e] = 0
            pub[e] = 0
            if cnt[e] == 0:
                continue
            pe_i = small_i if cnt[e] <= MOE_STREAM_ROWS else per_i
            pe_h = small_h if cnt[e] <= MOE_STREAM_ROWS else per_h
            if self.big_on_amx and cnt[e] >= self.min_rows:
                pe_i = self.amx_per_i
            if self.big_on_amx_d and cnt[e] >= self.min_rows_d:
                pe_h = self.amx_per_h
            for i in range(0, panels_i, pe_i):
                it1[c, 0], it1[c, 1], it1[c, 2] = e, i, min(i + pe_i, panels_i)
                c += 1
                pend[e] += 1
            for i in range(0, panels_h, pe_h):
                it2[s, 0], it2[s, 1], it2[s, 2] = e, i, min(i + pe_h, panels_h)
                s += 1
        n_items1, n_items2 = c, s
        cdef int8_t[:, ::1] xq, q1, q2
        cdef float[::1] xs, s1, s2
        cdef int32_t[:, ::1] xg, g1, g2
        cdef uint16_t[:, ::1] xb, b1, b2
        if integer:
            xq, xs, xg, q1, s1, g1 = self.a_xq, self.a_xs, self.a_xg, self.a_q1, self.a_s1, self.a_g1
        else:
            xb, b1 = self.a_xb, self.a_b1
        if integer_d:
            q2, s2, g2 = self.a_q2, self.a_s2, self.a_g2
        else:
            b2 = self.a_b2
        cdef float[:, ::1] hg = self.a_gate, hu = self.a_up, hd = self.a_down
        cdef int64_t scratch_bytes = ktcy_gemm_scratch_bytes(max(kh, ki))
        cdef char *scratch = <char *>&self.a_scratch[0]
        cdef int[::1] st = self.status
        for c in range(n_items1 + n_items2 + 1):
            st[c] = KTCY_OK
        cdef uint8_t[:, ::1] msg = self.a_messages
        for r in range(nthreads):
            msg[r, 0] = 0
        cdef int64_t m, p0, p1, seg0, col, col_end, tid, base
        cdef float wgt
        cdef ktcy_swiglu_fn swiglu = self.swiglu
        cdef ktcy_quant_act_fn quant_act = self.quant_act
        cdef ktcy_bf16_act_fn bf16_act = self.bf16_act
        cdef ktcy_glu_clamped_fn glu_clamped = self.glu_clamped
        cdef int clamped = self.activation == 1
        cdef ktcy_e2m1_starts_fn e2m1_starts = self.e2m1_starts, e2m1_starts_d = self.e2m1_starts_d
        cdef int quant_group = 0 if e2m1_starts != NULL else group  # its block sums have their own form
        cdef int quant_group_d = 0 if e2m1_starts_d != NULL else group_d
        cdef float alpha = self.alpha, limit = self.limit
        cdef const float *bg = self.bias_gate
        cdef const float *bu = self.bias_up
        cdef const float *bd = self.bias_down
        cdef int64_t cc, cn, team_slot, taken = 0, np0, np1, n_items = n_items1 + n_items2
        # Taking items one ahead costs balance where a phase has few items per thread (a thread
        # may hold one while another idles): decode on many cores keeps the plain schedule.  The
        # choice is the current item's phase's.
        cdef int ahead1 = n_items1 >= 4 * nthreads
        cdef int ahead2 = n_items2 >= 4 * nthreads
        cdef int ahead
        cdef ktcy_gemm_fn fn
        cdef char *my_scratch
        cdef const ktcy_weight *next_w
        # Each phase below reads what other threads wrote in the one before.  Cython ends every
        # prange of a parallel block with nowait; what orders the phases is the barrier each loop
        # begins with, because its index is both firstprivate and lastprivate (GCC and Clang wait
        # for every thread's firstprivate copy before any lastprivate write-back).  Explicit
        # barriers on top cost 1-2 us a call here (3 of them, 2 threads: a tiny layer's T = 1 call
        # took 1.09-1.16x the time), more on many-core hosts, for no change in order.
        with nogil, parallel(num_threads=nthreads):
            tid = openmp.omp_get_thread_num()
            my_scratch = scratch + tid * scratch_bytes
            # 0. convert every token once, then gather its rows into the expert segments
            for t in prange(T, schedule="static"):
                if integer:
                    quant_act(&x[0, 0], H, H, kh, t, t + 1, &xq[0, 0], &xs[0], quant_group, &xg[0, 0])
                    if e2m1_starts != NULL:
                        e2m1_starts(&xq[0, 0], kh, t, t + 1, &xg[0, 0])
                else:
                    bf16_act(&x[0, 0], H, H, kh, t, t + 1, &xb[0, 0])
            for r in prange(rows, schedule="static"):
                t = rtok[r]
                if t >= 0:
                    if integer:
                        memcpy(&q1[r, 0], &xq[t, 0], kh)
                        s1[r] = xs[t]
                        memcpy(&g1[r, 0], &xg[t, 0], gh * sizeof(int32_t))
                    else:
                        memcpy(&b1[r, 0], &xb[t, 0], kh * sizeof(uint16_t))
            # 1-3. one list: gate and up items (SwiGLU on their columns; an expert's last one
            # readies its rows for the down projection), then down items, each waiting for its
            # expert's rows.  Items are taken one ahead where that pays (worklist.h), so each
            # GEMM is told what this thread multiplies next.
            for team_slot in prange(nthreads, schedule="static", chunksize=1):
                c = ktcy_take(&taken)
                while c < n_items:
                    ahead = ahead1 if c < n_items1 else ahead2
                    cn = ktcy_take(&taken) if ahead else n_items  # n_items: not taken yet
                    next_w = NULL
                    np0 = np1 = 0
                    if cn < n_items1:
                        next_w = &self.gate_w[it1[cn, 0]]
                        np0 = it1[cn, 1]
                        np1 = it1[cn, 2]
                    elif cn < n_items:
                        next_w = &self.down_w[it2[cn - n_items1, 0]]
                        np0 = it2[cn - n_items1, 1]
                        np1 = it2[cn - n_items1, 2]
                    if c < n_items1:
                        e = <int>it1[c, 0]
                        p0 = it1[c, 1]
                        p1 = it1[c, 2]
                        seg0 = segv[e]
                        m = cnt[e]
                        fn = self.big_fn if m >= self.min_rows else self.small_fn
                        if integer:
                            st[c] = _expert_gemm(fn, &self.gate_w[e], &hg[seg0, 0], I, p0, p1, my_scratch, m, kh,
                                                 group, &q1[seg0, 0], &s1[seg0], &g1[seg0, 0], NULL, &self.up_w[e],
                                                 p0, p1)
                            st[c] |= _expert_gemm(fn, &self.up_w[e], &hu[seg0, 0], I, p0, p1, my_scratch, m, kh,
                                                  group, &q1[seg0, 0], &s1[seg0], &g1[seg0, 0], NULL, next_w, np0,
                                                  np1, 1)
                        else:
                            st[c] = _expert_gemm(fn, &self.gate_w[e], &hg[seg0, 0], I, p0, p1, my_scratch, m, kh, 0,
                                                 NULL, NULL, NULL, &b1[seg0, 0], &self.up_w[e], p0, p1)
                            st[c] |= _expert_gemm(fn, &self.up_w[e], &hu[seg0, 0], I, p0, p1, my_scratch, m, kh, 0,
                                                  NULL, NULL, NULL, &b1[seg0, 0], next_w, np0, np1, 1)
                        if st[c] != KTCY_OK:
                            _take_message(st[c], <char *>&msg[tid, 0])
                        col_end = p1 * KTCY_PANEL
                        if col_end > I:
                            col_end = I
                        col = p0 * KTCY_PANEL
                        for r in range(seg0, seg0 + m):
                            if bg != NULL:
                                for cc in range(col, col_end):
                                    hg[r, cc] = hg[r, cc] + bg[e * I + cc]
                            if bu != NULL:
                                for cc in range(col, col_end):
                                    hu[r, cc] = hu[r, cc] + bu[e * I + cc]
                            if clamped:
                                glu_clamped(&hg[r, col], &hu[r, col], col_end - col, alpha, limit)
                            else:
                                swiglu(&hg[r, col], &hu[r, col], col_end - col)
                        # 2. (whatever the status: a down item waits for this).  One thread converts
                        # the expert's rows: O(rows x I) against its GEMMs' O(rows x I x H).
                        if ktcy_finish_item(&pend[e]) == 0:
                            if integer_d:
                                quant_act(&hg[0, 0], I, I, ki, seg0, seg0 + m, &q2[0, 0], &s2[0], quant_group_d,
                                          &g2[0, 0])
                                if e2m1_starts_d != NULL:
                                    e2m1_starts_d(&q2[0, 0], ki, seg0, seg0 + m, &g2[0, 0])
                            else:
                                bf16_act(&hg[0, 0], I, I, ki, seg0, seg0 + m, &b2[0, 0])
                            ktcy_publish(&pub[e])
                    else:
                        # 3. down
                        e = <int>it2[c - n_items1, 0]
                        p0 = it2[c - n_items1, 1]
                        p1 = it2[c - n_items1, 2]
                        seg0 = segv[e]
                        m = cnt[e]
                        fn = self.big_fn_d if m >= self.min_rows_d else self.small_fn_d
                        ktcy_wait_published(&pub[e])
                        if integer_d:
                            st[c] = _expert_gemm(fn, &self.down_w[e], &hd[seg0, 0], H, p0, p1, my_scratch, m, ki,
                                                 group_d, &q2[seg0, 0], &s2[seg0], &g2[seg0, 0], NULL, next_w, np0,
                                                 np1)
                        else:
                            st[c] = _expert_gemm(fn, &self.down_w[e], &hd[seg0, 0], H, p0, p1, my_scratch, m, ki, 0,
                                                 NULL, NULL, NULL, &b2[seg0, 0], next_w, np0, np1)
                        if st[c] != KTCY_OK:
                            _take_message(st[c], <char *>&msg[tid, 0])
                        if bd != NULL:
                            col_end = p1 * KTCY_PANEL
                            if col_end > H:
                                col_end = H
                            for r in range(seg0, seg0 + m):
                                for cc in range(p0 * KTCY_PANEL, col_end):
                                    hd[r, cc] = hd[r, cc] + bd[e * H + cc]
                    c = cn if ahead else ktcy_take(&taken)
            # 4. weighted sum per token, experts in routing order (or the products one by one)
            for t in prange(T, schedule="static"):
                if per_slot:
                    for j in range(k):
                        wgt = rw[t, j]
                        base = slotv[t * k + j]
                        for col in range(H):
                            slots[t, j, col] = wgt * hd[base, col] if base >= 0 else 0.0
                    continue
                for col in range(H):
                    out[t, col] = 0.0
                for j in range(k):
                    wgt = rw[t, j]
                    base = slotv[t * k + j]
                    if base < 0:
                        continue
                    for col in range(H):
                        out[t, col] = out[t, col] + wgt * hd[base, col]
        for c in range(n_items1 + n_items2):
            if st[c] != KTCY_OK:
                text = next((bytes(msg[r]).split(b"\0")[0] for r in range(nthreads) if msg[r, 0]), b"")
                self._release_large_arena()
                _raise_status(st[c], text)
        self._release_large_arena()


def swiglu(str isa, const float[::1] g, const float[::1] u, str activation="silu", float alpha=1.702,
           float limit=7.0):
    """The gated activation an engine on `isa` would run, silu(g) * u or GPT-OSS's clamped form
    (for tests: every version must give the same bits)."""
    if g.shape[0] != u.shape[0]:
        raise ValueError("g and u must have the same length")
    if isa not in _ISA_RANK:
        raise ValueError(f"unknown ISA {isa!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: choose one of {', '.join(ACTIVATIONS)}")
    cdef int needs = _layer_need(isa, isa)
    if needs & ~_satisfied:
        raise UnsupportedISAError(f"this CPU cannot run the {isa} activation")
    out = np.array(g, np.float32)
    cdef float[::1] ov = out
    cdef ktcy_swiglu_fn fn = _swiglu_for(needs)
    cdef ktcy_glu_clamped_fn clamped = _glu_clamped_for(needs)
    if out.shape[0] and activation == "silu":
        fn(&ov[0], &u[0], out.shape[0])
    elif out.shape[0]:
        clamped(&ov[0], &u[0], out.shape[0], alpha, limit)
    return out
