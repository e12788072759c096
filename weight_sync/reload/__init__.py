"""Layerwise reload: new weights into a live model's existing tensors, as a transaction.

Start with :func:`begin_update` (or :func:`reload_weights` for a checkpoint directory or an iterable).
Layers complete when every key their plan expects has arrived; layers that need no processing are written
in place, the others are buffered in model format, processed (e.g. quantized online) and copied into
their kernel tensors. Pointers of all graph-visible tensors are verified after every update.

Limitations: a processed layer needs all of its tensors in every update (a quantized weight cannot be
patched partially); processors must produce the same kernel tensor shapes and dtypes on every update.
"""

from weight_sync.reload.api import (
    audit_ahead,
    begin_update,
    declare_loaded_layout,
    finalize_layerwise_processing,
    finalize_layerwise_reload,
    forget_audit,
    initialize_layerwise_reload,
    manifest_from_checkpoint,
    record_metadata_for_reloading,
    reload_weights,
)
from weight_sync.reload.plan import CopyOp, KeyPlan, Plan
from weight_sync.reload.report import UpdateReport, fingerprint
from weight_sync.reload.session import UpdateSession
from weight_sync.reload.staged import STAGING_PLACEMENTS, CommitReport, StagedWeights, StagingConfig
from weight_sync.reload.state import (
    check_servable,
    mark_layers_processed,
    register_direct_method,
    register_post_update_hook,
    torn_reason,
)

__all__ = [
    "STAGING_PLACEMENTS",
    "CommitReport",
    "CopyOp",
    "KeyPlan",
    "Plan",
    "StagedWeights",
    "StagingConfig",
    "UpdateReport",
    "UpdateSession",
    "audit_ahead",
    "begin_update",
    "check_servable",
    "declare_loaded_layout",
    "finalize_layerwise_processing",
    "finalize_layerwise_reload",
    "fingerprint",
    "forget_audit",
    "initialize_layerwise_reload",
    "manifest_from_checkpoint",
    "mark_layers_processed",
    "record_metadata_for_reloading",
    "register_direct_method",
    "register_post_update_hook",
    "reload_weights",
    "torn_reason",
]
