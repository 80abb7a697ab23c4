import types

import pytest

from prime_kernels_core.contracts import ShapeContract, UnsupportedShapeError, check_shape


def _kernel(**members):
    return types.SimpleNamespace(**members)


def test_contract_reason_becomes_error():
    kernel = _kernel(BLOCK_M=128, unsupported_shape_reason=lambda dim: None if dim % 128 == 0 else f"dim={dim}, needs a multiple of 128")
    assert isinstance(kernel, ShapeContract)
    check_shape(kernel, 256)
    with pytest.raises(UnsupportedShapeError, match="dim=100, needs a multiple of 128"):
        check_shape(kernel, 100)


def test_module_without_contract_is_rejected():
    assert not isinstance(_kernel(BLOCK_M=128), ShapeContract)
    with pytest.raises(TypeError, match="does not export unsupported_shape_reason"):
        check_shape(_kernel(), 1)
