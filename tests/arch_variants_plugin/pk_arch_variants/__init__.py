"""Test plugin of the build kit: ``scale(x, factor)`` whose CUDA code comes from a 9.0a source set on sm_90 and from
a generic one elsewhere. Each source refuses to compile for the other's archs, so building it proves the kit compiles
every source set for its own archs only."""
