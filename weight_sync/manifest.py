"""Manifests: the list of (name, dtype, shape[, checksum]) a sender announces before any data.

Manifests travel as JSON, never pickle. Checksums are cheap and computed where the tensor lives
(on device for CUDA tensors), so both ends can compare them without a host round trip of the data.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from weight_sync.checksum import tensor_checksum
from weight_sync.errors import ManifestError

__all__ = [
    "Manifest",
    "TensorMeta",
    "dtype_from_str",
    "dtype_to_str",
    "tensor_checksum",
]

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_to_str(dtype: torch.dtype) -> str:
    """Return the canonical name of a torch dtype ('bfloat16', 'float8_e4m3fn', ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ManifestError(f"dtype {dtype} is not supported on the wire; supported: {sorted(_DTYPES)}")
    return name


def dtype_from_str(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_to_str`; raises ManifestError for unknown names."""
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ManifestError(f"unknown dtype {name!r}; supported: {sorted(_DTYPES)}") from None


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Name, dtype and shape of one tensor a sender will send (and optionally its checksum)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    checksum: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ManifestError(f"tensor name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ManifestError(f"{self.name}: dtype must be a torch.dtype, got {self.dtype!r}")
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ManifestError(f"{self.name}: shape must be non-negative ints, got {self.shape!r}")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, *, checksum: bool = False) -> TensorMeta:
        """Describe ``tensor`` (shape and dtype read from metadata; meta tensors work)."""
        return cls(
            name=name,
            dtype=tensor.dtype,
            shape=tuple(tensor.shape),
            checksum=tensor_checksum(tensor) if checksum else None,
        )

    def to_json(self) -> dict:
        d: dict = {"name": self.name, "dtype": dtype_to_str(self.dtype), "shape": list(self.shape)}
        if self.checksum is not None:
            d["checksum"] = self.checksum
        return d

    @classmethod
    def from_json(cls, d: dict) -> TensorMeta:
        try:
            return cls(
                name=d["name"],
                dtype=dtype_from_str(d["dtype"]),
                shape=tuple(int(x) for x in d["shape"]),
                checksum=d.get("checksum"),
            )
        except KeyError as e:
            raise ManifestError(f"manifest entry {d!r} lacks field {e.args[0]!r}") from None


# TensorMeta's slot setters (a frozen dataclass refuses setattr; its slots take values directly).
_META_SLOTS = (TensorMeta.name.__set__, TensorMeta.dtype.__set__, TensorMeta.shape.__set__,  # type: ignore[attr-defined]
               TensorMeta.checksum.__set__)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Manifest:
    """An ordered list of :class:`TensorMeta`, announced before the data; names are unique."""

    tensors: tuple[TensorMeta, ...]
    version: int | str | None = None
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        seen: dict[str, int] = {}
        for i, m in enumerate(self.tensors):
            if not isinstance(m, TensorMeta):
                raise ManifestError(f"manifest entry {i} is {type(m).__name__}, expected TensorMeta")
            if m.name in seen:
                raise ManifestError(f"manifest lists {m.name!r} twice (entries {seen[m.name]} and {i})")
            seen[m.name] = i
        self._index.update(seen)

    def with_version(self, version: int | str | None) -> Manifest:
        """The same entries under ``version``, without validating them again (they were, once, here):
        an update that repeats its manifest costs O(1) instead of a pass over every entry."""
        out = object.__new__(Manifest)
        object.__setattr__(out, "tensors", self.tensors)
        object.__setattr__(out, "version", version)
        object.__setattr__(out, "_index", self._index)  # never mutated after __post_init__
        return out

    def as_bytes(self, nbytes: Sequence[int]) -> Manifest:
        """The same names, order and version, entry ``i`` a 1-D uint8 tensor of ``nbytes[i]`` bytes (a
        delta update's wire manifest: the sizes of its encodings). The names are not checked again (they
        were, here) and the entries are made without ``TensorMeta``'s checks once the sizes passed
        theirs: this runs for every call of every delta update, hundreds of entries."""
        sizes = [int(n) for n in nbytes]
        if len(sizes) != len(self.tensors):
            raise ManifestError(f"{len(sizes)} encoded sizes for a manifest of {len(self.tensors)} tensors")
        if sizes and min(sizes) < 0:
            raise ManifestError(f"encoded sizes must be non-negative, got {min(sizes)}")
        new, (set_name, set_dtype, set_shape, set_checksum) = object.__new__, _META_SLOTS
        entries = []
        for m, n in zip(self.tensors, sizes):
            e = new(TensorMeta)
            set_name(e, m.name)
            set_dtype(e, torch.uint8)
            set_shape(e, (n,))
            set_checksum(e, None)
            entries.append(e)
        out = object.__new__(Manifest)
        object.__setattr__(out, "tensors", tuple(entries))
        object.__setattr__(out, "version", self.version)
        object.__setattr__(out, "_index", self._index)  # same names in the same order; never mutated
        return out

    @classmethod
    def from_named_tensors(
        cls,
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | str | None = None,
        checksum: bool = False,
    ) -> Manifest:
        """Build a manifest from (name, tensor) pairs; meta tensors are fine without checksums."""
        return cls(tuple(TensorMeta.of(n, t, checksum=checksum) for n, t in named), version=version)

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[TensorMeta]:
        return iter(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __getitem__(self, name: str) -> TensorMeta:
        try:
            return self.tensors[self._index[name]]
        except KeyError:
            raise ManifestError(f"{name!r} is not in the manifest") from None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._index)  # in entry order (insertion order of the index)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.tensors)

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "tensors": [m.to_json() for m in self.tensors]})

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from e
        if not isinstance(d, dict) or "tensors" not in d:
            raise ManifestError("manifest JSON must be an object with a 'tensors' list")
        return cls(tuple(TensorMeta.from_json(x) for x in d["tensors"]), version=d.get("version"))
