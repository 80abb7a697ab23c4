"""prime-kernels plugin fused_logp. Import ``prime_kernels_fused_logp.ops`` (or ``prime_kernels.load("fused_logp")``)
for the kernels; this package itself stays light so that discovery never loads compiled code."""
