"""weight_sync: move weights into live inference engines without breaking them.

Layerwise reload (``begin_update`` / ``reload_weights``) for RL weight sync, transports between trainer
and engines, and distributed layerwise offload for diffusion transformers. Importing this package never
initializes CUDA and never imports vllm or ray.
"""

from weight_sync.errors import (
    ChecksumError,
    ConfigError,
    DuplicateTensorError,
    IncompleteUpdateError,
    LayoutMismatchError,
    ManifestError,
    PointerChangedError,
    SourceError,
    TornModelError,
    TransportError,
    TransportTimeout,
    UnknownTensorError,
    UpdateStateError,
    WeightSyncError,
)
from weight_sync.manifest import Manifest, TensorMeta
from weight_sync.reload import (
    UpdateReport,
    UpdateSession,
    begin_update,
    finalize_layerwise_processing,
    finalize_layerwise_reload,
    fingerprint,
    initialize_layerwise_reload,
    record_metadata_for_reloading,
    reload_weights,
)

__version__ = "0.1.0"

__all__ = [
    "ChecksumError",
    "ConfigError",
    "DuplicateTensorError",
    "IncompleteUpdateError",
    "LayoutMismatchError",
    "Manifest",
    "ManifestError",
    "PointerChangedError",
    "SourceError",
    "TensorMeta",
    "TornModelError",
    "TransportError",
    "TransportTimeout",
    "UnknownTensorError",
    "UpdateReport",
    "UpdateSession",
    "UpdateStateError",
    "WeightSyncError",
    "__version__",
    "begin_update",
    "finalize_layerwise_processing",
    "finalize_layerwise_reload",
    "fingerprint",
    "initialize_layerwise_reload",
    "record_metadata_for_reloading",
    "reload_weights",
]
