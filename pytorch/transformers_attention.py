"""flashgen's kernels as a Hugging Face transformers attention implementation.

    from flashgen.torch import transformers_attention
    transformers_attention.register()                  # the name "fgen"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="fgen",
                                                 dtype=torch.bfloat16).cuda()

`register(name)` adds an attention function to transformers' `AttentionInterface` and the
2-D padding-mask function of its flash-attention integration (`masking_utils.
flash_attention_mask`) to its `AttentionMaskInterface`, both under `name`. The name must not
contain "flash" (so not "flashgen"): transformers treats such names as flash-attn's, and then
requires the flash-attn package or loads a Hub kernel of that name. transformers is imported
by `register()`, never by importing `flashgen.torch` or this module.

transformers calls the function per layer as `fn(module, query, key, value, attention_mask,
dropout=..., scaling=..., **kwargs)` with `(batch, heads, seqlen, head_dim)` tensors (k and v
straight from the KV cache during `generate()`); it returns `(out, None)`, `out` in
`(batch, seqlen_q, heads, head_dim)`. What it is handed, and how each case runs:

- no mask (`None`): `flash_attn_func` on the `x.transpose(1, 2)` views (no copy). Causal
  models (`module.is_causal`, or an `is_causal` keyword) use `causal=True`, aligned to the
  bottom-right corner as in flash-attn: a decode step (seqlen_q of 1 or a few, keys from the
  cache) sees every cached key and the causal part of its own;
- a 2-D padding mask `(batch, kv_len)` (1/True: a token), what `flash_attention_mask` gives
  when some sequence is padded: the tokens are gathered (`padding_plan`, `unpad`), run through
  `flash_attn_varlen_func` with one sequence per batch row, and scattered back (`pad`; rows of
  padded queries are 0). Queries are the last seqlen_q tokens of the key sequence (left
  padding when decoding with a cache, as flash-attn's integration assumes); a mask shorter
  than the keys (a static cache) drops the keys past it;
- a 4-D mask `(batch, 1 or heads, q_len, kv_len)`, boolean (True: attend) or additive float
  (0: attend, <= -1e4 or -inf: masked; a user's mask, or one of an older transformers):
  `classify_mask` finds its padding and checks that, on the queries kept, it is exactly the
  mask the varlen call applies (causal or not, with the sliding window); then as above. Any
  other mask, such as an additive bias, falls back (below);
- packed sequences without a mask: `cu_seq_lens_q`/`cu_seq_lens_k` (`max_length_q/k`)
  keywords, or `position_ids` that restart (batch 1), become varlen sequences over the
  flattened tokens (`packed_plan`), as transformers' flash-attention integration does;
- GQA/MQA: k and v keep their fewer heads (no `repeat_kv`);
- keywords: `scaling` -> `softmax_scale`; `dropout` -> `dropout_p` only while
  `module.training`; `sliding_window=W` -> `window_size=(W - 1, W - 1)` when kv_len > W (the
  flash-attention mapping: a query sees itself and W - 1 keys before it); `softcap` ->
  `softcap`; `s_aux` (gpt-oss's sinks) -> `learnable_sink` (float32); a float32 query (e.g.
  a PEFT-upcast layer norm) is cast to the autocast dtype or the module's float16/bfloat16
  weight dtype, as flash-attn's integration does; a value head dim below the query's is
  zero-padded and the output cropped (MLA). `output_attentions=True` gives `None` weights
  with a one-time warning (as transformers' sdpa and flash-attention functions do).

What flashgen cannot serve falls back, with a one-time warning per kind of reason, to transformers'
own "sdpa" function, given a mask that says what the call meant (the padding and window as a
4-D boolean mask): an arbitrary 4-D or 3-D mask, a `position_bias` (T5-like), tensors off
CUDA, a float32 model, and whatever flashgen's functions refuse (`UnsupportedCall`: a head
dim above 256, a GPU other than compute capability 8.0/8.6/8.9/9.0, ...). A call that sdpa
cannot serve either (`softcap`, `s_aux`) raises UnsupportedCall instead. `register(name,
strict=True)` raises UnsupportedCall in every such case instead of falling back.

Each decision that reads mask or position values (a device-to-host copy) is made once per
mask tensor and reused by every layer that gets the same tensor (`_Memo`). Not traced by
torch.compile(fullgraph=True): unpadding has data-dependent shapes, as in flash-attn's
integration.
"""

