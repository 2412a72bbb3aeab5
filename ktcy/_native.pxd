# C declarations of include/ktcy/*.h used by the Cython layer.
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint64_t, uintptr_t

cdef extern from "ktcy/ktcy.h" nogil:
    ctypedef struct ktcy_cpu:
        int avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512dq
        int avx512_vnni, avx512_bf16, avx512_vbmi
        int amx_tile, amx_int8, amx_bf16
        int os_avx, os_avx512, os_amx, amx_permitted
        int amd
        int family
        char model_name[49]
    void ktcy_cpu_probe(ktcy_cpu *cpu)

    enum:
        KTCY_FMT_BF16, KTCY_FMT_INT8, KTCY_FMT_INT4, KTCY_FMT_FP8_PERCHANNEL, KTCY_FMT_FP8_BLOCK, KTCY_FMT_INT4_ZP, KTCY_FMT_MXFP4,
        KTCY_FMT_MXFP4_A8, KTCY_FMT_INT4_MIN, KTCY_FMT_INT8_GROUP, KTCY_FMT_INT8_MIN
        KTCY_NUM_FORMATS
        KTCY_CODE_S8, KTCY_CODE_U4, KTCY_CODE_BF16, KTCY_CODE_E4M3, KTCY_CODE_E2M1
        KTCY_ACT_INT8, KTCY_ACT_BF16
        KTCY_SCALE_NONE, KTCY_SCALE_CHANNEL, KTCY_SCALE_GROUP, KTCY_SCALE_BLOCK128, KTCY_SCALE_IN_BLOCK
        KTCY_E8M0_MIN, KTCY_E8M0_MAX
        KTCY_REF, KTCY_AVX2, KTCY_AVX512, KTCY_AMX, KTCY_AMX_EMU, KTCY_NUM_ISAS
        KTCY_OK, KTCY_ERR_TILE, KTCY_ERR_SCRATCH, KTCY_ERR_FORMAT
        KTCY_PANEL, KTCY_SCALE_BLOCK, KTCY_E2M1_SUB_K
        KTCY_ENABLE_AMX, KTCY_ENABLE_AVX512_VBMI, KTCY_ENABLE_AVX512_BF16
        KTCY_NEED_AVX2, KTCY_NEED_AVX512, KTCY_NEED_VNNI, KTCY_NEED_BF16, KTCY_NEED_VBMI
        KTCY_NEED_AMX_INT8, KTCY_NEED_AMX_BF16

    ctypedef struct ktcy_format_desc:
        const char *name
        int32_t code, block_k, block_bytes, act, scale, groups, zero_points, colsum, mins
    const ktcy_format_desc KTCY_FORMAT_DESCS[]
    const ktcy_format_desc *ktcy_format(int format)
    int ktcy_group_ok(int format, int group)
    int64_t ktcy_k_pad(int format, int64_t k, int group)
    int64_t ktcy_n_pad(int64_t n)
    int64_t ktcy_data_bytes(int format, int64_t n, int64_t k, int group)
    void ktcy_scale_shape(int format, int64_t n, int64_t k, int group, int64_t shape[2])
    void ktcy_zero_shape(int format, int64_t n, int64_t k, int group, int64_t shape[2])
    int64_t ktcy_colsum_count(int format, int64_t n)

    ctypedef struct ktcy_weight:
        int32_t format, group
        int64_t n, k, n_pad, k_pad
        const uint8_t *data
        const float *scale
        const int32_t *colsum
        const uint8_t *zero
        int32_t nan_codes

    ctypedef struct ktcy_tiles:
        int32_t one_panel_rows
        int32_t f32_rows
        int32_t i16_rows
        int32_t avx2_i16_rows
        int32_t e2m1_panel_rows
        int32_t fp8_fetch_l2
        int32_t wide_tiles
        int32_t fp8_normal_panels
        int32_t plain_fetch_l2

    ctypedef struct ktcy_act:
        int64_t m, m_pad, k_pad
        const int8_t *q
        const uint16_t *bf16
        const float *scale
        const int32_t *group_sum
        int32_t group
        const ktcy_weight *next_w
        int64_t next_pb, next_pe
        int32_t rows_in_scratch
        ktcy_tiles tiles

    ctypedef int (*ktcy_gemm_fn)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy,
                                 int64_t panel_begin, int64_t panel_end, void *scratch)

    ctypedef struct ktcy_variant:
        const char *name
        int formats, isa, needs
        ktcy_gemm_fn fn
    const ktcy_variant KTCY_VARIANTS[]
    int KTCY_NUM_VARIANTS
    int ktcy_satisfied_needs(const ktcy_cpu *c)
    ktcy_tiles ktcy_cpu_tiles(const ktcy_cpu *c)

    int64_t ktcy_gemm_scratch_bytes(int64_t k_pad)
    int64_t ktcy_split_panels(int64_t panels, int64_t parts)
    int64_t ktcy_take(int64_t *counter)
    int64_t ktcy_finish_item(int64_t *pending)
    void ktcy_publish(int32_t *flag)
    void ktcy_wait_published(const int32_t *flag)
    ctypedef struct ktcy_span:
        const uint8_t *at
        int64_t bytes
        int64_t panel_bytes
    ctypedef struct ktcy_ahead:
        uintptr_t at
        int64_t lines
    ktcy_ahead ktcy_ahead_share(ktcy_span next, int64_t tile, int64_t tiles, int64_t nkb)
    uintptr_t ktcy_stream_ahead(ktcy_span cont, int slot, const uint8_t *panel, int64_t kb, int64_t nkb,
                                int64_t ahead, int64_t block_bytes)

    uint16_t ktcy_f32_to_bf16(float f)
    uint16_t ktcy_e4m3_to_bf16(uint8_t b)
    int32_t ktcy_e4m3_any_nan(const uint8_t *codes, int64_t n)
    uint8_t ktcy_f32_to_e4m3(float f)
    uint16_t ktcy_mxfp4_to_bf16(uint8_t code, uint8_t e)

    int64_t ktcy_quantize_int8_rows(const float *w, int64_t ldw, int64_t k, int64_t n0, int64_t n1,
                                    int8_t *q, int64_t ldq, float *scale)
    int64_t ktcy_quantize_int4_rows(const float *w, int64_t ldw, int64_t k, int group, int64_t n0,
                                    int64_t n1, int8_t *q, int64_t ldq, float *scale, int64_t ld_scale)
    int64_t ktcy_quantize_int8_group_rows(const float *w, int64_t ldw, int64_t k, int group, int64_t n0,
                                          int64_t n1, int8_t *q, int64_t ldq, float *scale, int64_t ld_scale)
    int64_t ktcy_quantize_asym_rows(const float *w, int64_t ldw, int64_t k, int group, int64_t n0,
                                    int64_t n1, int8_t *q, int64_t ldq, float *scale, uint8_t *zero,
                                    float *mins, int64_t ld_scale, int top)
    int64_t ktcy_quantize_mxfp4_rows(const float *w, int64_t ldw, int64_t k, int64_t n0, int64_t n1,
                                     uint8_t *q, int64_t ldq, uint8_t *exps, int64_t ld_exp)
    int64_t ktcy_quantize_fp8_rows(const float *w, int64_t ldw, int64_t k, int64_t n0, int64_t n1,
                                   uint8_t *q, int64_t ldq, float *scale)
    int64_t ktcy_quantize_fp8_block_rows(const float *w, int64_t ldw, int64_t n, int64_t k, int64_t n0,
                                         uint8_t *q, int64_t ldq, float *scale_inv)
    ctypedef void (*ktcy_quant_act_fn)(const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0,
                                       int64_t m1, int8_t *q, float *scale, int group, int32_t *gsum)
    void ktcy_quantize_act_int8(const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0,
                                int64_t m1, int8_t *q, float *scale, int group, int32_t *gsum)
    void ktcy_quantize_act_int8_avx2(const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0,
                                     int64_t m1, int8_t *q, float *scale, int group, int32_t *gsum)
    void ktcy_quantize_act_int8_avx512(const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0,
                                       int64_t m1, int8_t *q, float *scale, int group, int32_t *gsum)
    ctypedef void (*ktcy_e2m1_starts_fn)(const int8_t *q, int64_t k_pad, int64_t m0, int64_t m1, int32_t *starts)
    void ktcy_act_e2m1_starts(const int8_t *q, int64_t k_pad, int64_t m0, int64_t m1, int32_t *starts)
    void ktcy_act_e2m1_starts_avx2(const int8_t *q, int64_t k_pad, int64_t m0, int64_t m1, int32_t *starts)
    ctypedef void (*ktcy_bf16_act_fn)(const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0,
                                      int64_t m1, uint16_t *out)
    void ktcy_convert_act_bf16(const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0,
                               int64_t m1, uint16_t *out)
    void ktcy_convert_act_bf16_avx2(const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0,
                                    int64_t m1, uint16_t *out)
    void ktcy_convert_act_bf16_avx512(const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0,
                                      int64_t m1, uint16_t *out)
    void ktcy_layout_block_scales(const uint8_t *exps, int64_t ld, int64_t n, int64_t k_pad,
                                  int64_t p0, int64_t p1, uint8_t *dst)
    void ktcy_layout_panels(int format, const void *codes, int64_t ld, int64_t n, int64_t k,
                            int64_t k_pad, int64_t p0, int64_t p1, uint8_t *dst, int32_t *colsum)

    # the emulated tile unit, for the instruction-level tests
    void ktcy_emu_ldtilecfg(const void *config)
    void ktcy_emu_tileloadd(int t, const void *base, int64_t stride)
    void ktcy_emu_tilestored(int t, void *base, int64_t stride)
    void ktcy_emu_tilezero(int t)
    void ktcy_emu_tdpbssd(int c, int a, int b)
    void ktcy_emu_tdpbf16ps(int c, int a, int b)
    void ktcy_emu_tilerelease()
    void ktcy_emu_clear_error()
    ctypedef struct ktcy_emu_tiles:
        uint8_t rows[8]
        uint16_t colsb[8]
        int error
        char message[160]
    ktcy_emu_tiles ktcy_emu

