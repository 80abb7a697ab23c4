from prime_kernels_core.build import setup_plugin

setup_plugin()
