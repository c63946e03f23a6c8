"""Hypothesis strategies for attention problems: what hand-picked grids miss.

Sizes are small by default (fast on a CPU); every strategy takes a `max_...` to go larger.
Lengths favour 1, 2, odd values and the maximum, and `seqlen_q != seqlen_k` in both directions.
Array values come from a NumPy generator seeded by Hypothesis (`kind` picks the distribution),
so a failing example replays exactly.

Varlen lengths are at least 1 by default; `allow_empty=True` also draws zero-length sequences
(the reference and the models handle them: an empty key sequence gives O = 0, LSE = -inf).

Score-stage features (`score_args`): the runtime values of the features a spec has (softcap,
ALiBi slopes, attention sinks; `verify.score_mods`), float32-representable as the kernels
take them; `cases_for_spec` draws them into every `Case`, so a test of a spec with a feature
exercises it together with every other feature of the spec.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flashgen.verify.baseline import round_to_dtype
from flashgen.verify.score_mods import ScoreArgs, check_score_args, spec_has
from hypothesis import strategies as st

__all__ = [
    "VALUE_KINDS",
    "Case",
    "DropoutParams",
    "ScoreArgs",
    "Shape",
    "attention_inputs",
    "block_layouts",
    "cases_for_spec",
    "cu_seqlens",
    "dropout_params",
    "fixed_score_args",
    "mask_mods",
    "self_attention",
    "user_mod_of",
    "fixed_user_params",
    "score_args",
    "user_params",
    "seqlens",
    "shapes",
    "valid_specs",
    "windows",
]

VALUE_KINDS = ("normal", "large", "one_hot", "duplicate_keys")
SOFTCAP_REGIMES = ("small", "typical")  # 0.5 .. 5: normal scores saturate; 10 .. 50: Gemma-2's
SLOPE_KINDS = ("geometric", "random", "mixed", "zero")
SINK_KINDS = ("uniform", "dominant", "mixed", "zero")


@dataclass(frozen=True)
class Shape:
    """Runtime sizes of a dense problem."""

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int


@dataclass(frozen=True)
class DropoutParams:
    p: float
    seed: int  # uint64
    offset: int  # uint32


def seqlens(max_seqlen: int = 33, min_seqlen: int = 1) -> st.SearchStrategy[int]:
    """A sequence length in `[min_seqlen, max_seqlen]`, often 1, 2, odd or the maximum."""
    special = sorted(
        {x for x in (min_seqlen, 1, 2, 3, 7, 17, 97, max_seqlen) if min_seqlen <= x <= max_seqlen}
    )
    return st.one_of(st.sampled_from(special), st.integers(min_seqlen, max_seqlen))


@st.composite
def shapes(
    draw: Any,
    *,
    max_batch: int = 2,
    max_heads: int = 4,
    max_seqlen: int = 33,
    head_dims: Sequence[int] = (8, 16),
    gqa: bool = True,
) -> Shape:
    """Batch, heads, kv_heads (a divisor of heads; equal to it when `gqa=False`), lengths
    with `Sq == Sk`, `Sq < Sk` and `Sq > Sk` each drawn deliberately, and a head dim."""
    heads = draw(st.integers(1, max_heads))
    divisors = [x for x in range(1, heads + 1) if heads % x == 0]
    kv_heads = draw(st.sampled_from(divisors)) if gqa else heads
    relation = draw(st.sampled_from(("equal", "q_shorter", "q_longer", "any")))
    sq = draw(seqlens(max_seqlen))
    if relation == "equal":
        sk = sq
    elif relation == "q_shorter" and sq < max_seqlen:
        sk = draw(seqlens(max_seqlen, min_seqlen=sq + 1))
    elif relation == "q_longer" and sq > 1:
        sk = draw(seqlens(sq - 1))
    else:
        sk = draw(seqlens(max_seqlen))
    return Shape(
        batch=draw(st.integers(1, max_batch)),
        heads=heads,
        kv_heads=kv_heads,
        seqlen_q=sq,
        seqlen_k=sk,
        head_dim=draw(st.sampled_from(tuple(head_dims))),
    )


@st.composite
def cu_seqlens(
    draw: Any, batch: int, *, max_seqlen: int = 33, allow_empty: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """int32 `(cu_seqlens_q, cu_seqlens_k)` of `batch + 1` entries, starting at 0."""
    low = 0 if allow_empty else 1
    lq = [draw(seqlens(max_seqlen, min_seqlen=low)) for _ in range(batch)]
    lk = [draw(seqlens(max_seqlen, min_seqlen=low)) for _ in range(batch)]
    cum = [np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lq, lk)]
    return cum[0], cum[1]


def windows(seqlen_k: int) -> st.SearchStrategy[tuple[int, int]]:
    """`(left, right)`, each -1 (unbounded) or in `0 .. Sk`."""
    side = st.one_of(st.just(-1), st.integers(0, max(seqlen_k, 0)))
    return st.tuples(side, side)


@st.composite
def block_layouts(draw: Any, layout_heads: int, num_q_tiles: int, num_k_tiles: int) -> np.ndarray:
    """Bool `(layout_heads, Tr, Tc)`: random density, local + global, rows with no block,
    all or nothing."""
    shape = (layout_heads, num_q_tiles, num_k_tiles)
    pattern = draw(st.sampled_from(("random", "local_global", "empty_rows", "full", "empty")))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if pattern == "full":
        return np.ones(shape, dtype=bool)
    if pattern == "empty":
        return np.zeros(shape, dtype=bool)
    if pattern == "local_global":
        band = draw(st.integers(0, max(num_k_tiles, 1)))
        n_global = draw(st.integers(0, max(min(num_k_tiles, 2), 0)))
        qt = np.arange(num_q_tiles)[:, None]
        kt = np.arange(num_k_tiles)[None, :]
        local = np.abs(qt - kt) <= band
        glob = (kt < n_global) | (qt < n_global)
        return np.broadcast_to(local | glob, shape).copy()
    density = draw(st.sampled_from((0.1, 0.3, 0.5, 0.8, 1.0)))
    out = rng.random(shape) < density
    if pattern == "empty_rows" and num_q_tiles:
        out[:, rng.random(num_q_tiles) < 0.5] = False
    return out


def dropout_params(*, max_offset: int = 2**32 - 1) -> st.SearchStrategy[DropoutParams]:
    """p in {0, small, 0.5, 0.9}, a 64-bit seed, an offset (32-bit by default)."""
    p = st.one_of(st.just(0.0), st.floats(1e-3, 0.1), st.just(0.5), st.just(0.9))
    return st.builds(
        DropoutParams, p=p, seed=st.integers(0, 2**64 - 1), offset=st.integers(0, max_offset)
    )


def _f32(x: Any) -> Any:
    """float32-representable float64 (what an fp32 device buffer holds)."""
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def alibi_geometric(heads: int) -> np.ndarray:
    """ALiBi's slopes `2^(-8 (k + 1) / H)`, k = 0 .. H - 1 (the paper's geometric sequence)."""
    return 2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)


@st.composite
def softcaps(draw: Any) -> float:
    """A softcap c: 'small' (0.5 .. 5: ordinary scores of a few units saturate tanh) or
    'typical' (10 .. 50, Gemma-2 uses 50 for attention; scores of ~1e4 saturate it), with
    the round values 0.5, 1, 5, 10, 20, 30, 50 drawn often; float32-representable."""
    regime = draw(st.sampled_from(SOFTCAP_REGIMES))
    lo, hi = (0.5, 5.0) if regime == "small" else (10.0, 50.0)
    special = [x for x in (0.5, 1.0, 5.0, 10.0, 20.0, 30.0, 50.0) if lo <= x <= hi]
    c = draw(st.one_of(st.sampled_from(special), st.floats(lo, hi)))
    return float(_f32(c))


@st.composite
def alibi_slopes(draw: Any, batch: int, heads: int) -> np.ndarray:
    """float32-representable slopes of shape `(heads,)` or `(batch, heads)`: ALiBi's geometric
    sequence (per batch row times a random factor in the 2-D form), random positive, mixed
    signs with zeros, or all zero."""
    kind = draw(st.sampled_from(SLOPE_KINDS))
    two_d = draw(st.booleans())
    shape = (batch, heads) if two_d else (heads,)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "geometric":
        out = np.broadcast_to(alibi_geometric(heads), shape).copy()
        if two_d:
            out = out * rng.uniform(0.25, 4.0, size=(batch, 1))
    elif kind == "random":
        out = rng.uniform(0.0, 1.0, size=shape) * 10.0 ** rng.uniform(-3, 0.3, size=shape)
    elif kind == "mixed":
        out = rng.uniform(-1.0, 1.0, size=shape)
        out[rng.random(shape) < 0.3] = 0.0
    else:
        out = np.zeros(shape)
    return _f32(out)


@st.composite
def sink_values(draw: Any, heads: int) -> np.ndarray:
    """float32-representable sinks `(heads,)` in [-5, 10]: uniform, dominant (6 .. 10: larger
    than ordinary rows' log-sum-exp, so the sink takes most of the weight), mixed, or zero."""
    kind = draw(st.sampled_from(SINK_KINDS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "uniform":
        out = rng.uniform(-5.0, 10.0, size=heads)
    elif kind == "dominant":
        out = rng.uniform(6.0, 10.0, size=heads)
    elif kind == "mixed":
        out = rng.choice(np.array([-5.0, 0.0, 0.5, 10.0]), size=heads)
        out = np.where(rng.random(heads) < 0.5, out, rng.uniform(-5.0, 10.0, size=heads))
    else:
        out = np.zeros(heads)
    return _f32(out)


def user_mod_of(spec: Any) -> Any:
    """The UserMod whose parameters a spec declares (its score_mod, else its mask_mod: both
    read the spec's `params`), or None."""
    mod = getattr(spec, "score_mod", None)
    return mod if mod is not None else getattr(spec, "mask_mod", None)


def self_attention(spec: Any) -> bool:
    """Whether a spec's parameters include a per_token vector (a mask_mod's, read at query
    and key positions alike): its calls need seqlen_q == seqlen_k (varlen: equal cu_seqlens)."""
    mod = user_mod_of(spec)
    return mod is not None and any(k.value == "per_token" for _, k in mod.params)


@st.composite
def mask_mods(draw: Any, max_terms: int = 3) -> Any:
    """A mask_mod (generator.usermod.UserMod): one of the shipped masks
    (generator/usermod/examples.py: causal, sliding window, chunked, prefix-LM, document) or
    `and` / `or` / `not` compositions of up to `max_terms` of them, with their parameters
    (each example's own names, so a composition declares their union)."""
    from flashgen.generator.usermod import EXAMPLES, parse_mask_mod

    masks = [e for e in EXAMPLES if e.kind == "mask_mod"]
    terms = draw(st.lists(st.sampled_from(masks), min_size=1, max_size=max_terms, unique=True))
    text = f"({terms[0].text})"
    for term in terms[1:]:
        op = draw(st.sampled_from(["and", "or"]))
        neg = "not " if draw(st.booleans()) else ""
        text = f"{text} {op} {neg}({term.text})"
    params = {name: kind for e in terms for name, kind in e.params}
    return parse_mask_mod(text, params)


def _token_ids(rng: np.random.Generator, n: int, runs: bool = True) -> np.ndarray:
    """Document ids of n tokens: runs of consecutive ids (packed documents, about 1 in 8
    tokens starts a new one) or, with runs=False, ids in [0, 3] in any order."""
    if not runs:
        return rng.integers(0, 4, size=n).astype(np.int64)
    return np.cumsum(rng.random(n) < 0.125).astype(np.int64)


def fixed_score_args(
    spec: Any, batch: int, heads: int, tokens: tuple[int, int] = (0, 0)
) -> ScoreArgs:
    """Deterministic values for the features `spec` has, for hand-picked cases: softcap 20,
    ALiBi's geometric slopes `(heads,)`, sinks spread over [-2, 4]; off otherwise."""
    c = 20.0 if spec_has(spec, "softcap") else 0.0
    slopes = alibi_geometric(heads) if spec_has(spec, "alibi") else None
    sinks = _f32(np.linspace(-2.0, 4.0, heads)) if spec_has(spec, "sink") else None
    mod = user_mod_of(spec)
    return check_score_args(
        c,
        slopes,
        sinks,
        batch=batch,
        heads=heads,
        score_mod=getattr(spec, "score_mod", None),
        score_params=None if mod is None else fixed_user_params(mod, batch, heads, tokens),
        mask_mod=getattr(spec, "mask_mod", None),
    )


def fixed_user_params(
    mod: Any, batch: int, heads: int, tokens: tuple[int, int] = (0, 0)
) -> dict[str, Any]:
    """Deterministic values of a score_mod's (or mask_mod's) parameters: scalars 20 (a
    softcap), ints 8, per_head ALiBi's geometric slopes, per_batch values in [0.5, 2], int
    vectors 0, 3, 6, ..., tables (heads, 32) spread over [-2, 2], per-token ids of documents of
    5 tokens (`tokens`: the call's query and key token counts, batch * seqlen or total)."""
    from flashgen.generator.usermod import ParamKind as K

    out: dict[str, Any] = {}
    for name, kind in mod.params:
        if kind is K.SCALAR:
            out[name] = 20.0
        elif kind is K.SCALAR_INT:
            out[name] = 8
        elif kind is K.PER_HEAD:
            out[name] = alibi_geometric(heads)
        elif kind is K.PER_BATCH:
            out[name] = _f32(np.linspace(0.5, 2.0, batch))
        elif kind is K.PER_BATCH_INT:
            out[name] = np.arange(batch, dtype=np.int64) * 3
        elif kind is K.TABLE:
            out[name] = _f32(np.linspace(-2.0, 2.0, heads * 32).reshape(heads, 32))
        elif kind in (K.PER_TOKEN, K.PER_TOKEN_Q, K.PER_TOKEN_K):
            n = tokens[1] if kind is K.PER_TOKEN_K else tokens[0]
            out[name] = np.arange(n, dtype=np.int64) // 5
    return out


@st.composite
def user_params(
    draw: Any, mod: Any, batch: int, heads: int, tokens: tuple[int, int] = (0, 0)
) -> dict[str, Any]:
    """Values of a score_mod's declared parameters, float32-representable: scalars in
    [0.5, 50] (positive: a softcap, a temperature; a score_mod that divides by one stays
    finite), ints in [0, 64], per_head / per_batch floats in [0, 1] (ALiBi-like slopes) or
    [-1, 1], int vectors in [0, 64], tables of 1 to 40 columns in [-4, 4] (a column past the
    end is clamped, so fewer columns than the expression's buckets are drawn too), per-token
    ids (`tokens`: the call's query and key token counts) in runs (packed documents) or in
    any order."""
    from flashgen.generator.usermod import ParamKind as K

    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out: dict[str, Any] = {}
    for name, kind in mod.params:
        if kind is K.SCALAR:
            out[name] = float(np.float32(draw(st.floats(0.5, 50.0))))
        elif kind is K.SCALAR_INT:
            out[name] = draw(st.integers(0, 64))
        elif kind in (K.PER_HEAD, K.PER_BATCH):
            n = heads if kind is K.PER_HEAD else batch
            lo = draw(st.sampled_from((0.0, -1.0)))
            out[name] = _f32(rng.uniform(lo, 1.0, size=n))
        elif kind is K.PER_BATCH_INT:
            out[name] = rng.integers(0, 65, size=batch).astype(np.int64)
        elif kind is K.TABLE:
            cols = draw(st.sampled_from((1, 8, 32, 40)))
            out[name] = _f32(rng.uniform(-4.0, 4.0, size=(heads, cols)))
        elif kind in (K.PER_TOKEN, K.PER_TOKEN_Q, K.PER_TOKEN_K):
            n = tokens[1] if kind is K.PER_TOKEN_K else tokens[0]
            out[name] = _token_ids(rng, n, runs=draw(st.booleans()))
    return out


@st.composite
def score_args(
    draw: Any, spec: Any, batch: int, heads: int, tokens: tuple[int, int] = (0, 0)
) -> ScoreArgs:
    """The runtime values of the score-stage features `spec` has (`spec.has(...)`), for a call
    of `batch` sequences and `heads` query heads; features the spec lacks stay off. Values
    are validated (`score_mods.check_score_args`) and float32-representable."""
    c = draw(softcaps()) if spec_has(spec, "softcap") else 0.0
    slopes = draw(alibi_slopes(batch, heads)) if spec_has(spec, "alibi") else None
    sinks = draw(sink_values(heads)) if spec_has(spec, "sink") else None
    mod = user_mod_of(spec)
    values = None if mod is None else draw(user_params(mod, batch, heads, tokens))
    return check_score_args(
        c,
        slopes,
        sinks,
        batch=batch,
        heads=heads,
        score_mod=getattr(spec, "score_mod", None),
        score_params=values,
        mask_mod=getattr(spec, "mask_mod", None),
    )


def _values(
    rng: np.random.Generator, kind: str, q_shape: tuple, k_shape: tuple, v_shape: tuple
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = rng.standard_normal(q_shape)
    k = rng.standard_normal(k_shape)
    v = rng.standard_normal(v_shape)
    d = q_shape[-1]
    if kind == "large":
        # scale * q.k has standard deviation amp**2: scores reach about +-1e4
        amp = np.sqrt(1e4 / 3.0)
        q, k = q * amp, k * amp
    elif kind == "one_hot" and k.shape[-3] > 0:
        # Some query rows point at one key, strongly enough that its weight is ~1.
        rows = rng.random(q.shape[:-1]) < 0.5
        j = rng.integers(0, k.shape[-3], size=q.shape[:-2])
        ks = np.take(k, j, axis=-3) if k.ndim == 3 else k[np.arange(k.shape[0])[:, None], j]
        heads, kv = q.shape[-2], k.shape[-2]
        ks = np.repeat(ks, heads // kv, axis=-2)
        target = 8.0 * np.sqrt(d) * ks / np.linalg.norm(ks, axis=-1, keepdims=True)
        q = np.where(rows[..., None], target, q)
    elif kind == "duplicate_keys" and k.shape[-3] > 1:
        n = k.shape[-3]
        src = rng.integers(0, n, size=n)
        dup = rng.random(n) < 0.5
        idx = np.where(dup, src, np.arange(n))
        k = np.take(k, idx, axis=-3)
    return q, k, v


@st.composite
def attention_inputs(
    draw: Any,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    *,
    kind: str | None = None,
    dtype: Any = None,
    v_shape: tuple[int, ...] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 `(q, k, v)` of the given shapes (dense or packed varlen); v has `v_shape`
    (default k's: its last dim is d_v, which may differ from q's and k's d).

    `kind` (drawn from VALUE_KINDS when None): 'normal'; 'large' (scores up to about +-1e4);
    'one_hot' (about half the query rows align with one key so strongly that the softmax is
    one-hot); 'duplicate_keys' (about half the keys copy another key: tied scores). With
    `dtype` ('fp16' / 'bf16') the values are rounded to it, so the kernel sees what the
    reference sees.
    """
    kind = draw(st.sampled_from(VALUE_KINDS)) if kind is None else kind
    if kind not in VALUE_KINDS:
        raise ValueError(f"kind={kind!r} is not allowed (allowed: {', '.join(VALUE_KINDS)})")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    v_shape = tuple(k_shape) if v_shape is None else tuple(v_shape)
    if tuple(v_shape[:-1]) != tuple(k_shape[:-1]):
        raise ValueError(f"v_shape {v_shape} must be k_shape {k_shape} but for the last dim")
    q, k, v = _values(rng, kind, tuple(q_shape), tuple(k_shape), v_shape)
    if dtype is not None:
        q, k, v = (round_to_dtype(x, dtype).astype(np.float64) for x in (q, k, v))
    return q, k, v


# ---------------------------------------------------------------------------------------------
# Specs (generator.spec) and per-spec runtime cases
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _fitting_tiles(target: Any, dtype: Any, head_dim: int) -> tuple[Any, ...]:
    from flashgen.generator.families.forward import TILE_MT, TILE_STAGES, TILE_WARPS
    from flashgen.generator.spec import Tile
    from flashgen.generator.tiles import tile_fits

    tiles = []
    for warps in TILE_WARPS:
        for mt in TILE_MT:
            for block_n in range(16, 257, 16):
                for stages in TILE_STAGES:
                    tile = Tile(16 * warps * mt, block_n, warps, stages)
                    if tile_fits(tile, target, dtype, head_dim):
                        tiles.append(tile)
    return tuple(tiles)


@st.composite
def valid_specs(draw: Any, *, head_dims: Sequence[int] | None = None, **fixed: Any) -> Any:
    """Valid forward `generator.spec.KernelSpec` objects over every spec axis.

    `fixed` pins fields (e.g. `dtype=Dtype.BF16`, `mask=Mask(...)`, `sparsity=...`,
    `features=frozenset()` for none of the score-stage features, which are drawn as any
    subset of those the kind accepts); `head_dims` restricts the head dims drawn (default:
    all the spec allows), for d and for d_v (`head_dim_v`: equal to d in half the draws,
    else any of them; pin `head_dim_v=None` for d_v = d).
    """
    from flashgen.generator.families.forward import HEAD_DIMS
    from flashgen.generator.features import FEATURES
    from flashgen.generator.spec import (
        Causal,
        Dtype,
        KernelKind,
        KernelSpec,
        Mask,
        Sparsity,
        Target,
    )

    def pick(name: str, strategy: st.SearchStrategy) -> Any:
        return fixed[name] if name in fixed else draw(strategy)

    target = pick("target", st.sampled_from([t for t in Target if not t.value.suffix]))
    dtype = pick("dtype", st.sampled_from(list(Dtype)))
    dims = tuple(head_dims or HEAD_DIMS)
    head_dim = pick("head_dim", st.sampled_from(dims))
    head_dim_v = pick("head_dim_v", st.one_of(st.none(), st.sampled_from(dims)))
    d_max = head_dim if head_dim_v is None else max(head_dim, head_dim_v)
    tiles = _fitting_tiles(target, dtype, d_max)  # shared memory grows with each dim
    tile = pick("tile", st.sampled_from(tiles))
    mask = pick(
        "mask",
        st.builds(Mask, st.sampled_from(list(Causal)), st.booleans(), st.booleans()),
    )
    dropout = pick("dropout", st.booleans())
    debug_keep_mask = pick("debug_keep_mask", st.booleans() if dropout else st.just(False))
    kernel = fixed.get("kernel", KernelKind.FORWARD)
    names = [
        f.name for f in FEATURES if f.kinds is None or getattr(kernel, "yaml", kernel) in f.kinds
    ]
    features = pick(
        "features", st.frozensets(st.sampled_from(names)) if names else st.just(frozenset())
    )
    return KernelSpec(
        kernel=kernel,
        dtype=dtype,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        tile=tile,
        mask=mask,
        dropout=dropout,
        debug_keep_mask=debug_keep_mask,
        sparsity=pick("sparsity", st.sampled_from(list(Sparsity))),
        gqa=pick("gqa", st.booleans()),
        target=target,
        instrument_io=pick("instrument_io", st.booleans()),
        features=features,
    )


@dataclass(frozen=True)
class Case:
    """One runtime problem for a spec: sizes, lengths, window, block layout, dropout, and the
    values of its score-stage features.

    Dense: `seqlen_q`, `seqlen_k` are the lengths. Varlen: `cu_seqlens_q/k` give them and
    `seqlen_q`, `seqlen_k` are the maxima. `block_mask` is bool `(layout_heads, Tr, Tc)` (use
    `verify.blocksparse.compact_layout`); with varlen and block sparsity every sequence has
    the same lengths (the compact layout is built for one `(Sq, Sk)`). `score` holds the
    softcap, ALiBi slopes and sinks (`score.kwargs()` are the reference's, the baseline's and
    the runners' keyword arguments; empty for a spec without features).
    """

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    window: tuple[int, int]
    cu_seqlens_q: np.ndarray | None
    cu_seqlens_k: np.ndarray | None
    block_mask: np.ndarray | None
    dropout: DropoutParams | None
    score: ScoreArgs = ScoreArgs()


@st.composite
def cases_for_spec(
    draw: Any, spec: Any, *, max_batch: int = 2, max_heads: int = 4, max_seqlen: int = 33
) -> Case:
    """A runtime `Case` that `spec` accepts (only the features it has are exercised)."""
    shape = draw(
        shapes(
            max_batch=max_batch,
            max_heads=max_heads,
            max_seqlen=max_seqlen,
            head_dims=(spec.head_dim,),
            gqa=bool(spec.gqa),
        )
    )
    batch, sq, sk = shape.batch, shape.seqlen_q, shape.seqlen_k
    cu_q = cu_k = None
    sparse = getattr(spec.sparsity, "yaml", spec.sparsity) == "block"
    if spec.mask.varlen:
        if sparse:
            cu_q = np.arange(batch + 1, dtype=np.int32) * sq
            cu_k = np.arange(batch + 1, dtype=np.int32) * sk
        else:
            cu_q, cu_k = draw(cu_seqlens(batch, max_seqlen=max_seqlen))
            sq, sk = int(np.diff(cu_q).max()), int(np.diff(cu_k).max())
    if self_attention(spec):  # a per_token vector: queries and keys are the same tokens
        sk, cu_k = sq, cu_q
    window = draw(windows(sk)) if spec.mask.window else (-1, -1)
    block_mask = None
    if sparse:
        bm, bn = spec.tile.block_m, spec.tile.block_n
        layout_heads = draw(st.sampled_from(sorted({1, shape.heads})))
        block_mask = draw(block_layouts(layout_heads, -(-sq // bm), -(-sk // bn)))
    dropout = draw(dropout_params()) if spec.dropout else None
    tokens = (int(cu_q[-1]), int(cu_k[-1])) if cu_q is not None else (batch * sq, batch * sk)
    score = draw(score_args(spec, batch, shape.heads, tokens))
    return Case(
        batch, shape.heads, shape.kv_heads, sq, sk, window, cu_q, cu_k, block_mask, dropout, score
    )