from __future__ import annotations

import re
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, NamedTuple, Optional

import torch
from flashgen.torch.selection import UnsupportedCall
from torch import Tensor

__all__ = [
    "DEFAULT_NAME",
    "MaskClass",
    "Plan",
    "check_name",
    "classify_mask",
    "mask_4d_from_padding",
    "packed_mask_4d",
    "packed_plan",
    "pad",
    "padding_plan",
    "register",
    "register_transformers",
    "unpad",
]

DEFAULT_NAME = "fgen"  # not "flashgen": transformers reads any name with "flash" as flash-attn's
MASKED_BELOW = -1.0e4  # an additive mask value at or below this masks the key out
_RESERVED = ("eager", "sdpa", "flex_attention")  # transformers' own names


# --------------------------------------------------------------------------------------------
# The name
# --------------------------------------------------------------------------------------------


def check_name(name: Any) -> str:
    """`name` if transformers can take it as a custom attention implementation, else
    ValueError saying why: it must be a non-empty str without "flash" (transformers then
    requires the flash-attn package), not one of its own names, not `paged|...`, and not of
    the `org/repo` form it loads from the Hub."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"the attention implementation name must be a non-empty str, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(
            f"attention implementation name {name!r} contains 'flash': transformers treats "
            "such names as flash-attn's and requires the flash-attn package for them; choose "
            f"another name, e.g. {DEFAULT_NAME!r}"
        )
    if name in _RESERVED or name.startswith("paged|"):
        raise ValueError(
            f"attention implementation name {name!r} is one of transformers' own; choose "
            f"another, e.g. {DEFAULT_NAME!r}"
        )
    if re.search(r"[/:@]", name):
        raise ValueError(
            f"attention implementation name {name!r} has the 'org/repo' form of a Hub kernel, "
            f"which transformers downloads; choose a plain name, e.g. {DEFAULT_NAME!r}"
        )
    return name


# --------------------------------------------------------------------------------------------
# Plans: which tokens run, as which varlen sequences (pure tensor functions, any device)
# --------------------------------------------------------------------------------------------


class Plan(NamedTuple):
    """How one attention call runs.

    `kind`: "dense" (flash_attn_func on the whole batch), "padded" (varlen over the tokens
    `indices_q` / `indices_k` of the flattened `(batch * seqlen)` queries and keys, one
    sequence per batch row) or "packed" (varlen over all flattened tokens, sequences at
    `cu_seqlens_*`). `causal` is the call's (bottom-right aligned per sequence)."""

    kind: str
    causal: bool
    indices_q: Optional[Tensor] = None
    indices_k: Optional[Tensor] = None
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


