"""Example prime-kernels plugin written in Triton: a MoE router. Import ``pk_example_router.ops`` (or
``prime_kernels.load("moe_router")``) for the kernel; this package itself stays light so that discovery never imports
Triton."""
