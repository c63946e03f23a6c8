"""flashgen verification: what a kernel's outputs are compared with, and how.

Modules (docs/verification.md says how they fit together; docs/conventions.md is the contract
they share with the CUDA templates):

- `reference`: the one float64 reference forward/backward and the visibility mask.
- `score_mods`: the score-stage features' values (softcap, ALiBi slopes, sinks), their checks
  and their arithmetic in float64 and in the kernel's precision.
- `baseline`: standard attention in the kernel's precision (fp16 / bf16), and `round_to_dtype`.
- `passrule`: the pass rule (kernel error against twice the baseline error plus a noise floor).
- `philox`, `dropout`: Philox4x32-10 and the dropout keep-mask the kernels draw.
- `blocksparse`: the compact block-sparse layout (full / partial tiles).
- `tiled_model`: a NumPy emulation of the kernel's tile loop that counts HBM bytes.
- `io_model`: closed-form HBM bytes of a kernel, standard attention and the paper's bound.
- `strategies`: Hypothesis strategies (shapes, lengths, windows, layouts, values, specs).
- `runner`, `runner_bwd`: NumPy in, NumPy out through a kernel's C launcher (poisoned margins).
- `io_model_bwd`, `blocksparse_bwd`: the backward's exact HBM bytes and transposed layout.

Nothing is imported here, so `import flashgen.verify.reference` does not pull in Hypothesis.
"""
