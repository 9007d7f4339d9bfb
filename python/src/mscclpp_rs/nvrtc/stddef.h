/*
 * stddef.h for NVRTC only (see stdint.h here). NVRTC defines size_t itself.
 */
#ifndef MSCCLPP_RS_NVRTC_STDDEF_H_
#define MSCCLPP_RS_NVRTC_STDDEF_H_
#if !defined(__CUDACC_RTC__)
#error "mscclpp_rs/nvrtc/stddef.h is for NVRTC: use the system's <stddef.h> elsewhere"
#endif
typedef long ptrdiff_t;
#ifndef NULL
#define NULL 0
#endif
#ifndef offsetof
#define offsetof(type, member) __builtin_offsetof(type, member)
#endif
#endif
