"""The score-stage modifiers (softcap, ALiBi, attention sinks): their arguments and numerics.

One module per feature lives in `generator.features` (the registry: spec field, C constant,
parameter rows); this module is their verification side: the runtime value each feature
takes (`ScoreArgs`), its validation, and its arithmetic in float64 (the reference) and in the
kernel's precision (the baseline). `verify.reference` and `verify.baseline` apply it through
the per-sequence `SeqInputs`; the runners upload the same values.

Exact semantics. Let `x = q_i . k_j` be the raw dot product and `scale` the softmax scale.
The logit is built in this order:

1. `z = scale * x`;
2. softcap `c > 0`: `z = c * tanh(z / c)` (flash-attn's `softcap`; 0 = off);
3. ALiBi: `z = z - slope[b, h] * |i + shift - j|`, with `shift = Sk - Sq` for causal 'none'
   and 'bottom_right' and 0 for 'top_left' (`reference.shift_for`; varlen: each sequence's
   own Sq, Sk); `slope` is `alibi_slopes[h]` (shape `(heads,)`) or `alibi_slopes[b, h]`
   (shape `(batch, heads)`);
4. the masks (causal, window, varlen, block sparsity): an invisible key is excluded;
5. the softmax, with sinks: `P_ij = exp(z_ij) / (exp(sink_h) + sum_{visible j} exp(z_ij))`
   and `LSE_i = log(exp(sink_h) + sum_j exp(z_ij))` (natural log; the sink is in the units
   of z, not multiplied by the scale); without sinks as before. A row with no visible key
   gives O = 0 and LSE = -inf without sinks, LSE = sink_h with them;
6. dropout on P as before.

Backward: `dP = dO V^T`, `D_i = rowsum(dO * O)`, `dZ = P * (dP - D)` as before (unchanged by
sinks: the LSE holds the sink). `dX = dZ * dz/dx`: `scale` for the identity and ALiBi,
`scale * (1 - tanh(scale x / c)^2)` with softcap (so dQ = scale (dZ (1 - t^2)) K and
dK = scale (dZ (1 - t^2))^T Q). The sink's gradient is
`dsink_h = -sum_{b, i} exp(sink_h - LSE_bhi) * D_bhi` over every batch and every query row of
head h (rows whose LSE is -inf contribute 0): the softmax gradient of an extra column whose
value row is zero.

The keyword argument of each feature is its first parameter row in the registry
(`ARGUMENTS`: softcap -> `softcap`, alibi -> `alibi_slopes`, sink -> `sinks`), so the
reference, the baseline, the runners and the kernels' parameter structs share one spelling.
Slopes and sinks are fp32 on the device: pass float32-representable values (the strategies
draw them so) or compare against what the runner uploaded (`res.inputs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from flashgen.generator.features import FEATURE_BY_NAME, FEATURES
from flashgen.verify.numerics import round_to

__all__ = [
    "ARGUMENTS",
    "ScoreArgs",
    "alibi_bias",
    "check_score_args",
    "check_user_params",
    "dsink_terms",
    "logits",
    "score_args_problems",
    "softcap_factor",
    "softcapped",
    "spec_has",
    "user_env",
    "user_grad",
    "user_logits",
]

# feature name -> keyword argument (its first parameter row: the C field that carries it)
ARGUMENTS: dict[str, str] = {f.name: f.params[0].name for f in FEATURES}
_FEATURE_OF = {arg: name for name, arg in ARGUMENTS.items()}
assert set(ARGUMENTS.values()) == {"softcap", "alibi_slopes", "sinks"}, ARGUMENTS


def spec_has(spec: Any, feature: str) -> bool:
    """`spec.has(feature)` for a KernelSpec; duck-typed specs (tests' stand-ins) without
    `has` use their `features` attribute, and have none when they lack it."""
    if feature not in FEATURE_BY_NAME:
        raise KeyError(f"{feature!r} is not a feature (allowed: {', '.join(FEATURE_BY_NAME)})")
    has = getattr(spec, "has", None)
    if callable(has):
        return bool(has(feature))
    return feature in getattr(spec, "features", ())


@dataclass(frozen=True, eq=False)
class ScoreArgs:
    """The runtime values of the score-stage features of one call (all off by default).

    `softcap`: c of `c * tanh(z / c)`, 0 = off. `alibi_slopes`: float `(heads,)` or
    `(batch, heads)`, None = off. `sinks`: float `(heads,)`, None = off. Build validated
    values with `check_score_args`.
    """

    softcap: float = 0.0
    alibi_slopes: np.ndarray | None = None
    sinks: np.ndarray | None = None
    # a spec's score_mod (generator.usermod.UserMod) and its parameters' values by name, as
    # the device holds them (`check_user_params`); None without one
    score_mod: Any = None
    score_params: dict[str, Any] | None = None
    # a spec's mask_mod (generator.usermod.UserMod; its parameters share `score_params`, as
    # the spec's `params` serve both), or None
    mask_mod: Any = None

    def uses(self, feature: str) -> bool:
        """Whether the call uses `feature` (a generator.features name)."""
        arg = ARGUMENTS[feature]
        value = getattr(self, arg)
        return value is not None and (arg != "softcap" or value != 0.0)

    @property
    def features(self) -> frozenset[str]:
        """The names of the features the call uses."""
        return frozenset(name for name in ARGUMENTS if self.uses(name))

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the features in use (for the reference, the baseline and
        the runners; empty when none is)."""
        out = {ARGUMENTS[name]: getattr(self, ARGUMENTS[name]) for name in sorted(self.features)}
        if self.score_mod is not None:
            out.update(score_mod=self.score_mod, score_params=self.score_params)
        if self.mask_mod is not None:
            out.update(mask_mod=self.mask_mod, score_params=self.score_params)
        return out

    @property
    def user_mod(self) -> Any:
        """The UserMod whose declared parameters `score_params` holds (score_mod, else
        mask_mod: both declare the spec's `params`), or None."""
        return self.score_mod if self.score_mod is not None else self.mask_mod

    def slopes_for(self, b: int, heads: slice) -> np.ndarray | None:
        """The slopes of sequence `b`'s query heads `heads`, `(h,)`, or None."""
        s = self.alibi_slopes
        if s is None:
            return None
        return s[heads] if s.ndim == 1 else s[b, heads]

    def sinks_for(self, heads: slice) -> np.ndarray | None:
        return None if self.sinks is None else self.sinks[heads]

    def __repr__(self) -> str:  # short enough for a Hypothesis failure report
        def arr(a: np.ndarray | None) -> str:
            return "None" if a is None else f"array({a.tolist()!r})"

        user = ""
        if self.user_mod is not None:
            vals = {
                k: (v.tolist() if isinstance(v, np.ndarray) else v)
                for k, v in (self.score_params or {}).items()
            }
            if self.score_mod is not None:
                user += f", score_mod={self.score_mod.canonical!r}"
            if self.mask_mod is not None:
                user += f", mask_mod={self.mask_mod.canonical!r}"
            user += f", score_params={vals!r}"
        return (
            f"ScoreArgs(softcap={self.softcap!r}, alibi_slopes={arr(self.alibi_slopes)}, "
            f"sinks={arr(self.sinks)}{user})"
        )


def _float_array(value: Any, name: str) -> np.ndarray:
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{name} must be a float array, got dtype {arr.dtype}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return np.array(arr, dtype=np.float64)


def check_score_args(
    softcap: Any = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    *,
    batch: int | None = None,
    heads: int | None = None,
    score_mod: Any = None,
    score_params: Any = None,
    mask_mod: Any = None,
) -> ScoreArgs:
    """Validated `ScoreArgs` (float64 copies of the arrays); ValueError names the argument and
    what is allowed. `batch`, `heads` (when given) fix the allowed shapes: slopes `(heads,)`
    or `(batch, heads)`, sinks `(heads,)`."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.integer, np.floating)):
        raise ValueError(f"softcap must be a number (0: off, else > 0), got {softcap!r}")
    c = float(softcap)
    if not (math.isfinite(c) and c >= 0.0):
        raise ValueError(f"softcap={softcap!r} must be finite and >= 0 (0: off, else > 0)")
    slopes = None
    if alibi_slopes is not None:
        slopes = _float_array(alibi_slopes, "alibi_slopes")
        allowed = "(heads,) or (batch, heads)"
        if heads is not None:
            allowed = f"(heads,) = ({heads},) or (batch, heads) = ({batch}, {heads})"
        ok = slopes.ndim in (1, 2)
        if ok and heads is not None:
            ok = slopes.shape[-1] == heads and (slopes.ndim == 1 or slopes.shape[0] == batch)
        if not ok:
            raise ValueError(f"alibi_slopes must have shape {allowed}, got {slopes.shape}")
    sk = None
    if sinks is not None:
        sk = _float_array(sinks, "sinks")
        if sk.ndim != 1 or (heads is not None and sk.shape[0] != heads):
            want = "(heads,)" if heads is None else f"(heads,) = ({heads},)"
            raise ValueError(f"sinks must have shape {want}, got {sk.shape}")
    if score_mod is None and mask_mod is None:
        if score_params:
            raise ValueError("score_params given without a score_mod or mask_mod")
        return ScoreArgs(c, slopes, sk)
    mod = score_mod if score_mod is not None else mask_mod
    values = check_user_params(mod, score_params, batch=batch, heads=heads)
    return ScoreArgs(c, slopes, sk, score_mod, values, mask_mod)


def check_user_params(
    mod: Any, values: Any, *, batch: int | None = None, heads: int | None = None
) -> dict[str, Any]:
    """The values of a score_mod's declared parameters as the kernel holds them: float32-rounded
    floats (kept as float64), int64 ints; `values` maps every declared name (and no other) to
    a number (scalar, scalar_int), a 1-D array (per_head `(heads,)`, per_batch and
    per_batch_int `(batch,)`) or a 2-D array (table `(heads, columns)`, columns >= 1). ValueError
    names the parameter and what is allowed."""
    from flashgen.generator.usermod import KIND_INFO, ParamKind, Type

    declared = dict(mod.params)
    given = dict(values or {})
    extra = sorted(set(given) - set(declared))
    if extra:
        raise ValueError(
            f"score_params {', '.join(extra)} not declared by the score_mod (declared: "
            f"{', '.join(declared) or 'none'})"
        )
    out: dict[str, Any] = {}
    for name, kind in declared.items():
        if name not in given:
            raise ValueError(f"score_params lacks {name!r} ({kind.value})")
        v = given[name]
        info = KIND_INFO[kind]
        if kind in (ParamKind.SCALAR, ParamKind.SCALAR_INT):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise ValueError(f"score_params[{name!r}] ({kind.value}) must be a number")
            if kind is ParamKind.SCALAR_INT:
                if int(v) != v:
                    raise ValueError(f"score_params[{name!r}] (scalar_int) must be an integer")
                out[name] = int(v)
            else:
                if not math.isfinite(float(v)):
                    raise ValueError(f"score_params[{name!r}] (scalar) must be finite")
                out[name] = float(np.float32(v))
            continue
        arr = np.asarray(v)
        want = {
            ParamKind.PER_HEAD: (heads,),
            ParamKind.PER_BATCH: (batch,),
            ParamKind.PER_BATCH_INT: (batch,),
            ParamKind.TABLE: (heads, None),
            # per-token vectors (a mask_mod's): one id per token of the batch, indexed by the
            # packed position (varlen) or b * seqlen + position; `token_slice` checks lengths
            ParamKind.PER_TOKEN_Q: (None,),
            ParamKind.PER_TOKEN_K: (None,),
            ParamKind.PER_TOKEN: (None,),
        }.get(kind)
        if want is None:
            raise ValueError(f"parameter kind {kind.value} is not served by the kernels")
        ok = arr.ndim == len(want) and all(w is None or n == w for n, w in zip(arr.shape, want))
        if kind is ParamKind.TABLE:
            ok = ok and arr.shape[1] >= 1
        if not ok:
            what = "tokens" if kind.value in TOKEN_KINDS else "columns"
            dims = ", ".join(what if w is None else str(w) for w in want)
            shape = f"({dims},)" if len(want) == 1 else f"({dims})"
            raise ValueError(
                f"score_params[{name!r}] ({kind.value}) must have shape {shape}, got {arr.shape}"
            )
        if info.type is Type.INT:
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"score_params[{name!r}] ({kind.value}) must hold ints")
            if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
                raise ValueError(f"score_params[{name!r}] ({kind.value}) must fit int32")
            out[name] = arr.astype(np.int64)
        else:
            f = _float_array(arr.astype(np.float64), f"score_params[{name!r}]")
            out[name] = f.astype(np.float32).astype(np.float64)
    return out


def user_env(
    s: np.ndarray, *, b: int, heads: np.ndarray, seqlen_q: int, seqlen_k: int
) -> dict[str, Any]:
    """The variables of a score_mod over scores `s` `(h, Sq, Sk)` of sequence `b` and query
    heads `heads` `(h,)`: i, j the 0-based positions in the sequence, the lengths its own."""
    return {
        "s": s,
        "b": np.int64(b),
        "h": np.asarray(heads, dtype=np.int64)[:, None, None],
        "i": np.arange(s.shape[-2], dtype=np.int64)[None, :, None],
        "j": np.arange(s.shape[-1], dtype=np.int64)[None, None, :],
        "seqlen_q": np.int64(seqlen_q),
        "seqlen_k": np.int64(seqlen_k),
    }


def user_logits(s: np.ndarray, mod: Any, params: dict[str, Any], **where: Any) -> np.ndarray:
    """The score_mod's logits over `s` `(h, Sq, Sk)` in the dtype of `s` (float64: the
    reference; float32: the baseline, the kernel's arithmetic order); `where` as `user_env`."""
    from flashgen.generator.usermod import evaluate

    return evaluate(mod.tree, user_env(s, **where), params, dtype=s.dtype).astype(s.dtype)


def user_grad(s: np.ndarray, mod: Any, params: dict[str, Any], **where: Any) -> np.ndarray:
    """d(score_mod)/ds over `s` (the symbolic derivative, `UserMod.derivative`), in the dtype
    of `s`, broadcast to its shape."""
    from flashgen.generator.usermod import evaluate

    g = evaluate(mod.derivative, user_env(s, **where), params, dtype=s.dtype)
    return np.broadcast_to(g, s.shape).astype(s.dtype)


def score_args_problems(spec: Any, score: ScoreArgs) -> list[str]:
    """What a kernel of `spec` cannot take: a feature value for a feature the spec lacks, or
    no value for one it has (softcap must then be > 0). Empty when the call fits the spec."""
    out = []
    for name in ARGUMENTS:
        arg = ARGUMENTS[name]
        has, used = spec_has(spec, name), score.uses(name)
        if used and not has:
            out.append(f"{arg} given but this spec has {name}: false")
        elif has and not used:
            what = {
                "softcap": "softcap > 0 (finite)",
                "alibi_slopes": "alibi_slopes, float (heads,) or (batch, heads)",
                "sinks": "sinks, float (heads,)",
            }[arg]
            out.append(f"this spec has {name}: true: pass {what}")
    mask = getattr(spec, "mask_mod", None)
    if mask is not None and score.mask_mod != mask:
        out.append(
            f"this spec has mask_mod {mask.canonical!r}: pass score_params "
            f"({', '.join(f'{n}: {k.value}' for n, k in mask.params) or 'none declared'})"
        )
    elif mask is None and score.mask_mod is not None:
        out.append("a mask_mod given but this spec has none")
    mod = getattr(spec, "score_mod", None)
    if mod is not None and score.score_mod != mod:
        out.append(
            f"this spec has score_mod {mod.canonical!r}: pass score_params "
            f"({', '.join(f'{n}: {k.value}' for n, k in mod.params) or 'none declared'})"
        )
    elif mod is None and score.score_mod is not None:
        out.append("score_params given but this spec has no score_mod")
    return out


TOKEN_KINDS = ("per_token_q", "per_token_k", "per_token")


def mask_visible(
    mod: Any,
    params: dict[str, Any],
    *,
    b: int,
    heads: np.ndarray,
    seqlen_q: int,
    seqlen_k: int,
    q_tok0: int,
    k_tok0: int,
) -> np.ndarray:
    """A mask_mod's visibility `(h, Sq, Sk)` (or broadcastable to it) over sequence `b`, query
    heads `heads`, whose first query and key are tokens `q_tok0`, `k_tok0` of the per-token
    vectors. Evaluated in float32, the kernels' arithmetic (a float decision at a rounding
    boundary is the kernel's; the reference and the baseline share it). A per_token vector is
    read at query and key positions alike, so it needs q_tok0 == k_tok0 and Sq == Sk."""
    from flashgen.generator.usermod import evaluate

    vals = dict(params)
    for name, kind in mod.params:
        if kind.value not in TOKEN_KINDS:
            continue
        arr = vals[name]
        if kind.value == "per_token" and (q_tok0 != k_tok0 or seqlen_q != seqlen_k):
            raise ValueError(
                f"mask_mod parameter {name} (per_token) is read at queries and keys alike: "
                "queries and keys must be the same tokens (seqlen_q == seqlen_k, "
                "cu_seqlens_q == cu_seqlens_k); use per_token_q / per_token_k otherwise"
            )
        lo = q_tok0 if kind.value != "per_token_k" else k_tok0
        n = seqlen_q if kind.value != "per_token_k" else seqlen_k
        if lo + n > arr.shape[0]:
            raise ValueError(
                f"mask_mod parameter {name} ({kind.value}) has {arr.shape[0]} tokens; sequence "
                f"{b} reads tokens {lo}..{lo + n - 1}"
            )
        vals[name] = arr[lo : lo + n]
    env = {
        "b": np.int64(b),
        "h": np.asarray(heads, dtype=np.int64)[:, None, None],
        "i": np.arange(seqlen_q, dtype=np.int64)[None, :, None],
        "j": np.arange(seqlen_k, dtype=np.int64)[None, None, :],
        "seqlen_q": np.int64(seqlen_q),
        "seqlen_k": np.int64(seqlen_k),
    }
    return np.asarray(evaluate(mod.tree, env, vals, dtype=np.float32), dtype=bool)


# ---------------------------------------------------------------------------------------------
# Numerics: arrays of scaled scores `s = scale * q.k`, shape (heads, Sq, Sk), any float dtype
# ---------------------------------------------------------------------------------------------


def _round(x: np.ndarray, dtype: str | None) -> np.ndarray:
    """x rounded to fp16 / bf16 (kept in x's dtype); None or 'fp32' leave float32 as is."""
    if dtype is None or dtype == "fp32":
        return x
    if dtype not in ("fp16", "bf16"):
        raise ValueError(f"capped_dtype={dtype!r} is not allowed (allowed: fp16, bf16, fp32)")
    with np.errstate(over="ignore"):
        return round_to(x, dtype).astype(x.dtype)


def softcapped(s: np.ndarray, softcap: float) -> np.ndarray:
    """`c * tanh(s / c)` in the dtype of `s` (c > 0)."""
    c = s.dtype.type(softcap)
    return c * np.tanh(s / c)


def softcap_factor(
    s: np.ndarray, softcap: float, *, capped_dtype: str | None = None
) -> np.ndarray | None:
    """`d(c tanh(s / c)) / ds = 1 - tanh(s / c)^2` in the dtype of `s`, or None when off.

    float64 (the reference) uses `1 / cosh^2`, which keeps its relative precision where tanh
    saturates; other dtypes use `1 - t * t` (the kernel's formula), with `t` rounded to
    `capped_dtype` when given (the baseline: autograd of an unfused tanh keeps its output
    tensor, in the dtype, for the backward)."""
    if not softcap:
        return None
    c = s.dtype.type(softcap)
    if s.dtype == np.float64 and capped_dtype is None:
        with np.errstate(over="ignore"):
            return 1.0 / np.cosh(s / c) ** 2
    t = _round(np.tanh(s / c), capped_dtype)
    return s.dtype.type(1) - t * t


def alibi_bias(
    slopes: np.ndarray, seqlen_q: int, seqlen_k: int, shift: int, dtype: Any = np.float64
) -> np.ndarray:
    """`-slope_h * |i + shift - j|`, shape `(h, Sq, Sk)` in `dtype` (the distance is exact,
    the product rounded once)."""
    dt = np.dtype(dtype).type
    i = np.arange(seqlen_q, dtype=np.int64)[:, None]
    j = np.arange(seqlen_k, dtype=np.int64)[None, :]
    dist = np.abs(i + int(shift) - j).astype(dt)
    return -(np.asarray(slopes, dtype=dt)[:, None, None] * dist[None])


def logits(
    s: np.ndarray,
    *,
    softcap: float = 0.0,
    alibi_slopes: np.ndarray | None = None,
    shift: int = 0,
    capped_dtype: str | None = None,
) -> np.ndarray:
    """The logits z `(h, Sq, Sk)` from scaled scores `s` (steps 2-3 of the module doc), in the
    dtype of `s`. `capped_dtype` ('fp16' / 'bf16') rounds, to that dtype, the two tensors an
    unfused softcap holds: `t = tanh(s / c)` and the capped score `c * t` (the baseline:
    Gemma-2's eager path and flash-attn's `attention_ref(upcast=False)` run `tanh` and `* c`
    on dtype tensors); None keeps both in the working precision."""
    z = s
    if softcap and capped_dtype is not None:
        c = s.dtype.type(softcap)
        z = _round(c * _round(np.tanh(s / c), capped_dtype), capped_dtype)
    elif softcap:
        z = softcapped(s, softcap)
    if alibi_slopes is not None:
        z = z + alibi_bias(alibi_slopes, s.shape[-2], s.shape[-1], shift, s.dtype)
    return z


def dsink_terms(sinks: np.ndarray, lse: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """`-sum_i exp(sink_h - LSE_hi) * D_hi` per head `(h,)` for `lse`, `delta` `(h, Sq)`, in
    their dtype; rows whose LSE is -inf contribute 0."""
    dt = lse.dtype.type
    sink = np.asarray(sinks, dtype=lse.dtype)[:, None]
    ok = np.isfinite(lse)
    w = np.where(ok, np.exp(sink - np.where(ok, lse, dt(0))), dt(0))
    return -(w * delta).sum(axis=-1, dtype=lse.dtype)
