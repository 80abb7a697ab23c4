"""prime-kernels plugin flash_moe (fused MoE experts, bf16). Import ``prime_kernels_flash_moe.ops`` (or
``prime_kernels.load("flash_moe")``) for the kernels; this package itself stays light so that discovery never loads
compiled code."""
