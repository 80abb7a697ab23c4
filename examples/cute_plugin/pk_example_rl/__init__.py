"""Example prime-kernels plugin written in the CuTe DSL: PPO's clipped surrogate loss per token. Import
``pk_example_rl.ops`` (or ``prime_kernels.load("ppo_loss")``) for the kernel; this package itself stays light so that
discovery never imports the DSL."""
