"""One registry from quantization config type to the linear method that implements it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from weight_sync.errors import ConfigError
from weight_sync.quant.base import LinearMethod, UnquantizedLinearMethod
from weight_sync.quant.fp8 import Fp8Config, Fp8LinearMethod
from weight_sync.quant.int8 import Int8Config, Int8LinearMethod

__all__ = [
    "QUANTIZATION_NAMES",
    "make_linear_method",
    "register_linear_method",
    "resolve_quantization",
]

C = TypeVar("C")
_REGISTRY: dict[type, Callable[[Any], LinearMethod]] = {}

# Short names accepted wherever a quantization is configured (CLI, engine kwargs).
QUANTIZATION_NAMES: dict[str, Any] = {
    "fp8": Fp8Config(granularity="tensor"),
    "fp8_per_tensor": Fp8Config(granularity="tensor"),
    "fp8_per_channel": Fp8Config(granularity="channel"),
    "fp8_block": Fp8Config(granularity="block"),
    "int8": Int8Config(),
    "int8_per_channel": Int8Config(),
}


def register_linear_method(config_type: type[C]) -> Callable[[Callable[[C], LinearMethod]], Callable[[C], LinearMethod]]:
    """Decorator: ``@register_linear_method(MyConfig)`` on a factory ``MyConfig -> LinearMethod``."""

    def deco(factory: Callable[[C], LinearMethod]) -> Callable[[C], LinearMethod]:
        _REGISTRY[config_type] = factory
        return factory

    return deco


register_linear_method(Fp8Config)(Fp8LinearMethod)
register_linear_method(Int8Config)(Int8LinearMethod)


def resolve_quantization(spec: object) -> object | None:
    """Turn a quantization spec (None, a short name, or a config object) into a config object."""
    if spec is None or spec == "none":
        return None
    if isinstance(spec, str):
        try:
            return QUANTIZATION_NAMES[spec]
        except KeyError:
            raise ConfigError(
                f"unknown quantization {spec!r}; expected one of {sorted(QUANTIZATION_NAMES)} or a config"
            ) from None
    if type(spec) not in _REGISTRY:
        raise ConfigError(
            f"quantization config of type {type(spec).__name__} has no registered linear method; "
            f"registered: {sorted(t.__name__ for t in _REGISTRY)}"
        )
    return spec


def make_linear_method(spec: object) -> LinearMethod:
    """The linear method for a quantization spec (unquantized for None)."""
    config = resolve_quantization(spec)
    if config is None:
        return UnquantizedLinearMethod()
    return _REGISTRY[type(config)](config)
