"""`compile_variant`: a spec's user-defined score_mod as a flash-attn style function.

    from flashgen.torch import compile_variant

    alibi = compile_variant('''
    kernel: [forward, backward]
    dtype: bf16
    head_dim: 128
    score_mod: "s - slopes[h] * abs(i + seqlen_k - seqlen_q - j)"
    params: {slopes: per_head}
    ''')
    out = alibi(q, k, v, causal=True, slopes=slopes)        # flash_attn_func's conventions
    out = alibi.varlen(q, k, v, cu_q, cu_k, max_q, max_k, slopes=slopes)

The spec (YAML text, or the path of a spec file; docs/usermod.md, "In a spec") names the
modifier (`score_mod`, `params`), the dtypes and head dims it is built for and the kernel
kinds (forward; backward for autograd). Everything else about a call (mask, window, varlen,
GQA, dropout, deterministic, the family and tile for the GPU) is decided per call exactly as
for `flash_attn_func`: the call goes through `interface._attention` and the ops
`torch.ops.flashgen.fwd_variant` / `bwd_variant` (fwd's and bwd's arguments, then the
variant's, `ops.USER_ARGS`; the same implementation functions), so torch.compile, opcheck and
CUDA graphs serve it as they serve every other call. The compiled binding does not intercept
the variant ops: with it on, a variant call takes the ctypes path. The kernels are generated
and compiled on first use into the kernel cache (`flashgen.torch.cache`), like any other
kernel of flashgen.torch.

Refused (ValueError: `UnsupportedCall` or the spec's `SpecError`, naming what is wrong and
what is allowed): a spec that does not parse, one without `score_mod` (flash_attn_func serves
it), one with several score_mods (one variant per spec), decode kernels, a parameter named
like an argument of the call; and at call time missing, extra or ill-shaped parameters, and
dtypes or head dims the spec does not declare.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

from flashgen.generator.features import USER_SLOTS
from flashgen.generator.load import load_spec_file, load_spec_text
from flashgen.generator.spec import KernelKind, SpecError
from flashgen.generator.usermod import ParamKind, UserMod
from flashgen.torch.selection import UnsupportedCall

__all__ = ["Variant", "compile_variant"]

# the call's own argument names: a parameter may not take one of them
_CALL_ARGS = frozenset(
    "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale causal "
    "window_size deterministic return_attn_probs learnable_sink softcap alibi_slopes".split()
)
_SERVED_KINDS = (KernelKind.FORWARD, KernelKind.BACKWARD)
_TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
# what a parameter of each kind is, for messages
_KIND_TEXT = {
    ParamKind.SCALAR: "a float",
    ParamKind.SCALAR_INT: "an int",
    ParamKind.PER_HEAD: "a float32 tensor (heads,) on q's device",
    ParamKind.PER_BATCH: "a float32 tensor (batch,) on q's device",
    ParamKind.PER_BATCH_INT: "an int32 tensor (batch,) on q's device",
    ParamKind.TABLE: "a float32 tensor (heads, columns) on q's device",
}


def _load(spec: Union[str, os.PathLike]) -> list:
    """The KernelSpecs of YAML text or of a spec file (a path: a PathLike, or a one-line
    string naming an existing file ending in .yaml / .yml)."""
    if isinstance(spec, os.PathLike):
        return load_spec_file(spec)
    if not isinstance(spec, str):
        raise TypeError(
            f"compile_variant takes YAML spec text or a spec file's path, got {type(spec).__name__}"
        )
    one_line = "\n" not in spec.strip()
    if one_line and spec.strip().endswith((".yaml", ".yml")):
        path = Path(spec.strip()).expanduser()
        if not path.is_file():
            raise SpecError(f"no such spec file: {spec.strip()}")
        return load_spec_file(path)
    return load_spec_text(spec, "<compile_variant>")


class Variant:
    """A compiled attention variant (see the module docstring): call it as flash_attn_func,
    `.varlen` as flash_attn_varlen_func, plus the spec's parameters by name."""

    def __init__(self, specs: list) -> None:
        if not specs:
            raise SpecError("declares no kernel")
        mods = {s.score_mod for s in specs}
        if mods == {None}:
            raise UnsupportedCall(
                "the spec has no score_mod: compile_variant builds a user-defined score "
                "modifier (docs/usermod.md); a spec without one is served by flash_attn_func "
                "(softcap=, alibi_slopes=, causal=, window_size=)"
            )
        if len(mods) > 1:
            texts = sorted("none" if m is None else repr(m.canonical) for m in mods)
            raise UnsupportedCall(
                f"the spec declares {len(mods)} score_mods ({', '.join(texts)}); compile_variant "
                "takes one variant per spec: split it, one compile_variant each"
            )
        (mod,) = mods
        kinds = {s.kernel for s in specs}
        bad = sorted(k.yaml for k in kinds if k not in _SERVED_KINDS)
        if bad:
            raise UnsupportedCall(
                f"the spec declares kernel: {', '.join(bad)}; compile_variant builds forward "
                "and backward kernels (kernel: [forward, backward]); decode takes no variant yet"
            )
        clash = sorted(n for n, _ in mod.params if n in _CALL_ARGS)
        if clash:
            raise UnsupportedCall(
                f"parameter {', '.join(clash)} of the score_mod has the name of an argument of "
                "the call: rename it in params and in the expression"
            )
        from flashgen.torch import ops

        self.score_mod: UserMod = mod
        self.key: str = ops.variant_key(mod)
        self.params: dict[str, ParamKind] = dict(mod.params)
        self.dtypes = frozenset(_TORCH_DTYPES[s.dtype.yaml] for s in specs)
        self.head_dims = frozenset(int(s.head_dim) for s in specs)
        self.backward = KernelKind.BACKWARD in kinds
        self.specs = tuple(specs)

    def __repr__(self) -> str:
        decl = ", ".join(f"{n}: {k.value}" for n, k in self.params.items())
        return f"Variant({self.score_mod.canonical!r}, params={{{decl}}})"

    # -- the op's user arguments ------------------------------------------------------------

    def user_args(self, params: Mapping[str, Any]) -> tuple:
        """The variant ops' nine user arguments (`ops.USER_ARGS`) for these parameter values:
        slot k (the k-th parameter by name) takes a tensor in user_t<k> or a number in
        user_s<k>.
        Missing and undeclared names are refused here; values are checked by the op."""
        extra = sorted(set(params) - set(self.params))
        missing = [n for n in self.params if n not in params]
        if extra or missing:
            decl = ", ".join(f"{n}= ({_KIND_TEXT[k]})" for n, k in self.params.items())
            what = []
            if missing:
                what.append(f"missing {', '.join(missing)}")
            if extra:
                what.append(f"unknown {', '.join(extra)}")
            raise UnsupportedCall(
                f"{'; '.join(what)}: this variant takes the parameters {decl or 'none'} "
                f"(score_mod {self.score_mod.canonical!r})"
            )
        tensors: list = [None] * USER_SLOTS
        numbers: list = [0.0] * USER_SLOTS
        for k, (name, kind) in enumerate(self.params.items()):
            value = params[name]
            if kind in (ParamKind.SCALAR, ParamKind.SCALAR_INT):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
                        raise UnsupportedCall(
                            f"{name}= ({kind.value}) must be a Python number, not a tensor "
                            "(pass float(x); a tensor's value would need a device sync)"
                        )
                    raise UnsupportedCall(
                        f"{name}= ({kind.value}) must be {_KIND_TEXT[kind]}, got "
                        f"{type(value).__name__}"
                    )
                if not math.isfinite(value):
                    raise UnsupportedCall(f"{name}= ({kind.value}) must be finite, got {value}")
                numbers[k] = float(value)
            else:
                import torch

                if not isinstance(value, torch.Tensor):
                    raise UnsupportedCall(
                        f"{name}= ({kind.value}) must be {_KIND_TEXT[kind]}, got "
                        f"{type(value).__name__}"
                    )
                tensors[k] = value
        return (self.key, *tensors, *numbers)

    @staticmethod
    def _no_builtin(softcap, alibi_slopes) -> None:
        """softcap= and alibi_slopes= keep their places in the call (flash_attn_func's
        positional order) but a variant takes neither: its score_mod gives the whole logit."""
        if softcap != 0.0 or alibi_slopes is not None:
            name = "softcap" if softcap != 0.0 else "alibi_slopes"
            raise UnsupportedCall(
                f"{name}= is not taken by a variant: its score_mod gives the whole logit, so "
                "write it in the expression (cap * tanh(s / cap), s - slopes[h] * abs(i + "
                "seqlen_k - seqlen_q - j)) with its parameter in params (docs/usermod.md)"
            )

    def _check_call(self, q, k, v) -> None:
        import torch

        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise UnsupportedCall(f"{name} must be a tensor, got {type(t).__name__}")
        dtype = str(q.dtype).removeprefix("torch.")
        if dtype not in self.dtypes:
            raise UnsupportedCall(
                f"q has dtype {dtype}; this variant's spec declares "
                f"{', '.join(sorted(self.dtypes))} (add the dtype to the spec's dtype field)"
            )
        d = q.shape[-1] if q.dim() else 0
        if d not in self.head_dims:
            dims = ", ".join(map(str, sorted(self.head_dims)))
            raise UnsupportedCall(
                f"q has head_dim {d}; this variant's spec declares head_dim {dims} (add it to "
                "the spec's head_dim field: variants are not zero-padded)"
            )
        if (
            not self.backward
            and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad)
        ):
            raise UnsupportedCall(
                "q, k or v requires grad but the spec declares no backward kernel: add "
                "kernel: [forward, backward], or call under torch.no_grad()"
            )

    # -- the entry points --------------------------------------------------------------------

    def __call__(
        self,
        q,
        k,
        v,
        dropout_p: float = 0.0,
        softmax_scale: Optional[float] = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes=None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        *,
        learnable_sink=None,
        **params: Any,
    ):
        """flash_attn_func's call, plus the spec's parameters by name (softcap and
        alibi_slopes must stay off: write them in the score_mod)."""
        from flashgen.torch import interface

        self._no_builtin(softcap, alibi_slopes)
        user = self.user_args(params)
        self._check_call(q, k, v)
        return interface._attention(
            q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal, window_size, 0.0, None,
            deterministic, return_attn_probs, learnable_sink, user,
        )  # fmt: skip

    def varlen(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float = 0.0,
        softmax_scale: Optional[float] = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes=None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        block_table=None,
        *,
        learnable_sink=None,
        **params: Any,
    ):
        """flash_attn_varlen_func's call (packed sequences, or paged K/V with block_table;
        per_batch parameters have one entry per sequence), plus the spec's parameters by
        name."""
        from flashgen.torch import interface

        self._no_builtin(softcap, alibi_slopes)
        user = self.user_args(params)
        self._check_call(q, k, v)
        if block_table is not None:
            k, v = interface._paged_kv(k, v, cu_seqlens_k, block_table)
        return interface._attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
            dropout_p, softmax_scale, causal, window_size, 0.0, None, deterministic,
            return_attn_probs, learnable_sink, user,
        )  # fmt: skip


def compile_variant(spec: Union[str, os.PathLike]) -> Variant:
    """The attention variant of a flashgen spec with a `score_mod` (YAML text, or a spec
    file's path): a callable with flash_attn_func's conventions plus the spec's declared
    parameters by name, `.varlen` with flash_attn_varlen_func's. Its kernels are compiled on
    first use into the kernel cache; gradients flow to q, k and v (not to the parameters).
    See the module docstring and docs/torch.md, "User-defined variants"."""
    return Variant(_load(spec))