cdef extern from "ktcy/ktcy.h" nogil:
    uint64_t ktcy_read_ref(const uint8_t *p, int64_t n)
    uint64_t ktcy_read_avx2(const uint8_t *p, int64_t n)
    uint64_t ktcy_read_avx512(const uint8_t *p, int64_t n)
    float ktcy_peak_fma256(int64_t iters, float seed)
    float ktcy_peak_fma512(int64_t iters, float seed)
    float ktcy_peak_dpbf16(int64_t iters, float seed)
    float ktcy_peak_dpbusd(int64_t iters, float seed)
    float ktcy_peak_amx(int64_t iters, int bf16)
    int ktcy_amx_release_tiles()

cdef extern from "ktcy/ktcy.h" nogil:
    ctypedef void (*ktcy_swiglu_fn)(float *g, const float *u, int64_t n)
    ctypedef void (*ktcy_glu_clamped_fn)(float *g, const float *u, int64_t n, float alpha, float limit)
    void ktcy_glu_clamped_ref(float *g, const float *u, int64_t n, float alpha, float limit)
    void ktcy_glu_clamped_avx2(float *g, const float *u, int64_t n, float alpha, float limit)
    void ktcy_glu_clamped_avx512(float *g, const float *u, int64_t n, float alpha, float limit)
    void ktcy_swiglu_ref(float *g, const float *u, int64_t n)
    void ktcy_swiglu_avx2(float *g, const float *u, int64_t n)
    void ktcy_swiglu_avx512(float *g, const float *u, int64_t n)
