/* generated from generator/features/ by `flashgen generate`: do not edit. */
/* flashgen: runtime parameters of the score-stage features (score_mod.cuh). Every
   family's parameter struct ends with one `fg_score_params score;`. All fields are
   8 bytes wide; zero (NULL) means the feature is not used by the call. */
#ifndef FLASHGEN_SCORE_PARAMS_H
#define FLASHGEN_SCORE_PARAMS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fg_score_params {
  /* softcap (kSoftcap): logit soft-capping s -> c tanh(s / c), c = softcap */
  double softcap; /* c of c * tanh(s / c); > 0 and finite */
  /* alibi (kAlibi): ALiBi bias -slope_h * |i + shift - j| on the scaled score */
  const float* alibi_slopes; /* fp32 (heads) or (batch, heads): bias -slope * |i + shift - j| */
  int64_t alibi_batch_stride; /* elements between batches' slopes: 0 (one row for all) or heads */
  /* sink (kSink): a per-head logit in the softmax denominator only */
  const float* sinks; /* fp32 (heads): natural-log sink logits */
  float* dsinks; /* backward: fp32 (heads) output, dL/dsink (written) */
  /* score_mod and mask_mod (Spec::UserScore, Spec::UserMask): the spec's params, 4
     slots; param k (by name) reads user_f<k> (scalar), user_i<k> (scalar_int),
     user_ptr<k> (fp32 per_head / per_batch vector, int32 per_batch_int vector, fp32
     (heads, columns) table with user_i<k> = columns, int32 per-token vector of a
     mask_mod, by packed position); docs/usermod.md */
  const void* user_ptr0; /* param 0: its device array */
  double user_f0; /* param 0: a scalar's value */
  int64_t user_i0; /* param 0: a scalar_int's value, or a table's columns */
  const void* user_ptr1; /* param 1: its device array */
  double user_f1; /* param 1: a scalar's value */
  int64_t user_i1; /* param 1: a scalar_int's value, or a table's columns */
  const void* user_ptr2; /* param 2: its device array */
  double user_f2; /* param 2: a scalar's value */
  int64_t user_i2; /* param 2: a scalar_int's value, or a table's columns */
  const void* user_ptr3; /* param 3: its device array */
  double user_f3; /* param 3: a scalar's value */
  int64_t user_i3; /* param 3: a scalar_int's value, or a table's columns */
} fg_score_params;

/* nonzero when a user slot is set: a kernel generated without score_mod refuses that
   (score_check.h) */
static inline int fg_score_user_slots_set(const fg_score_params* s) {
  return s->user_ptr0 != 0 ||
         s->user_f0 != 0.0 ||
         s->user_i0 != 0 ||
         s->user_ptr1 != 0 ||
         s->user_f1 != 0.0 ||
         s->user_i1 != 0 ||
         s->user_ptr2 != 0 ||
         s->user_f2 != 0.0 ||
         s->user_i2 != 0 ||
         s->user_ptr3 != 0 ||
         s->user_f3 != 0.0 ||
         s->user_i3 != 0;
}

#ifdef __cplusplus
}
#endif
#endif /* FLASHGEN_SCORE_PARAMS_H */
