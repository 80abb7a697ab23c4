"""Example prime-kernels plugin: fused residual-add + RMSNorm. Import ``pk_example_rmsnorm.ops`` (or
``prime_kernels.load("residual_rmsnorm")``) for the kernel; this package itself stays light so that discovery never
loads compiled code."""
