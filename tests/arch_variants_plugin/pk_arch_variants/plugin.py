from prime_kernels_core import hookimpl, manifest


@hookimpl
def prime_kernels_declare():
    return manifest.declare(__file__)
