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
} fg_score_params;

#ifdef __cplusplus
}
#endif
#endif /* FLASHGEN_SCORE_PARAMS_H */