def _cumulative(lengths: Tensor) -> Tensor:
    """int32 `[0, l0, l0 + l1, ...]` of per-sequence lengths."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def padding_plan(k_valid: Tensor, q_valid: Tensor, causal: bool) -> Plan:
    """The plan of a batch whose row b has the keys `k_valid[b]` and the queries
    `q_valid[b]` (boolean `(batch, kv_len)`, `(batch, q_len)`): dense when every token is
    kept, else one varlen sequence per row. One device-to-host copy (the lengths), and one
    more for the indices when some token is dropped."""
    k_valid, q_valid = k_valid.bool(), q_valid.bool()
    lens_k = k_valid.sum(-1, dtype=torch.int32)
    lens_q = q_valid.sum(-1, dtype=torch.int32)
    host = torch.cat([lens_k, lens_q]).tolist()
    batch = k_valid.shape[0]
    host_k, host_q = host[:batch], host[batch:]
    if all(n == k_valid.shape[1] for n in host_k) and all(n == q_valid.shape[1] for n in host_q):
        return Plan("dense", causal)
    return Plan(
        "padded",
        causal,
        indices_q=q_valid.flatten().nonzero().flatten(),
        indices_k=k_valid.flatten().nonzero().flatten(),
        cu_seqlens_q=_cumulative(lens_q),
        cu_seqlens_k=_cumulative(lens_k),
        max_seqlen_q=max(host_q, default=0),
        max_seqlen_k=max(host_k, default=0),
    )


def padding_from_2d(mask: Tensor, q_len: int, kv_len: int) -> tuple[Tensor, Tensor]:
    """(k_valid, q_valid) of a 2-D padding mask `(batch, L)` (nonzero: a token) for q_len
    queries and kv_len keys: a mask longer than the keys is read from the right (a sliding
    cache), one shorter keeps only the keys it covers (the caller slices them: a static
    cache). Queries are the last q_len keys (left padding, as flash-attn's integration);
    a single query is always kept."""
    k_valid = mask.bool()
    if k_valid.shape[-1] > kv_len:
        k_valid = k_valid[:, -kv_len:]
    if q_len == 1:
        q_valid = torch.ones((k_valid.shape[0], 1), dtype=torch.bool, device=k_valid.device)
    elif q_len <= k_valid.shape[-1]:
        q_valid = k_valid[:, k_valid.shape[-1] - q_len :]
    else:
        raise UnsupportedCall(
            f"a 2-D padding mask of {k_valid.shape[-1]} positions for {q_len} queries: the "
            "queries must be the last keys (allowed: a mask at least as long as the queries)"
        )
    return k_valid, q_valid


def packed_plan(
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    causal: bool,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
) -> Plan:
    """The plan of sequences packed along the flattened tokens (`cu_seqlens_*`: `n + 1`
    cumulative lengths from 0); the max lengths are taken from the lengths when not given."""
    cu_q = cu_seqlens_q.to(torch.int32).contiguous()
    cu_k = cu_seqlens_k.to(torch.int32).contiguous()
    if max_seqlen_q is None or max_seqlen_k is None:
        host = torch.stack([cu_q.diff().max(), cu_k.diff().max()]).tolist()
        max_seqlen_q = host[0] if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = host[1] if max_seqlen_k is None else max_seqlen_k
    return Plan(
        "packed",
        causal,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=int(max_seqlen_q),
        max_seqlen_k=int(max_seqlen_k),
    )


def cu_seqlens_from_position_ids(position_ids: Tensor) -> Optional[Tensor]:
    """The int32 cumulative lengths of the sequences packed in a `(1, total)` row of
    `position_ids` (each restarts at the row's smallest position, as transformers'
    `prepare_fa_kwargs_from_position_ids`), or None when the row is one increasing run
    (nothing packed)."""
    flat = position_ids.reshape(-1)
    if flat.numel() < 2:
        return None
    steps = torch.arange(flat.numel(), device=flat.device) + flat.min()
    if not bool((steps != flat).any()):
        return None
    starts = (flat == flat.min()).nonzero().flatten().to(torch.int32)
    end = torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)
    return torch.cat([starts, end])


def unpad(x: Tensor, indices: Tensor) -> Tensor:
    """`(batch, seqlen, ...)` -> `(len(indices), ...)`: the rows `indices` of the flattened
    `(batch * seqlen)` positions, gathered from x as it is laid out (one copy)."""
    seqlen = x.shape[1]
    return x[torch.div(indices, seqlen, rounding_mode="floor"), indices % seqlen]


def pad(y: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """The inverse of `unpad`: `(len(indices), ...)` -> `(batch, seqlen, ...)`, zeros at the
    positions not in `indices` (differentiable in y)."""
    out = y.new_zeros((batch * seqlen, *y.shape[1:]))
    out[indices] = y
    return out.view(batch, seqlen, *y.shape[1:])


def _window_terms(rel: Tensor, allowed: Tensor, causal: bool, window: tuple[int, int]) -> Tensor:
    """`allowed` where `rel` (key position minus the query's diagonal, per sequence) obeys the
    causal bound and the window (-1: unbounded), flash-attn's rule."""
    left, right = window
    if causal:
        allowed = allowed & (rel <= 0)
    elif right >= 0:
        allowed = allowed & (rel <= right)
    if left >= 0:
        allowed = allowed & (rel >= -left)
    return allowed


def mask_4d_from_padding(
    k_valid: Tensor, q_valid: Tensor, causal: bool, window: tuple[int, int] = (-1, -1)
) -> Tensor:
    """The boolean `(batch, 1, q_len, kv_len)` mask (True: attend) that a padding plan of
    (k_valid, q_valid) computes: in row b, kept query i (the i'-th kept one) sees kept key j
    (the j'-th) iff `j' <= i' + n_k - n_q` when causal (bottom-right per sequence) and within
    the window; rows of dropped queries see nothing."""
    k_valid, q_valid = k_valid.bool(), q_valid.bool()
    kc = k_valid.long().cumsum(-1) - 1
    qc = q_valid.long().cumsum(-1) - 1
    shift = (k_valid.sum(-1) - q_valid.sum(-1))[:, None, None]
    rel = kc[:, None, :] - qc[:, :, None] - shift
    allowed = q_valid[:, :, None] & k_valid[:, None, :]
    return _window_terms(rel, allowed, causal, window)[:, None]


def packed_mask_4d(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, causal: bool, window: tuple[int, int] = (-1, -1)
) -> Tensor:
    """The boolean `(1, 1, total_q, total_k)` mask that a packed plan computes: query and key
    see each other only within one sequence, causal bottom-right per sequence."""
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    tq = torch.arange(int(cu_q[-1]), device=cu_q.device)
    tk = torch.arange(int(cu_k[-1]), device=cu_k.device)
    sq = torch.searchsorted(cu_q[1:], tq, right=True)
    sk = torch.searchsorted(cu_k[1:], tk, right=True)
    lens_q, lens_k = cu_q.diff(), cu_k.diff()
    iq = tq - cu_q[sq] + (lens_k - lens_q)[sq]  # the query's diagonal, in key positions
    jk = tk - cu_k[sk]
    rel = jk[None, :] - iq[:, None]
    allowed = sq[:, None] == sk[None, :]
    return _window_terms(rel, allowed, causal, window)[None, None]


class MaskClass(NamedTuple):
    """What a 4-D mask is: "padding" (with the `k_valid`, `q_valid` it keeps and whether it
    is `causal`) or "arbitrary" (no plan computes it; `reason` says why)."""

    kind: str
    causal: bool = False
    k_valid: Optional[Tensor] = None
    q_valid: Optional[Tensor] = None
    reason: str = ""


def mask_allowed(mask: Tensor) -> Optional[Tensor]:
    """The boolean (True: attend) `(batch, heads, q, kv)` form of a 4-D mask: bool as it is;
    float additive, 0 attends and <= MASKED_BELOW (or -inf) masks. None when a float mask
    holds any other value (a bias, not a mask)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return mask != 0
    zero, masked = mask == 0, mask <= MASKED_BELOW
    if not bool((zero | masked).all()):
        return None
    return zero


def classify_mask(
    mask: Tensor,
    batch: int,
    q_len: int,
    kv_len: int,
    prefer_causal: bool,
    window: tuple[int, int] = (-1, -1),
) -> MaskClass:
    """Whether a 4-D attention mask is one that a padding plan computes exactly on the
    queries it keeps. The keys kept are those some query sees; the queries kept are those
    that see some key, else (right padding) those at kept key positions, the queries being
    the last keys. On the kept queries the mask must equal `mask_4d_from_padding` of them,
    causal or not (`prefer_causal` is tried first) with `window`, in every head. A mask wider
    than kv_len is cut to its first kv_len keys."""
    if mask.dim() != 4:
        return MaskClass("arbitrary", reason=f"a {mask.dim()}-D attention mask")
    if mask.shape[-1] > kv_len:
        mask = mask[..., :kv_len]
    if mask.shape[-2:] != (q_len, kv_len) or mask.shape[0] not in (1, batch):
        return MaskClass(
            "arbitrary",
            reason=f"an attention mask of shape {tuple(mask.shape)} for "
            f"batch {batch}, {q_len} queries and {kv_len} keys",
        )
    allowed = mask_allowed(mask)
    if allowed is None:
        return MaskClass(
            "arbitrary", reason="an additive attention bias (values other than 0 and masked)"
        )
    if allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        return MaskClass("arbitrary", reason="an attention mask that differs between heads")
    allowed = allowed[:, 0].expand(batch, q_len, kv_len)
    k_valid = allowed.any(-2)
    # The queries kept: those that see a key (left padding, a static cache's prefill), or
    # those at kept key positions when the queries are the last keys (right padding: its pad
    # queries see keys; their rows are not compared, and their outputs are 0 as in varlen).
    candidates = [allowed.any(-1)]
    if q_len <= kv_len:
        candidates.append(k_valid[:, kv_len - q_len :])
    for q_valid in candidates:
        for causal in (prefer_causal, not prefer_causal):
            want = mask_4d_from_padding(k_valid, q_valid, causal, window)[:, 0]
            if torch.equal(want[q_valid], allowed[q_valid]):
                return MaskClass("padding", causal, k_valid, q_valid)
    return MaskClass(
        "arbitrary", reason="an attention mask that is not padding on a causal or full mask"
    )


# --------------------------------------------------------------------------------------------
# Memo: one decision per mask tensor, reused by every layer
# --------------------------------------------------------------------------------------------


class _Memo:
    """Results computed from a tensor (weakly referenced, so it is not kept alive), reused
    while that same tensor is alive and unmodified (`_version`). Not under tracing."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    def get(self, tensor: Tensor, key: tuple, make: Callable[[], Any]) -> Any:
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return make()
        full = (id(tensor), tensor._version, key)
        hit = self.entries.get(full)
        if hit is not None and hit[0]() is tensor:
            self.entries.move_to_end(full)
            return hit[1]
        value = make()
        self.entries[full] = (weakref.ref(tensor), value)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


_MEMO = _Memo()


# --------------------------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------------------------


class _Fallback(Exception):
    """flashgen cannot serve the call: `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_WARNED: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


def _kernels():
    """(flash_attn_func, flash_attn_varlen_func): flashgen's (the CPU tests replace them)."""
    from flashgen.torch.interface import flash_attn_func, flash_attn_varlen_func

    return flash_attn_func, flash_attn_varlen_func


def _served_device(t: Tensor) -> bool:
    """Whether t is where flashgen's kernels run (the CPU tests replace this)."""
    return t.device.type == "cuda"


def _target_dtype(query: Tensor, module: Any) -> Optional[torch.dtype]:
    """The half dtype a float32 query is cast to (flash-attn's integration's rule): the
    autocast dtype, else the first Linear weight's dtype of the module; None if not half."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = None
        for layer in module.modules() if isinstance(module, torch.nn.Module) else ():
            if isinstance(layer, torch.nn.Linear):
                dtype = layer.weight.dtype
                break
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def _window(sliding_window: Optional[int], kv_len: int) -> tuple[int, int]:
    if sliding_window is None or kv_len <= int(sliding_window):
        return (-1, -1)
    return (int(sliding_window) - 1, int(sliding_window) - 1)


def _plan(
    attention_mask,
    kwargs: dict,
    batch: int,
    q_len: int,
    kv_len: int,
    causal: bool,
    window: tuple[int, int],
) -> tuple[Plan, int]:
    """The call's plan and the number of keys it reads (a 2-D mask shorter than the keys
    drops the rest). Raises _Fallback for a mask no plan computes."""
    if attention_mask is None:
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if cu_q is not None and cu_k is not None:
            return packed_plan(
                cu_q, cu_k, causal, kwargs.get("max_length_q"), kwargs.get("max_length_k")
            ), kv_len
        position_ids = kwargs.get("position_ids")
        if (
            isinstance(position_ids, Tensor)
            and batch == 1
            and q_len == kv_len > 1
            and position_ids.numel() == q_len
        ):
            cu = _MEMO.get(
                position_ids, ("packed",), lambda: cu_seqlens_from_position_ids(position_ids)
            )
            if cu is not None:
                return _MEMO.get(
                    position_ids, ("plan", causal), lambda: packed_plan(cu, cu, causal)
                ), kv_len
        return Plan("dense", causal), kv_len
    if not isinstance(attention_mask, Tensor):
        raise _Fallback(f"an attention mask of type {type(attention_mask).__name__}")
    if attention_mask.dim() == 2:
        keys = min(kv_len, attention_mask.shape[-1])

        def make() -> Plan:
            k_valid, q_valid = padding_from_2d(attention_mask, q_len, keys)
            return padding_plan(k_valid, q_valid, causal)

        return _MEMO.get(attention_mask, ("2d", q_len, keys, causal), make), keys

    def classify() -> MaskClass:
        return classify_mask(attention_mask, batch, q_len, kv_len, causal, window)

    found = _MEMO.get(attention_mask, ("4d", batch, q_len, kv_len, causal, window), classify)
    if found.kind != "padding":
        raise _Fallback(found.reason)
    return _MEMO.get(
        attention_mask,
        ("4d-plan", batch, q_len, kv_len, causal, window),
        lambda: padding_plan(found.k_valid, found.q_valid, found.causal),
    ), kv_len


def _fallback_mask(attention_mask, kwargs, batch, q_len, kv_len, causal, window):
    """The mask sdpa needs to compute what the call means (None: its `is_causal` does)."""
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
        keys = min(kv_len, attention_mask.shape[-1])
        k_valid, q_valid = padding_from_2d(attention_mask, q_len, keys)
        mask = mask_4d_from_padding(k_valid, q_valid, causal, window)
        if keys < kv_len:
            mask = torch.nn.functional.pad(mask, (0, kv_len - keys), value=False)
        return mask
    if attention_mask is not None:
        return attention_mask
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    if cu_q is None and isinstance(position_ids, Tensor) and batch == 1 and q_len == kv_len:
        cu_q = cu_k = cu_seqlens_from_position_ids(position_ids)
    if cu_q is not None and cu_k is not None:
        return packed_mask_4d(cu_q, cu_k, causal, window).expand(batch, 1, -1, -1)
    if window != (-1, -1) or (causal and 1 < q_len != kv_len):
        device = position_ids.device if isinstance(position_ids, Tensor) else None
        ones_k = torch.ones((batch, kv_len), dtype=torch.bool, device=device)
        ones_q = torch.ones((batch, q_len), dtype=torch.bool, device=device)
        return mask_4d_from_padding(ones_k, ones_q, causal, window)
    return None


def _run(plan: Plan, q: Tensor, k: Tensor, v: Tensor, keys: int, call: dict) -> Tensor:
    """flashgen on `(batch, seqlen, heads, head_dim)` views; the output in that layout."""
    flash_attn_func, flash_attn_varlen_func = _kernels()
    if keys < k.shape[1]:
        k, v = k[:, :keys], v[:, :keys]
    batch, q_len = q.shape[:2]
    if plan.kind == "dense":
        return flash_attn_func(q, k, v, causal=plan.causal, **call)
    if plan.kind == "padded":
        out = flash_attn_varlen_func(
            unpad(q, plan.indices_q),
            unpad(k, plan.indices_k),
            unpad(v, plan.indices_k),
            plan.cu_seqlens_q,
            plan.cu_seqlens_k,
            plan.max_seqlen_q,
            plan.max_seqlen_k,
            causal=plan.causal,
            **call,
        )
        return pad(out, plan.indices_q, batch, q_len)
    out = flash_attn_varlen_func(
        q.reshape(-1, *q.shape[2:]),
        k.reshape(-1, *k.shape[2:]),
        v.reshape(-1, *v.shape[2:]),
        plan.cu_seqlens_q,
        plan.cu_seqlens_k,
        plan.max_seqlen_q,
        plan.max_seqlen_k,
        causal=plan.causal,
        **call,
    )
    return out.view(batch, q_len, *out.shape[1:])


def _attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float,
    scaling: Optional[float],
    sliding_window: Optional[int],
    softcap: Optional[float],
    is_causal: Optional[bool],
    s_aux: Optional[Tensor],
    kwargs: dict,
) -> Tensor:
    """flashgen's output `(batch, q_len, heads, head_dim)`, or _Fallback."""
    if kwargs.get("position_bias") is not None:
        raise _Fallback("a position_bias (an additive attention bias)")
    if not _served_device(query):
        raise _Fallback(f"tensors on {query.device.type} (flashgen's kernels run on CUDA)")
    if query.dtype == torch.float32:
        target = _target_dtype(query, module)
        if target is None:
            raise _Fallback("float32 attention (flashgen's kernels take float16 and bfloat16)")
        query, key, value = query.to(target), key.to(target), value.to(target)
    batch, _, q_len, head_dim = query.shape
    kv_len, v_dim = key.shape[2], value.shape[-1]
    if v_dim > head_dim:
        raise _Fallback(f"a value head dim {v_dim} above the query's {head_dim}")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = _window(sliding_window, kv_len)
    plan, keys = _plan(attention_mask, kwargs, batch, q_len, kv_len, causal, window)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if v_dim < head_dim:
        v = torch.nn.functional.pad(v, (0, head_dim - v_dim))
    call = {
        "dropout_p": float(dropout) if getattr(module, "training", False) else 0.0,
        "softmax_scale": None if scaling is None else float(scaling),
        "window_size": window,
        "softcap": 0.0 if softcap is None else float(softcap),
        "learnable_sink": None if s_aux is None else s_aux.float(),
    }
    out = _run(plan, q, k, v, keys, call)
    return out[..., :v_dim] if v_dim < head_dim else out


def _make_attention(strict: bool) -> Callable:
    def flashgen_attention_forward(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        dropout: float = 0.0,
        scaling: Optional[float] = None,
        sliding_window: Optional[int] = None,
        softcap: Optional[float] = None,
        is_causal: Optional[bool] = None,
        s_aux: Optional[Tensor] = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        """transformers' attention function signature over flashgen's kernels (see
        flashgen.torch.transformers_attention)."""
        if kwargs.get("output_attentions", False):
            _warn_once(
                "output_attentions",
                "flashgen attention does not return attention "
                "weights (output_attentions=True gives None); use "
                "attn_implementation='eager' for them",
            )
        try:
            try:
                out = _attention(
                    module,
                    query,
                    key,
                    value,
                    attention_mask,
                    dropout,
                    scaling,
                    sliding_window,
                    softcap,
                    is_causal,
                    s_aux,
                    kwargs,
                )
                return out, None
            except UnsupportedCall as e:
                raise _Fallback(f"flashgen refused the call ({e})") from e
        except _Fallback as fb:
            if strict:
                raise UnsupportedCall(f"flashgen attention cannot serve {fb.reason}") from fb
            return _sdpa_fallback(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout,
                scaling,
                sliding_window,
                softcap,
                is_causal,
                s_aux,
                kwargs,
                fb.reason,
            )

    return flashgen_attention_forward


def _sdpa_fallback(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout,
    scaling,
    sliding_window,
    softcap,
    is_causal,
    s_aux,
    kwargs,
    reason,
):
    if softcap is not None or s_aux is not None:
        what = "softcap" if softcap is not None else "s_aux (attention sinks)"
        raise UnsupportedCall(
            f"flashgen attention cannot serve {reason}, and transformers' sdpa, its fallback, "
            f"has no {what}: use attn_implementation='eager'"
        )
    kind = reason.split(" (")[0]
    _warn_once(kind, f"flashgen attention falls back to transformers' sdpa for {reason}")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = _window(sliding_window, kv_len)
    mask = _fallback_mask(attention_mask, kwargs, batch, q_len, kv_len, causal, window)
    if isinstance(mask, Tensor) and mask.device != query.device:
        mask = mask.to(query.device)
    rest = {
        k: v
        for k, v in kwargs.items()
        if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    }
    return ALL_ATTENTION_FUNCTIONS["sdpa"](
        module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=causal, **rest
    )


def register(name: str = DEFAULT_NAME, *, strict: bool = False) -> str:
    """Register flashgen's attention function with transformers under `name` (checked by
    `check_name`: no "flash" in it), and transformers' 2-D padding-mask function for it, so
    that models built with `attn_implementation=name` run flashgen's kernels. With
    `strict=True` a call flashgen cannot serve raises UnsupportedCall instead of falling back
    to transformers' sdpa. Returns the name. Imports transformers (>= 4.48; the mask function
    needs >= 4.53, older versions hand 4-D masks, which are classified)."""
    check_name(name)
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError(
            f"flashgen.torch.transformers_attention.register needs transformers >= 4.48 with "
            f"AttentionInterface ({e}): pip install transformers"
        ) from e
    AttentionInterface.register(name, _make_attention(bool(strict)))
    try:
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:  # before 4.53: models build 4-D masks themselves
        return name
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


register_transformers = register  # the name flashgen.torch exports it under
